"""NVFP4 quantize / dequantize in Triton, bit for bit as `kernels/reference/nvfp4.py`.

Quantize is two passes, like FP8 current scaling: (1) the global amax of the finite values (of
x, and of the RHT'd x^T for the columnwise usage), max-accumulated by atomic max on the int32 bits;
(2) one cast kernel that reads its tile of x once for every usage:

- rowwise 1x16 and 2D 16x16 blocks: the tile is loaded as [G, 16, NB, 16] (row block, row, column
  block, column), so block amaxes are plain reductions and the 2D columnwise buffers are the same
  codes permuted (the exact transpose the reference builds with `transpose_2d_blocks`);
- columnwise 1D (of x^T, blocks of 16 along M, optional RHT): the tile is loaded as 16 row
  slices v_j = x[16 g + j, k] ([G, BK] each, coalesced along K) joined into [G, BK, 16], so each
  block of 16 along M sits in one thread. The RHT splits it back into the 16 slices and runs the
  reference's butterfly as elementwise adds between them, in the same fixed order (so bitwise).

All scale math is the reference's fp32 ops in its order: correctly rounded divisions (`div_rn`)
where the reference divides tensors, the saturating RNE e4m3 cast of `_common.fp8_bits`, E2M1
thresholds with ties to the even code, stochastic rounding against the given uniform draws.
Dequantize computes the reference's fp32 value and rounds once to the output dtype: the
registered `nvfp4_dequantize` returns fp32 like the reference; `nvfp4_dequantize_to` writes
bf16 / fp16 directly (== reference fp32 then `.to(dtype)`, bit for bit).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference import nvfp4 as _ref
from ..reference.nvfp4_to import nvfp4_dequantize_to as _ref_dequantize_to
from ..zeroed import zeros
from ._common import (
    INT32_LIMIT,
    abs_bits,
    as_kernel_input,
    cdiv,
    finite_abs_bits,
    flat_2d,
    fp8_bits,
    scale_from_amax,
    soft_cast,
    to_f32,
    triton_kernel,
)
from .dequant import OUT_KIND, fp8_value, out_buffer, round_out
from .float8 import _amax_kernel  # the same per-tensor amax; launched with this module's CONFIG["amax"]
from .launch import fast_launch

# Launch configurations (tunable; tests/test_triton_nvfp4.py checks alternatives bitwise). Chosen
# by compiling for sm_90 (registers, no spills), not yet timed on a GPU.
CONFIG = {
    "amax": dict(BLOCK=8192, num_warps=8),
    "amax_rht": dict(G=4, BK=64, num_warps=4),  # tile (16 G) x BK
    "cast": dict(G=4, NB=4, num_warps=4),  # tile (16 G) rows x (16 NB) columns
    "dequant_rowwise": dict(BR=32, NB=8, num_warps=4),  # BR rows x NB blocks of 16
    "dequant_columnwise": dict(BR=64, G=4, num_warps=4),  # BR rows x G groups of 16
}


# ---- device helpers -------------------------------------------------------------------------
@triton.jit
def _s_enc(amax_ptr):
    """Global encode scale 448 * 6 / amax (the reference's edge rules) from the amax buffer."""
    amax = tl.load(amax_ptr)
    return scale_from_amax(amax, 2688.0, 1.0, False, 0.0)


@triton.jit
def _e2m1_bits(code):
    """int32 fp32 bits of E2M1 codes (int32, low 4 bits, bit 3 the sign; code 8 is -0.0):
    magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes >= 2 are normal: shift and rebias)."""
    c = code & 7
    mag = tl.where(c >= 2, (c << 22) + (126 << 23), tl.where(c == 1, 0x3F000000, 0))
    return mag | ((code & 8) << 28)


@triton.jit
def _e2m1_mag(c):
    """fp32 magnitude of E2M1 codes 0..7."""
    return _e2m1_bits(c).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_code(v, r, SR: tl.constexpr):
    """E2M1 code (int32) of scaled fp32 v: nearest, ties to the even code (or stochastic with
    uniform r), |v| > 6 saturates, NaN gives 0 -- `reference.nvfp4.fp4_encode`."""
    a = tl.abs(v)
    a = tl.where(a > 6.0, 6.0, a)  # clamp(max=6): NaN stays NaN
    if SR:
        lo_c = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
                + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
                + (a >= 6.0).to(tl.int32))
        # p = (a - lo) / gap; gap is 0.5, 1 or 2 (0 at saturation): dividing by a power of two is
        # exactly multiplying by its inverse (the same real number, rounded once either way)
        inv_gap = tl.where(lo_c < 4, 2.0, tl.where(lo_c < 6, 1.0, 0.5))
        p = tl.where(lo_c < 7, (a - _e2m1_mag(lo_c)) * inv_gap, 0.0)
        code = tl.where(r < p, tl.minimum(lo_c + 1, 7), lo_c)
    else:
        # round to the E2M1 grid with one RNE add: adding 2**22 / 2**23 / 2**24 puts the grid's
        # quantum (0.5 / 1 / 2 in [0, 2) / [2, 4) / [4, 6]) at the fp32 ulp, and an even
        # multiple of the quantum is exactly an even code -- the reference's tie rule
        magic = tl.where(a < 2.0, 4194304.0, tl.where(a < 4.0, 8388608.0, 16777216.0))
        r = (a + magic) - magic
        # r in {0, 0.5, 1, 1.5, 2, 3, 4, 6}: bits >> 22 is 0, 0xFC, 0xFE, 0xFF, 0x100 .. 0x103
        code = tl.maximum((r.to(tl.int32, bitcast=True) >> 22) - 0xFC, 0) + (r == 0.5).to(tl.int32)
    bits = v.to(tl.int32, bitcast=True)
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return tl.where(nan, 0, code | ((bits >> 28) & 8))


