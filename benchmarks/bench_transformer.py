"""Training step of a stack of `te.TransformerLayer`s: recipes x {eager, compile default, reduce-overhead}.

    python benchmarks/bench_transformer.py                     # 4 layers, hidden 1024, ffn 4096, 16 heads, 2048 tokens
    python benchmarks/bench_transformer.py --optimizer adamw --out out/
    python benchmarks/bench_transformer.py --smoke             # tiny, CPU-friendly check

A step is what a TE training loop does: `with te.autocast(recipe=...): y = model(x)` (entered every
step, as in `examples/train.py`; `--autocast-once` enters it once around the measurement instead),
then `y.backward(dy)` with a precomputed `dy`, then optionally an optimizer step (`--optimizer`,
eager, foreach). Grads are set to None at the start of every step. Compiled variants use
`torch.compile(fullgraph=True, dynamic=False)` on the whole stack (`--compile-scope layer` compiles
each layer instead: 4x less to compile, a graph per layer), each after `torch._dynamo.reset()` on a
freshly constructed model (same seed). Reduce-overhead steps begin with
`torch.compiler.cudagraph_mark_step_begin()`. For every variant the table reports dynamo's graph
breaks (`counters["graph_break"]`) and inductor's `counters["inductor"]["cudagraph_skips"]`
(reasons are printed). Model TFLOP/s counts the GEMMs and causal attention (half of s^2), x3 for
fwd+bwd. CUDA times are `triton.testing.do_bench` medians; CPU times `time.perf_counter` medians.
"""
from __future__ import annotations

import contextlib
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

DEFAULT_RECIPES = ["none", "delayed", "current", "blockwise", "mxfp8"]
ALL_RECIPES = DEFAULT_RECIPES + ["nvfp4"]
DEFAULT_MODES = ["eager", "default", "reduce-overhead"]


def build_model(args, device, dtype):
    import transformer_engine_proto as te

    torch.manual_seed(0)
    layers = [te.TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                  attn_input_format="bshd", params_dtype=dtype, device=device)
              for _ in range(args.layers)]
    return torch.nn.Sequential(*layers)


def model_flops(args) -> float:
    """fwd+bwd flops of one step: GEMMs (qkv, proj, fc1, fc2) + causal attention, x3 for training."""
    h, f, s, b, L = args.hidden, args.ffn, args.seq, args.batch, args.layers
    tokens = b * s
    gemm = 2 * tokens * (h * 3 * h + h * h + 2 * h * f)
    attn = 2 * 2 * b * s * s * h / 2  # QK^T and PV, causal: half the score matrix
    return 3.0 * L * (gemm + attn)


