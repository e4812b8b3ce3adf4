"""Lab 3: is the fp8 cast instruction-bound? fp8_bits without the explicit clamp (the hardware
cvt.rn.satfinite saturates itself) in every quantize kernel: bitwise vs the reference on edge
inputs, and times at 8192^2 bf16 before/after."""
import sys, torch, triton, triton.language as tl
from triton.testing import do_bench
sys.path.insert(0, "tests")
from test_triton_kernels import make_input, assert_bitwise
from transformer_engine_proto.kernels.triton import float8 as f8, blockwise as bw, mxfp8 as mx, _common
from transformer_engine_proto.kernels.reference import float8 as rf8, blockwise as rbw, mxfp8 as rmx
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2

@triton.jit
def fp8_bits_noclamp(v, FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr):
    vb = v.to(tl.int32, bitcast=True)
    sign = (vb >> 24) & 0x80
    if E4M3:
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(v != v, (sign | 0x7F).to(tl.uint8), q)

def times(tag):
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([0.37], device="cuda")
    cases = {
        "delayed rw+cw": lambda: f8.fp8_quantize_delayed(x, s, torch.zeros(1, device="cuda"), E4, True, True),
        "current rw+cw": lambda: f8.fp8_quantize_current(x, E4, True, True),
        "bw 1x128 rw+cw": lambda: bw.fp8_blockwise_quantize(x, E4, 1, True, True),
        "bw 128x128 rw+cw": lambda: bw.fp8_blockwise_quantize(x, E4, 2, True, True),
        "bw 1x128 rw": lambda: bw.fp8_blockwise_quantize(x, E4, 1, True, False),
        "bw 1x128 cw": lambda: bw.fp8_blockwise_quantize(x, E4, 1, False, True),
        "mx rw+cw": lambda: mx.mxfp8_quantize(x, E4, True, True),
    }
    for k, fn in cases.items():
        print(f"{tag:8s} {k:18s} {do_bench(fn, return_mode='median')*1e3:7.1f} us", flush=True)

def check():
    n = 0
    for kind in ("huge", "inf", "nan", "mixed", "denormal", "normal"):
        x = make_input((256, 384), kind)
        for d in (E4, E5):
            for sv in (0.37, 3e38, 1e-3):
                s = torch.tensor([sv], device="cuda")
                a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
                assert_bitwise(f8.fp8_quantize_delayed(x, s, a1, d, True, True), rf8.fp8_quantize_delayed(x, s, a2, d, True, True), "d"); n += 1
            assert_bitwise(f8.fp8_quantize_current(x, d, True, True), rf8.fp8_quantize_current(x, d, True, True), "c")
            for dim in (1, 2):
                assert_bitwise(bw.fp8_blockwise_quantize(x, d, dim, True, True), rbw.fp8_blockwise_quantize(x, d, dim, True, True), "bw")
            assert_bitwise(mx.mxfp8_quantize(x, d, True, True), rmx.mxfp8_quantize(x, d, True, True), "mx")
            n += 4
    print("bitwise ok", n)

if sys.argv[1] == "base":
    times("base"); check(); times("base2")
elif sys.argv[1] == "noclamp_first":
    for mod in (f8, bw, mx):
        mod.fp8_bits = fp8_bits_noclamp
    times("noclamp"); check(); times("noclamp2")
elif False:
    times("clamp")
else:
    for mod in (f8, bw, mx):
        mod.fp8_bits = fp8_bits_noclamp
    check()
    times("noclamp")
