"""MXFP8 reference kernels: fp8 data with one E8M0 (power-of-two) scale per 32 values.

Rowwise blocks run along K (scale shape (M, K/32)); columnwise blocks run along M (scale shape
(M/32, K)); both data buffers keep the logical (M, K) layout. The block exponent is
e = ceil(log2(amax / fp8_max)), the smallest e with amax <= fp8_max * 2**e, clamped to
[-127, 127]. It is estimated with log2 and then corrected by exact power-of-two comparisons, so
log2 rounding (which differs between eager and compiled code) never changes the result.

Edge rules: an all-zero block gets e = -127. NaN elements are ignored when taking the block amax
(as a `fmaxf` reduction does); they stay NaN in the fp8 data, so only they dequantize to NaN.
Inf makes e clamp to 127 and saturates to +-fp8_max (which dequantizes to +-inf in fp32).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from .. import register_kernel
from .common import fp8_max, saturating_cast

MXFP8_BLOCK = 32
E8M0_BIAS = 127
E_MIN, E_MAX = -127, 127


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-127, 127], built from the bits (2**-127 is subnormal)."""
    e = e.to(torch.int32).clamp(E_MIN, E_MAX)
    normal = torch.bitwise_left_shift(e + E8M0_BIAS, 23)
    bits = torch.where(e >= -126, normal, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def block_exponent(amax: torch.Tensor, fmt_max: float) -> torch.Tensor:
    """int32 e = ceil(log2(amax / fmt_max)) clamped to [-127, 127]; amax is fp32, >= 0 or Inf.

    amax * 2**-e is computed exactly (a power-of-two scaling), so comparing it with fmt_max is
    the exact test `amax <= fmt_max * 2**e` without ever forming fmt_max * 2**e (which can
    overflow fp32 at e = 127).
    """
    amax = amax.float()
    usable = torch.isfinite(amax) & (amax > 0)
    safe = torch.where(usable, amax, torch.ones_like(amax))
    est = torch.ceil(torch.log2(safe) - math.log2(fmt_max)).clamp(E_MIN, E_MAX)
    e = est.to(torch.int32)
    # log2 may be off by one ulp near a power of two: one step each way is always enough.
    e = torch.where(amax * exp2_int(-e) > fmt_max, e + 1, e).clamp(E_MIN, E_MAX)
    e = torch.where(amax * exp2_int(-e) * 2 <= fmt_max, e - 1, e).clamp(E_MIN, E_MAX)
    e = torch.where(amax == 0, torch.full_like(e, E_MIN), e)
    return torch.where(torch.isinf(amax), torch.full_like(e, E_MAX), e)


def exponent_to_e8m0(e: torch.Tensor) -> torch.Tensor:
    """E8M0 scales (byte e + 127) from int exponents in [-127, 127].

    Casts the exact power of two 2**e: any rounding mode keeps it exact (tests pin every byte).
    A value cast, not a uint8 bitcast, because Inductor's CPU codegen has no e8m0 type: it runs
    e8m0 casts as eager aten ops but tries to generate code for e8m0 bitcasts.
    """
    return exp2_int(e).to(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Exact float32 value of E8M0 scales: 2**(byte - 127), byte 255 is NaN (torch's cast)."""
    return scale.float()


def _quantize_blocks(xb: torch.Tensor, dim: int, fp8_dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 `xb` with one scale per slice along `dim` (the block of 32)."""
    mag = xb.abs()
    amax = torch.where(torch.isnan(mag), torch.zeros_like(mag), mag).amax(dim=dim)
    e = block_exponent(amax, fp8_max(fp8_dtype))
    data = saturating_cast(xb * exp2_int(-e).unsqueeze(dim), fp8_dtype)
    return data, exponent_to_e8m0(e)


@register_kernel("mxfp8_quantize")
def mxfp8_quantize(x: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool
                   ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                              Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(rowwise data, rowwise scale_inv (M, K/32), columnwise data, columnwise scale_inv (M/32, K));
    data buffers have x's shape, absent usages are None."""
    shape = x.shape
    k = shape[-1]
    x2d = x.float().reshape(-1, k)
    m = x2d.shape[0]
    row_data = row_scale = col_data = col_scale = None
    if rowwise:
        d, s = _quantize_blocks(x2d.reshape(m, k // MXFP8_BLOCK, MXFP8_BLOCK), 2, fp8_dtype)
        row_data, row_scale = d.reshape(shape), s
    if columnwise:
        d, s = _quantize_blocks(x2d.reshape(m // MXFP8_BLOCK, MXFP8_BLOCK, k), 1, fp8_dtype)
        col_data, col_scale = d.reshape(shape), s
    return row_data, row_scale, col_data, col_scale


@register_kernel("mxfp8_dequantize")
def mxfp8_dequantize(data: torch.Tensor, scale_inv: torch.Tensor, columnwise: bool,
                     dtype: torch.dtype) -> torch.Tensor:
    """data.float() * 2**e per block, for rowwise (columnwise=False) or columnwise buffers."""
    shape = data.shape
    k = shape[-1]
    d2 = data.float().reshape(-1, k)
    m = d2.shape[0]
    s = e8m0_to_float(scale_inv)
    if columnwise:
        out = d2.reshape(m // MXFP8_BLOCK, MXFP8_BLOCK, k) * s.unsqueeze(1)
    else:
        out = d2.reshape(m, k // MXFP8_BLOCK, MXFP8_BLOCK) * s.unsqueeze(2)
    return out.reshape(shape).to(dtype)
