"""NVFP4 reference kernels: E2M1 values packed two per byte, an E4M3 scale per 16 values and one
fp32 global amax per usage (docs/design.md, format facts).

Encoding, with S_enc = 448 * 6 / amax (see `global_encode_scale`):
  S_dec_b = e4m3(saturate(amax_b / 6 * S_enc))      one per block of 16 along the reduction dim
  q       = e2m1(x * (S_enc / S_dec_b))              (0 where S_dec_b == 0; where that factor
                                                     overflows: e2m1((x * S_enc) / S_dec_b))
  x~      = q * S_dec_b / S_enc

Non-finite values (E2M1 has neither inf nor NaN): the global amax is that of the finite values
(`common.abs_max`), so they leave the other blocks their precision; a block holding an inf or NaN
gets a NaN S_dec_b (its codes are 0), so the whole block dequantizes to NaN.
The columnwise operand may go through a random Hadamard transform (RHT) first: every run of 16
values along M is multiplied by the orthonormal H = Had16 @ diag(signs) / 4.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .. import register_kernel
from .common import FLOAT32_MAX, FP4_E2M1_MAX, FP8_MAX, abs_max, saturating_cast, transpose_2d, true_div

__all__ = [
    "BLOCK", "E2M1_VALUES", "fp4_encode", "fp4_decode", "pack_fp4", "unpack_fp4_codes", "unpack_fp4",
    "global_encode_scale", "rht_matrix", "apply_rht", "quantize_blocks", "dequantize_blocks", "transpose_2d_blocks",
    "check_given_amax",
]

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude by code 0..7; bit 3 is the sign
# Midpoints between neighbouring magnitudes, and whether a tie there rounds up (to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_E4M3_MAX = FP8_MAX[torch.float8_e4m3fn]


# ---- E2M1 codes ---------------------------------------------------------------------------
def _magnitude(code: torch.Tensor) -> torch.Tensor:
    """fp32 E2M1 magnitude of codes 0..7, computed rather than looked up: a table would be a
    host-to-device copy (illegal during CUDA-graph capture) or a cached tensor (which would live
    in the graph pool, untracked). Code = exponent (2 bits) then mantissa (1 bit), bias 1."""
    e = (code >> 1).float()
    m = (code & 1).float()
    return torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e - 1.0))


def fp4_encode(v: torch.Tensor, rand: Optional[torch.Tensor] = None) -> torch.Tensor:
    """E2M1 codes (uint8 0..15, one per element) of already-scaled fp32 values.

    Round to nearest, ties to the even code; |v| > 6 (Inf too) saturates to 6; NaN gives 0.
    With `rand` (uniform [0, 1), v's shape): stochastic rounding, rounding |v| up from its lower
    neighbour lo to hi with probability (|v| - lo) / (hi - lo) -- unbiased below saturation.
    """
    v = v.float()
    a = v.abs().clamp(max=FP4_E2M1_MAX)
    if rand is None:
        code = torch.zeros(v.shape, dtype=torch.int32, device=v.device)
        for mid, tie_up in _MIDPOINTS:
            code = code + ((a >= mid) if tie_up else (a > mid)).to(torch.int32)
    else:
        lo_code = torch.zeros(v.shape, dtype=torch.int32, device=v.device)
        for val in E2M1_VALUES[1:]:
            lo_code = lo_code + (a >= val).to(torch.int32)
        hi_code = (lo_code + 1).clamp(max=7)
        lo, hi = _magnitude(lo_code), _magnitude(hi_code)
        gap = hi - lo
        p = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(a))
        code = torch.where(rand.to(v.device).float() < p, hi_code, lo_code)
    nan = torch.isnan(v)
    code = torch.where(nan, torch.zeros_like(code), code)
    sign = (torch.signbit(v) & ~nan).to(torch.int32) << 3
    return (code | sign).to(torch.uint8)


def fp4_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8, low 4 bits used); code 8 is -0.0."""
    c = codes.to(torch.int32)
    mag = _magnitude(c & 7)
    return torch.where((c & 8) != 0, -mag, mag)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """(..., 2n) codes -> (..., n) bytes: element 2i in the low nibble, 2i+1 in the high nibble."""
    lo, hi = codes[..., 0::2], codes[..., 1::2]
    return (lo | (hi << 4)).to(torch.uint8)


def unpack_fp4_codes(data: torch.Tensor) -> torch.Tensor:
    """(..., n) bytes -> (..., 2n) codes (inverse of `pack_fp4`)."""
    d = data.view(torch.uint8) if data.dtype != torch.uint8 else data
    return torch.stack((d & 0xF, d >> 4), dim=-1).flatten(-2)


def unpack_fp4(data: torch.Tensor) -> torch.Tensor:
    """(..., n) packed bytes -> (..., 2n) float32 E2M1 values (unscaled)."""
    return fp4_decode(unpack_fp4_codes(data))


# ---- scales and the Hadamard transform --------------------------------------------------------
def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """S_enc = 448 * 6 / amax (correctly rounded, `true_div`); float32 max if that overflows; 1 for
    amax 0, NaN or Inf."""
    amax = amax.float()
    s = true_div(_E4M3_MAX * FP4_E2M1_MAX, amax)
    s = torch.where(torch.isinf(s) & (amax > 0), torch.full_like(s, FLOAT32_MAX), s)
    return torch.where((amax == 0) | ~torch.isfinite(amax), torch.ones_like(s), s)


_RHT_CACHE = {}


@torch.compiler.assume_constant_result
def _rht_values(seed: int) -> Tuple[Tuple[float, ...], ...]:
    """H as nested tuples, cached per seed: a compile-time constant (run at trace time, since a
    torch.Generator cannot be created inside a graph)."""
    if seed not in _RHT_CACHE:
        with _disable_current_modes():  # real tensors even while an op body is being traced
            g = torch.Generator().manual_seed(seed)
            # device="cpu": the generator's device, also under a user's `with torch.device("cuda")`
            signs = (torch.randint(0, 2, (BLOCK,), generator=g, device="cpu") * 2 - 1).tolist()
        _RHT_CACHE[seed] = tuple(
            tuple((-1.0 if bin(i & j).count("1") % 2 else 1.0) * signs[j] / 4.0 for j in range(BLOCK))
            for i in range(BLOCK)
        )
    return _RHT_CACHE[seed]


def rht_matrix(seed: int, device=None) -> torch.Tensor:
    """The orthonormal 16x16 RHT matrix H = Had16 @ diag(signs) / 4, signs fixed by `seed`."""
    return torch.tensor(_rht_values(int(seed)), dtype=torch.float32, device=device)


@torch.compiler.assume_constant_result
def _rht_negative_mask(seed: int) -> int:
    """Bit j set where sign j is -1 (row 0 of Had16 is all ones, so row 0 of H is signs / 4)."""
    return sum(1 << j for j in range(BLOCK) if _rht_values(seed)[0][j] < 0)


def _rht_signs(seed: int, device) -> torch.Tensor:
    """The 16 signs as an fp32 tensor built on the device from an integer mask (no host-to-device
    copy, nothing cached: both would break CUDA-graph capture)."""
    bits = (_rht_negative_mask(int(seed)) >> torch.arange(BLOCK, device=device)) & 1
    return 1.0 - 2.0 * bits.float()


def apply_rht(x2d: torch.Tensor, seed: int, inverse: bool = False) -> torch.Tensor:
    """Multiply each run of 16 along the last dim by H (or by H^T = H^-1 with `inverse`).

    A fast Walsh-Hadamard butterfly (4 stages of a+b, a-b) rather than a matmul: the additions
    happen in one fixed order, so the result is bitwise the same on every device and backend.
    """
    r, c = x2d.shape
    signs = _rht_signs(seed, x2d.device)
    y = x2d.float().reshape(-1, BLOCK)
    if not inverse:
        y = y * signs  # H v = Had16 (signs * v) / 4
    for h in (1, 2, 4, 8):
        pairs = y.reshape(-1, BLOCK // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, BLOCK)
    y = y * 0.25
    if inverse:
        y = y * signs  # H^T v = signs * (Had16 v) / 4
    return y.reshape(r, c)


# ---- block quantization ---------------------------------------------------------------------------
def _block_amax(x2d: torch.Tensor, two_d: bool) -> torch.Tensor:
    """Amax per 1x16 block, flat (R * C/16,) in row-major block order; with `two_d` per 16x16 tile,
    replicated to every row of the tile (a last partial tile, R % 16 != 0, takes the amax of the
    rows it has). NaN propagates."""
    r, c = x2d.shape
    a = x2d.abs().reshape(-1, BLOCK).amax(-1)
    if not two_d:
        return a
    a = a.reshape(r, c // BLOCK)
    pad = (-r) % BLOCK
    if pad:
        a = torch.cat((a, a.new_zeros(pad, a.shape[1])), 0)
    tiles = a.reshape(-1, BLOCK, a.shape[1]).amax(1)
    return tiles.repeat_interleave(BLOCK, 0)[:r].reshape(-1)


def quantize_blocks(x2d: torch.Tensor, amax: torch.Tensor, two_d: bool = False,
                    rand: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize (R, C) fp32 along C with global `amax`: returns (packed data (R, C/2) uint8,
    scale_inv (R, C/16) float8_e4m3fn)."""
    # Works on flat (blocks, 16) views: the rowwise and columnwise passes then have the same loop
    # structure, which inductor's CPU backend needs to fuse them (torch 2.13 asserts otherwise).
    r, c = x2d.shape
    s_enc = global_encode_scale(amax)
    six = s_enc.new_full((1,), FP4_E2M1_MAX)  # a tensor: CUDA divides by a scalar via its reciprocal
    block_amax = _block_amax(x2d, two_d)
    # a non-finite block amax (the block holds an inf or NaN) gives a NaN scale, not a saturated one
    s_dec = saturating_cast(torch.where(block_amax < math.inf, block_amax / six * s_enc, math.nan),
                            torch.float8_e4m3fn)
    s_dec_f = s_dec.float().unsqueeze(-1)
    enc = torch.where(s_dec_f == 0, torch.zeros_like(s_dec_f), s_enc / s_dec_f)
    blocks = x2d.reshape(-1, BLOCK)
    # S_enc / S_dec_b overflows only for block amax < ~1.8e-38 (S_enc clamped to float32 max):
    # there scale in two steps, which stays finite, instead of multiplying by inf.
    scaled = torch.where(torch.isinf(enc), (blocks * s_enc) / s_dec_f, blocks * enc)
    codes = fp4_encode(scaled, None if rand is None else rand.reshape(-1, BLOCK))
    return pack_fp4(codes).reshape(r, c // 2), s_dec.reshape(r, c // BLOCK)


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """fp32 (R, C) values of packed (R, C/2) data with its (R, C/16) scales and global amax."""
    vals = unpack_fp4(data)
    r, c = vals.shape
    scaled = vals.reshape(r, c // BLOCK, BLOCK) * scale_inv.float().unsqueeze(-1)
    return (scaled / global_encode_scale(amax)).reshape(r, c)


def transpose_2d_blocks(data: torch.Tensor, scale_inv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact relayout of 16x16-tile (2D) quantized buffers: packed (R, C/2) data and replicated
    (R, C/16) scales -> (C, R/2) and (C, R/16) of the transpose. Needs R % 16 == 0."""
    codes_t = transpose_2d(unpack_fp4_codes(data))
    tiles = transpose_2d(scale_inv.view(torch.uint8)[::BLOCK])  # (C/16, R/16): one scale per tile
    return pack_fp4(codes_t), tiles.repeat_interleave(BLOCK, 0).view(torch.float8_e4m3fn)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """The global amax: of the finite values."""
    return abs_max(x, finite=True)


def check_given_amax(amax: Optional[torch.Tensor], rht: bool) -> None:
    """An amax handed to nvfp4_quantize must be one float32 value, and cannot stand in for the
    rotated tensor's amax."""
    if amax is None:
        return
    if amax.numel() != 1 or amax.dtype != torch.float32:
        raise ValueError(f"nvfp4_quantize: amax must be one float32 value, "
                         f"got {amax.dtype} of shape {tuple(amax.shape)}")
    if rht:
        raise ValueError("nvfp4_quantize: a given amax cannot be combined with the RHT (the columnwise "
                         "amax is the rotated tensor's)")


@register_kernel("nvfp4_quantize")
def nvfp4_quantize(x: torch.Tensor, rowwise: bool, columnwise: bool, two_d: bool = False,
                   rht: bool = False, rht_seed: int = 0, stochastic: bool = False,
                   rand: Optional[torch.Tensor] = None, rand_columnwise: Optional[torch.Tensor] = None,
                   amax: Optional[torch.Tensor] = None):
    """Quantize x viewed as (M, K). Returns (rowwise_data (M, K/2), rowwise_scale_inv (M, K/16),
    columnwise_data (K, M/2), columnwise_scale_inv (K, M/16), amax_rowwise (1,),
    amax_columnwise (1,)), None for a usage not asked for.

    Columnwise quantizes x^T, after the RHT when `rht`. With `stochastic`, `rand` (M, K) and
    `rand_columnwise` (K, M) are the uniform draws (None: drawn with torch.rand). 2D blocks use
    one rounding of x for both usages (columnwise is the exact transpose), so only `rand`.
    `amax` (fp32, (1,)) replaces x's own amax for every usage: an FSDP shard of a weight is
    quantized with the whole weight's amax. Not with `rht` (the columnwise amax is the rotated one's).
    """
    if two_d and rht:
        raise ValueError("nvfp4_quantize: the RHT cannot be combined with 2D (16x16) quantization")
    check_given_amax(amax, rht)
    m, k = x.numel() // x.shape[-1], x.shape[-1]
    x2d = x.reshape(m, k).float()
    rand = rand.reshape(m, k) if rand is not None else None
    rand_columnwise = rand_columnwise.reshape(k, m) if rand_columnwise is not None else None
    if stochastic and rand is None and (rowwise or two_d):
        rand = torch.rand((m, k), device=x.device)
    rand_row = rand if stochastic else None
    row_data = row_scale = col_data = col_scale = amax_row = amax_col = None
    own = _amax if amax is None else (lambda _: amax.float().reshape(1).clone())
    if two_d:
        amax_row = own(x2d)
        data, scale = quantize_blocks(x2d, amax_row, True, rand_row)
        if rowwise:
            row_data, row_scale = data, scale
        if columnwise:
            col_data, col_scale = transpose_2d_blocks(data, scale)
            amax_col = amax_row.clone()
        return row_data, row_scale, col_data, col_scale, (amax_row if rowwise else None), amax_col
    if rowwise:
        amax_row = own(x2d)
        row_data, row_scale = quantize_blocks(x2d, amax_row, False, rand_row)
    if columnwise:
        xt = transpose_2d(x2d)
        if rht:
            xt = apply_rht(xt, rht_seed)
        if stochastic and rand_columnwise is None:
            rand_columnwise = torch.rand((k, m), device=x.device)
        amax_col = own(xt)
        col_data, col_scale = quantize_blocks(xt, amax_col, False, rand_columnwise if stochastic else None)
    return row_data, row_scale, col_data, col_scale, amax_row, amax_col


@register_kernel("nvfp4_dequantize")
def nvfp4_dequantize(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                     columnwise_scale_inv, amax_columnwise, rht: bool = False, rht_seed: int = 0):
    """fp32 (M, K) values: from the rowwise buffers if given, else from the columnwise ones
    (undoing the RHT when `rht`, then transposing back)."""
    if rowwise_data is not None:
        return dequantize_blocks(rowwise_data, rowwise_scale_inv, amax_rowwise)
    vals = dequantize_blocks(columnwise_data, columnwise_scale_inv, amax_columnwise)
    if rht:
        vals = apply_rht(vals, rht_seed, inverse=True)
    return transpose_2d(vals)