@triton.jit
def _block_scale(amax_bits, s_enc, SOFT: tl.constexpr):
    """(e4m3 byte, its fp32 value) of the block scale e4m3(amax_b / 6 * S_enc), saturating; NaN
    for a non-finite block amax (a block holding an inf or NaN)."""
    amax_b = amax_bits.to(tl.float32, bitcast=True)
    v = tl.math.div_rn(amax_b, tl.zeros_like(amax_b) + 6.0) * s_enc
    q = fp8_bits(tl.where(amax_bits < 0x7F800000, v, float("nan")), 448.0, True, SOFT)
    return q, fp8_value(q, True, SOFT)


@triton.jit
def _encode(x, s_enc, s_dec, r, SR: tl.constexpr):
    """E2M1 codes of x in blocks with decode scale s_dec (fp32) under global encode scale s_enc."""
    enc = tl.where(s_dec == 0, 0.0, tl.math.div_rn(tl.zeros_like(s_dec) + s_enc, s_dec))
    scaled = x * enc
    # Where S_enc / S_dec overflows the reference scales in two steps, (x * S_enc) / S_dec. That
    # needs S_enc > FLT_MAX * 2**-9 (S_dec >= 2**-9, the least e4m3): a global amax < ~4e-33. A
    # branch on the scalar keeps the per-element division off the common path.
    if s_enc > 1.2676506002282294e30:  # 2**100
        enc_inf = (enc.to(tl.int32, bitcast=True) & 0x7FFFFFFF) == 0x7F800000
        scaled = tl.where(enc_inf, tl.math.div_rn(x * s_enc, s_dec), scaled)
    return _e2m1_code(scaled, r, SR)


@triton.jit
def _wht16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """Unnormalized Walsh-Hadamard transform of 16 tensors: the reference's butterfly stages
    h = 1, 2, 4, 8, (a, b) -> (a + b, a - b), each output one fp32 add or subtract."""
    v0, v1, v2, v3, v4, v5, v6, v7 = v0 + v1, v0 - v1, v2 + v3, v2 - v3, v4 + v5, v4 - v5, v6 + v7, v6 - v7
    v8, v9, v10, v11 = v8 + v9, v8 - v9, v10 + v11, v10 - v11
    v12, v13, v14, v15 = v12 + v13, v12 - v13, v14 + v15, v14 - v15
    v0, v2, v1, v3, v4, v6, v5, v7 = v0 + v2, v0 - v2, v1 + v3, v1 - v3, v4 + v6, v4 - v6, v5 + v7, v5 - v7
    v8, v10, v9, v11 = v8 + v10, v8 - v10, v9 + v11, v9 - v11
    v12, v14, v13, v15 = v12 + v14, v12 - v14, v13 + v15, v13 - v15
    v0, v4, v1, v5, v2, v6, v3, v7 = v0 + v4, v0 - v4, v1 + v5, v1 - v5, v2 + v6, v2 - v6, v3 + v7, v3 - v7
    v8, v12, v9, v13 = v8 + v12, v8 - v12, v9 + v13, v9 - v13
    v10, v14, v11, v15 = v10 + v14, v10 - v14, v11 + v15, v11 - v15
    v0, v8, v1, v9, v2, v10, v3, v11 = v0 + v8, v0 - v8, v1 + v9, v1 - v9, v2 + v10, v2 - v10, v3 + v11, v3 - v11
    v4, v12, v5, v13 = v4 + v12, v4 - v12, v5 + v13, v5 - v13
    v6, v14, v7, v15 = v6 + v14, v6 - v14, v7 + v15, v7 - v15
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _signs16(t, SIGNS: tl.constexpr):
    """t [..., 16] times the RHT signs (bit j of SIGNS set: sign j is -1). A multiply, as in the
    reference: Triton's unary minus is 0 - v, which would turn +0 into +0 instead of -0."""
    j = tl.arange(0, 16)
    return t * tl.where(((SIGNS >> j) & 1) != 0, -1.0, 1.0)


