"""MoE expert GEMM fwd+bwd: te.GroupedLinear vs a loop of per-expert te.Linear vs bf16 grouped GEMM vs a bf16 loop.

    python benchmarks/bench_grouped.py --out out/        # 8 experts, hidden 4096, ffn 14336, 16k tokens (CUDA)
    python benchmarks/bench_grouped.py --smoke           # tiny, CPU-friendly check

One expert layer (hidden -> ffn, like an MoE fc1) over `--tokens` tokens grouped by expert with
uneven splits (a fixed seed; multiples of 128, so every recipe can take them). Variants:
`bf16:loop` (F.linear per expert), `bf16:grouped_mm` (`torch._grouped_mm` over the offsets),
`te:<recipe>` (`te.GroupedLinear`) and `te-loop:<recipe>` (one `te.Linear` per expert). Modes:
`eager` (splits as a list, as TE's API) and `default` (`torch.compile`; te.GroupedLinear and
the grouped GEMM get the splits as a tensor, read into the graph as unbacked SymInts, so
`torch._dynamo.config.capture_scalar_outputs` is set). A step is forward, backward with a fixed
output grad, grads set to None. Every variant runs in this process; ms is the median step.
"""
from __future__ import annotations

import os
import random
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DEFAULT_VARIANTS = ["bf16:loop", "bf16:grouped_mm", "te:current", "te-loop:current", "te:delayed", "te-loop:delayed",
                    "te:blockwise", "te:mxfp8"]
DEFAULT_MODES = ["eager", "default"]


def make_splits(experts: int, tokens: int, align: int, seed: int = 0):
    """Uneven split sizes (multiples of `align`) summing to `tokens`."""
    rng = random.Random(seed)
    units = tokens // align
    cuts = sorted(rng.randint(0, units) for _ in range(experts - 1))
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [units])]
    return [s * align for s in sizes]


class _BF16Experts(torch.nn.Module):
    def __init__(self, experts, hidden, ffn, device, dtype, grouped: bool):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, ffn, hidden, device=device, dtype=dtype) * hidden ** -0.5)
        self.grouped = grouped

    def forward(self, x, splits):
        if self.grouped:
            offs = splits.to(torch.int32).cumsum(0, dtype=torch.int32)
            return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=offs)
        return torch.cat([F.linear(p, w) for p, w in zip(torch.split(x, splits), self.weight)])


class _TELoop(torch.nn.Module):
    def __init__(self, experts, hidden, ffn, device, dtype):
        super().__init__()
        import transformer_engine_proto as te

        self.experts = torch.nn.ModuleList(te.Linear(hidden, ffn, bias=False, params_dtype=dtype, device=device)
                                           for _ in range(experts))

    def forward(self, x, splits):
        return torch.cat([e(p) for e, p in zip(self.experts, torch.split(x, splits))])


def build(variant: str, args, device, dtype):
    """(module, recipe or None, whether it takes the splits as a tensor under compile)."""
    kind, _, name = variant.partition(":")
    torch.manual_seed(0)
    if kind == "bf16":
        grouped = name == "grouped_mm"
        return _BF16Experts(args.experts, args.hidden, args.ffn, device, dtype, grouped), None, grouped
    recipe = C.make_recipe(name)
    if kind == "te":
        import transformer_engine_proto as te

        return te.GroupedLinear(args.experts, args.hidden, args.ffn, bias=False, params_dtype=dtype,
                                device=device), recipe, True
    if kind == "te-loop":
        return _TELoop(args.experts, args.hidden, args.ffn, device, dtype), recipe, False
    raise ValueError(f"unknown variant {variant!r}")


def run_variant(variant: str, mode: str, args, device, dtype) -> dict:
    import transformer_engine_proto as te

    C.reset_compile_state(device)
    model, recipe, tensor_splits = build(variant, args, device, dtype)
    splits = make_splits(args.experts, args.tokens, 128 if not args.smoke else 32)
    if variant == "bf16:grouped_mm" or (mode != "eager" and tensor_splits):
        splits_arg = torch.tensor(splits, device=device)
    else:
        splits_arg = splits
    fn = model
    if mode != "eager":
        torch._dynamo.config.capture_scalar_outputs = True
        fn = torch.compile(model, mode=None if mode == "default" else mode)
    x = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(args.tokens, args.ffn, device=device, dtype=dtype)
    ctx = te.autocast(recipe=recipe) if recipe is not None else None

    def step():
        for p in model.parameters():
            p.grad = None
        x.grad = None
        if ctx is None:
            y = fn(x, splits_arg)
        else:
            with te.autocast(recipe=recipe):
                y = fn(x, splits_arg)
        y.backward(dy)

    ms = C.bench_ms(step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, cpu_warmup=args.cpu_warmup,
                    cpu_reps=args.cpu_reps)
    stats = C.compile_stats()
    flops = 3 * 2 * args.tokens * args.hidden * args.ffn
    return dict(variant=variant, mode=mode, ms=ms, tflops=flops / ms / 1e9, graph_breaks=stats["graph_breaks"],
                unique_graphs=stats["unique_graphs"])


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--modes", default=",".join(DEFAULT_MODES))
    C.add_model_args(p, experts=8, hidden=4096, ffn=14336, tokens=16384)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the wiring)")
    C.add_run_args(p, "bench_grouped", warmup_ms=100.0, rep_ms=500.0)
    args = p.parse_args(argv)
    device = C.device_from_arg(args.device)
    if args.smoke:
        args.experts, args.hidden, args.ffn, args.tokens = 4, 64, 128, 256
    dtype = torch.bfloat16
    C.configure_dynamo()
    variants = C.names(args.variants)
    modes = C.names(args.modes)
    results = C.measure_grid(modes, variants, lambda v, mode: run_variant(v, mode, args, device, dtype),
                             C.Budget(args.max_minutes), lambda r: f"{r['ms']:9.3f} ms")
    base = {r["mode"]: r["ms"] for r in results if r["variant"] == "bf16:loop" and "ms" in r}
    rows = []
    for r in results:
        if "ms" in r:
            ratio = f"{base[r['mode']] / r['ms']:.2f}x" if r["mode"] in base else "-"
            rows.append([r["mode"], r["variant"], f"{r['ms']:.3f}", ratio, f"{r['tflops']:.1f}", r["graph_breaks"],
                         r["unique_graphs"]])
        else:
            rows.append([r["mode"], r["variant"], r["error"], "-", "-", "-", "-"])
    print(f"\n## Expert GEMM fwd+bwd ({args.experts} experts, {args.hidden} -> {args.ffn}, {args.tokens} tokens, "
          f"{dtype}, {device})\n")
    print(C.markdown_table(["mode", "variant", "ms", "speed vs bf16 loop", "TFLOP/s", "graph breaks", "graphs"], rows))
    if args.out:
        C.write_json(args.out, args.name, dict(env=C.environment(device), args=vars(args), results=results))
    return results


if __name__ == "__main__":
    main()
