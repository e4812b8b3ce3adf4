"""Which GEMM costs a recipe its loss? Each GEMM module of a trained model, alone in the recipe.

A recipe's loss gap in training is the sum of many small per-GEMM errors; this finds the ones that
matter. On a model trained in high precision and fixed validation batches it evaluates the loss
with no module quantized (the baseline), with all of them, with all but the output head, and with
each module alone under the recipe; next to each it gives the module's relative output error
against high precision on the same input (forward only: the backward's errors act through
training, which `convergence.py` measures).

    python benchmarks/convergence.py --recipes bf16 --gemm-sensitivity current,delayed --out out/
"""
from __future__ import annotations

import contextlib
import statistics

import torch

import transformer_engine_proto as te

GEMM_MODULES = (te.Linear, te.LayerNormLinear, te.LayerNormMLP)


@contextlib.contextmanager
def quantized(modules, recipe):
    """Run exactly `modules` under `te.autocast(recipe)`, everything else in high precision."""
    for m in modules:
        def forward(*args, _forward=m.forward, **kwargs):
            with te.autocast(recipe=recipe):
                return _forward(*args, **kwargs)
        m.forward = forward
    try:
        yield
    finally:
        for m in modules:
            del m.forward  # back to the class's forward


def _outputs(modules):
    """Forward hooks recording each module's first output: {module: tensor}."""
    seen, handles = {}, []

    def record(mod, _args, out) -> None:  # returns None: the module's output is left as it is
        if mod not in seen:
            seen[mod] = (out[0] if isinstance(out, tuple) else out).float()

    for m in modules:
        handles.append(m.register_forward_hook(record))
    return seen, handles


def sensitivity(model: torch.nn.Module, loss_of, recipe, head: torch.nn.Module) -> dict:
    """Loss with each configuration of quantized modules, and each module's output error.

    `loss_of(model)` is the validation loss (no grad); `head` is the output projection."""
    names = {m: n for n, m in model.named_modules() if isinstance(m, GEMM_MODULES)}
    modules = list(names)
    with torch.no_grad():
        base_out, handles = _outputs(modules)
        base = loss_of(model)  # the first batch's outputs stay in base_out
        for h in handles:
            h.remove()

        def loss_with(subset):
            with quantized(subset, recipe):
                return loss_of(model)

        rows = []
        for m in modules:
            out, handles = _outputs([m])
            loss = loss_with([m])
            for h in handles:
                h.remove()
            err = ((out[m] - base_out[m]).norm() / base_out[m].norm()).item()
            rows.append({"module": names[m], "loss": loss, "delta_pct": 100 * (loss - base) / base, "out_rel_err": err})
        all_loss = loss_with(modules)
        no_head = loss_with([m for m in modules if m is not head])
    return {"baseline": base, "all": all_loss, "all_pct": 100 * (all_loss - base) / base,
            "all_but_head": no_head, "all_but_head_pct": 100 * (no_head - base) / base,
            "modules": sorted(rows, key=lambda r: -r["delta_pct"])}


def markdown(result: dict, recipe_name: str, top: int = 8) -> str:
    lines = [f"### {recipe_name}: validation loss with GEMM modules quantized (trained bf16 weights)", "",
             "| quantized | val loss | change |", "|---|--:|--:|",
             f"| none (bf16) | {result['baseline']:.4f} | |",
             f"| all | {result['all']:.4f} | {result['all_pct']:+.2f}% |",
             f"| all but the head | {result['all_but_head']:.4f} | {result['all_but_head_pct']:+.2f}% |"]
    for r in result["modules"][:top]:
        lines.append(f"| only `{r['module']}` (output error {r['out_rel_err']:.3%}) | {r['loss']:.4f} | "
                     f"{r['delta_pct']:+.2f}% |")
    rest = result["modules"][top:]
    if rest:
        lines.append(f"| each of the other {len(rest)}, median | "
                     f"{statistics.median(r['loss'] for r in rest):.4f} | "
                     f"{statistics.median(r['delta_pct'] for r in rest):+.2f}% |")
    return "\n".join(lines)
