import sys, torch
from triton.testing import do_bench
from transformer_engine_proto.kernels.triton import blockwise as bw
tag = sys.argv[1]
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
E4 = torch.float8_e4m3fn
for key, cands in (((1, True, True), [(16, 4), (32, 4), (64, 4), (16, 8), (32, 8), (64, 8)]),
                   ((2, True, True), [(32, 4), (64, 4), (32, 8), (64, 8)])):
    for ch, w in cands:
        bw.CONFIG[key] = dict(BM=128, BK=128, CH=ch, num_warps=w)
        t = do_bench(lambda: bw.fp8_blockwise_quantize(x, E4, key[0], True, True), return_mode="median")
        print(f"{tag:5s} dim={key[0]} CH={ch:3d} W={w}: {t*1e3:7.1f} us", flush=True)
