"""Per-tensor amax kernel variants at the Llama step's shapes: device time per launch (CUDA-graph
replays), bandwidth, and the step's amax total weighted by how often each shape occurs."""
import sys, json
import torch, triton, triton.language as tl
from triton.testing import do_bench_cudagraph
from transformer_engine_proto.kernels.triton._common import to_f32, finite_abs_bits, as_kernel_input
from transformer_engine_proto.kernels.triton.float8 import _amax_kernel

@triton.jit
def _amax_persistent(x_ptr, amax_ptr, N, amax_slot, FINITE: tl.constexpr, BF16_BITS: tl.constexpr,
                     BLOCK: tl.constexpr):
    amax_ptr = amax_ptr.to(tl.pointer_type(tl.int32))
    pid = tl.program_id(0).to(tl.int64)  # the loop index is int64 (offsets past 2**31)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    n_blocks = tl.cdiv(N, BLOCK)
    for b in range(pid, n_blocks, nprog):
        base = b * BLOCK
        mask = offs < N - base
        x = to_f32(tl.load(x_ptr + base + offs, mask=mask, other=0), BF16_BITS)
        if FINITE:
            acc = tl.maximum(acc, finite_abs_bits(x))
        else:
            acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    m = tl.max(acc, axis=0)
    cur = tl.load(amax_ptr + amax_slot)
    tl.atomic_max(amax_ptr + amax_slot, m, mask=m > cur, sem="relaxed")

@triton.jit
def _amax_bf16_persistent(x_ptr, amax_ptr, N, amax_slot, FINITE: tl.constexpr, BLOCK: tl.constexpr):
    """bf16 only: max over the int16 bits of |x| (the bf16 order is the int order too)."""
    amax_ptr = amax_ptr.to(tl.pointer_type(tl.int32))
    pid = tl.program_id(0).to(tl.int64)  # the loop index is int64 (offsets past 2**31)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int16)
    n_blocks = tl.cdiv(N, BLOCK)
    for b in range(pid, n_blocks, nprog):
        base = b * BLOCK
        mask = offs < N - base
        bits = tl.load(x_ptr + base + offs, mask=mask, other=0) & 0x7FFF
        if FINITE:
            bits = tl.where(bits < 0x7F80, bits, 0)
        acc = tl.maximum(acc, bits)
    m = tl.max(acc, axis=0).to(tl.int32) << 16
    cur = tl.load(amax_ptr + amax_slot)
    tl.atomic_max(amax_ptr + amax_slot, m, mask=m > cur, sem="relaxed")

SHAPES = [((2048, 2048), 16), ((5632, 2048), 12), ((8192, 2048), 33), ((8192, 5632), 12),
          ((32768, 2048), 1), ((8192, 32768), 1)]
n_sm = torch.cuda.get_device_properties(0).multi_processor_count

def variants():
    yield "base 16384/8", lambda xk, a, n, bb: _amax_kernel[(triton.cdiv(n, 16384),)](xk, a, n, 0, FINITE=True, BF16_BITS=bb, BLOCK=16384, num_warps=8)
    for blk, w in ((8192, 8), (4096, 8), (4096, 4), (2048, 4)):
        yield f"plain {blk}/{w}", (lambda blk, w: lambda xk, a, n, bb: _amax_kernel[(triton.cdiv(n, blk),)](xk, a, n, 0, FINITE=True, BF16_BITS=bb, BLOCK=blk, num_warps=w))(blk, w)
    for blk, w, per in ((4096, 8, 2), (4096, 8, 4), (8192, 8, 2), (8192, 8, 4), (4096, 4, 4), (4096, 4, 8), (2048, 4, 8), (8192, 16, 2)):
        yield f"persist {blk}/{w} x{per}", (lambda blk, w, per: lambda xk, a, n, bb: _amax_persistent[(min(triton.cdiv(n, blk), n_sm * per),)](xk, a, n, 0, FINITE=True, BF16_BITS=bb, BLOCK=blk, num_warps=w))(blk, w, per)
    for blk, w, per in ((4096, 8, 4), (8192, 8, 4), (4096, 4, 8), (8192, 8, 2), (16384, 16, 2)):
        yield f"bf16bits {blk}/{w} x{per}", (lambda blk, w, per: lambda xk, a, n, bb: _amax_bf16_persistent[(min(triton.cdiv(n, blk), n_sm * per),)](xk, a, n, 0, FINITE=True, BLOCK=blk, num_warps=w))(blk, w, per)

def main():
    torch.manual_seed(0)
    xs = []
    for (shape, count) in SHAPES:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
        x.view(-1)[12345] = float("inf")  # a non-finite value the finite amax skips
        xs.append((x, count))
    copy = torch.empty(256 << 20, dtype=torch.uint8, device="cuda"); dst = torch.empty_like(copy)
    t = do_bench_cudagraph(lambda: dst.copy_(copy), rep=50)
    print(f"copy ceiling: {2 * copy.numel() / t / 1e9:.0f} GB/s")
    rows = {}
    for name, fn in variants():
        total, per = 0.0, []
        for x, count in xs:
            ref = x.float().abs().where(torch.isfinite(x.float()), 0).amax()
            a = torch.zeros(1, device="cuda")
            xk, bb = as_kernel_input(x)
            fn(xk, a, x.numel(), bb); torch.cuda.synchronize()
            assert torch.equal(a[0], ref), (name, x.shape, a, ref)
            us = do_bench_cudagraph(lambda: fn(xk, a, x.numel(), bb), rep=30) * 1e3
            per.append(us); total += us * count
        rows[name] = (total, per)
        print(f"{name:24s} step {total / 1e3:.3f} ms | " + " ".join(f"{u:7.1f}" for u in per), flush=True)
    print("per-launch us at", [s for s, _ in SHAPES])
    best = min(rows, key=lambda k: rows[k][0]); print("best", best, rows[best][0] / 1e3, "base", rows["base 16384/8"][0] / 1e3)
    if len(sys.argv) > 1:
        json.dump({k: v for k, v in rows.items()}, open(sys.argv[1], "w"), indent=1)

main()
