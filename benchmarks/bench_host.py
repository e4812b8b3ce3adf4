"""Host time of one Linear fwd+bwd with the device work taken out, per recipe, vs nn.Linear.

    python benchmarks/bench_host.py                       # CPU, compiled (default mode) and eager
    python benchmarks/bench_host.py --out out/ --repeats 9

Host time per Linear bounds eager te Linears and small shapes (figures from an H100 host:
benchmarks/results/2026-11-23-h100-f8c3bc0). This measures it without a GPU: every quantize /
dequantize kernel and the te GEMM are replaced by stubs that return uninitialized tensors shaped
like the real results of their first call, so what is timed is our Python (plans, quantized-tensor
objects, dispatch), torch's custom-op and autograd machinery and the compiled graph's wrappers. The baseline
`nn.Linear` keeps its real (small) matmuls, in float32 on CPU (CPU bf16 matmuls are slow enough to
dominate; params are bf16 on CUDA). Numbers depend on the host CPU: compare variants within one run.
A te variant may add `+op`: eager calls through the op even where an eager Linear program would
serve them (CUDA; `custom_ops/eager_program.py`), for an A/B in one run.
Reported: the best of `--repeats` timings of `--steps` steps each (the least disturbed run), and
the Python function calls into this library during one step (`sys.setprofile`; under inductor the
ops are inlined, so what remains is the eager code around the compiled region, e.g. autocast).
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

VARIANTS = ["nn.Linear", "te:none", "te:delayed", "te:current", "te:blockwise", "te:mxfp8", "te:nvfp4"]


def _fresh(t):
    if isinstance(t, torch.Tensor):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    if isinstance(t, (tuple, list)):
        return type(t)(_fresh(x) for x in t)
    return t


def _signature(args):
    from transformer_engine_proto.tensor.storage import QuantizedTensorStorage

    def one(a):
        if isinstance(a, QuantizedTensorStorage):  # bare storages (the ops' internal operands)
            return type(a).__name__, tuple(a._shape), tuple(a.get_buffers())
        return (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a

    return tuple(one(a) for a in args if not isinstance(a, (list, dict)))


def _stubbed(fn):
    """`fn` once per argument signature; afterwards uninitialized outputs of the same layout."""
    first = {}

    def stub(*args, **kwargs):
        key = _signature(args)
        if key not in first:
            first[key] = fn(*args, **kwargs)
        return _fresh(first[key])

    return stub


@contextlib.contextmanager
def stubbed_device_work():
    """Every registered kernel and the te Linear GEMMs (the op's, the eager programs') replaced by
    stubs, restored on exit."""
    from transformer_engine_proto import kernels
    from transformer_engine_proto.custom_ops import eager_program
    from transformer_engine_proto.custom_ops import linear as linear_ops

    kernels.kernel("amax")  # load the registry
    saved_kernels, saved_gemm, saved_mm = dict(kernels._KERNELS), linear_ops.gemm, eager_program.tensorwise_mm
    try:
        for key, fn in saved_kernels.items():
            kernels._KERNELS[key] = _stubbed(fn)
        linear_ops.gemm = _stubbed(saved_gemm)
        eager_program.tensorwise_mm = _stubbed(saved_mm)
        yield
    finally:
        kernels._KERNELS.clear()
        kernels._KERNELS.update(saved_kernels)
        linear_ops.gemm = saved_gemm
        eager_program.tensorwise_mm = saved_mm


def host_us(variant, shape, compiled, steps, repeats, device, dtype):
    import transformer_engine_proto as te

    C.reset_compile_state(device)
    m, k, n = shape
    torch.manual_seed(0)
    if variant == "nn.Linear":
        mod, recipe = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype), None
    else:
        mod = te.Linear(k, n, bias=False, device=device, params_dtype=dtype)
        recipe = C.make_recipe(variant.split(":", 1)[1])
    # +op: eager calls through the op even where an eager program would serve them (CUDA)
    te.custom_ops.eager_program.set_enabled("+op" not in variant)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=dtype)
    run = torch.compile(mod, fullgraph=True, dynamic=False) if compiled else mod
    wrt = [x, mod.weight]

    def step():
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = run(x)
        torch.autograd.grad(y, wrt, dy)

    for _ in range(5):
        step()
    calls = library_calls(step)
    best = float("inf")
    for _ in range(repeats):
        C.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t0) / steps)
    return best * 1e6, calls


def library_calls(fn) -> int:
    """Python function calls into transformer_engine_proto during one `fn()` (sys.setprofile)."""
    import transformer_engine_proto

    root = os.path.dirname(transformer_engine_proto.__file__)
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" and frame.f_code.co_filename.startswith(root):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shape", default="128x128x128", help="MxKxN (small: bf16's matmuls stay real)")
    p.add_argument("--modes", default="compiled,eager")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="bench_host")
    args = p.parse_args(argv)
    C.configure_dynamo()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = tuple(int(s) for s in args.shape.lower().split("x"))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = []
    with stubbed_device_work():
        for mode in modes:
            for v in variants:
                try:
                    us, calls = host_us(v, shape, mode == "compiled", args.steps, args.repeats, device, dtype)
                    results.append(dict(variant=v, mode=mode, host_us=us, library_calls=calls))
                except Exception as e:  # keep timing the others
                    results.append(dict(variant=v, mode=mode, error=C.report_exception(v, e)))
    base = {r["mode"]: r["host_us"] for r in results if r["variant"] == "nn.Linear" and "host_us" in r}
    rows = []
    for r in results:
        if "host_us" in r:
            ratio = f"{r['host_us'] / base[r['mode']]:.1f}x" if r["mode"] in base else "-"
            rows.append([r["mode"], r["variant"], f"{r['host_us']:.0f}", ratio, r["library_calls"]])
        else:
            rows.append([r["mode"], r["variant"], r["error"], "-", "-"])
    print(f"\n## Host us per Linear fwd+bwd, {args.shape}, device work stubbed ({device}), "
          f"best of {args.repeats} x {args.steps} steps\n")
    print(C.markdown_table(["mode", "variant", "host us/step", f"vs nn.Linear ({dtype})",
                            "library Python calls/step"], rows))
    if args.out:
        C.write_json(args.out, args.name, dict(env=C.environment(device), shape=shape, results=results))
        plt = C.try_pyplot()
        if plt is not None:
            fig, ax = plt.subplots(figsize=(8, 4))
            for i, mode in enumerate(modes):
                rs = [r for r in results if r["mode"] == mode and "host_us" in r]
                xs = [j + 0.4 * i for j in range(len(rs))]
                ax.bar(xs, [r["host_us"] for r in rs], width=0.4, label=mode)
                ax.set_xticks([j + 0.2 for j in range(len(rs))], [r["variant"] for r in rs], rotation=30)
            ax.set_ylabel("host us per fwd+bwd")
            ax.legend()
            C.save_figure(fig, args.out, args.name)
    return results


if __name__ == "__main__":
    main()
