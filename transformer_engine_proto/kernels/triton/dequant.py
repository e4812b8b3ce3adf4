"""Dequantize kernels in Triton, and the decode / output-rounding helpers the NVFP4 kernels share.

A dequantize is memory-bound: these kernels read the fp8 (or fp4) bytes and the block scales once
and write the output dtype once, with the fp32 intermediate kept in registers. Results are bit
for bit those of `kernels/reference`: the fp32 value is computed with the same fp32 operations in
the same order, then rounded once to the output dtype (round to nearest even), which is what the
reference's final `.to(dtype)` does.

- `fp8_value`: fp8 byte -> fp32 (exact). The hardware conversion on the GPU; under the interpreter
  (SOFT) a bit-level decode, since Triton's emulated fp8 types are not trusted there.
- `round_out`: fp32 -> output dtype. bf16 travels as int16 bits: the interpreter's own
  fp32 -> bf16 conversion is not round-to-nearest-even, so under SOFT the RNE is done on the bits.
- E8M0 scale 2**-127 is an fp32 subnormal: that block multiplies by 2**-64 then 2**-63 (the first
  product is exact, so the result is the single rounding of data * 2**-127): no multiply has a
  subnormal operand.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import mxfp8 as _ref_mx
from ._common import INT32_LIMIT, cdiv, soft_cast, triton_kernel
from .launch import aligned, fast_launch, plan_key, planned, run_recorded

# output dtype -> OUT constexpr
OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# after editing CONFIG, call `launch.clear_plans()` (recorded eager launches keep their config)
CONFIG = {
    # rowwise: tile BM rows x (NB * 32) columns; columnwise: (MB * 32) rows x BK columns
    "mxfp8_rowwise": dict(BM=32, NB=4, num_warps=4),
    "mxfp8_columnwise": dict(MB=1, BK=128, num_warps=4),
}


@triton.jit
def f32_nan():
    return tl.full((), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def f32_inf():
    return tl.full((), 0x7F800000, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def fp8_value(b, E4M3: tl.constexpr, SOFT: tl.constexpr):
    """Exact fp32 value of fp8 bytes `b` (uint8): E4M3 (0x7F/0xFF NaN) or E5M2 (Inf, NaN)."""
    if SOFT:
        bi = b.to(tl.int32)
        mag = bi & 0x7F
        if E4M3:
            # normal: shift the exponent / mantissa into place and rebias (7 -> 127)
            normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
            v = tl.where(mag >= 8, normal, mag.to(tl.float32) * 0.001953125)  # subnormal m * 2**-9
            v = tl.where(mag == 0x7F, f32_nan(), v)
        else:
            normal = ((mag << 21) + (112 << 23)).to(tl.float32, bitcast=True)
            v = tl.where(mag >= 4, normal, mag.to(tl.float32) * 1.52587890625e-05)  # m * 2**-16
            v = tl.where(mag == 0x7C, f32_inf(), v)
            v = tl.where(mag > 0x7C, f32_nan(), v)
        sign = (bi & 0x80) << 24
        return (v.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        if E4M3:
            return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            return b.to(tl.float8e5, bitcast=True).to(tl.float32)


@triton.jit
def round_out(v, OUT: tl.constexpr, SOFT: tl.constexpr):
    """fp32 `v` rounded (nearest even) to the output dtype: 0 fp32, 1 bf16 (as int16 bits), 2 fp16."""
    if OUT == 1:
        if SOFT:
            b = v.to(tl.int32, bitcast=True)
            a = b & 0x7FFFFFFF
            r = (a + 0x7FFF + ((a >> 16) & 1)) >> 16  # a <= 0x7F800000: no int32 overflow
            r = tl.where(a > 0x7F800000, 0x7FC0, r)  # NaN: quiet NaN (torch CPU's choice)
            return (r | ((b >> 16) & 0x8000)).to(tl.int16)
        else:
            return v.to(tl.bfloat16).to(tl.int16, bitcast=True)
    elif OUT == 2:
        return v.to(tl.float16)
    else:
        return v


@triton.jit
def e8m0_factors(e):
    """(s1, s2) with s1 * s2 == 2**(e - 127) for E8M0 bytes e (int32): both normal fp32, s2 == 1
    except for e == 0 (2**-127 is subnormal); e == 255 gives NaN."""
    tiny = e == 0
    s1 = tl.where(tiny, 5.421010862427522e-20, (e << 23).to(tl.float32, bitcast=True))  # 2**-64
    s1 = tl.where(e == 255, f32_nan(), s1)
    s2 = tl.where(tiny, 1.0842021724855044e-19, 1.0)  # 2**-63
    return s1, s2


@fast_launch
@triton.jit
def _mxfp8_dequant_kernel(d_ptr, s_ptr, o_ptr, M, K, n_k,
                          COLWISE: tl.constexpr, E4M3: tl.constexpr, OUT: tl.constexpr,
                          SOFT: tl.constexpr, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """One tile [A, B, C]: rowwise A rows x B blocks x 32 columns (scale per [A, B]);
    columnwise A blocks x 32 rows x C columns (scale per [A, C])."""
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    ia = tl.arange(0, A)[:, None, None]
    ib = tl.arange(0, B)[None, :, None]
    ic = tl.arange(0, C)[None, None, :]
    if COLWISE:
        m0 = pid_m * (A * 32)
        k0 = pid_k * C
        r = ia * 32 + ib
        c = ic
        s_offs = ia * K + ic  # scale (M/32, K)
        s_base = (m0 // 32).to(tl.int64) * K + k0
        s_mask = ((m0 // 32 + ia) < M // 32) & ((k0 + ic) < K)
    else:
        m0 = pid_m * A
        k0 = pid_k * (B * 32)
        r = ia
        c = ib * 32 + ic
        s_offs = ia * (K // 32) + ib  # scale (M, K/32)
        s_base = m0.to(tl.int64) * (K // 32) + k0 // 32
        s_mask = ((m0 + ia) < M) & ((k0 // 32 + ib) < K // 32)
    mask = ((m0 + r) < M) & ((k0 + c) < K)
    base = m0.to(tl.int64) * K + k0
    offs = r * K + c
    d = fp8_value(tl.load(d_ptr + base + offs, mask=mask, other=0), E4M3, SOFT)
    s1, s2 = e8m0_factors(tl.load(s_ptr + s_base + s_offs, mask=s_mask, other=127).to(tl.int32))
    tl.store(o_ptr + base + offs, round_out((d * s1) * s2, OUT, SOFT), mask=mask)


def out_buffer(shape, dtype, device):
    """(output tensor, what the kernel writes into): bf16 is written as its int16 bits."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out, (out.view(torch.int16) if dtype == torch.bfloat16 else out)


