"""Per-GEMM precision for users: pins (`pin_gemm_precision`) and the policy's report."""
from __future__ import annotations

from typing import Optional

import torch

from ..precision import calibrate
from ..precision.cost_model import BF16, gemm_shapes
from ..precision.policy import decisions, pins_key
from ..tensor.recipe_quantizers import GEMMS
from .quantized_gemm import QuantizedGemm

__all__ = ["pin_gemm_precision", "precision_report"]


def pin_gemm_precision(module: torch.nn.Module, *, fprop: Optional[str] = None, dgrad: Optional[str] = None,
                       wgrad: Optional[str] = None) -> int:
    """Fix the precision of GEMMs in every quantized GEMM of `module` (a layer or a whole model):
    "bf16" (high precision) or "fp8" (the recipe's format, whatever its format); None leaves
    that GEMM to the GemmPolicy (or the recipe). The policy never overrides a pin; without a
    policy, a "bf16" pin is TE's DisableFp8Gemm as a module setting. Returns the GEMMs changed."""
    pins = {g: v for g, v in (("fprop", fprop), ("dgrad", dgrad), ("wgrad", wgrad)) if v is not None}
    key = pins_key(pins)
    n = 0
    for m in module.modules():
        if isinstance(m, QuantizedGemm):
            m.pinned_precision = key
            n += 1
    if n == 0:
        raise ValueError(f"pin_gemm_precision: {type(module).__name__} holds no quantized GEMM (a te.Linear, "
                         "LayerNormLinear, LayerNormMLP, ... or a model containing them)")
    return n


def _measure(decision, device):
    """{gemm: (bf16 ms, recipe ms)} measured now for the decision's GEMM shapes."""
    recipe = _recipe_of(decision.format_name)
    shapes = gemm_shapes(*decision.shape)
    out = {}
    for g in decision.gemm_ms:
        out[g] = (calibrate.measure_gemm(None, g, *shapes[g], device),
                  calibrate.measure_gemm(recipe, g, *shapes[g], device))
    return out


def _recipe_of(format_name: str):
    """The recipe class a cost-table format_name names, with TE's defaults (the GEMM speed of a format
    does not depend on the recipe's scaling options)."""
    from .. import recipe as R

    cls = getattr(R, format_name, None)
    if cls is None:
        raise ValueError(f"precision_report(measure=True): cannot rebuild recipe {format_name!r} to measure it")
    return cls()


def precision_report(model: torch.nn.Module, measure: bool = False) -> str:
    """A table of each quantized GEMM the model ran under a GemmPolicy or pins: its shape (tokens x
    out x in), each GEMM's precision (`*` pinned), and the predicted ms of one forward + backward
    for the choice, all-bf16 and all in the recipe's format (GEMMs plus quantizes). With
    `measure=True`, each GEMM's bf16 and recipe-format time is also measured now (on the model's
    device), next to the prediction. Run the model once first: choices are made per call shape."""
    made = decisions()
    rows = []
    header = "| layer | tokens x out x in | fprop | dgrad | wgrad | predicted ms | all-bf16 ms | all-recipe ms |"
    if measure:
        header += " GEMM ms predicted -> measured (bf16 / recipe) |"
    rows.append(header)
    rows.append("|" + "---|" * (header.count("|") - 1))
    total = [0.0, 0.0, 0.0]
    for name, m in model.named_modules():
        if not isinstance(m, QuantizedGemm) or m._debug_uid not in made:
            continue
        d = made[m._debug_uid]
        cells = []
        for g in GEMMS:
            where = BF16 if g in d.high_precision else d.format_name
            cells.append(where + ("*" if g in d.pinned else ""))
        row = (f"| {name or type(model).__name__} | {' x '.join(map(str, d.shape))} | {' | '.join(cells)} | "
               f"{d.predicted_ms:.3f} | {d.bf16_ms:.3f} | {d.recipe_ms:.3f} |")
        total = [t + v for t, v in zip(total, (d.predicted_ms, d.bf16_ms, d.recipe_ms))]
        if measure:
            device = next(m.buffers()).device
            got = _measure(d, device)
            row += " " + "; ".join(f"{g} {d.gemm_ms[g][0]:.3f}/{d.gemm_ms[g][1]:.3f} -> {got[g][0]:.3f}/{got[g][1]:.3f}"
                                   for g in d.gemm_ms) + " |"
        rows.append(row)
    if len(rows) == 2:
        return ("precision_report: no GEMM has run under a GemmPolicy or pins yet (run a step inside "
                "te.autocast(recipe=..., gemm_policy=te.GemmPolicy()) first)")
    rows.append(f"| total | | | | | {total[0]:.3f} | {total[1]:.3f} | {total[2]:.3f} |")
    return "\n".join(rows)
