"""An MLP block's fwd+bwd: `te.ops.Sequential(LayerNorm, Linear, SwiGLU, Linear)` vs `te.LayerNormMLP`
vs the same block in plain torch bf16, per recipe, compiled (and eager).

    python benchmarks/bench_mlp.py                                   # hidden 4096, ffn 11008, 8192 tokens
    python benchmarks/bench_mlp.py --recipes current,delayed --modes default,eager --out out/
    python benchmarks/bench_mlp.py --smoke                           # tiny, CPU check of the wiring

The three blocks compute the same function at the same shapes (LayerNorm, fc1 to 2 x ffn, SwiGLU
gating the first half, fc2 back to hidden). The step is `y = block(x)` under `te.autocast`
then `y.backward(dy)`; compiled variants use `torch.compile(fullgraph=True, dynamic=False)` on a
fresh block after `torch._dynamo.reset()`. Ratios are to the bf16 block of the same mode and run.
CUDA times are `triton.testing.do_bench` medians.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class TorchMLP(torch.nn.Module):
    """The block in plain torch: the bf16 baseline."""

    def __init__(self, hidden: int, ffn: int, device, dtype):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden, device=device, dtype=dtype)
        self.fc1 = torch.nn.Linear(hidden, 2 * ffn, device=device, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn, hidden, device=device, dtype=dtype)

    def forward(self, x):
        a, b = self.fc1(self.norm(x)).chunk(2, dim=-1)
        return self.fc2(F.silu(a) * b)


def build(block: str, args, device, dtype):
    import transformer_engine_proto as te

    torch.manual_seed(0)
    if block == "torch":
        return TorchMLP(args.hidden, args.ffn, device, dtype)
    if block == "te.ops":
        return te.ops.Sequential(te.ops.LayerNorm(args.hidden, device=device, dtype=dtype),
                                 te.ops.Linear(args.hidden, 2 * args.ffn, device=device, dtype=dtype),
                                 te.ops.SwiGLU(),
                                 te.ops.Linear(args.ffn, args.hidden, device=device, dtype=dtype))
    return te.LayerNormMLP(args.hidden, args.ffn, activation="swiglu", params_dtype=dtype, device=device)


def run(block: str, recipe_name: str, mode: str, args, device, dtype) -> dict:
    C.reset_compile_state(device)
    model = build(block, args, device, dtype)
    recipe = C.make_recipe(recipe_name)
    fwd = model if mode == "eager" else torch.compile(model, fullgraph=True, dynamic=False)
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)

    def step():
        with C.te_autocast(recipe, recipe_name):
            y = fwd(x)
        y.backward(dy)

    step()
    C.synchronize(device)
    res = dict(block=block, recipe=recipe_name, mode=mode)
    res["ms"] = C.bench_ms(step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, cpu_warmup=args.cpu_warmup,
                           cpu_reps=args.cpu_reps)
    res.update(C.compile_stats())
    return res


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--recipes", default="current,delayed")
    p.add_argument("--modes", default="default")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the wiring)")
    C.add_model_args(p, hidden=4096, ffn=11008, tokens=8192)
    C.add_run_args(p, "bench_mlp", warmup_ms=100.0, rep_ms=500.0)
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.ffn, args.tokens = 64, 96, 32
    device = C.device_from_arg(args.device)
    dtype = torch.bfloat16
    C.configure_dynamo()
    budget = C.Budget(args.max_minutes)
    results = []
    for mode in C.names(args.modes):
        cases = [("torch", "bf16")] + [(b, r) for r in C.names(args.recipes) for b in ("te.ops", "LayerNormMLP")]
        for block, recipe in cases:
            r = C.measure(dict(block=block, recipe=recipe, mode=mode), f"{block} {recipe} {mode}",
                          lambda b=block, r=recipe, m=mode: run(b, r, m, args, device, dtype), budget, device)
            results.append(r)
            print(f"{mode:10s} {block:13s} {recipe:10s} " + (f"{r['ms']:.3f} ms" if "ms" in r else r["error"]),
                  flush=True)
    rows = []
    for r in results:
        base = next((b["ms"] for b in results if b["block"] == "torch" and b["mode"] == r["mode"] and "ms" in b), None)
        ops_ms = next((o["ms"] for o in results if o["block"] == "te.ops" and o["recipe"] == r["recipe"]
                       and o["mode"] == r["mode"] and "ms" in o), None)
        if "ms" not in r:
            rows.append([r["mode"], r["block"], r["recipe"], r["error"], "-", "-", "-"])
            continue
        rows.append([r["mode"], r["block"], r["recipe"], f"{r['ms']:.3f}",
                     f"{base / r['ms']:.2f}x" if base else "-",
                     f"{r['ms'] / ops_ms:.3f}" if ops_ms and r["block"] == "LayerNormMLP" else "-",
                     r.get("graph_breaks", "-")])
    print(f"\n## MLP block fwd+bwd (hidden {args.hidden}, ffn {args.ffn}, {args.tokens} tokens, {device})\n")
    print(C.markdown_table(["mode", "block", "recipe", "ms", "speed vs bf16 torch", "LayerNormMLP / te.ops",
                            "graph breaks"], rows))
    if args.out:
        C.write_json(args.out, args.name, dict(env=C.environment(device), args=vars(args), results=results))
    return results


if __name__ == "__main__":
    main()
