"""FP8 blockwise (1x128 / 128x128 tiles) quantize in Triton: one pass over x writes the rowwise
and the columnwise buffers, in the exact layouts of `kernels/reference/blockwise.py`:

- 1x128 (block_scaling_dim=1): rowwise data (shape of x), scale_inv (M, ceil(K/128)) with
  strides (1, M); columnwise data (K, M) quantized in 1x128 tiles along M, scale_inv
  (K, ceil(M/128)) with strides (1, K). A 128x128 tile of x gives 128 row amaxes (along K) and
  128 column amaxes (along M) from the same registers.
- 128x128 (block_scaling_dim=2): one scale per tile; rowwise scale_inv (ceil(M/128),
  ceil(K/128)) contiguous; the columnwise data is the transpose of the rowwise data and its
  scale_inv the (ceil(K/128), ceil(M/128)) transpose.

Partial tiles: masked loads give 0, which cannot raise an amax. Non-finite values as in the
reference: tile amaxes of the finite values (`finite_abs_bits`), inf / NaN kept non-finite in the
data (`fp8_scaled_bits`).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..reference import blockwise as _ref
from ._common import (
    INT32_LIMIT,
    as_kernel_input,
    cdiv,
    finite_abs_bits,
    fp8_params,
    fp8_scaled_bits,
    scale_from_amax,
    scale_reciprocal,
    soft_cast,
    to_f32,
    triton_kernel,
)
from .launch import fast_launch

TILE = 128

CONFIG = {
    # (BM, BK, CH, num_warps) by (block_scaling_dim, rowwise, columnwise). BK must be 128 for
    # 1x128 rowwise, BM 128 for 1x128 columnwise, both 128 for 128x128. CH (rows per chunk,
    # divides BM): CH == BM holds the tile in registers, CH < BM re-reads it from L2. The
    # rowwise + columnwise configs were chosen by timing at 8192^2 bf16 on an H100
    # (benchmarks/results/2026-11-24-h100-96e8cd3).
    (1, True, True): dict(BM=128, BK=128, CH=32, num_warps=4),  # faster than CH 64 or 8 warps
    (1, True, False): dict(BM=32, BK=128, CH=32, num_warps=4),
    (1, False, True): dict(BM=128, BK=64, CH=32, num_warps=4),
    (2, True, True): dict(BM=128, BK=128, CH=64, num_warps=4),  # here CH 64 is faster than CH 32
    (2, True, False): dict(BM=128, BK=128, CH=32, num_warps=4),
    (2, False, True): dict(BM=128, BK=128, CH=32, num_warps=4),
}


@triton.jit
def _load_rows(x_ptr, m0, r0, M, K, k0, rc, rk, k_ok, BF16_BITS: tl.constexpr):
    """fp32 rows m0 + r0 + rc (x columns k0 + rk), masked to the matrix (zeros outside)."""
    mask = ((m0 + r0 + rc) < M)[:, None] & k_ok[None, :]
    base = (m0 + r0).to(tl.int64) * K + k0
    x = tl.load(x_ptr + base + rc[:, None] * K + rk[None, :], mask=mask, other=0)
    return to_f32(x, BF16_BITS), mask, base


@triton.jit
def _store_t(col_ptr, col_base, r0, offs_t, q, mask):
    """Chunk q [CH, BK] (rows r0.. of the program's tile) into the (K, M) output, transposed."""
    tl.store(col_ptr + col_base + r0 + offs_t, tl.trans(q), mask=tl.trans(mask))


@triton.jit
def _rowwise_1x128(x, mask, base, rows, row_ptr, row_si_ptr, pid_k, M, K, rc, rk,
                   FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr,
                   POW2: tl.constexpr, EPS: tl.constexpr):
    ramax = tl.max(finite_abs_bits(x), axis=1).to(tl.float32, bitcast=True)
    rscale = scale_from_amax(ramax, FMAX, 1.0, POW2, EPS)
    q = fp8_scaled_bits(x, rscale[:, None], FMAX, E4M3, SOFT, True)
    tl.store(row_ptr + base + rc[:, None] * K + rk[None, :], q, mask=mask)
    # scale_inv (M, n_k) with strides (1, M)
    tl.store(row_si_ptr + pid_k.to(tl.int64) * M + rows, scale_reciprocal(rscale, POW2), mask=rows < M)


@fast_launch
@triton.jit
def _blockwise_kernel(x_ptr, row_ptr, row_si_ptr, col_ptr, col_si_ptr, M, K, n_m, n_k,
                      FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr,
                      POW2: tl.constexpr, EPS: tl.constexpr, TWO_D: tl.constexpr,
                      ROWWISE: tl.constexpr, COLWISE: tl.constexpr, BF16_BITS: tl.constexpr,
                      BM: tl.constexpr, BK: tl.constexpr, CH: tl.constexpr):
    """One program: rows [m0, m0 + BM) x columns [k0, k0 + BK).

    CH == BM: the tile is read once and held in registers. CH < BM: the tile is walked in
    chunks of CH rows; where a scale needs all BM rows first (128x128 tiles; 1x128 columnwise
    tiles, along M) a first walk takes the amax and a second one re-reads the chunks (from L2)
    to cast them, so few registers are live at a time.
    """
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    m0 = pid_m * BM
    k0 = pid_k * BK
    rc = tl.arange(0, CH)
    rk = tl.arange(0, BK)
    k_ok = (k0 + rk) < K
    NCH: tl.constexpr = BM // CH
    col_base = k0.to(tl.int64) * M + m0
    offs_t = rk[:, None] * M + rc[None, :]  # transposed chunk [BK, CH] in the (K, M) output
    if TWO_D:
        if NCH == 1:
            x, mask, base = _load_rows(x_ptr, m0, 0, M, K, k0, rc, rk, k_ok, BF16_BITS)
            amax_bits = tl.max(tl.max(finite_abs_bits(x), axis=1), axis=0)
        else:
            acc = tl.zeros([CH, BK], dtype=tl.int32)
            for c in range(NCH):
                xc, _, _ = _load_rows(x_ptr, m0, c * CH, M, K, k0, rc, rk, k_ok, BF16_BITS)
                acc = tl.maximum(acc, finite_abs_bits(xc))
            amax_bits = tl.max(tl.max(acc, axis=1), axis=0)
        scale = scale_from_amax(amax_bits.to(tl.float32, bitcast=True), FMAX, 1.0, POW2, EPS)
        si = scale_reciprocal(scale, POW2)
        if ROWWISE:
            tl.store(row_si_ptr + pid_m * n_k + pid_k, si)
        if COLWISE:
            tl.store(col_si_ptr + pid_k * n_m + pid_m, si)
        if NCH == 1:
            q = fp8_scaled_bits(x, scale, FMAX, E4M3, SOFT, True)
            if ROWWISE:
                tl.store(row_ptr + base + rc[:, None] * K + rk[None, :], q, mask=mask)
            if COLWISE:
                _store_t(col_ptr, col_base, 0, offs_t, q, mask)
        else:
            for c in range(NCH):
                xc, maskc, basec = _load_rows(x_ptr, m0, c * CH, M, K, k0, rc, rk, k_ok, BF16_BITS)
                q = fp8_scaled_bits(xc, scale, FMAX, E4M3, SOFT, True)
                if ROWWISE:
                    tl.store(row_ptr + basec + rc[:, None] * K + rk[None, :], q, mask=maskc)
                if COLWISE:
                    _store_t(col_ptr, col_base, c * CH, offs_t, q, maskc)
    else:
        # 1x128 rowwise tiles lie inside a chunk (BK == 128); columnwise ones span all BM rows
        if NCH == 1:
            x, mask, base = _load_rows(x_ptr, m0, 0, M, K, k0, rc, rk, k_ok, BF16_BITS)
            if ROWWISE:
                _rowwise_1x128(x, mask, base, m0 + rc, row_ptr, row_si_ptr, pid_k, M, K, rc, rk,
                               FMAX, E4M3, SOFT, POW2, EPS)
            if COLWISE:
                cacc = tl.max(finite_abs_bits(x), axis=0)
        else:
            # elementwise max over the chunks, one reduction across rows (threads) at the end
            cacc2 = tl.zeros([CH, BK], dtype=tl.int32)
            for c in range(NCH):
                xc, maskc, basec = _load_rows(x_ptr, m0, c * CH, M, K, k0, rc, rk, k_ok, BF16_BITS)
                if ROWWISE:
                    _rowwise_1x128(xc, maskc, basec, m0 + c * CH + rc, row_ptr, row_si_ptr, pid_k,
                                   M, K, rc, rk, FMAX, E4M3, SOFT, POW2, EPS)
                if COLWISE:
                    cacc2 = tl.maximum(cacc2, finite_abs_bits(xc))
            cacc = tl.max(cacc2, axis=0)
        if COLWISE:  # BM == 128: this program is m-tile pid_m
            cscale = scale_from_amax(cacc.to(tl.float32, bitcast=True), FMAX, 1.0, POW2, EPS)
            # scale_inv (K, n_m) with strides (1, K)
            tl.store(col_si_ptr + pid_m.to(tl.int64) * K + k0 + rk, scale_reciprocal(cscale, POW2), mask=k_ok)
            if NCH == 1:
                qc = fp8_scaled_bits(x, cscale[None, :], FMAX, E4M3, SOFT, True)
                _store_t(col_ptr, col_base, 0, offs_t, qc, mask)
            else:
                for c in range(NCH):
                    xc, maskc, _ = _load_rows(x_ptr, m0, c * CH, M, K, k0, rc, rk, k_ok, BF16_BITS)
                    qc = fp8_scaled_bits(xc, cscale[None, :], FMAX, E4M3, SOFT, True)
                    _store_t(col_ptr, col_base, c * CH, offs_t, qc, maskc)


def _outer_dim_major(rows: int, cols: int, device) -> torch.Tensor:
    """Uninitialized fp32 (rows, cols) with strides (1, rows)."""
    return torch.empty((cols, rows), dtype=torch.float32, device=device).t()


@triton_kernel("fp8_blockwise_quantize")
def fp8_blockwise_quantize(x: torch.Tensor, fp8_dtype, block_scaling_dim: int, rowwise: bool,
                           columnwise: bool, power_2: bool = True, epsilon: float = 0.0
                           ) -> Tuple[Optional[torch.Tensor], ...]:
    """Returns (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv); the
    buffers of an unrequested usage are None."""
    shape = tuple(x.shape)
    if block_scaling_dim not in (1, 2):
        raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim}")
    fmax, e4m3 = fp8_params(fp8_dtype)
    k = shape[-1] if shape else 1
    m = math.prod(shape[:-1]) if shape else 1
    if not (rowwise or columnwise):
        return None, None, None, None
    cfg = CONFIG[(block_scaling_dim, bool(rowwise), bool(columnwise))]
    bm, bk = cfg["BM"], cfg["BK"]
    if m == 0 or k == 0 or bm * k >= INT32_LIMIT or bk * m >= INT32_LIMIT:
        return _ref.fp8_blockwise_quantize(x, fp8_dtype, block_scaling_dim, rowwise, columnwise,
                                           power_2, epsilon)
    dev = x.device
    x2d = x.contiguous().reshape(m, k)
    mt, kt = cdiv(m, TILE), cdiv(k, TILE)
    row_data = row_si = col_data = col_si = None
    if rowwise:
        row_data = torch.empty((m, k), dtype=fp8_dtype, device=dev)
        row_si = (_outer_dim_major(m, kt, dev) if block_scaling_dim == 1
                  else torch.empty((mt, kt), dtype=torch.float32, device=dev))
    if columnwise:
        col_data = torch.empty((k, m), dtype=fp8_dtype, device=dev)
        col_si = (_outer_dim_major(k, mt, dev) if block_scaling_dim == 1
                  else torch.empty((kt, mt), dtype=torch.float32, device=dev))
    n_m, n_k = cdiv(m, bm), cdiv(k, bk)
    dummy = row_si if rowwise else col_si
    xk, bf16_bits = as_kernel_input(x2d)
    _blockwise_kernel[(n_m * n_k,)](
        xk,
        row_data.view(torch.uint8) if rowwise else dummy, row_si if rowwise else dummy,
        col_data.view(torch.uint8) if columnwise else dummy, col_si if columnwise else dummy,
        m, k, n_m, n_k,
        FMAX=fmax, E4M3=e4m3, SOFT=soft_cast(), POW2=bool(power_2), EPS=float(epsilon),
        TWO_D=block_scaling_dim == 2, ROWWISE=bool(rowwise), COLWISE=bool(columnwise),
        BF16_BITS=bf16_bits, BM=bm, BK=bk, CH=cfg.get("CH", bm), num_warps=cfg["num_warps"],
    )
    if rowwise:
        row_data = row_data.view(shape)
    return row_data, row_si, col_data, col_si