@triton.jit
def _join16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
    """[A, B, 16] from 16 [A, B] tensors, element j = v_j (each join appends an axis, so the
    leaves go in bit-reversed order)."""
    t = tl.join(tl.join(tl.join(tl.join(v0, v8), tl.join(v4, v12)), tl.join(tl.join(v2, v10), tl.join(v6, v14))),
                tl.join(tl.join(tl.join(v1, v9), tl.join(v5, v13)), tl.join(tl.join(v3, v11), tl.join(v7, v15))))
    return tl.reshape(t, (v0.shape[0], v0.shape[1], 16))


@triton.jit
def _split16(t):
    """The 16 [A, B] slices of t [A, B, 16] (inverse of `_join16`)."""
    e, o = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 2, 2, 2, 2)))  # j = 8 a + 4 b + 2 c + d
    ee, eo = tl.split(e)
    oe, oo = tl.split(o)
    eee, eeo = tl.split(ee)
    eoe, eoo = tl.split(eo)
    oee, oeo = tl.split(oe)
    ooe, ooo = tl.split(oo)
    v0, v8 = tl.split(eee)
    v4, v12 = tl.split(eeo)
    v2, v10 = tl.split(eoe)
    v6, v14 = tl.split(eoo)
    v1, v9 = tl.split(oee)
    v5, v13 = tl.split(oeo)
    v3, v11 = tl.split(ooe)
    v7, v15 = tl.split(ooo)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


# ---- quantize ---------------------------------------------------------------------------------
@triton.jit
def _row(x_ptr, offs, mask, BF16_BITS: tl.constexpr):
    return to_f32(tl.load(x_ptr + offs, mask=mask, other=0), BF16_BITS)


@triton.jit
def _load16(x_ptr, offs, mask, BF16_BITS: tl.constexpr, K):
    """The tile as [G, BK, 16]: element (g, k, j) = x[16 g + j, k] (row j of each group of 16).
    Loaded as 16 row slices and joined, so a block of 16 along M lands in one thread."""
    p, m, b = x_ptr + offs, mask, BF16_BITS
    return _join16(_row(p, 0, m, b), _row(p, K, m, b), _row(p, 2 * K, m, b), _row(p, 3 * K, m, b),
                   _row(p, 4 * K, m, b), _row(p, 5 * K, m, b), _row(p, 6 * K, m, b), _row(p, 7 * K, m, b),
                   _row(p, 8 * K, m, b), _row(p, 9 * K, m, b), _row(p, 10 * K, m, b), _row(p, 11 * K, m, b),
                   _row(p, 12 * K, m, b), _row(p, 13 * K, m, b), _row(p, 14 * K, m, b), _row(p, 15 * K, m, b))


@triton.jit
def _rht(t, SIGNS: tl.constexpr):
    """H v = Had16 (signs * v) / 4 along the last dim of t [..., 16] (the reference's forward)."""
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _split16(_signs16(t, SIGNS))
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _wht16(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
    return _join16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15) * 0.25


