"""Where dynamo's tracing of a model's first compiled call goes, per traced Python function.

    python benchmarks/trace_profile.py --variants bf16,te:current,te:delayed
    python benchmarks/trace_profile.py --variants te:delayed --functions 40 --out out/

A warm first step (compiled graphs and kernels cached) is mostly dynamo tracing the Python of the
model and of this library, then building guards (`compile_breakdown.py` times it on the GPU). This
runs the forward of `bench_llama.py`'s Llama (smaller by default: hidden 256, 4 layers, 29
Linears) once under `torch.compile` with a backend that compiles nothing, so the first call is
dynamo's work alone, on any device. For each variant it prints the first call, dynamo's tracing
and guard seconds (best of `--repeats` fresh models), and, for one more traced call, each inlined
function's exclusive and inclusive seconds and its calls, and the bytecode instructions dynamo
stepped through per function (a deterministic measure of the same work: seconds move with the
host, instructions only with the code).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import bench_llama as L  # noqa: E402
import torch  # noqa: E402

LIBRARY = "transformer_engine_proto"


def _name(code) -> str:
    path = code.co_filename
    for marker in ("site-packages/", os.path.dirname(_HERE) + os.sep):
        path = path.split(marker)[-1]
    return f"{path}:{code.co_firstlineno}:{code.co_name}"


@contextlib.contextmanager
def inline_times():
    """{function: [calls, inclusive s, exclusive s]} and {function: instructions} of what dynamo
    inlines while the block runs (it wraps dynamo's inliner and instruction step)."""
    from torch._dynamo import symbolic_convert as sc

    inliner, base = sc.InliningInstructionTranslator, sc.InstructionTranslatorBase
    if not (hasattr(inliner, "inline_call_") and hasattr(base, "step")):
        raise RuntimeError("trace_profile: this torch's dynamo has no InliningInstructionTranslator.inline_call_ / "
                           "InstructionTranslatorBase.step to time")
    times = collections.defaultdict(lambda: [0, 0.0, 0.0])
    steps = collections.Counter()
    children = []  # per open inline call: seconds spent in the calls it inlined
    inline_call, step = inliner.inline_call_, base.step

    def timed_inline(self):
        t0 = time.perf_counter()
        children.append(0.0)
        try:
            return inline_call(self)
        finally:
            dt = time.perf_counter() - t0
            inner = children.pop()
            if children:
                children[-1] += dt
            row = times[_name(self.f_code)]
            row[0] += 1
            row[1] += dt
            row[2] += dt - inner

    def counted_step(self):
        steps[_name(self.f_code)] += 1
        return step(self)

    inliner.inline_call_, base.step = timed_inline, counted_step
    try:
        yield times, steps
    finally:
        inliner.inline_call_, base.step = inline_call, step


def first_call(variant: str, args, device, dtype) -> dict:
    """One fresh model's first compiled forward: seconds of the call, of dynamo's tracing and guards."""
    from torch._dynamo.utils import compilation_time_metrics

    model, recipe = L.make_variant(variant, args, device, dtype)
    fwd = torch.compile(model, backend=lambda gm, inputs: gm.forward, fullgraph=True)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    torch._dynamo.reset()
    compilation_time_metrics.clear()
    t0 = time.perf_counter()
    with C.te_autocast(recipe, variant):
        fwd(input_ids=ids, labels=ids)
    return dict(first_call_s=time.perf_counter() - t0,
                tracing_s=sum(compilation_time_metrics.get("bytecode_tracing", [0.0])),
                guards_s=sum(compilation_time_metrics.get("build_guards", [0.0])))


def profile_variant(variant: str, args, device, dtype) -> dict:
    best = min((first_call(variant, args, device, dtype) for _ in range(args.repeats)), key=lambda r: r["first_call_s"])
    with inline_times() as (times, steps):
        first_call(variant, args, device, dtype)
    functions = sorted(([name, calls, inc, exc] for name, (calls, inc, exc) in times.items()), key=lambda r: -r[3])
    library = [r for r in functions if LIBRARY in r[0]]
    return dict(variant=variant, **best,
                library_exclusive_s=sum(r[3] for r in library),
                library_instructions=sum(n for name, n in steps.items() if LIBRARY in name),
                instructions=sum(steps.values()),
                functions=functions[:args.functions],
                library_steps=[[name, n] for name, n in steps.most_common() if LIBRARY in name][:args.functions])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default="bf16,te:current,te:delayed")
    p.add_argument("--repeats", type=int, default=3, help="fresh models per variant, the fastest first call kept")
    p.add_argument("--functions", type=int, default=25, help="functions listed per variant")
    C.add_model_args(p, hidden=256, ffn=512, layers=4, heads=4, vocab=1024, seq=64, batch=1)
    p.add_argument("--device", default="cpu", help="the traced tensors' device (tracing itself runs on the host)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16
    C.configure_dynamo()
    results = [profile_variant(v, args, device, dtype) for v in C.names(args.variants)
               if not (v.startswith("torchao:") and device.type != "cuda")]
    print(f"\n## First compiled forward, no-op backend (Llama hidden {args.hidden}, {args.layers} layers, "
          f"{device}; best of {args.repeats})\n")
    print(C.markdown_table(["variant", "first call s", "dynamo tracing s", "guards s", "library exclusive s",
                            "instructions", "of them in the library"],
                           [[r["variant"], f"{r['first_call_s']:.2f}", f"{r['tracing_s']:.2f}", f"{r['guards_s']:.2f}",
                             f"{r['library_exclusive_s']:.2f}", r["instructions"], r["library_instructions"]]
                            for r in results]))
    for r in results:
        print(f"\n### {r['variant']}: inlined functions by exclusive seconds (one traced call)\n")
        print(C.markdown_table(["function", "calls", "inclusive s", "exclusive s"],
                               [[name, calls, f"{inc:.3f}", f"{exc:.3f}"] for name, calls, inc, exc in r["functions"]]))
    if args.out:
        C.write_json(args.out, "trace_profile", dict(env=C.environment(device), args=vars(args), results=results))
    return results


if __name__ == "__main__":
    main()