class _Plan:
    """The launch of one eager call signature, replayed for the next call into a fresh output
    (`launch.Replay`: the launcher reads pointers only, so the views the full path passes are not
    needed)."""

    __slots__ = ("launch", "shape", "dtype", "device")

    def __init__(self, data, dtype, launches):
        (self.launch,) = launches
        self.shape, self.dtype, self.device = data.shape, dtype, data.device

    def __call__(self, data, scale_inv):
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.launch(data, scale_inv, out)
        return out


@triton_kernel("mxfp8_dequantize")
def mxfp8_dequantize(data: torch.Tensor, scale_inv: torch.Tensor, columnwise: bool,
                     dtype: torch.dtype) -> torch.Tensor:
    """data * 2**e per block of 32 (rowwise along K, columnwise along M), rounded once to dtype."""
    key = plan_key(data, "mxfp8_dequantize", columnwise, dtype)
    key = (*key, scale_inv.shape, scale_inv.dtype, aligned(scale_inv)) if key and scale_inv.is_contiguous() else None
    plan = planned(key)
    if plan is not None:
        return plan(data, scale_inv)
    return run_recorded(key, lambda launches: _Plan(data, dtype, launches),
                        _mxfp8_dequantize, data, scale_inv, columnwise, dtype)


def _mxfp8_dequantize(data, scale_inv, columnwise, dtype):
    shape = data.shape
    k = shape[-1] if data.dim() > 0 else 0
    m = data.numel() // k if k else 0
    want = (m // 32, k) if columnwise else (m, k // 32)
    usable = (m > 0 and k > 0 and dtype in OUT_KIND and data.is_contiguous()
              and data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
              and (m % 32 == 0 if columnwise else k % 32 == 0)
              and scale_inv.dtype == torch.float8_e8m0fnu and tuple(scale_inv.shape) == want
              and scale_inv.is_contiguous())
    cfg = CONFIG["mxfp8_columnwise" if columnwise else "mxfp8_rowwise"]
    tile_rows = cfg["MB"] * 32 if columnwise else cfg["BM"]
    if not usable or tile_rows * k >= INT32_LIMIT:
        return _ref_mx.mxfp8_dequantize(data, scale_inv, columnwise, dtype)
    out, out_k = out_buffer(shape, dtype, data.device)
    if columnwise:
        a, b, c = cfg["MB"], 32, cfg["BK"]
        n_m, n_k = cdiv(m, a * 32), cdiv(k, c)
    else:
        a, b, c = cfg["BM"], cfg["NB"], 32
        n_m, n_k = cdiv(m, a), cdiv(k, b * 32)
    _mxfp8_dequant_kernel[(n_m * n_k,)](
        data.view(torch.uint8), scale_inv.view(torch.uint8), out_k, m, k, n_k,
        COLWISE=bool(columnwise), E4M3=data.dtype == torch.float8_e4m3fn, OUT=OUT_KIND[dtype],
        SOFT=soft_cast(), A=a, B=b, C=c, num_warps=cfg["num_warps"],
    )
    return out