@triton.jit
def _rht_inverse(t, SIGNS: tl.constexpr):
    """H^T v = signs * (Had16 v) / 4 along the last dim of t [..., 16]."""
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _split16(t)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _wht16(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
    t = _join16(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15)
    return _signs16(t * 0.25, SIGNS)


@fast_launch
@triton.jit
def _amax_rht_kernel(x_ptr, row_ptr, col_ptr, M, K, n_k, SIGNS: tl.constexpr, ROWWISE: tl.constexpr,
                     BF16_BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """amax of the finite values of the RHT'd x^T (and, with ROWWISE, of x) from one read of the
    tile."""
    pid = tl.program_id(0)
    m0 = (pid // n_k) * (16 * G)
    k0 = (pid % n_k) * BK
    g = tl.arange(0, G)[:, None]
    kk = tl.arange(0, BK)[None, :]
    mask = ((m0 + 16 * g) < M) & ((k0 + kk) < K)
    t = _load16(x_ptr + m0.to(tl.int64) * K + k0, g * (16 * K) + kk, mask, BF16_BITS, K)
    if ROWWISE:
        a = tl.max(tl.reshape(finite_abs_bits(t), (G * BK * 16,)), axis=0)
        tl.atomic_max(row_ptr, a, mask=a > tl.load(row_ptr), sem="relaxed")
    a = tl.max(tl.reshape(finite_abs_bits(_rht(t, SIGNS)), (G * BK * 16,)), axis=0)
    tl.atomic_max(col_ptr, a, mask=a > tl.load(col_ptr), sem="relaxed")


@triton.jit
def _pack_pairs(codes, RANK: tl.constexpr):
    """[..., 16] E2M1 codes (rank 3 or 4) -> [..., 8] bytes: element 2i in the low nibble, 2i+1
    in the high nibble."""
    if RANK == 3:
        lo, hi = tl.split(tl.reshape(codes, (codes.shape[0], codes.shape[1], 8, 2)))
    else:
        lo, hi = tl.split(tl.reshape(codes, (codes.shape[0], codes.shape[1], codes.shape[2], 8, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@fast_launch
@triton.jit
def _cast_kernel(x_ptr, rand_ptr, randc_ptr, amax_r_ptr, amax_c_ptr, rd_ptr, rs_ptr, cd_ptr, cs_ptr,
                 M, K, n_k, ROWWISE: tl.constexpr, COLWISE: tl.constexpr, TWO_D: tl.constexpr,
                 RHT: tl.constexpr, SIGNS: tl.constexpr, SR: tl.constexpr, BF16_BITS: tl.constexpr,
                 SOFT: tl.constexpr, G: tl.constexpr, NB: tl.constexpr):
    """All usages of one (16 G) x (16 NB) tile of x (see the module docstring)."""
    pid = tl.program_id(0)
    m0 = (pid // n_k) * (16 * G)
    k0 = (pid % n_k) * (16 * NB)
    if ROWWISE or TWO_D:
        s_enc = _s_enc(amax_r_ptr)
        ib = tl.arange(0, G)[:, None, None, None]
        i = tl.arange(0, 16)[None, :, None, None]
        jb = tl.arange(0, NB)[None, None, :, None]
        j = tl.arange(0, 16)[None, None, None, :]
        r4 = ib * 16 + i
        mask = ((m0 + r4) < M) & ((k0 + jb * 16 + j) < K)
        offs = r4 * K + jb * 16 + j
        x = to_f32(tl.load(x_ptr + m0.to(tl.int64) * K + k0 + offs, mask=mask, other=0), BF16_BITS)
        if TWO_D:
            q, s_dec = _block_scale(tl.max(tl.max(abs_bits(x), axis=3), axis=1), s_enc, SOFT)  # [G, NB]
            s_dec4 = s_dec[:, None, :, None]
        else:
            q, s_dec = _block_scale(tl.max(abs_bits(x), axis=3), s_enc, SOFT)  # [G, 16, NB]
            s_dec4 = s_dec[:, :, :, None]
        if SR:
            r = tl.load(rand_ptr + m0.to(tl.int64) * K + k0 + offs, mask=mask, other=0.0)
        else:
            r = x
        codes = _encode(x, s_enc, s_dec4, r, SR)  # [G, 16, NB, 16]
        r3 = tl.arange(0, G)[:, None, None] * 16 + tl.arange(0, 16)[None, :, None]
        jb3 = tl.arange(0, NB)[None, None, :]
        mask3 = ((m0 + r3) < M) & ((k0 // 16 + jb3) < K // 16)
        if ROWWISE:
            p = tl.arange(0, 8)[None, None, None, :]
            tl.store(rd_ptr + m0.to(tl.int64) * (K // 2) + k0 // 2 + r4 * (K // 2) + jb * 8 + p,
                     _pack_pairs(codes, 4), mask=mask3[:, :, :, None] & (p < 8))
            q3 = q[:, None, :] if TWO_D else q
            tl.store(rs_ptr + m0.to(tl.int64) * (K // 16) + k0 // 16 + r3 * (K // 16) + jb3,
                     tl.broadcast_to(q3, (G, 16, NB)), mask=mask3)
        if COLWISE and TWO_D:
            # the same codes transposed, [NB, 16 (column), G, 16 (row)], packed along the rows
            cd = _pack_pairs(tl.permute(codes, (2, 3, 0, 1)), 4)  # [NB, 16, G, 8]
            cj = tl.arange(0, NB)[:, None, None] * 16 + tl.arange(0, 16)[None, :, None]
            cg = tl.arange(0, G)[None, None, :]
            c_mask = ((k0 + cj) < K) & ((m0 + cg * 16) < M)
            cp = tl.arange(0, 8)[None, None, None, :]
            tl.store(cd_ptr + k0.to(tl.int64) * (M // 2) + m0 // 2 + cj[:, :, :, None] * (M // 2)
                     + cg[:, :, :, None] * 8 + cp, cd, mask=c_mask[:, :, :, None] & (cp < 8))
            tl.store(cs_ptr + k0.to(tl.int64) * (M // 16) + m0 // 16 + cj * (M // 16) + cg,
                     tl.broadcast_to(tl.trans(q)[:, None, :], (NB, 16, G)), mask=c_mask)
    if COLWISE and not TWO_D:
        BK: tl.constexpr = 16 * NB
        s_enc = _s_enc(amax_c_ptr)
        g = tl.arange(0, G)[:, None]
        kk = tl.arange(0, BK)[None, :]
        mask = ((m0 + 16 * g) < M) & ((k0 + kk) < K)
        t = _load16(x_ptr + m0.to(tl.int64) * K + k0, g * (16 * K) + kk, mask, BF16_BITS, K)  # [G, BK, 16]
        if RHT:
            t = _rht(t, SIGNS)
        q, s_dec = _block_scale(tl.max(abs_bits(t), axis=2), s_enc, SOFT)  # [G, BK]
        if SR:  # rand_columnwise is (K, M): element (k, m0 + 16 g + j)
            j3 = tl.arange(0, 16)[None, None, :]
            r = tl.load(randc_ptr + k0.to(tl.int64) * M + m0 + kk[:, :, None] * M + g[:, :, None] * 16 + j3,
                        mask=mask[:, :, None] & (j3 < 16), other=0.0)
        else:
            r = t
        data = tl.permute(_pack_pairs(_encode(t, s_enc, s_dec[:, :, None], r, SR), 3), (1, 0, 2))  # [BK, G, 8]
        ck = tl.arange(0, BK)[:, None]
        cg = tl.arange(0, G)[None, :]
        c_mask = ((k0 + ck) < K) & ((m0 + cg * 16) < M)
        cp = tl.arange(0, 8)[None, None, :]
        tl.store(cd_ptr + k0.to(tl.int64) * (M // 2) + m0 // 2 + ck[:, :, None] * (M // 2) + cg[:, :, None] * 8
                 + cp, data, mask=c_mask[:, :, None] & (cp < 8))
        tl.store(cs_ptr + k0.to(tl.int64) * (M // 16) + m0 // 16 + ck * (M // 16) + cg, tl.trans(q), mask=c_mask)


# ---- dequantize -------------------------------------------------------------------------------
@triton.jit
def _decode_pairs(byte, s, s_enc):
    """[A, B, 16] fp32 values RN(code * S_dec / S_enc) of packed bytes [A, B, 8]; s holds the
    fp32 block scales, broadcasting against [A, B, 8, 2].

    Every E2M1 magnitude is m * 2**k with m in {1, 3}, and code * S_dec is exact, so the value is
    2**k * RN(m * S_dec / S_enc) wherever that stays in the normal range (scaling by a power of
    two commutes with rounding there): two divisions per block instead of one per element. A
    tile with a block outside that range (only for a tiny global amax) divides per element."""
    b = byte.to(tl.int32)
    vb = tl.join(_e2m1_bits(b & 15), _e2m1_bits(b >> 4))  # [A, B, 8, 2]
    se = tl.zeros_like(s) + s_enc
    q1 = tl.math.div_rn(s, se)
    q3 = tl.math.div_rn(s * 3.0, se)
    ok = (s == 0) | (s != s) | ((tl.abs(q1) >= 2.350988701644575e-38) & (tl.abs(q3) < 2.1267647932558654e37))
    if tl.min(ok.to(tl.int32)) == 1:  # every block: S_dec zero or NaN, or |q| in [2**-125, 2**124)
        m3 = vb & 0x400000  # the mantissa bit: 1.5, 3 and 6 (m = 3)
        # 2**k with the sign: clear the mantissa bit and halve (1.5 -> 0.5, 3 -> 1, 6 -> 2)
        v = (vb - 3 * m3).to(tl.float32, bitcast=True) * tl.where(m3 != 0, q3, q1)
    else:
        v = tl.math.div_rn(vb.to(tl.float32, bitcast=True) * s, tl.zeros_like(vb).to(tl.float32) + s_enc)
    return tl.reshape(v, (byte.shape[0], byte.shape[1], 16))


@fast_launch
@triton.jit
def _dequant_rows_kernel(d_ptr, s_ptr, amax_ptr, o_ptr, R, C, n_c, OUT: tl.constexpr,
                         SOFT: tl.constexpr, BR: tl.constexpr, NB: tl.constexpr):
    """(R, C) values of packed (R, C/2) data: a tile of BR rows x NB blocks of 16."""
    pid = tl.program_id(0)
    r0 = (pid // n_c) * BR
    b0 = (pid % n_c) * NB
    rr = tl.arange(0, BR)[:, None, None]
    jb = tl.arange(0, NB)[None, :, None]
    p = tl.arange(0, 8)[None, None, :]
    mask = ((r0 + rr) < R) & ((b0 + jb) < C // 16)
    byte = tl.load(d_ptr + r0.to(tl.int64) * (C // 2) + b0 * 8 + rr * (C // 2) + jb * 8 + p,
                   mask=mask, other=0)
    r2 = tl.arange(0, BR)[:, None]
    j2 = tl.arange(0, NB)[None, :]
    # the scales as their own 2D tensor: per-block math is then done once per block, not once
    # per element of a broadcast layout
    sb = tl.load(s_ptr + r0.to(tl.int64) * (C // 16) + b0 + r2 * (C // 16) + j2,
                 mask=((r0 + r2) < R) & ((b0 + j2) < C // 16), other=0)
    v = _decode_pairs(byte, fp8_value(sb, True, SOFT)[:, :, None, None], _s_enc(amax_ptr))  # [BR, NB, 16]
    tl.store(o_ptr + r0.to(tl.int64) * C + b0 * 16 + rr * C + jb * 16 + tl.arange(0, 16)[None, None, :],
             round_out(v, OUT, SOFT), mask=mask)


@fast_launch
@triton.jit
def _dequant_cols_kernel(d_ptr, s_ptr, amax_ptr, o_ptr, R, C, n_g, RHT: tl.constexpr,
                         SIGNS: tl.constexpr, OUT: tl.constexpr, SOFT: tl.constexpr,
                         BR: tl.constexpr, G: tl.constexpr):
    """(C, R) values (the transpose) of columnwise (R, C/2) data, undoing the RHT when asked:
    a tile of BR rows x G groups of 16 values."""
    pid = tl.program_id(0)
    r0 = (pid // n_g) * BR
    g0 = (pid % n_g) * G
    rr = tl.arange(0, BR)[:, None]
    gg = tl.arange(0, G)[None, :]
    mask = ((r0 + rr) < R) & ((g0 + gg) < C // 16)
    p = tl.arange(0, 8)[None, None, :]
    byte = tl.load(d_ptr + r0.to(tl.int64) * (C // 2) + g0 * 8 + rr[:, :, None] * (C // 2) + gg[:, :, None] * 8 + p,
                   mask=mask[:, :, None] & (p < 8), other=0)
    sb = tl.load(s_ptr + r0.to(tl.int64) * (C // 16) + g0 + rr * (C // 16) + gg, mask=mask, other=0)
    v = _decode_pairs(byte, fp8_value(sb, True, SOFT)[:, :, None, None], _s_enc(amax_ptr))  # [BR, G, 16]
    if RHT:
        v = _rht_inverse(v, SIGNS)
    v = tl.permute(round_out(v, OUT, SOFT), (1, 2, 0))  # [G, 16, BR]
    g3 = tl.arange(0, G)[:, None, None]
    j3 = tl.arange(0, 16)[None, :, None]
    r3 = tl.arange(0, BR)[None, None, :]
    tl.store(o_ptr + (g0 * 16).to(tl.int64) * R + r0 + (g3 * 16 + j3) * R + r3, v,
             mask=((g0 + g3) < C // 16) & ((r0 + r3) < R))


# ---- host side --------------------------------------------------------------------------------
def _signs_mask(seed: int) -> int:
    """The RHT sign vector of `seed` as a bit mask (bit j set: sign j is -1)."""
    row0 = _ref._rht_values(int(seed))[0]  # row 0 of Had16 is all ones: row 0 of H is signs / 4
    return sum(1 << j for j in range(16) if row0[j] < 0)


def _buffers_ok(data, scale, amax, tile_rows: int) -> bool:
    """Packed (R, C/2) uint8 data, (R, C/16) e4m3 scales, one fp32 amax; all contiguous."""
    if data is None or scale is None or amax is None or data.dim() != 2:
        return False
    r, c = data.shape[0], data.shape[1] * 2
    return (r > 0 and c > 0 and c % 16 == 0 and data.dtype == torch.uint8 and data.is_contiguous()
            and scale.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (r, c // 16)
            and scale.is_contiguous() and amax.dtype == torch.float32 and amax.numel() == 1
            and tile_rows * max(r, c) < INT32_LIMIT)  # tile-local offsets are int32


def _dequantize(row_data, row_scale, amax_row, col_data, col_scale, amax_col, rht, rht_seed, dtype):
    """The fused dequantize, or None where the buffers are not what the kernels handle."""
    if dtype not in OUT_KIND:
        return None
    if row_data is not None:
        cfg = CONFIG["dequant_rowwise"]
        if not _buffers_ok(row_data, row_scale, amax_row, cfg["BR"] + 16 * cfg["NB"]):
            return None
        r, c = row_data.shape[0], row_data.shape[1] * 2
        out, out_k = out_buffer((r, c), dtype, row_data.device)
        n_c = cdiv(c // 16, cfg["NB"])
        _dequant_rows_kernel[(cdiv(r, cfg["BR"]) * n_c,)](
            row_data, row_scale.view(torch.uint8), amax_row, out_k, r, c, n_c,
            OUT=OUT_KIND[dtype], SOFT=soft_cast(), BR=cfg["BR"], NB=cfg["NB"], num_warps=cfg["num_warps"])
        return out
    cfg = CONFIG["dequant_columnwise"]
    if not _buffers_ok(col_data, col_scale, amax_col, cfg["BR"] + 16 * cfg["G"]):
        return None
    r, c = col_data.shape[0], col_data.shape[1] * 2
    out, out_k = out_buffer((c, r), dtype, col_data.device)
    n_g = cdiv(c // 16, cfg["G"])
    _dequant_cols_kernel[(cdiv(r, cfg["BR"]) * n_g,)](
        col_data, col_scale.view(torch.uint8), amax_col, out_k, r, c, n_g, RHT=bool(rht),
        SIGNS=_signs_mask(rht_seed) if rht else 0, OUT=OUT_KIND[dtype], SOFT=soft_cast(),
        BR=cfg["BR"], G=cfg["G"], num_warps=cfg["num_warps"])
    return out


@triton_kernel("nvfp4_dequantize")
def nvfp4_dequantize(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                     columnwise_scale_inv, amax_columnwise, rht: bool = False, rht_seed: int = 0):
    """fp32 (M, K) values: from the rowwise buffers if given, else from the columnwise ones
    (undoing the RHT when `rht`, transposed back), in one pass."""
    out = _dequantize(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                      columnwise_scale_inv, amax_columnwise, rht, rht_seed, torch.float32)
    if out is None:
        return _ref.nvfp4_dequantize(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                                     columnwise_scale_inv, amax_columnwise, rht, rht_seed)
    return out


@triton_kernel("nvfp4_dequantize_to")
def nvfp4_dequantize_to(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                        columnwise_scale_inv, amax_columnwise, rht: bool = False, rht_seed: int = 0,
                        dtype: torch.dtype = torch.float32):
    """`nvfp4_dequantize(...).to(dtype)` without the fp32 round trip through memory."""
    out = _dequantize(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                      columnwise_scale_inv, amax_columnwise, rht, rht_seed, dtype)
    if out is None:
        return _ref_dequantize_to(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                                  columnwise_scale_inv, amax_columnwise, rht, rht_seed, dtype)
    return out


def _amax_pass(xk, bf16_bits, m, k, row: bool, col: bool, rht: bool, rht_seed: int):
    """(rowwise amax, columnwise amax) as int32 views, None where not wanted; the columnwise one of
    the rotated tensor when `rht`."""
    amax_r = zeros(1, xk, torch.int32) if row else None
    amax_c = zeros(1, xk, torch.int32) if col else None
    if rht:
        ca = CONFIG["amax_rht"]
        n_k = cdiv(k, ca["BK"])
        _amax_rht_kernel[(cdiv(m, 16 * ca["G"]) * n_k,)](
            xk, amax_r if amax_r is not None else amax_c, amax_c, m, k, n_k, SIGNS=_signs_mask(rht_seed),
            ROWWISE=amax_r is not None, BF16_BITS=bf16_bits, G=ca["G"], BK=ca["BK"], num_warps=ca["num_warps"])
    else:
        cm = CONFIG["amax"]
        _amax_kernel[(cdiv(m * k, cm["BLOCK"]),)](
            xk, amax_r if amax_r is not None else amax_c, m * k, 0, FINITE=True, BF16_BITS=bf16_bits,
            BLOCK=cm["BLOCK"], num_warps=cm["num_warps"])
        if amax_r is not None and amax_c is not None:
            amax_c = amax_r.clone()  # the same values: x^T has x's amax
    return amax_r, amax_c


@triton_kernel("nvfp4_quantize")
def nvfp4_quantize(x: torch.Tensor, rowwise: bool, columnwise: bool, two_d: bool = False,
                   rht: bool = False, rht_seed: int = 0, stochastic: bool = False,
                   rand: Optional[torch.Tensor] = None, rand_columnwise: Optional[torch.Tensor] = None,
                   amax: Optional[torch.Tensor] = None):
    """Same outputs as the reference: (rowwise_data, rowwise_scale_inv, columnwise_data,
    columnwise_scale_inv, amax_rowwise, amax_columnwise). Missing draws for stochastic rounding
    are made with torch.rand exactly as the reference makes them (same shapes, same order). A
    given `amax` skips the amax pass (see the reference)."""
    _ref.check_given_amax(amax, rht)
    m, k = flat_2d(x)
    cfg, ca = CONFIG["cast"], CONFIG["amax_rht"]
    g, nb = cfg["G"], cfg["NB"]
    usable = (x.dim() > 0 and m > 0 and k > 0 and (rowwise or columnwise) and not (two_d and rht)
              and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
              and (k % 16 == 0 or not (rowwise or two_d)) and (m % 16 == 0 or not columnwise)
              # tile-local offsets are int32: (tile rows) * K and (tile columns) * M must fit
              and 16 * max(g, ca["G"]) * k < INT32_LIMIT and max(16 * nb, ca["BK"]) * m < INT32_LIMIT)
    if not usable:
        return _ref.nvfp4_quantize(x, rowwise, columnwise, two_d, rht, rht_seed, stochastic, rand,
                                   rand_columnwise, amax)
    dev = x.device
    rand = rand.reshape(m, k) if rand is not None else None
    rand_columnwise = rand_columnwise.reshape(k, m) if rand_columnwise is not None else None
    row_sr = stochastic and (rowwise or two_d)
    col_sr = stochastic and columnwise and not two_d
    if row_sr and rand is None:
        rand = torch.rand((m, k), device=dev)
    if col_sr and rand_columnwise is None:
        rand_columnwise = torch.rand((k, m), device=dev)
    rand = rand.to(dev).float().contiguous() if row_sr else None
    rand_columnwise = rand_columnwise.to(dev).float().contiguous() if col_sr else None

    xk, bf16_bits = as_kernel_input(x.contiguous().reshape(m, k))
    if amax is not None:  # the given value, in the int32 view the kernels keep amaxes in
        given = amax.to(dev).float().reshape(1).view(torch.int32)
        amax_r = given.clone() if (rowwise or two_d) else None
        amax_c = given.clone() if (columnwise and not two_d) else None
    else:
        amax_r, amax_c = _amax_pass(xk, bf16_bits, m, k, rowwise or two_d, columnwise and not two_d,
                                    rht and columnwise, rht_seed)

    u8 = torch.uint8
    e4m3 = torch.float8_e4m3fn
    row_data = torch.empty((m, k // 2), dtype=u8, device=dev) if rowwise else None
    row_scale = torch.empty((m, k // 16), dtype=e4m3, device=dev) if rowwise else None
    col_data = torch.empty((k, m // 2), dtype=u8, device=dev) if columnwise else None
    col_scale = torch.empty((k, m // 16), dtype=e4m3, device=dev) if columnwise else None
    dummy = amax_r if amax_r is not None else amax_c
    n_k = cdiv(k, 16 * nb)
    _cast_kernel[(cdiv(m, 16 * g) * n_k,)](
        xk, rand if rand is not None else dummy, rand_columnwise if rand_columnwise is not None else dummy,
        (amax_r if amax_r is not None else dummy).view(torch.float32),
        (amax_c if amax_c is not None else dummy).view(torch.float32),
        row_data if rowwise else dummy, row_scale.view(u8) if rowwise else dummy,
        col_data if columnwise else dummy, col_scale.view(u8) if columnwise else dummy,
        m, k, n_k, ROWWISE=bool(rowwise), COLWISE=bool(columnwise), TWO_D=bool(two_d), RHT=bool(rht),
        SIGNS=_signs_mask(rht_seed) if rht else 0, SR=bool(stochastic), BF16_BITS=bf16_bits,
        SOFT=soft_cast(), G=g, NB=nb, num_warps=cfg["num_warps"])
    amax_row = amax_r.view(torch.float32) if amax_r is not None else None
    if two_d:
        return (row_data, row_scale, col_data, col_scale, amax_row if rowwise else None,
                amax_row.clone() if columnwise else None)
    amax_col = amax_c.view(torch.float32) if amax_c is not None else None
    return row_data, row_scale, col_data, col_scale, amax_row, amax_col
