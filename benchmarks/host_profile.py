"""Where a Llama step's host time goes: cProfile of `bench_llama.py`'s training step.

    python benchmarks/host_profile.py --variants bf16,te:current,te:delayed --out out/
    python benchmarks/host_profile.py --mode default --variants bf16,torchao:tensorwise,te:delayed

A step (eager, or compiled with `--mode default`: the compiled graphs' launches are host work
too) whose device-kernel time (bench_llama.py --profile) is below its wall time is
host-bound: the GPU waits for Python. For each variant this prints the wall time per step, the host
time per step (the same steps, the clock stopped before the final synchronize), the process's
CPU time per step (all threads, and the main one) with the OS's involuntary context switches (a
wall time above the CPU time is a host the step shares; a CPU time that moves between runs is the
cores' speed or the code's work), single synchronized steps (median and min: on a shared host
the min is the code's cost), the host's and
(CUDA) the GPU's time for each part of the step (autocast entry, forward, exit, backward, clipping,
optimizer) and the functions with the most own time under cProfile, so the host cost can be cut
where it is.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import statistics
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import bench_llama as L  # noqa: E402
import torch  # noqa: E402


class PartClock:
    """`training_step`'s `mark`: while `on`, each mark's host time and (CUDA) an event recorded on
    the stream, so a step's parts get the host's time and the GPU's (event to event: the part's
    kernels plus the GPU's idle time in it)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.on = False
        self.steps = []

    def __call__(self, part: str) -> None:
        if not self.on:
            return
        if part == "start":
            self.steps.append([])
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self.steps[-1].append((part, time.perf_counter(), event))

    def medians(self) -> dict:
        """{part: (GPU ms or None, host ms)}, medians over the recorded steps."""
        out = {}
        for i, part in enumerate(L.STEP_PARTS, start=1):
            host = [(s[i][1] - s[i - 1][1]) * 1e3 for s in self.steps]
            gpu = [s[i - 1][2].elapsed_time(s[i][2]) for s in self.steps] if self.cuda else None
            out[part] = (statistics.median(gpu) if gpu else None, statistics.median(host))
        return out


def profile_variant(variant: str, args, device, dtype, log) -> dict:
    C.reset_compile_state(device)
    model, recipe = L.make_variant(variant, args, device, dtype)
    clock = PartClock(device)
    step = L.training_step(model, recipe, variant, args.mode, args, device, mark=clock)

    for _ in range(3):  # compiles, when compiled
        step()
    C.synchronize(device)
    use0, cpu0, main0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.thread_time()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    host = (time.perf_counter() - t0) / args.steps
    C.synchronize(device)
    wall = (time.perf_counter() - t0) / args.steps
    # the CPU time the steps took (all threads; the main one) and how often the OS took the CPU
    # away: a wall time above the CPU time with many involuntary switches is a contended host, a
    # CPU time that grows is slower cores or more work
    use1, cpu = resource.getrusage(resource.RUSAGE_SELF), (time.process_time() - cpu0) / args.steps
    main_cpu = (time.thread_time() - main0) / args.steps
    preempted = (use1.ru_nivcsw - use0.ru_nivcsw) / args.steps
    # each step alone, synchronized: on a shared host the least disturbed step (min) is the
    # code's cost, the median what a run sees
    per_step = []
    for _ in range(args.step_times):
        t = time.perf_counter()
        step()
        C.synchronize(device)
        per_step.append((time.perf_counter() - t) * 1e3)
    per_step.sort()
    # the step's parts, steps back to back (as in a run): where the GPU time exceeds the host's, the
    # GPU ran the part's kernels (or waited in it); where the host's exceeds it, the GPU waited for the host
    clock.on = True
    for _ in range(args.step_times):
        step()
    C.synchronize(device)
    clock.on = False
    parts = clock.medians()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    C.synchronize(device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    table = C.markdown_table(["part", "GPU ms (events)", "host ms"],
                             [[p, "-" if g is None else f"{g:.3f}", f"{h:.3f}"] for p, (g, h) in parts.items()])
    log(f"\n## {variant} ({args.mode}): wall {wall * 1e3:.2f} ms/step, host {host * 1e3:.2f} ms/step, CPU "
        f"{cpu * 1e3:.2f} ms/step (main thread {main_cpu * 1e3:.2f}), {preempted:.1f} involuntary switches/step\n\n"
        f"The step's parts, medians of {args.step_times} steps:\n\n{table}\n\n"
        f"cProfile of {args.steps} steps:\n\n{text.getvalue()}")
    return dict(variant=variant, mode=args.mode, wall_ms=wall * 1e3, host_ms=host * 1e3, cpu_ms=cpu * 1e3,
                main_thread_cpu_ms=main_cpu * 1e3, involuntary_switches=preempted, parts=parts,
                step_median_ms=per_step[len(per_step) // 2] if per_step else None,
                step_min_ms=per_step[0] if per_step else None)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="bf16,te:current,te:delayed")
    p.add_argument("--mode", default="eager", choices=("eager", "default", "reduce-overhead"),
                   help="eager, or torch.compile's mode")
    p.add_argument("--preset", default="llama", choices=sorted(L.PRESETS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--step-times", type=int, default=40, help="steps timed one by one (synchronized)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the wiring)")
    args = p.parse_args(argv)
    shape = dict(L.PRESETS[args.preset], vocab=32768, seq=2048, batch=4)
    if args.smoke:
        shape = dict(hidden=64, ffn=128, layers=2, heads=4, vocab=256, seq=32, batch=2)
    for key, value in shape.items():
        setattr(args, key, value)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    results = [profile_variant(v.strip(), args, device, dtype, log) for v in args.variants.split(",") if v.strip()]
    log("\n| variant | wall ms/step | host ms/step | CPU ms/step | main thread CPU ms/step | involuntary switches/step "
        "| one step, median ms | one step, min ms |\n|---|--:|--:|--:|--:|--:|--:|--:|")
    for r in results:
        one = [f"{r[k]:.2f}" if r[k] is not None else "-" for k in ("step_median_ms", "step_min_ms")]
        log(f"| {r['variant']} | {r['wall_ms']:.2f} | {r['host_ms']:.2f} | {r['cpu_ms']:.2f} | "
            f"{r['main_thread_cpu_ms']:.2f} | {r['involuntary_switches']:.1f} | {one[0]} | {one[1]} |")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_profile.txt"), "w") as f:
            f.write("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
