"""Shared numerics: format maxima, amaxes and saturating casts.

Non-finite inputs (the FP8 formats' spec): a scale is computed from the amax of the finite values
(`abs_max(x, finite=True)`), so one inf or NaN leaves every other value its FP8 precision; and
`scaled_cast` keeps inf / NaN non-finite in the quantized data, so they reach the GEMM outputs as
they would in bf16: E5M2 keeps +-inf and NaN, E4M3 (no inf) holds both as NaN. Finite values
beyond the format's max saturate to +-max.
"""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import statically_known_true

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP4_E2M1_MAX = 6.0
FLOAT32_MAX = torch.finfo(torch.float32).max


def traced(x: torch.Tensor) -> bool:
    """Whether `x` is a tracing (fake) tensor. A plain real tensor, the eager case, answers with
    two C calls instead of `is_fake`'s unwrapping (host time per eager call)."""
    if (type(x) is torch.Tensor and not torch._is_functional_tensor(x)
            and not torch._C._functorch.is_functorch_wrapped_tensor(x)):
        return False
    return is_fake(x)


def abs_max(x: torch.Tensor, finite: bool = False) -> torch.Tensor:
    """max |x| as a float32 tensor of shape (1,): over every element (NaN if x has a NaN, else
    inf if it has an inf: what delayed scaling records, so its history sees the overflow) or, with
    `finite`, over the finite elements only (what a scale is computed from; 0 if there are none).
    0 for an empty tensor, which torch's amax() rejects. Decided on the shape alone: a symbolic
    size is never guarded."""
    if statically_known_true(x.numel() == 0):
        return x.new_zeros(1, dtype=torch.float32)
    a = x.abs()
    if finite:
        a = torch.where(a < math.inf, a, 0.0)  # NaN compares False too
    if statically_known_true(x.numel() != 0):
        return a.amax().float().reshape(1)
    # a row count that is data (an unbacked SymInt: a GroupedLinear expert's tokens under compile)
    # may be 0 at run time: reduce with one zero prepended (a copy)
    return torch.cat([x.new_zeros(1), a.reshape(-1)]).amax().float().reshape(1)


def fp8_max(fp8_dtype: torch.dtype) -> float:
    try:
        return FP8_MAX[fp8_dtype]
    except KeyError:
        raise TypeError(f"unsupported fp8 dtype {fp8_dtype}; expected float8_e4m3fn or float8_e5m2") from None


def saturating_cast(x: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """Round-to-nearest-even cast to fp8 that clamps to +-max (Inf saturates, NaN stays NaN)."""
    m = fp8_max(fp8_dtype)
    return x.float().clamp(-m, m).to(fp8_dtype)


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp8 of `x * scale` (a finite scale > 0, broadcast against x), rounded to nearest even.

    A finite x saturates to +-max, also where x * scale overflows fp32. A non-finite x stays
    non-finite, with the product's sign (a NaN's sign: the device's multiply): E5M2 keeps +-inf
    and NaN; E4M3 has no inf, so both become NaN."""
    m = fp8_max(fp8_dtype)
    x = x.float()
    v = x * scale.float()
    special = v if fp8_dtype == torch.float8_e5m2 else torch.copysign(torch.full_like(v, math.nan), v)
    return torch.where(x.abs() < math.inf, v.clamp(-m, m), special).to(fp8_dtype)


def true_div(num: float, den: torch.Tensor) -> torch.Tensor:
    """`num / den` as the correctly rounded fp32 quotient, eager and compiled alike.

    Computed as a float64 tensor / tensor division rounded once to fp32: float64 carries more than
    2 * 24 + 2 bits, so that single rounding gives exactly the fp32 IEEE quotient. A plain fp32
    division would not survive inductor, which lowers it on CUDA to Triton's approximate division
    (up to 2 ulp off eager); and a Python scalar over a tensor is reciprocal-then-multiply."""
    den = den.double()
    return (torch.full_like(den, num) / den).float()


def scale_from_amax(amax: torch.Tensor, fmt_max: float, margin: int = 0, power_2: bool = False,
                    epsilon: float = 0.0) -> torch.Tensor:
    """Quantization scale `fmt_max / amax / 2**margin` with TE's edge rules.

    amax == 0 (or NaN/Inf amax) gives scale 1; a scale that overflows float32 becomes float32 max;
    `power_2` rounds the scale down to a power of two (so scale_inv is exact).
    """
    amax = amax.float()
    if epsilon > 0:
        amax = torch.clamp(amax, min=epsilon)
    scale = true_div(fmt_max, amax) * (2.0 ** -margin)  # x * 2**-m: the bits of x / 2**m, no division
    scale = torch.where(torch.isinf(scale) & (amax > 0), torch.full_like(scale, FLOAT32_MAX), scale)
    bad = (amax == 0) | ~torch.isfinite(amax)
    scale = torch.where(bad, torch.ones_like(scale), scale)
    if power_2:
        scale = pow2_floor(scale)
    return scale


def pow2_floor(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= `scale` (positive, finite, normal fp32), by zeroing the mantissa.

    Exact where `exp2(floor(log2(s)))` is not: fp32 log2 of a value one ulp below 2**k rounds
    to k, which would give a scale that overflows fp8 for the tile's amax.
    """
    return (scale.float().view(torch.int32) & 0x7F800000).view(torch.float32)


def transpose_2d(x2d: torch.Tensor) -> torch.Tensor:
    """A (K, M) copy of a (M, K) tensor with canonical contiguous strides (even for size-1 dims,
    where `.t().contiguous()` would keep the old strides and break layout equality)."""
    out = torch.empty((x2d.shape[1], x2d.shape[0]), dtype=x2d.dtype, device=x2d.device)
    return out.copy_(x2d.t())

