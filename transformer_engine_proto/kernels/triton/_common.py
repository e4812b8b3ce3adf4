"""Device helpers shared by the Triton quantize kernels, and host-side launch helpers.

Numerics follow `kernels/reference/common.py` bit for bit:
- `fp8_bits`: saturating round-to-nearest-even fp32 -> fp8 cast, returned as the fp8 byte
  (uint8). NaN gives 0x7F | sign (what torch's `Float8_e4m3fn` / `Float8_e5m2` conversion
  gives). On the GPU the cast is the hardware `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (RNE). Under
  `TRITON_INTERPRET=1` Triton's emulated fp8 cast is wrong at a mantissa carry (it rounds
  127.4 to 64 instead of 128), so there the kernels use `SOFT_CAST`: an exact RNE done with
  fp32 adds and bit ops (also usable on the GPU, for cross-checks).
- `fp8_scaled_bits`: the cast of x * scale that `reference.common.scaled_cast` specifies, a
  non-finite x kept non-finite (E5M2 +-inf, E4M3 NaN) by one select (in place of `fp8_bits`'
  NaN select); `finite_abs_bits`: what an amax of the finite values reduces.
- `scale_from_amax`: `fp8_max / amax` as a correctly rounded fp32 division (`div_rn`), times
  2**-margin (exact), the edge rules of the reference, optional power-of-two floor by masking
  the mantissa; a power-of-two scale without margin (the blockwise default) and its reciprocal
  are computed from exponent bits, without a division.
"""
from __future__ import annotations

import functools
import os
import struct

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..reference.common import fp8_max, traced

FLOAT32_MAX = 3.4028234663852886e38
INT32_LIMIT = 2**31


def triton_kernel(name: str):
    """Register a Triton entry point under `name` (backend "triton"). An empty input (its first
    tensor argument) goes to the reference kernel instead: a zero-size grid is no valid launch,
    and the reference is the spec of what an empty tensor gives (amax 0, empty buffers)."""
    from .. import _KERNELS, register_kernel

    def decorate(fn):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            first = next((a for a in args if a is not None), None)
            if isinstance(first, torch.Tensor):
                n = first.numel()  # a plain int in eager: no symbolic-shape machinery per launch
                if (n == 0) if type(n) is int else statically_known_true(n == 0):
                    return _KERNELS[(name, "reference")](*args, **kwargs)
            return fn(*args, **kwargs)

        return register_kernel(name, "triton")(guarded)

    return decorate


def cdiv(a, b):
    """`triton.cdiv` for the host: Triton's is a constexpr function whose every call unwraps its
    arguments (host time per launch); this is the same formula, SymInts included."""
    return (a + b - 1) // b


def next_power_of_2(n):
    """`triton.next_power_of_2` for the host (plain ints; anything else goes to Triton's)."""
    if type(n) is int:
        return 1 if n <= 1 else 1 << (n - 1).bit_length()
    return triton.next_power_of_2(n)


_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """True when Triton runs in its CPU interpreter (TRITON_INTERPRET=1). Read once, at import:
    Triton itself reads the variable when the kernels are defined, and an environment lookup per
    launch is host time."""
    return _INTERPRETING


_soft_cast = None  # None: not read yet, take TE_PROTO_TRITON_SOFT_CAST at the next launch


def set_soft_cast(on) -> None:
    """True: the software fp8 rounding on the GPU too (cross-checks); False: the hardware cast
    (the interpreter always uses the software one); None: follow `TE_PROTO_TRITON_SOFT_CAST` again."""
    global _soft_cast
    _soft_cast = None if on is None else bool(on)


def soft_cast() -> bool:
    """Use the exact software fp8 rounding (interpreter, or TE_PROTO_TRITON_SOFT_CAST=1 /
    set_soft_cast(True); the variable is read once)."""
    global _soft_cast
    if _soft_cast is None:
        _soft_cast = os.environ.get("TE_PROTO_TRITON_SOFT_CAST", "0") == "1"
    return _soft_cast or interpreting()


def fp8_params(fp8_dtype: torch.dtype):
    """(fmt_max, is_e4m3) for the kernels' constexpr arguments."""
    m = fp8_max(fp8_dtype)  # raises TypeError for other dtypes, like the reference
    return m, fp8_dtype == torch.float8_e4m3fn


def float_bits(v: float) -> int:
    return struct.unpack("<i", struct.pack("<f", v))[0]


