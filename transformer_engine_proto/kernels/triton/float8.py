"""Per-tensor FP8 (delayed and current scaling) in Triton: amax, and one fused kernel that reads
x once and writes the rowwise fp8 data and its (K, M) transpose.

Same names, signatures and results (bit for bit) as `kernels/reference/float8.py`.

- amax: a (1,) fp32 buffer, zeroed, max-accumulated by `atomic_max` on the float bits as int32
  (|x| >= 0, so integer order is float order; a NaN's bits are above Inf's, so any NaN gives a
  NaN amax, as torch's `amax` does).
- current scaling: pass 1 amax; pass 2 the cast kernel reads the amax, computes the scale on
  the device (`scale_from_amax`), writes scale_inv (program 0) and the data. No host sync.
- delayed scaling: cast with the given scale; the amax max-accumulated into `amax_out` by atomic
  max (its bits viewed as int32: correct for amax_out >= 0 or +NaN): per tile inside the cast
  for the rowwise-only cast (one pass), by the amax pass when a transpose is written too (a tile
  reduction in the transposing kernel made it 3x slower on an H100).
- the transpose goes through registers (`tl.trans`), so both stores are coalesced.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .. import register_kernel
from ..reference import float8 as _ref
from .launch import fast_launch
from ._common import (INT32_LIMIT, abs_bits, as_kernel_input, flat_2d, fp8_bits, fp8_params,
                      reciprocal, scale_from_amax, soft_cast, to_f32)

# Launch configurations (tunable: benchmarks/bench_quantize.py sweeps them).
CONFIG = {
    "amax": dict(BLOCK=16384, num_warps=8),
    "cast": dict(BM=128, BK=128, num_warps=8),
    # one-usage casts need no transpose: a wide row tile
    "cast_rowwise": dict(BM=32, BK=256, num_warps=8),
}


@fast_launch
@triton.jit
def _amax_kernel(x_ptr, amax_ptr, N, BF16_BITS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = pid.to(tl.int64) * BLOCK
    mask = offs < N - base
    x = to_f32(tl.load(x_ptr + base + offs, mask=mask, other=0), BF16_BITS)
    m = tl.max(abs_bits(x), axis=0)
    # a plain (possibly stale) read can only under-estimate the running max: skipping the
    # atomic when m <= it is safe, and spares most programs the contended atomic
    cur = tl.load(amax_ptr)
    tl.atomic_max(amax_ptr, m, mask=m > cur, sem="relaxed")


@fast_launch
@triton.jit
def _cast_transpose_kernel(x_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, scale_inv_ptr, M, K, n_k,
                           FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr,
                           CURRENT: tl.constexpr, TILE_AMAX: tl.constexpr,
                           MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
                           EPS: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                           BF16_BITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    if CURRENT:
        amax = tl.load(amax_ptr).to(tl.float32, bitcast=True)
        scale = scale_from_amax(amax, FMAX, MARGIN_MUL, POW2, EPS)
    else:
        scale = tl.load(scale_ptr)
    tl.store(scale_inv_ptr, reciprocal(scale), mask=pid == 0)

    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m0 = pid_m * BM
    k0 = pid_k * BK
    mask = ((m0 + rm)[:, None] < M) & ((k0 + rk)[None, :] < K)
    row_base = m0.to(tl.int64) * K + k0
    offs = rm[:, None] * K + rk[None, :]
    x = to_f32(tl.load(x_ptr + row_base + offs, mask=mask, other=0), BF16_BITS)
    if TILE_AMAX:
        tile_amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0)
    q = fp8_bits(x * scale, FMAX, E4M3, SOFT)
    if ROWWISE:
        tl.store(row_ptr + row_base + offs, q, mask=mask)
    if COLWISE:
        col_base = k0.to(tl.int64) * M + m0
        offs_t = rk[:, None] * M + rm[None, :]
        tl.store(col_ptr + col_base + offs_t, tl.trans(q), mask=tl.trans(mask))
    if TILE_AMAX:
        # last and relaxed: an acq_rel atomic before the stores would pin the whole tile in
        # registers (208 instead of 64 at 128x128, 8 warps)
        cur = tl.load(amax_ptr)
        tl.atomic_max(amax_ptr, tile_amax, mask=tile_amax > cur, sem="relaxed")


def _amax_into(x2d: torch.Tensor, amax_i32: torch.Tensor) -> None:
    n = x2d.numel()
    cfg = CONFIG["amax"]
    grid = (triton.cdiv(n, cfg["BLOCK"]),)
    xk, bf16_bits = as_kernel_input(x2d)
    _amax_kernel[grid](xk, amax_i32, n, BF16_BITS=bf16_bits, BLOCK=cfg["BLOCK"],
                       num_warps=cfg["num_warps"])


def _launch_cast(x2d, fp8_dtype, rowwise, columnwise, scale=None, amax_i32=None, current=False,
                 margin=0, power_2=False, epsilon=0.0, tile_amax=False):
    m, k = x2d.shape
    dev = x2d.device
    fmax, e4m3 = fp8_params(fp8_dtype)
    data = torch.empty((m, k), dtype=fp8_dtype, device=dev) if rowwise else None
    transpose = torch.empty((k, m), dtype=fp8_dtype, device=dev) if columnwise else None
    scale_inv = torch.empty((1,), dtype=torch.float32, device=dev)
    cfg = CONFIG["cast"] if columnwise else CONFIG["cast_rowwise"]
    bm, bk = cfg["BM"], cfg["BK"]
    n_k = triton.cdiv(k, bk)
    grid = (triton.cdiv(m, bm) * n_k,)
    row_arg = data.view(torch.uint8) if rowwise else scale_inv  # unused pointer when absent
    col_arg = transpose.view(torch.uint8) if columnwise else scale_inv
    xk, bf16_bits = as_kernel_input(x2d)
    _cast_transpose_kernel[grid](
        xk, row_arg, col_arg, scale if scale is not None else scale_inv, amax_i32, scale_inv,
        m, k, n_k,
        FMAX=fmax, E4M3=e4m3, SOFT=soft_cast(), CURRENT=current, TILE_AMAX=bool(tile_amax),
        MARGIN_MUL=float(2.0 ** -margin), POW2=bool(power_2), EPS=float(epsilon),
        ROWWISE=bool(rowwise), COLWISE=bool(columnwise), BF16_BITS=bf16_bits, BM=bm, BK=bk,
        num_warps=cfg["num_warps"],
    )
    return data, transpose, scale_inv


def _fits(x: torch.Tensor) -> bool:
    """Shapes the kernels index with int32 tile-local offsets (and not empty)."""
    m, k = flat_2d(x)
    if m == 0 or k == 0:
        return False
    bm = max(CONFIG["cast"]["BM"], CONFIG["cast_rowwise"]["BM"])
    bk = max(CONFIG["cast"]["BK"], CONFIG["cast_rowwise"]["BK"])
    return bm * k < INT32_LIMIT and bk * m < INT32_LIMIT


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    m, k = flat_2d(x)
    return x.contiguous().reshape(m, k)


@register_kernel("amax", backend="triton")
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 tensor of shape (1,) (NaN if x has a NaN)."""
    if x.numel() == 0:
        return _ref.amax(x)
    out = torch.zeros((1,), dtype=torch.int32, device=x.device)
    _amax_into(x.contiguous().reshape(-1), out)
    return out.view(torch.float32)


