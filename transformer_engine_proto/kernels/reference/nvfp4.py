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

Two options of TE's NVFP4 recipe change the encoding (neither combines with the RHT or stochastic
rounding; TE refuses both too):

- row scaling (TE's `row_scaled_nvfp4`): one amax, hence one S_enc, per row of the quantized
  matrix instead of one per tensor: rowwise buffers carry (M,) amaxes, columnwise ones (K,) (the
  rows of x^T). A row of small values then keeps its precision next to a row of large ones. 1D
  blocks only.
- "4 over 6" (TE's `nvfp4_use_4over6`): each block is encoded twice, once with the usual scale
  (its amax maps to 6, the largest E2M1 value) and once with a 1.5x larger one (its amax maps to
  4), and keeps the candidate whose dequantized values are closer to x (sum of |error| "MAE" or of
  error^2 "MSE" over the block, or over the 16x16 tile with 2D blocks; a tie keeps the map-to-6
  candidate). Relative to the block amax, map-to-6 has nothing between 2/3 and 1 (E2M1's 4 and
  6); map-to-4 has 3/4 there, at the cost of coarser small values. TE also lowers the bound in
  S_enc from 448 to 256 by default (`e4m3_max`), so that 1.5x the largest block scale, 384,
  still fits E4M3 unsaturated.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._python_dispatch import _disable_current_modes

from .. import register_kernel
from .common import FLOAT32_MAX, FP4_E2M1_MAX, FP8_MAX, abs_max, saturating_cast, transpose_2d, true_div

__all__ = [
    "BLOCK", "E2M1_VALUES", "fp4_encode", "fp4_decode", "pack_fp4", "unpack_fp4_codes", "unpack_fp4",
    "global_encode_scale", "rht_matrix", "apply_rht", "quantize_blocks", "dequantize_blocks", "transpose_2d_blocks",
    "check_given_amax", "check_options", "row_abs_max", "FOUR_OVER_SIX_MODES", "E4M3_BOUNDS",
]

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude by code 0..7; bit 3 is the sign
# Midpoints between neighbouring magnitudes, and whether a tie there rounds up (to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_E4M3_MAX = FP8_MAX[torch.float8_e4m3fn]
FOUR_OVER_SIX_MODES = ("MAE", "MSE")  # the block error 4over6 minimizes
E4M3_BOUNDS = (448, 256)  # the block-scale bound in S_enc: E4M3's max, or TE's 4over6 default
_MAP_TO_4 = 1.5  # 6 / 4: the map-to-4 block scale over the map-to-6 one


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
def global_encode_scale(amax: torch.Tensor, e4m3_max: float = _E4M3_MAX) -> torch.Tensor:
    """S_enc = e4m3_max * 6 / amax (correctly rounded, `true_div`; e4m3_max 448, or 256 for TE's
    4over6 default); float32 max if that overflows; 1 for amax 0, NaN or Inf. Elementwise: a row
    scaled tensor's (rows,) amaxes give one S_enc per row."""
    amax = amax.float()
    s = true_div(float(e4m3_max) * FP4_E2M1_MAX, amax)
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


def row_abs_max(x2d: torch.Tensor) -> torch.Tensor:
    """(R,) float32 amax of each row's finite values (0 for a row with none): a row-scaled
    tensor's amaxes. An empty row count gives (0,); zero columns give zeros."""
    a = x2d.abs()
    a = torch.where(a < math.inf, a, 0.0)  # NaN compares False too
    if statically_known_true(x2d.shape[1] != 0):
        return a.amax(1).float()
    return torch.cat([a.new_zeros(a.shape[0], 1), a], 1).amax(1).float()


def _block_scale(block_amax: torch.Tensor, s_enc: torch.Tensor, six: torch.Tensor,
                 expand: Optional[float] = None) -> torch.Tensor:
    """e4m3(saturate(block amax / 6 * S_enc [* expand])); NaN for a non-finite block amax (the
    block holds an inf or NaN), not a saturated scale."""
    v = block_amax / six * s_enc
    if expand is not None:
        v = v * expand
    return saturating_cast(torch.where(block_amax < math.inf, v, math.nan), torch.float8_e4m3fn)


def _encode(blocks: torch.Tensor, s_dec: torch.Tensor, s_enc: torch.Tensor,
            rand: Optional[torch.Tensor]) -> torch.Tensor:
    """E2M1 codes of (blocks, 16) values under their block scales (blocks,) and S_enc ((1,), or
    (blocks, 1) when each block has its own)."""
    s_dec_f = s_dec.float().unsqueeze(-1)
    enc = torch.where(s_dec_f == 0, torch.zeros_like(s_dec_f), s_enc / s_dec_f)
    # S_enc / S_dec_b overflows only for block amax < ~1.8e-38 (S_enc clamped to float32 max):
    # there scale in two steps, which stays finite, instead of multiplying by inf.
    scaled = torch.where(torch.isinf(enc), (blocks * s_enc) / s_dec_f, blocks * enc)
    return fp4_encode(scaled, rand)


def _sum16(e: torch.Tensor) -> torch.Tensor:
    """Sum over a last dim of 16 as a fixed pairwise tree (halves added elementwise): one order of
    additions on every backend, so a near tie between two candidates is decided the same way."""
    while e.shape[-1] > 1:
        h = e.shape[-1] // 2
        e = e[..., :h] + e[..., h:]
    return e.squeeze(-1)


def _block_error(codes, s_dec, s_enc, blocks, mode: str) -> torch.Tensor:
    """(blocks,) sum of |x~ - x| (MAE) or (x~ - x)^2 (MSE) over each block, x~ the values the
    dequantize gives. Its division is done in float64 and rounded once: the correctly rounded fp32
    quotient eager fp32 division gives too, also where a compiler would approximate it."""
    scaled = fp4_decode(codes) * s_dec.float().unsqueeze(-1)
    d = (scaled.double() / s_enc.double()).float() - blocks
    return _sum16(d.abs() if mode == "MAE" else d * d)


def _tile_sum(err: torch.Tensor, r: int, nb: int) -> torch.Tensor:
    """Per-block errors (R * nb,) summed over each 16x16 tile (16 rows, pairwise as `_sum16`; a
    last partial tile sums the rows it has), replicated back to every row of the tile."""
    e = err.reshape(r, nb)
    pad = (-r) % BLOCK
    if pad:
        e = torch.cat((e, e.new_zeros(pad, nb)), 0)
    tiles = _sum16(e.reshape(-1, BLOCK, nb).transpose(1, 2))  # (tiles, nb)
    return tiles.repeat_interleave(BLOCK, 0)[:r].reshape(-1)


def quantize_blocks(x2d: torch.Tensor, amax: torch.Tensor, two_d: bool = False,
                    rand: Optional[torch.Tensor] = None, *, row_scaled: bool = False,
                    four_over_six: Optional[str] = None,
                    e4m3_max: float = _E4M3_MAX) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize (R, C) fp32 along C with global `amax` ((1,), or (R,) with `row_scaled`): returns
    (packed data (R, C/2) uint8, scale_inv (R, C/16) float8_e4m3fn). `four_over_six` ("MAE" /
    "MSE") picks each block's map-to-4 or map-to-6 scale by that error; `e4m3_max` is the block
    scale bound in S_enc (module docstring)."""
    # Works on flat (blocks, 16) views: the rowwise and columnwise passes then have the same loop
    # structure, which inductor's CPU backend needs to fuse them (torch 2.13 asserts otherwise).
    r, c = x2d.shape
    nb = c // BLOCK
    s_enc = global_encode_scale(amax, e4m3_max)
    if row_scaled:  # one S_enc per block, from its row's amax
        s_enc = s_enc.reshape(r, 1).expand(r, nb).reshape(-1)
    s_enc_col = s_enc.unsqueeze(-1) if row_scaled else s_enc
    six = s_enc.new_full((1,), FP4_E2M1_MAX)  # a tensor: CUDA divides by a scalar via its reciprocal
    block_amax = _block_amax(x2d, two_d)
    blocks = x2d.reshape(-1, BLOCK)
    rand = None if rand is None else rand.reshape(-1, BLOCK)
    s_dec = _block_scale(block_amax, s_enc, six)
    codes = _encode(blocks, s_dec, s_enc_col, rand)
    if four_over_six is not None:
        s_dec4 = _block_scale(block_amax, s_enc, six, _MAP_TO_4)
        codes4 = _encode(blocks, s_dec4, s_enc_col, rand)
        err6 = _block_error(codes, s_dec, s_enc_col, blocks, four_over_six)
        err4 = _block_error(codes4, s_dec4, s_enc_col, blocks, four_over_six)
        if two_d:
            err6, err4 = _tile_sum(err6, r, nb), _tile_sum(err4, r, nb)
        pick4 = err4 < err6  # a tie (and a NaN block) keeps map-to-6
        codes = torch.where(pick4.unsqueeze(-1), codes4, codes)
        s_dec = torch.where(pick4, s_dec4.view(torch.uint8), s_dec.view(torch.uint8)).view(torch.float8_e4m3fn)
    return pack_fp4(codes).reshape(r, c // 2), s_dec.reshape(r, c // BLOCK)


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor, *,
                      row_scaled: bool = False, e4m3_max: float = _E4M3_MAX) -> torch.Tensor:
    """fp32 (R, C) values of packed (R, C/2) data with its (R, C/16) scales and global amax ((1,),
    or (R,) with `row_scaled`)."""
    vals = unpack_fp4(data)
    r, c = vals.shape
    scaled = vals.reshape(r, c // BLOCK, BLOCK) * scale_inv.float().unsqueeze(-1)
    s_enc = global_encode_scale(amax, e4m3_max)
    if row_scaled:
        s_enc = s_enc.reshape(r, 1, 1)
    return (scaled / s_enc).reshape(r, c)


def transpose_2d_blocks(data: torch.Tensor, scale_inv: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Exact relayout of 16x16-tile (2D) quantized buffers: packed (R, C/2) data and replicated
    (R, C/16) scales -> (C, R/2) and (C, R/16) of the transpose. Needs R % 16 == 0."""
    codes_t = transpose_2d(unpack_fp4_codes(data))
    tiles = transpose_2d(scale_inv.view(torch.uint8)[::BLOCK])  # (C/16, R/16): one scale per tile
    return pack_fp4(codes_t), tiles.repeat_interleave(BLOCK, 0).view(torch.float8_e4m3fn)


def _amax(x: torch.Tensor) -> torch.Tensor:
    """The global amax: of the finite values."""
    return abs_max(x, finite=True)


def check_given_amax(amax: Optional[torch.Tensor], rht: bool, row_scaled: bool = False) -> None:
    """An amax handed to nvfp4_quantize must be one float32 value, and cannot stand in for the
    rotated tensor's amax nor for a row-scaled tensor's per-row ones."""
    if amax is None:
        return
    if amax.numel() != 1 or amax.dtype != torch.float32:
        raise ValueError(f"nvfp4_quantize: amax must be one float32 value, "
                         f"got {amax.dtype} of shape {tuple(amax.shape)}")
    if rht:
        raise ValueError("nvfp4_quantize: a given amax cannot be combined with the RHT (the columnwise "
                         "amax is the rotated tensor's)")
    if row_scaled:
        raise ValueError("nvfp4_quantize: a given amax cannot be combined with row_scaled (each row "
                         "takes its own amax)")


def check_options(two_d: bool, rht: bool, stochastic: bool, row_scaled: bool,
                  four_over_six: Optional[str], e4m3_max: float) -> None:
    """The combinations of the row-scaled and 4over6 options TE refuses are refused here too."""
    if four_over_six is not None:
        if four_over_six not in FOUR_OVER_SIX_MODES:
            raise ValueError(f"nvfp4_quantize: four_over_six must be one of {FOUR_OVER_SIX_MODES} or None, "
                             f"got {four_over_six!r}")
        if rht or stochastic:
            raise ValueError("nvfp4_quantize: 4over6 cannot be combined with the RHT or stochastic rounding")
    if row_scaled and (two_d or rht or stochastic):
        raise ValueError("nvfp4_quantize: row_scaled cannot be combined with 2D (16x16) blocks, the RHT or "
                         "stochastic rounding")
    if e4m3_max not in E4M3_BOUNDS:
        raise ValueError(f"nvfp4_quantize: e4m3_max must be one of {E4M3_BOUNDS}, got {e4m3_max!r}")


@register_kernel("nvfp4_quantize")
def nvfp4_quantize(x: torch.Tensor, rowwise: bool, columnwise: bool, two_d: bool = False,
                   rht: bool = False, rht_seed: int = 0, stochastic: bool = False,
                   rand: Optional[torch.Tensor] = None, rand_columnwise: Optional[torch.Tensor] = None,
                   amax: Optional[torch.Tensor] = None, *, row_scaled: bool = False,
                   four_over_six: Optional[str] = None, e4m3_max: float = _E4M3_MAX):
    """Quantize x viewed as (M, K). Returns (rowwise_data (M, K/2), rowwise_scale_inv (M, K/16),
    columnwise_data (K, M/2), columnwise_scale_inv (K, M/16), amax_rowwise (1,),
    amax_columnwise (1,)), None for a usage not asked for.

    Columnwise quantizes x^T, after the RHT when `rht`. With `stochastic`, `rand` (M, K) and
    `rand_columnwise` (K, M) are the uniform draws (None: drawn with torch.rand). 2D blocks use
    one rounding of x for both usages (columnwise is the exact transpose), so only `rand`.
    `amax` (fp32, (1,)) replaces x's own amax for every usage: an FSDP shard of a weight is
    quantized with the whole weight's amax. Not with `rht` (the columnwise amax is the rotated one's).
    `row_scaled`: amaxes (M,) rowwise and (K,) columnwise, one per row of each usage's matrix.
    `four_over_six` ("MAE" / "MSE"): the per-block map-to-4 / map-to-6 choice; `e4m3_max`: 448 or
    256, the block-scale bound in S_enc (module docstring). Only this reference implements these
    three: `kernel(..., reference=True)`.
    """
    if two_d and rht:
        raise ValueError("nvfp4_quantize: the RHT cannot be combined with 2D (16x16) quantization")
    check_given_amax(amax, rht, row_scaled)
    check_options(two_d, rht, stochastic, row_scaled, four_over_six, e4m3_max)
    opts = dict(row_scaled=row_scaled, four_over_six=four_over_six, e4m3_max=e4m3_max)
    m, k = x.numel() // x.shape[-1], x.shape[-1]
    x2d = x.reshape(m, k).float()
    rand = rand.reshape(m, k) if rand is not None else None
    rand_columnwise = rand_columnwise.reshape(k, m) if rand_columnwise is not None else None
    if stochastic and rand is None and (rowwise or two_d):
        rand = torch.rand((m, k), device=x.device)
    rand_row = rand if stochastic else None
    row_data = row_scale = col_data = col_scale = amax_row = amax_col = None
    if row_scaled:
        own = row_abs_max
    else:
        own = _amax if amax is None else (lambda _: amax.float().reshape(1).clone())
    if two_d:
        amax_row = own(x2d)
        data, scale = quantize_blocks(x2d, amax_row, True, rand_row, **opts)
        if rowwise:
            row_data, row_scale = data, scale
        if columnwise:
            col_data, col_scale = transpose_2d_blocks(data, scale)
            amax_col = amax_row.clone()
        return row_data, row_scale, col_data, col_scale, (amax_row if rowwise else None), amax_col
    if rowwise:
        amax_row = own(x2d)
        row_data, row_scale = quantize_blocks(x2d, amax_row, False, rand_row, **opts)
    if columnwise:
        xt = transpose_2d(x2d)
        if rht:
            xt = apply_rht(xt, rht_seed)
        if stochastic and rand_columnwise is None:
            rand_columnwise = torch.rand((k, m), device=x.device)
        amax_col = own(xt)
        col_data, col_scale = quantize_blocks(xt, amax_col, False, rand_columnwise if stochastic else None, **opts)
    return row_data, row_scale, col_data, col_scale, amax_row, amax_col


@register_kernel("nvfp4_dequantize")
def nvfp4_dequantize(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                     columnwise_scale_inv, amax_columnwise, rht: bool = False, rht_seed: int = 0, *,
                     row_scaled: bool = False, e4m3_max: float = _E4M3_MAX):
    """fp32 (M, K) values: from the rowwise buffers if given, else from the columnwise ones
    (undoing the RHT when `rht`, then transposing back). `row_scaled` / `e4m3_max` as the quantize's."""
    opts = dict(row_scaled=row_scaled, e4m3_max=e4m3_max)
    if rowwise_data is not None:
        return dequantize_blocks(rowwise_data, rowwise_scale_inv, amax_rowwise, **opts)
    vals = dequantize_blocks(columnwise_data, columnwise_scale_inv, amax_columnwise, **opts)
    if rht:
        vals = apply_rht(vals, rht_seed, inverse=True)
    return transpose_2d(vals)