@triton.jit
def fp8_bits(v, FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr):
    """uint8 fp8 bytes of fp32 `v`: clamp to +-FMAX, round to nearest even; NaN -> 0x7F|sign.

    FMAX must be the format's largest finite value (every caller's): the hardware cast
    (`cvt.rn.satfinite`) saturates to it by itself, so only the software path clamps: the same
    bytes on huge, Inf and NaN inputs, and a faster kernel without the explicit clamp."""
    vb = v.to(tl.int32, bitcast=True)
    sign = (vb >> 24) & 0x80
    if SOFT:
        c = tl.minimum(tl.maximum(v, -FMAX), FMAX)
        if E4M3:
            MANT: tl.constexpr = 3
            BIAS: tl.constexpr = 7
        else:
            MANT: tl.constexpr = 2
            BIAS: tl.constexpr = 15
        a = tl.where(c != c, 0.0, tl.abs(c))  # NaN is patched below
        ab = a.to(tl.int32, bitcast=True)
        e = ((ab >> 23) & 0xFF) - 127
        e = tl.maximum(e, 1 - BIAS)  # subnormal fp8 values share the min-normal quantum
        # adding 2**(e - MANT + 23) puts the fp8 quantum at the fp32 ulp: one RNE add
        magic = ((e - MANT + 23 + 127) << 23).to(tl.float32, bitcast=True)
        r = (a + magic) - magic
        rb = r.to(tl.int32, bitcast=True)
        re = ((rb >> 23) & 0xFF) - 127
        normal = (((re + BIAS) << MANT) | ((rb >> (23 - MANT)) & ((1 << MANT) - 1)))
        INV_SUB_Q: tl.constexpr = 2.0 ** (BIAS + MANT - 1)  # 1 / (subnormal quantum)
        subnormal = (r * INV_SUB_Q).to(tl.int32)  # exact: r is a multiple of the quantum
        q = tl.where(re >= 1 - BIAS, normal, subnormal) | sign
        q = q.to(tl.uint8)
    else:
        if E4M3:
            q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(v != v, (sign | 0x7F).to(tl.uint8), q)


@triton.jit
def fp8_scaled_bits(x, scale, FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr,
                    SCALE_FROM_X: tl.constexpr):
    """uint8 fp8 bytes of fp32 `x * scale` (scale finite, > 0), as `reference.common.scaled_cast`:
    finite x saturates to +-FMAX; a non-finite x stays non-finite, with the product's sign: E5M2
    inf 0x7C, NaN 0x7F; E4M3 (no inf) 0x7F for both. One select, in place of `fp8_bits`' NaN one.

    SCALE_FROM_X: the scale comes from the amax of x's finite values (current scaling, blockwise
    tiles), so x * scale cannot overflow and is non-finite exactly where x is: the test reads the
    product's bits. Otherwise (a given scale: delayed scaling, where a finite x * scale may
    overflow and must saturate) it reads x's."""
    v = x * scale
    vb = v.to(tl.int32, bitcast=True)
    va = vb & 0x7FFFFFFF
    if SCALE_FROM_X:
        nonfinite = va >= 0x7F800000
    else:
        nonfinite = abs_bits(x) >= 0x7F800000
    sign = (vb >> 24) & 0x80
    if E4M3:
        special = sign | 0x7F
    else:
        special = sign | (0x7C + 3 * (va > 0x7F800000).to(tl.int32))
    if SOFT:
        q = fp8_bits(v, FMAX, E4M3, SOFT)
    elif E4M3:  # the hardware cast of `fp8_bits`, without its NaN select
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(nonfinite, special.to(tl.uint8), q)


@triton.jit
def to_f32(x, BF16_BITS: tl.constexpr):
    """fp32 value of a loaded input; bf16 arrives as its int16 bits (see `as_kernel_input`)."""
    if BF16_BITS:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


def as_kernel_input(x: torch.Tensor):
    """(tensor to pass, BF16_BITS): bf16 goes in as int16 bits and is widened by a shift, which
    is what the GPU does anyway and is exact for subnormals also in the interpreter (whose own
    bf16 -> fp32 conversion mangles them). While torch traces the call (inductor) bf16 goes in as
    itself: inductor cannot hand a user kernel a dtype view of a buffer it computed, and on the GPU
    the kernel's own bf16 -> fp32 conversion is the same exact widening."""
    if x.dtype == torch.bfloat16 and not traced(x):
        return x.view(torch.int16), True
    return x, False


