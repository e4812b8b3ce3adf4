"""Linear forward+backward: bf16 `torch.nn.Linear` vs `te.Linear` per recipe vs torchao float8.

    python benchmarks/bench_linear.py                                  # DESIGN shapes, compile default
    python benchmarks/bench_linear.py --modes default,reduce-overhead --out out/
    python benchmarks/bench_linear.py --smoke                          # tiny, CPU-friendly check

One step is `y = module(x)` (x: [M, K] bf16) then `torch.autograd.grad(y, [x, weight], dy)` with a
precomputed `dy`, i.e. the forward GEMM plus the dgrad and wgrad GEMMs: 6*M*K*N flops.
Every variant is a freshly constructed module (same initial weight), compiled with
`torch.compile(fullgraph=True, dynamic=False, mode=...)` after `torch._dynamo.reset()`, all in one
process. `te.Linear` variants run inside one `te.autocast(recipe=...)` entered around the whole
measurement (so the table shows the module, not the per-step autocast entry). Under
mode="reduce-overhead" every step starts with `torch.compiler.cudagraph_mark_step_begin()`.
CUDA times are `triton.testing.do_bench` medians; CPU times are `time.perf_counter` medians.
A failing variant shows as 'error: ...' in the table (traceback on stderr).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402

# M (tokens), K (in features), N (out features): the shapes of docs/design.md's reference table
DEFAULT_SHAPES = "8192x8192x8192,4096x8192x16384,16384x4096x14336,2048x2048x2048,1024x2048x1024"
TE_RECIPES = ["delayed", "current", "blockwise", "mxfp8", "nvfp4"]
DEFAULT_VARIANTS = ["bf16"] + [f"te:{r}" for r in TE_RECIPES] + ["torchao:tensorwise", "torchao:rowwise"]
OPTIONAL_VARIANTS = ["te:none"]  # te.Linear without autocast (bf16 through our custom ops)

# docs/design.md: torchao 0.18 float8 Linear fwd+bwd vs bf16, both compiled (mode default), H100
REFERENCE_SPEEDUP = {
    "torchao:tensorwise": {(8192, 8192, 8192): 1.50, (4096, 8192, 16384): 1.40, (16384, 4096, 14336): 1.61,
                           (2048, 2048, 2048): 0.48, (1024, 2048, 1024): 0.35},
    "torchao:rowwise": {(8192, 8192, 8192): 1.10, (4096, 8192, 16384): 1.09, (16384, 4096, 14336): 1.30,
                        (2048, 2048, 2048): 0.59, (1024, 2048, 1024): 0.36},
}


def parse_shapes(text: str):
    shapes = []
    for item in text.split(","):
        item = item.strip().lower().replace("*", "x").replace("·", "x")
        if not item:
            continue
        dims = tuple(int(d) for d in item.split("x"))
        if len(dims) != 3:
            raise argparse.ArgumentTypeError(f"shape {item!r} is not MxKxN")
        shapes.append(dims)
    return shapes


def shape_str(shape) -> str:
    return "x".join(str(d) for d in shape)


def torchao_available():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401

        return True, None
    except Exception as e:  # ImportError, or a torchao that does not load against this torch
        return False, f"{type(e).__name__}: {e}"


def build(variant: str, shape, device, dtype, bias: bool):
    """(module, recipe or None) for one variant, with the same initial weight for every variant."""
    import transformer_engine_proto as te

    M, K, N = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.rand(N, K, generator=g) * 2 - 1).mul_(K ** -0.5).to(device=device, dtype=dtype)
    if variant == "bf16" or variant.startswith("torchao:"):
        mod = torch.nn.Linear(K, N, bias=bias, device=device, dtype=dtype)
        with torch.no_grad():
            mod.weight.copy_(weight)
            if bias:
                mod.bias.zero_()
        if variant.startswith("torchao:"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig.from_recipe_name(variant.split(":", 1)[1])
            mod = convert_to_float8_training(mod, config=config)
        return mod, None
    if variant.startswith("te:"):
        recipe = C.make_recipe(variant.split(":", 1)[1])
        mod = te.Linear(K, N, bias=bias, params_dtype=dtype, device=device)
        with torch.no_grad():
            mod.weight.copy_(weight)
        return mod, recipe
    raise ValueError(f"unknown variant {variant!r}")


def run_variant(variant, shape, mode, args, device, dtype):

    C.reset_compile_state(device)
    M, K, N = shape
    res = {"variant": variant, "shape": list(shape), "mode": mode}
    mod, recipe = build(variant, shape, device, dtype, args.bias)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(M, K, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    dy = torch.randn(M, N, generator=g).to(device=device, dtype=dtype)
    wrt = [x] + [p for p in mod.parameters() if p.requires_grad]
    cmod = torch.compile(mod, fullgraph=True, dynamic=False, mode=None if mode == "default" else mode)
    cudagraphs = mode in ("reduce-overhead", "max-autotune")

    def step():
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        y = cmod(x)
        return torch.autograd.grad(y, wrt, dy)

    with C.te_autocast(recipe, variant):
        t0 = time.perf_counter()
        step()
        C.synchronize(device)
        res["compile_s"] = time.perf_counter() - t0
        for _ in range(2):  # cudagraph trees: warm-up run, then record; later calls replay
            step()
        C.synchronize(device)
        ms = C.bench_ms(step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                        cpu_warmup=args.cpu_warmup, cpu_reps=args.cpu_reps)
    res["ms"] = ms
    res["tflops"] = 6.0 * M * K * N / (ms * 1e-3) / 1e12
    res.update(C.compile_stats())
    cmod = mod = x = dy = wrt = None  # free the GPU memory `step` holds (not `del`: its closure reads them)
    return res


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--shapes", type=parse_shapes, default=None,
                   help=f"comma-separated MxKxN (tokens x in x out); default {DEFAULT_SHAPES}")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {DEFAULT_VARIANTS + OPTIONAL_VARIANTS}")
    p.add_argument("--modes", default="default", help="comma-separated torch.compile modes: default,reduce-overhead")
    p.add_argument("--bias", action="store_true", help="Linear with bias (default: no bias)")
    C.add_run_args(p, "bench_linear", warmup_ms=25.0, rep_ms=100.0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 reps, mode default (CPU check)")
    args = p.parse_args(argv)

    if args.smoke:
        args.shapes = args.shapes or [(128, 128, 128)]
        args.modes = "default"
        args.cpu_warmup, args.cpu_reps = 1, 2
        args.warmup_ms, args.rep_ms = 5.0, 10.0
    shapes = args.shapes or parse_shapes(DEFAULT_SHAPES)
    modes = C.names(args.modes)
    variants = C.names(args.variants)
    for v in variants:
        if v.removesuffix("+policy") not in DEFAULT_VARIANTS + OPTIONAL_VARIANTS:
            p.error(f"unknown variant {v!r}")
    if "bf16" in variants:
        variants.remove("bf16")
    variants.insert(0, "bf16")  # the baseline runs first for every (mode, shape)

    device = C.device_from_arg(args.device)
    dtype = torch.bfloat16
    C.configure_dynamo()
    env = C.environment(device)
    ao_ok, ao_err = torchao_available()
    notes = []
    if not ao_ok and any(v.startswith("torchao:") for v in variants):
        notes.append(f"torchao not importable ({ao_err}): torchao columns skipped")
        print(f"NOTE: {notes[-1]}")
        variants = [v for v in variants if not v.startswith("torchao:")]
    print(f"bench_linear: {env.get('gpu', device)}, torch {env['torch']}, triton {env['triton']}, "
          f"torchao {env['torchao']}; modes {modes}; shapes {[shape_str(s) for s in shapes]}")
    sys.stdout.flush()

    budget = C.Budget(args.max_minutes)
    results = []
    for mode in modes:
        if device.type != "cuda" and mode != "default":
            notes.append(f"mode {mode} on {device.type}: CUDA graphs do not apply, numbers are not meaningful")
        for shape in shapes:
            base_ms = None
            for variant in variants:
                label = f"{variant} {shape_str(shape)} {mode}"
                res = C.measure({"variant": variant, "shape": list(shape), "mode": mode}, label,
                                functools.partial(run_variant, variant, shape, mode, args, device, dtype),
                                budget, device)
                if variant == "bf16" and "ms" in res:
                    base_ms = res["ms"]
                if "ms" in res and base_ms is not None:
                    res["speedup_vs_bf16"] = base_ms / res["ms"]
                results.append(res)
                status = res.get("error") or (f"{res['ms']:.3f} ms, {_tf(res['tflops'])} TFLOP/s, "
                                              f"compile {res['compile_s']:.1f}s")
                print(f"  {label}: {status}", flush=True)

    # ---- detail table ------------------------------------------------------------------------
    headers = ["shape MxKxN", "mode", "variant", "ms fwd+bwd", "TFLOP/s", "vs bf16", "compile s",
               "graph breaks", "cudagraph skips"]
    rows = []
    for r in results:
        shp = shape_str(r["shape"])
        if "ms" in r:
            sp = r.get("speedup_vs_bf16")
            rows.append([shp, r["mode"], r["variant"], f"{r['ms']:.3f}", _tf(r["tflops"]),
                         "-" if sp is None else f"{sp:.2f}x", f"{r['compile_s']:.1f}",
                         r.get("graph_breaks", ""), r.get("cudagraph_skips", "")])
        else:
            rows.append([shp, r["mode"], r["variant"], r["error"], "", "", "",
                         r.get("graph_breaks", ""), r.get("cudagraph_skips", "")])
    detail = C.markdown_table(headers, rows)

    reasons = [(r["variant"], shape_str(r["shape"]), r["mode"], r.get("graph_break_reasons"),
                r.get("cudagraph_skip_reasons")) for r in results
               if r.get("graph_break_reasons") or r.get("cudagraph_skip_reasons")]

    # ---- summary: speedup vs bf16 per variant x shape (printed last) --------------------------
    shp_keys = [shape_str(s) for s in shapes]
    by = {(r["variant"], shape_str(r["shape"]), r["mode"]): r for r in results}
    srows = []
    for mode in modes:
        for variant in variants:
            cells = []
            for s in shp_keys:
                r = by.get((variant, s, mode))
                if r is None:
                    cells.append("")
                elif "ms" not in r:
                    cells.append("skipped" if r["error"].startswith("skipped") else "error")
                elif variant == "bf16":
                    cells.append(f"{r['ms']:.3f} ms")
                else:
                    sp = r.get("speedup_vs_bf16")
                    cells.append(f"{sp:.2f}x" if sp is not None else f"{r['ms']:.3f} ms")
            srows.append([mode, variant] + cells)
        if mode == "default" and device.type == "cuda":
            for variant, ref in REFERENCE_SPEEDUP.items():
                if variant in variants:
                    srows.append([mode, f"ref {variant} (DESIGN.md, H100)"] +
                                 [f"{ref[s]:.2f}x" if s in ref else "" for s in shapes])
    summary = C.markdown_table(["mode", "variant (bf16 row: ms; others: speedup vs bf16)"] + shp_keys, srows)

    if args.out:
        C.write_json(args.out, args.name, {"benchmark": "linear_fwd_bwd", "env": env, "args": vars(args) | {
            "shapes": [list(s) for s in shapes]}, "notes": notes, "results": results})
        plt = C.try_pyplot()
        if plt is not None:
            _plot(plt, results, modes, variants, shp_keys, args)

    print()
    for n in notes:
        print(f"NOTE: {n}")
    if reasons:
        print("\ngraph breaks / cudagraph skips:")
        for v, s, m, gb, cs in reasons:
            print(f"  {v} {s} {m}: graph breaks {gb or {}}; cudagraph skips {cs or []}")
    print("\n## Linear fwd+bwd, all numbers\n")
    print(detail)
    print(f"\n## Speedup vs bf16 nn.Linear (same mode), {env.get('gpu', device)}\n")
    print(summary)
    return 0


def _tf(tflops: float) -> str:
    return f"{tflops:.1f}" if tflops >= 10 else f"{tflops:.3g}"


def _plot(plt, results, modes, variants, shp_keys, args):
    fig, axes = plt.subplots(1, len(modes), figsize=(max(7, 1.6 * len(shp_keys) * len(modes)), 4.5), squeeze=False)
    by = {(r["variant"], shape_str(r["shape"]), r["mode"]): r for r in results}
    for ax, mode in zip(axes[0], modes):
        C.grouped_bars(ax, shp_keys, [v for v in variants if v != "bf16"],
                       lambda v, s, mode=mode: by.get((v, s, mode), {}).get("speedup_vs_bf16", 0.0) or 0.0,
                       rotation=20, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8, ls=":")
        ax.set_ylabel("speedup vs bf16 nn.Linear")
        ax.set_title(f"Linear fwd+bwd, compile mode={mode}")
    axes[0][-1].legend(fontsize=7)
    C.save_figure(fig, args.out, args.name)


if __name__ == "__main__":
    sys.exit(main())