@register_kernel("fp8_quantize_delayed", backend="triton")
def fp8_quantize_delayed(x, scale, amax_out, fp8_dtype, rowwise, columnwise
                         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Cast with a given scale; max-accumulate this tensor's amax into `amax_out` in place."""
    if (not _fits(x) or amax_out.dtype != torch.float32 or amax_out.numel() != 1
            or not amax_out.is_contiguous()):
        return _ref.fp8_quantize_delayed(x, scale, amax_out, fp8_dtype, rowwise, columnwise)
    fp8_params(fp8_dtype)
    x2d = _as_2d(x)
    scale = scale.reshape(-1)[:1].float()
    amax_i32 = amax_out.view(torch.int32)
    if columnwise:
        # measured on an H100 at 8192^2: the tile amax inside the transposing kernel took it from
        # 109 to 361 us; the separate amax pass costs 59 us
        _amax_into(x2d, amax_i32)
    data, transpose, scale_inv = _launch_cast(x2d, fp8_dtype, rowwise, columnwise, scale=scale,
                                              amax_i32=amax_i32, current=False,
                                              tile_amax=not columnwise)
    if data is not None:
        data = data.view(x.shape)
    return data, transpose, scale_inv


@register_kernel("fp8_quantize_current", backend="triton")
def fp8_quantize_current(x, fp8_dtype, rowwise, columnwise, margin=0, power_2=False, epsilon=0.0):
    """Scale from this tensor's own amax: returns (data, transpose, scale_inv, amax)."""
    if not _fits(x):
        return _ref.fp8_quantize_current(x, fp8_dtype, rowwise, columnwise, margin, power_2, epsilon)
    fp8_params(fp8_dtype)
    x2d = _as_2d(x)
    amax_i32 = torch.zeros((1,), dtype=torch.int32, device=x.device)
    _amax_into(x2d, amax_i32)
    data, transpose, scale_inv = _launch_cast(x2d, fp8_dtype, rowwise, columnwise, amax_i32=amax_i32,
                                              current=True, margin=margin, power_2=power_2,
                                              epsilon=epsilon)
    if data is not None:
        data = data.view(x.shape)
    return data, transpose, scale_inv, amax_i32.view(torch.float32)