@triton.jit
def abs_bits(x):
    """int32 bits of |x| (fp32): their integer order is the float order, NaN above Inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def finite_abs_bits(x):
    """`abs_bits` of the finite values, 0 for inf and NaN: their max is the amax of the finite
    values (`reference.common.abs_max(x, finite=True)`)."""
    b = abs_bits(x)
    return tl.where(b < 0x7F800000, b, 0)


@triton.jit
def _pow2_scale_from_amax(amax, FMAX: tl.constexpr):
    """`scale_from_amax` with POW2 and no margin, without a division: the power-of-two floor of
    the correctly rounded FMAX / amax is 2**e, e read off the exponent and mantissa bits. With
    amax = ma * 2**ea and FMAX = mf * 2**ef (ma, mf in [1, 2)), mf / ma lies in (1/2, 2) and
    rounding never carries it across 1 or 2 (the largest quotient under 1 is 1 - 1/Ma for a
    24-bit integer mantissa Ma, below the rounding midpoint 1 - 2**-25), so e = ef - ea - (ma > mf).
    Division overflow (e > 127, or any fp32-subnormal amax) gives 2**127, as the reference's
    clamp to FLOAT32_MAX then mask; zero, Inf and NaN amax give 1."""
    ab = amax.to(tl.int32, bitcast=True)  # amax >= 0
    fb = (tl.zeros_like(amax) + FMAX).to(tl.int32, bitcast=True)
    ea = (ab >> 23) & 0xFF
    e = ((fb >> 23) & 0xFF) - ea - ((ab & 0x7FFFFF) > (fb & 0x7FFFFF)).to(tl.int32)
    e = tl.where(ea == 0, 127, tl.minimum(e, 127))  # subnormal amax (zero is patched below)
    scale = tl.where(e < -126, 0.0, ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True))
    return tl.where((amax == 0) | (ea == 0xFF), 1.0, scale)


@triton.jit
def scale_from_amax(amax, FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
                    EPS: tl.constexpr):
    """`reference.common.scale_from_amax` elementwise on fp32 `amax` (>= 0, Inf or NaN)."""
    if EPS > 0.0:
        amax = tl.where(amax < EPS, EPS, amax)  # torch.clamp(min=eps): NaN stays NaN
    if POW2 and MARGIN_MUL == 1.0:
        return _pow2_scale_from_amax(amax, FMAX)
    scale = tl.math.div_rn(tl.zeros_like(amax) + FMAX, amax)
    if MARGIN_MUL != 1.0:
        scale = scale * MARGIN_MUL  # exact power of two, as torch's tensor / python scalar
    ab = amax.to(tl.int32, bitcast=True)
    sb = scale.to(tl.int32, bitcast=True)
    scale_inf = (sb & 0x7FFFFFFF) == 0x7F800000
    scale = tl.where(scale_inf & (amax > 0), 3.4028234663852886e38, scale)
    amax_not_finite = (ab & 0x7F800000) == 0x7F800000
    scale = tl.where((amax == 0) | amax_not_finite, 1.0, scale)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def pack4(q0, q1, q2, q3):
    """int32 words of four uint8 tiles of one shape, q0 in the lowest byte: stored through an int32
    pointer they lay the bytes q0, q1, q2, q3 side by side (little-endian). A transposed store of
    words moves 4 bytes per element through the layout change instead of 1."""
    return (q0.to(tl.int32) | (q1.to(tl.int32) << 8) | (q2.to(tl.int32) << 16)
            | (q3.to(tl.int32) << 24))


@triton.jit
def reciprocal(s):
    """Correctly rounded 1 / s (torch's `reciprocal`)."""
    return tl.math.div_rn(tl.zeros_like(s) + 1.0, s)


@triton.jit
def scale_reciprocal(s, POW2: tl.constexpr):
    """`reciprocal(s)`; for a POW2 scale (a power of two or zero) from its exponent bits, without
    a division: 1 / 2**k = 2**-k, fp32-subnormal 2**-127 for k = 127, Inf for 0."""
    if POW2:
        es = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
        r = tl.where(es == 254, 0x00400000, (254 - es) << 23).to(tl.float32, bitcast=True)
        return tl.where(es == 0, float("inf"), r)
    else:
        return reciprocal(s)


def flat_2d(x: torch.Tensor):
    """(M, K) of x seen as a matrix over its last dim (M = 1 for a 1-D x)."""
    k = x.shape[-1] if x.dim() > 0 else 1
    m = x.numel() // k if k else 0
    return m, k
