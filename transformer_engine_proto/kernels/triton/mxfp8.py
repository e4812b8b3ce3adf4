"""MXFP8 quantize in Triton: rowwise and columnwise in ONE pass over x, bit for bit as
`kernels/reference/mxfp8.py`.

A program loads a (MB*32) x (NB*32) tile as a 4-D block [MB, 32, NB, 32] (row block, row in
block, column block, column in block): the rowwise block amax is the max over axis 3, the
columnwise one the max over axis 1, both from the same registers and without any reshape.
With a columnwise usage, the quarters kernel (the default) loads a 32-row tile as four
interleaved quarters instead, so a column block's 32-row amax is an elementwise max of the
quarters and a reduction over 8 rows.

The block exponent is computed exactly from the amax bits: with amax = s * 2**E (s in [1, 2))
and fmt_max = s_max * 2**E_max, the smallest e with amax <= fmt_max * 2**e is
E - E_max + (s > s_max); clamped to [-127, 127]; zero or fp32-subnormal amax -> -127, Inf -> 127
(NaN is ignored in the amax). The data is x * 2**-e (exact); 2**-127 is fp32-subnormal, so for
e == 127 the multiply is split into 2**-64 * 2**-63 (same result, no subnormal operand).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..reference import mxfp8 as _ref
from ._common import (
    INT32_LIMIT,
    abs_bits,
    as_kernel_input,
    cdiv,
    flat_2d,
    float_bits,
    fp8_bits,
    fp8_params,
    soft_cast,
    to_f32,
    triton_kernel,
)
from .launch import fast_launch, plan_key, planned, run_recorded

BLOCK = 32

# after editing CONFIG, call `launch.clear_plans()` (recorded eager launches keep their config)
CONFIG = {
    # (MB, NB, num_warps) by (rowwise, columnwise): tile (MB*32) x (NB*32); chosen by a sweep at
    # 8192^2 bf16 on an H100 (benchmarks/bench_quantize.py --sweep)
    (True, True): dict(MB=1, NB=2, num_warps=4),
    (True, False): dict(MB=2, NB=4, num_warps=8),
    (False, True): dict(MB=2, NB=4, num_warps=8),
    # with a columnwise usage: the quarters kernel, tile 32 x (NB*32) (False: `_mxfp8_kernel`);
    # on an H100 it is faster than `_mxfp8_kernel` and than NB 2 / 4 warps
    # (benchmarks/results/2026-11-24-h100-96e8cd3)
    "quarters": dict(NB=4, num_warps=2),
}


@triton.jit
def _block_exponent(amax_bits, FMAX_EXP: tl.constexpr, FMAX_MANT: tl.constexpr):
    """int32 e = ceil(log2(amax / fmt_max)) clamped to [-127, 127], from int32 bits of amax."""
    biased = amax_bits >> 23
    mant = amax_bits & 0x7FFFFF
    e = biased - 127 - FMAX_EXP + (mant > FMAX_MANT).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(biased == 0, -127, e)  # zero or subnormal amax
    return tl.where(amax_bits == 0x7F800000, 127, e)  # Inf


@triton.jit
def _pow2_neg(e):
    """(s1, s2), normal fp32 powers of two with s1 * s2 == 2**-e, for int32 e in [-127, 127]."""
    big = e == 127
    ne = tl.where(big, -64, -e)
    s1 = ((ne + 127) << 23).to(tl.float32, bitcast=True)
    s2 = tl.where(big, 1.0842021724855044e-19, 1.0)  # 2**-63
    return s1, s2


@fast_launch
@triton.jit
def _mxfp8_kernel(x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, n_k,
                  FMAX: tl.constexpr, FMAX_EXP: tl.constexpr, FMAX_MANT: tl.constexpr,
                  E4M3: tl.constexpr, SOFT: tl.constexpr,
                  ROWWISE: tl.constexpr, COLWISE: tl.constexpr, BF16_BITS: tl.constexpr,
                  MB: tl.constexpr, NB: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    m0 = pid_m * (MB * 32)
    k0 = pid_k * (NB * 32)
    ib = tl.arange(0, MB)
    i = tl.arange(0, 32)
    jb = tl.arange(0, NB)
    j = tl.arange(0, 32)
    # tile-local row / column index, 4-D [MB, 32, NB, 32]
    r4 = ib[:, None, None, None] * 32 + i[None, :, None, None]
    c4 = jb[None, None, :, None] * 32 + j[None, None, None, :]
    mask = ((m0 + r4) < M) & ((k0 + c4) < K)
    base = m0.to(tl.int64) * K + k0
    offs = r4 * K + c4
    x = to_f32(tl.load(x_ptr + base + offs, mask=mask, other=0), BF16_BITS)
    bits = abs_bits(x)
    bits = tl.where(bits > 0x7F800000, 0, bits)  # NaN ignored in the block amax
    if ROWWISE:
        e = _block_exponent(tl.max(bits, axis=3), FMAX_EXP, FMAX_MANT)  # [MB, 32, NB]
        s1, s2 = _pow2_neg(e)
        q = fp8_bits((x * s1[:, :, :, None]) * s2[:, :, :, None], FMAX, E4M3, SOFT)
        tl.store(row_ptr + base + offs, q, mask=mask)
        # scale (M, K/32): element (m0 + r, k0/32 + jb)
        r3 = ib[:, None, None] * 32 + i[None, :, None]
        jb3 = jb[None, None, :]
        s_mask = ((m0 + r3) < M) & ((k0 // 32 + jb3) < K // 32)
        s_base = m0.to(tl.int64) * (K // 32) + k0 // 32
        tl.store(row_s_ptr + s_base + r3 * (K // 32) + jb3, (e + 127).to(tl.uint8), mask=s_mask)
    if COLWISE:
        e = _block_exponent(tl.max(bits, axis=1), FMAX_EXP, FMAX_MANT)  # [MB, NB, 32]
        s1, s2 = _pow2_neg(e)
        q = fp8_bits((x * s1[:, None, :, :]) * s2[:, None, :, :], FMAX, E4M3, SOFT)
        tl.store(col_ptr + base + offs, q, mask=mask)
        # scale (M/32, K): element (m0/32 + ib, k0 + c)
        ib3 = ib[:, None, None]
        c3 = jb[None, :, None] * 32 + j[None, None, :]
        s_mask = ((m0 // 32 + ib3) < M // 32) & ((k0 + c3) < K)
        s_base = (m0 // 32).to(tl.int64) * K + k0
        tl.store(col_s_ptr + s_base + ib3 * K + c3, (e + 127).to(tl.uint8), mask=s_mask)


@triton.jit
def _load_quarter(x_ptr, base, i, j: tl.constexpr, c, K, cmask, BF16_BITS: tl.constexpr):
    """Rows 4 i + j of the tile, [8, NB, 32]: fp32 values and NaN-less |x| bits."""
    x = to_f32(tl.load(x_ptr + base + (4 * i + j) * K + c, mask=cmask, other=0), BF16_BITS)
    bits = abs_bits(x)
    return x, tl.where(bits > 0x7F800000, 0, bits)  # NaN ignored in the block amax


@triton.jit
def _rowwise_quarter(x, bits, row_ptr, row_s_ptr, base, m0, k0, i, j: tl.constexpr, c, jb, K, cmask,
                     FMAX: tl.constexpr, FMAX_EXP: tl.constexpr, FMAX_MANT: tl.constexpr,
                     E4M3: tl.constexpr, SOFT: tl.constexpr):
    """Rowwise blocks of the quarter's rows: data and the (M, K/32) e8m0 scales."""
    e = _block_exponent(tl.max(bits, axis=2), FMAX_EXP, FMAX_MANT)  # [8, NB]
    s1, s2 = _pow2_neg(e)
    q = fp8_bits((x * s1[:, :, None]) * s2[:, :, None], FMAX, E4M3, SOFT)
    tl.store(row_ptr + base + (4 * i + j) * K + c, q, mask=cmask)
    rows = m0 + 4 * tl.arange(0, 8)[:, None] + j  # [8, 1]
    tl.store(row_s_ptr + rows.to(tl.int64) * (K // 32) + k0 // 32 + jb, (e + 127).to(tl.uint8),
             mask=(k0 // 32 + jb) < K // 32)


@triton.jit
def _colwise_quarter(x, s1, s2, col_ptr, base, i, j: tl.constexpr, c, K, cmask,
                     FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr):
    q = fp8_bits((x * s1[None, :, :]) * s2[None, :, :], FMAX, E4M3, SOFT)
    tl.store(col_ptr + base + (4 * i + j) * K + c, q, mask=cmask)


@fast_launch
@triton.jit
def _mxfp8_quarters_kernel(x_ptr, row_ptr, row_s_ptr, col_ptr, col_s_ptr, M, K, n_k,
                           FMAX: tl.constexpr, FMAX_EXP: tl.constexpr, FMAX_MANT: tl.constexpr,
                           E4M3: tl.constexpr, SOFT: tl.constexpr, ROWWISE: tl.constexpr,
                           BF16_BITS: tl.constexpr, NB: tl.constexpr):
    """Columnwise (and rowwise) blocks of a 32 x (NB*32) tile (M % 32 == 0), its rows loaded as
    four interleaved quarters (rows 4i + j, i < 8): a column block's amax is the elementwise max
    of the quarters reduced over 8 rows, where `_mxfp8_kernel` reduces 32 rows across warps."""
    pid = tl.program_id(0)
    m0 = (pid // n_k) * 32
    k0 = (pid % n_k) * (NB * 32)
    i = tl.arange(0, 8)[:, None, None]
    jb = tl.arange(0, NB)[None, :]
    c = jb[:, :, None] * 32 + tl.arange(0, 32)[None, None, :]  # [1, NB, 32] tile column
    cmask = (k0 + c) < K
    base = m0.to(tl.int64) * K + k0
    x0, b0 = _load_quarter(x_ptr, base, i, 0, c, K, cmask, BF16_BITS)
    x1, b1 = _load_quarter(x_ptr, base, i, 1, c, K, cmask, BF16_BITS)
    x2, b2 = _load_quarter(x_ptr, base, i, 2, c, K, cmask, BF16_BITS)
    x3, b3 = _load_quarter(x_ptr, base, i, 3, c, K, cmask, BF16_BITS)
    if ROWWISE:
        _rowwise_quarter(x0, b0, row_ptr, row_s_ptr, base, m0, k0, i, 0, c, jb, K, cmask,
                         FMAX, FMAX_EXP, FMAX_MANT, E4M3, SOFT)
        _rowwise_quarter(x1, b1, row_ptr, row_s_ptr, base, m0, k0, i, 1, c, jb, K, cmask,
                         FMAX, FMAX_EXP, FMAX_MANT, E4M3, SOFT)
        _rowwise_quarter(x2, b2, row_ptr, row_s_ptr, base, m0, k0, i, 2, c, jb, K, cmask,
                         FMAX, FMAX_EXP, FMAX_MANT, E4M3, SOFT)
        _rowwise_quarter(x3, b3, row_ptr, row_s_ptr, base, m0, k0, i, 3, c, jb, K, cmask,
                         FMAX, FMAX_EXP, FMAX_MANT, E4M3, SOFT)
    cmax = tl.max(tl.maximum(tl.maximum(b0, b1), tl.maximum(b2, b3)), axis=0)  # [NB, 32]
    e = _block_exponent(cmax, FMAX_EXP, FMAX_MANT)
    s1, s2 = _pow2_neg(e)
    _colwise_quarter(x0, s1, s2, col_ptr, base, i, 0, c, K, cmask, FMAX, E4M3, SOFT)
    _colwise_quarter(x1, s1, s2, col_ptr, base, i, 1, c, K, cmask, FMAX, E4M3, SOFT)
    _colwise_quarter(x2, s1, s2, col_ptr, base, i, 2, c, K, cmask, FMAX, E4M3, SOFT)
    _colwise_quarter(x3, s1, s2, col_ptr, base, i, 3, c, K, cmask, FMAX, E4M3, SOFT)
    # scale (M/32, K): element (m0/32, k0 + c2)
    c2 = tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(col_s_ptr + (m0 // 32).to(tl.int64) * K + k0 + c2, (e + 127).to(tl.uint8),
             mask=(k0 + c2) < K)


class _Plan:
    """The launch of one eager call signature, replayed for the next call with fresh buffers and
    none of the entry point's Python (`launch.Replay`); the scales are allocated as e8m0 and the
    data as fp8 directly (the launcher reads pointers only)."""

    __slots__ = ("launch", "shape", "row_scale_shape", "col_scale_shape", "fp8_dtype", "device",
                 "rowwise", "columnwise")

    def __init__(self, x, fp8_dtype, rowwise, columnwise, launches):
        m, k = flat_2d(x)
        (self.launch,) = launches
        self.shape, self.row_scale_shape, self.col_scale_shape = x.shape, (m, k // BLOCK), (m // BLOCK, k)
        self.fp8_dtype, self.device, self.rowwise, self.columnwise = fp8_dtype, x.device, rowwise, columnwise

    def __call__(self, x):
        dev, e8m0 = self.device, torch.float8_e8m0fnu
        row_data = row_scale = col_data = col_scale = None
        if self.rowwise:
            row_data = torch.empty(self.shape, dtype=self.fp8_dtype, device=dev)
            row_scale = torch.empty(self.row_scale_shape, dtype=e8m0, device=dev)
        if self.columnwise:
            col_data = torch.empty(self.shape, dtype=self.fp8_dtype, device=dev)
            col_scale = torch.empty(self.col_scale_shape, dtype=e8m0, device=dev)
        dummy = row_scale if self.rowwise else col_scale
        self.launch(x, dummy if row_data is None else row_data, dummy if row_scale is None else row_scale,
                    dummy if col_data is None else col_data, dummy if col_scale is None else col_scale)
        return row_data, row_scale, col_data, col_scale


@triton_kernel("mxfp8_quantize")
def mxfp8_quantize(x: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool
                   ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                              Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(rowwise data, rowwise scale_inv (M, K/32), columnwise data, columnwise scale_inv (M/32, K));
    data buffers have x's shape, absent usages are None."""
    key = plan_key(x, "mxfp8", fp8_dtype, rowwise, columnwise)
    plan = planned(key)
    if plan is not None:
        return plan(x)
    return run_recorded(key, lambda launches: _Plan(x, fp8_dtype, rowwise, columnwise, launches),
                        _mxfp8_quantize, x, fp8_dtype, rowwise, columnwise)


def _mxfp8_quantize(x, fp8_dtype, rowwise, columnwise):
    m, k = flat_2d(x)
    usable = (x.dim() > 0 and m > 0 and k > 0 and (rowwise or columnwise)
              and (not rowwise or k % BLOCK == 0) and (not columnwise or m % BLOCK == 0))
    cfg = CONFIG.get((bool(rowwise), bool(columnwise)))
    if not usable or cfg is None or cfg["MB"] * 32 * k >= INT32_LIMIT:
        # the reference raises the same errors for shapes the blocks do not divide
        return _ref.mxfp8_quantize(x, fp8_dtype, rowwise, columnwise)
    fmax, e4m3 = fp8_params(fp8_dtype)
    fb = float_bits(fmax)
    dev = x.device
    x2d = x.contiguous().reshape(m, k)
    row_data = row_scale = col_data = col_scale = None
    if rowwise:
        row_data = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
        row_scale = torch.empty((m, k // BLOCK), dtype=torch.uint8, device=dev)
    if columnwise:
        col_data = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
        col_scale = torch.empty((m // BLOCK, k), dtype=torch.uint8, device=dev)
    dummy = row_scale if rowwise else col_scale
    xk, bf16_bits = as_kernel_input(x2d)
    quarters = CONFIG["quarters"]
    if columnwise and quarters:
        nb = quarters["NB"]
        n_k = cdiv(k, nb * 32)
        _mxfp8_quarters_kernel[(m // 32 * n_k,)](
            xk,
            row_data.view(torch.uint8) if rowwise else dummy, row_scale if rowwise else dummy,
            col_data.view(torch.uint8), col_scale, m, k, n_k,
            FMAX=fmax, FMAX_EXP=((fb >> 23) & 0xFF) - 127, FMAX_MANT=fb & 0x7FFFFF,
            E4M3=e4m3, SOFT=soft_cast(), ROWWISE=bool(rowwise), BF16_BITS=bf16_bits, NB=nb,
            num_warps=quarters["num_warps"],
        )
        return _mxfp8_outputs(row_data, row_scale, col_data, col_scale)
    mb, nb = cfg["MB"], cfg["NB"]
    n_m, n_k = cdiv(m, mb * 32), cdiv(k, nb * 32)
    _mxfp8_kernel[(n_m * n_k,)](
        xk,
        row_data.view(torch.uint8) if rowwise else dummy, row_scale if rowwise else dummy,
        col_data.view(torch.uint8) if columnwise else dummy, col_scale if columnwise else dummy,
        m, k, n_k,
        FMAX=fmax, FMAX_EXP=((fb >> 23) & 0xFF) - 127, FMAX_MANT=fb & 0x7FFFFF,
        E4M3=e4m3, SOFT=soft_cast(), ROWWISE=bool(rowwise), COLWISE=bool(columnwise),
        BF16_BITS=bf16_bits, MB=mb, NB=nb, num_warps=cfg["num_warps"],
    )
    return _mxfp8_outputs(row_data, row_scale, col_data, col_scale)


def _mxfp8_outputs(row_data, row_scale, col_data, col_scale):
    e8m0 = torch.float8_e8m0fnu
    return (row_data, row_scale.view(e8m0) if row_scale is not None else None,
            col_data, col_scale.view(e8m0) if col_scale is not None else None)