def run_variant(recipe_name, mode, args, device, dtype):

    C.reset_compile_state(device)
    res = {"recipe": recipe_name, "mode": mode}
    recipe = C.make_recipe(recipe_name)
    model = build_model(args, device, dtype)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)
    elif args.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    else:
        opt = None

    if mode == "eager":
        fwd = model
    elif args.compile_scope == "model":
        fwd = torch.compile(model, fullgraph=True, dynamic=False, mode=None if mode == "default" else mode)
    else:
        for layer in model:
            layer.compile(fullgraph=True, dynamic=False, mode=None if mode == "default" else mode)
        fwd = model
    cudagraphs = mode in ("reduce-overhead", "max-autotune")

    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(args.batch, args.seq, args.hidden, generator=g).to(device=device, dtype=dtype)

    def ctx():
        return C.te_autocast(recipe, recipe_name)

    per_step = ctx if not args.autocast_once else contextlib.nullcontext

    def step():
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        for p in params:
            p.grad = None
        with per_step():
            y = fwd(x)
        y.backward(dy)
        if opt is not None:
            opt.step()

    with (ctx() if args.autocast_once else contextlib.nullcontext()):
        t0 = time.perf_counter()
        step()
        C.synchronize(device)
        res["first_step_s"] = time.perf_counter() - t0
        for _ in range(2):  # cudagraph trees: warm-up, record, then replays
            step()
        C.synchronize(device)
        ms = C.bench_ms(step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                        cpu_warmup=args.cpu_warmup, cpu_reps=args.cpu_reps)
    res["ms"] = ms
    res["tflops"] = model_flops(args) / (ms * 1e-3) / 1e12
    res.update(C.compile_stats())
    if recipe_name.endswith("+policy"):  # which GEMMs the policy kept in the recipe's format
        import transformer_engine_proto as te

        print(f"{recipe_name} ({mode}):\n{te.precision_report(model)}", flush=True)
    fwd = model = params = opt = x = dy = None  # free the GPU memory `step` holds (not `del`: its closure reads them)
    return res


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--recipes", default=",".join(DEFAULT_RECIPES), help=f"comma-separated subset of {ALL_RECIPES}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated: eager,default,reduce-overhead")
    C.add_model_args(p, layers=4, hidden=1024, ffn=4096, heads=16, seq=2048, batch=1)
    p.add_argument("--optimizer", choices=["none", "sgd", "adamw"], default="none",
                   help="optimizer step inside the timed step (eager, foreach)")
    p.add_argument("--compile-scope", choices=["model", "layer"], default="model",
                   help="torch.compile the whole stack (default) or each layer")
    p.add_argument("--autocast-once", action="store_true",
                   help="enter te.autocast once around the measurement instead of every step")
    C.add_run_args(p, "bench_transformer", warmup_ms=100.0, rep_ms=500.0)
    p.add_argument("--smoke", action="store_true",
                   help="2 tiny layers (hidden 128, 128 tokens), eager + compile default, 2 reps (CPU check)")
    args = p.parse_args(argv)
    if args.smoke:
        args.layers, args.hidden, args.ffn, args.heads, args.seq, args.batch = 2, 128, 256, 2, 128, 1
        args.modes = "eager,default"
        args.cpu_warmup, args.cpu_reps = 1, 2
        args.warmup_ms, args.rep_ms = 5.0, 20.0

    recipes = C.names(args.recipes)
    modes = C.names(args.modes)
    for r in recipes:
        if r.removesuffix("+policy") not in ALL_RECIPES:
            p.error(f"unknown recipe {r!r}")
    for m in modes:
        if m not in ("eager", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
            p.error(f"unknown mode {m!r}")

    device = C.device_from_arg(args.device)
    dtype = torch.bfloat16
    C.configure_dynamo()
    env = C.environment(device)
    notes = []
    if device.type != "cuda" and "reduce-overhead" in modes:
        notes.append("reduce-overhead on CPU: CUDA graphs do not apply (expect cudagraph skips)")
    print(f"bench_transformer: {env.get('gpu', device)}, torch {env['torch']}, triton {env['triton']}; "
          f"{args.layers} x TransformerLayer(hidden {args.hidden}, ffn {args.ffn}, heads {args.heads}), "
          f"{args.batch}x{args.seq} tokens bshd, bf16 params, optimizer {args.optimizer}, "
          f"compile scope {args.compile_scope}, autocast {'once' if args.autocast_once else 'per step'}")
    sys.stdout.flush()

    budget = C.Budget(args.max_minutes)
    results = []
    for recipe_name in recipes:
        for mode in modes:
            label = f"{recipe_name} {mode}"
            res = C.measure({"recipe": recipe_name, "mode": mode}, label,
                            functools.partial(run_variant, recipe_name, mode, args, device, dtype), budget, device)
            results.append(res)
            status = res.get("error") or (f"{res['ms']:.3f} ms/step, first step {res['first_step_s']:.1f}s, "
                                          f"graph breaks {res['graph_breaks']}, "
                                          f"cudagraph skips {res['cudagraph_skips']}")
            print(f"  {label}: {status}", flush=True)

    by = {(r["recipe"], r["mode"]): r for r in results}

    def ms_of(recipe_name, mode):
        r = by.get((recipe_name, mode))
        return r.get("ms") if r else None

    for r in results:
        if "ms" in r:
            eager = ms_of(r["recipe"], "eager")
            base = ms_of("none", r["mode"])
            r["speedup_vs_eager"] = eager / r["ms"] if eager else None
            r["speedup_vs_bf16_same_mode"] = base / r["ms"] if base else None

    def x_(v):
        return "-" if v is None else f"{v:.2f}x"

    headers = ["recipe", "mode", "ms/step", "model TFLOP/s", "vs eager", "vs none (same mode)", "first step s",
               "graph breaks", "cudagraph skips", "graphs"]
    rows = []
    for r in results:
        if "ms" in r:
            rows.append([r["recipe"], r["mode"], f"{r['ms']:.3f}", f"{r['tflops']:.3g}", x_(r["speedup_vs_eager"]),
                         x_(r["speedup_vs_bf16_same_mode"]), f"{r['first_step_s']:.1f}", r["graph_breaks"],
                         r["cudagraph_skips"], r["unique_graphs"]])
        else:
            rows.append([r["recipe"], r["mode"], r["error"], "", "", "", "", r.get("graph_breaks", ""),
                         r.get("cudagraph_skips", ""), r.get("unique_graphs", "")])
    detail = C.markdown_table(headers, rows)

    # summary (printed last): ms per mode, and compiled modes' speedup over eager, per recipe
    compiled = [m for m in modes if m != "eager"]
    sheaders = ["recipe"] + [f"{m} ms" for m in modes]
    if "eager" in modes:
        sheaders += [f"{m} vs eager" for m in compiled]
    sheaders += ["graph breaks", "cudagraph skips"]
    srows = []
    for recipe_name in recipes:
        row = [recipe_name]
        for m in modes:
            r = by.get((recipe_name, m), {})
            row.append(f"{r['ms']:.3f}" if "ms" in r else ("skipped" if r.get("error", "").startswith("skipped")
                                                           else "error"))
        if "eager" in modes:
            for m in compiled:
                row.append(x_(by.get((recipe_name, m), {}).get("speedup_vs_eager")))
        row.append(" / ".join(f"{m}:{by.get((recipe_name, m), {}).get('graph_breaks', '?')}" for m in compiled) or "-")
        row.append(" / ".join(f"{m}:{by.get((recipe_name, m), {}).get('cudagraph_skips', '?')}" for m in compiled)
                   or "-")
        srows.append(row)
    summary = C.markdown_table(sheaders, srows)

    if args.out:
        C.write_json(args.out, args.name, {"benchmark": "transformer_train_step", "env": env, "args": vars(args),
                                           "model_flops_per_step": model_flops(args), "notes": notes,
                                           "results": results})
        plt = C.try_pyplot()
        if plt is not None:
            _plot(plt, results, recipes, modes, args)

    print()
    for n in notes:
        print(f"NOTE: {n}")
    print("\ngraph breaks / cudagraph skips per variant:")
    for r in results:
        gb = f" {r['graph_break_reasons']}" if r.get("graph_break_reasons") else ""
        cs = f" {r['cudagraph_skip_reasons']}" if r.get("cudagraph_skip_reasons") else ""
        print(f"  {r['recipe']:>9s} {r['mode']:<16s} graph breaks {r.get('graph_breaks', '?')}{gb}; "
              f"cudagraph skips {r.get('cudagraph_skips', '?')}{cs}")
    print(f"\n## TransformerLayer x{args.layers} training step, all numbers\n")
    print(detail)
    print(f"\n## ms/step per recipe and mode, {env.get('gpu', device)}\n")
    print(summary)
    return 0


def _plot(plt, results, recipes, modes, args):
    by = {(r["recipe"], r["mode"]): r for r in results}
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(recipes)), 4.5))
    C.grouped_bars(ax, recipes, modes, lambda m, rn: by.get((rn, m), {}).get("ms", 0.0))
    ax.set_ylabel("ms / training step (lower is better)")
    ax.set_title(f"{args.layers} x TransformerLayer({args.hidden}, {args.ffn}, {args.heads}), "
                 f"{args.batch}x{args.seq} tokens")
    ax.legend(fontsize=8)
    C.save_figure(fig, args.out, args.name)


if __name__ == "__main__":
    sys.exit(main())
