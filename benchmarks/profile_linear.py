"""Where the time of one compiled Linear fwd+bwd step goes: a torch.profiler table per variant.

    python benchmarks/profile_linear.py --variants bf16,te:current --shape 8192x8192x8192
    python benchmarks/profile_linear.py --variants bf16,te:current --shape 1024x2048x1024 --mode reduce-overhead

The step is the one `bench_linear.py` times (same module, input and `autograd.grad` call). For each
variant: wall time per step (host clock around `--steps` steps, synchronized), summed device-kernel
time per step, and the top kernels by device time. Wall well above kernel time means the host
(Python, launches, cudagraph-tree bookkeeping) is the limit, not the GPU. A diagnosis tool: the
numbers in the closing notes come from bench_linear.py.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402
from bench_linear import build, parse_shapes  # noqa: E402


def profile_variant(variant, shape, mode, steps, top, device, log):
    import transformer_engine_proto as te

    C.reset_compile_state(device)
    M, K, N = shape
    mod, recipe = build(variant, shape, device, torch.bfloat16, bias=False)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=torch.bfloat16).requires_grad_(True)
    dy = torch.randn(M, N, generator=g).to(device=device, dtype=torch.bfloat16)
    wrt = [x] + [p for p in mod.parameters() if p.requires_grad]
    cmod = torch.compile(mod, fullgraph=True, dynamic=False, mode=None if mode == "default" else mode)
    cudagraphs = mode == "reduce-overhead"

    def step():
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        return torch.autograd.grad(cmod(x), wrt, dy)

    ctx = te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
    with ctx:
        for _ in range(3):
            step()
        C.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        t1 = time.perf_counter()
        C.synchronize(device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        host_ms = (t1 - t0) * 1e3 / steps  # enqueue time: about the wall time when host-bound
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                step()
            C.synchronize(device)
    averages = prof.key_averages()
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.self_device_time_total for e in kernels) / steps
    log(f"\n## {variant}  {'x'.join(map(str, shape))}  mode={mode}: wall {wall_ms:.3f} ms/step, "
        f"host enqueue {host_ms:.3f} ms/step, kernels {kernel_us / 1e3:.3f} ms/step")
    log("  device time per step, by kernel:")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        log(f"  {e.self_device_time_total / steps:9.1f} us  x{e.count / steps:4.1f}  {e.key[:110]}")
    log("  host time per step, by op (self CPU):")
    for e in sorted(averages, key=lambda e: -e.self_cpu_time_total)[:top]:
        log(f"  {e.self_cpu_time_total / steps:9.1f} us  x{e.count / steps:4.1f}  {e.key[:110]}")
    cmod = mod = x = dy = wrt = None  # free the GPU memory `step` holds (not `del`: its closure reads them)
    return dict(variant=variant, wall_ms=wall_ms, kernel_ms=kernel_us / 1e3)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="bf16,te:current")
    p.add_argument("--shape", type=parse_shapes, default=parse_shapes("8192x8192x8192"))
    p.add_argument("--mode", default="default", choices=["default", "reduce-overhead"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="append the report to <out>/profile_linear.log")
    args = p.parse_args()
    C.configure_dynamo()
    device = C.device_from_arg(args.device)
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    for shape in args.shape:
        for variant in args.variants.split(","):
            try:
                profile_variant(variant.strip(), shape, args.mode, args.steps, args.top, device, log)
            except Exception as e:  # keep profiling the other variants
                log(f"\n## {variant} {shape}: {C.report_exception(variant, e)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_linear.log"), "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
