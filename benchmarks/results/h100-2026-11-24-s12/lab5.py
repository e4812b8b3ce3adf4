import sys, torch
from triton.testing import do_bench
from transformer_engine_proto.kernels.triton import mxfp8 as mx
tag = sys.argv[1]
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
E4 = torch.float8_e4m3fn
if tag == "old":
    mx.CONFIG["quarters"] = False
    t = do_bench(lambda: mx.mxfp8_quantize(x, E4, True, True), return_mode="median")
    print(f"old  rw+cw {t*1e3:7.1f} us", flush=True)
    t = do_bench(lambda: mx.mxfp8_quantize(x, E4, False, True), return_mode="median")
    print(f"old  cw    {t*1e3:7.1f} us", flush=True)
else:
    for nb in (1, 2, 4, 8):
        for w in (1, 2, 4, 8):
            mx.CONFIG["quarters"] = dict(NB=nb, num_warps=w)
            t = do_bench(lambda: mx.mxfp8_quantize(x, E4, True, True), return_mode="median")
            t2 = do_bench(lambda: mx.mxfp8_quantize(x, E4, False, True), return_mode="median")
            print(f"quarters NB={nb} W={w}: rw+cw {t*1e3:7.1f} us  cw {t2*1e3:7.1f} us", flush=True)
