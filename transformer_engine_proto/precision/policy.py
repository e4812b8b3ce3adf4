"""`GemmPolicy`: run each GEMM of a Linear in the recipe's format only where that is predicted faster.

Opt in with `te.autocast(recipe=..., gemm_policy=te.GemmPolicy())`. For every Linear call the
policy predicts, from the call's shapes (tokens m, out n, in k), the time of each of the eight
fprop / dgrad / wgrad precision choices: the GEMMs' times in bf16 or in the recipe's format plus
the quantizes that choice needs (the input once with the usages its GEMMs read, the weight for
fprop and again for dgrad, the gradient once), and keeps the fastest; the recipe's format must win
by `margin` over all-bf16. A GEMM in high precision runs the bf16 path's own GEMM.

The choice is a trace-time constant (`key_with_policy_precision` is dynamo's `assume_constant_result`): no graph
break, no recompile, CUDA-graph safe; it depends on shapes, the recipe, the cost table and the
pins only, so eager and compiled runs, and two processes reading one table, choose alike. Pins
(`pin_gemm_precision`) are never overridden; the debug features may disable more GEMMs.

The cost table: the user's cache for this device / torch / triton (measured points), over the
table shipped for the device (H100: a measured grid), and, where neither predicts a point,
a measurement on first use (cached). In a multi-process run nothing is measured (each rank would
time its own GPU and could choose differently): an unpredicted point is an error naming the fix.
"""
from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from ..custom_ops.recipe_key import RecipeKey
from ..tensor.recipe_quantizers import GEMMS
from . import calibrate
from .cost_model import BF16, CostTable, cache_path, gemm_shapes, shipped_table_path

__all__ = ["GemmPolicy", "Decision", "key_with_policy_precision", "policy_key", "policy_from_key", "decisions",
           "pins_key", "with_default_pins", "HIGH", "RECIPE", "cost_table"]

HIGH, RECIPE = "high_precision", "recipe"  # pinned values
_PIN_NAMES = {"bf16": HIGH, "high_precision": HIGH, "high": HIGH, "fp8": RECIPE, "recipe": RECIPE,
              "quantized": RECIPE}


@dataclass(frozen=True)
class GemmPolicy:
    """Choose each GEMM's precision by predicted time.

    table: a cost-table JSON to use instead of this device's (e.g. the shipped H100 table, to
      predict as on an H100 from any machine); None: the user's cache over the shipped table.
    calibrate: measure, on first use, what the table cannot predict (and cache it).
    margin: how much faster the recipe's format must be predicted than bf16 to be chosen."""

    table: Optional[str] = None
    calibrate: bool = True
    margin: float = 0.02

    def __post_init__(self):
        if not 0 <= self.margin < 1:
            raise ValueError(f"GemmPolicy: margin={self.margin!r}, expected 0 <= margin < 1")
        if self.table is not None and not os.path.exists(self.table):
            raise FileNotFoundError(f"GemmPolicy: cost table {self.table!r} does not exist")


@dataclass(frozen=True)
class Decision:
    """One Linear shape's choice: GEMMs run in high precision and the predicted ms."""

    format_name: str
    shape: Tuple[int, int, int]  # tokens, out, in
    high_precision: frozenset
    pinned: Dict[str, str] = field(hash=False, compare=False)
    predicted_ms: float = 0.0  # the choice: GEMMs and quantizes
    bf16_ms: float = 0.0  # every GEMM in bf16
    recipe_ms: float = 0.0  # every (unpinned) GEMM in the recipe's format
    gemm_ms: Dict[str, Tuple[float, float]] = field(default_factory=dict, hash=False, compare=False)  # bf16, fmt


# ---- registries: what compiled code sees are strings ----------------------------------------
_POLICIES: Dict[str, GemmPolicy] = {}
_DECISIONS: Dict[int, Decision] = {}  # QuantizedGemm uid -> its latest decision (the report's source)


def policy_key(policy: Optional[GemmPolicy]) -> str:
    if policy is None:
        return ""
    if not isinstance(policy, GemmPolicy):
        raise TypeError(f"gemm_policy must be a transformer_engine_proto.GemmPolicy or None, got "
                        f"{type(policy).__name__}")
    key = repr(policy)
    _POLICIES[key] = policy
    return key


def policy_from_key(key: str) -> Optional[GemmPolicy]:
    return _POLICIES.get(key) if key else None


def pins_key(pins: Dict[str, str]) -> str:
    """A pin dict as the string `key_with_policy_precision` takes ("dgrad=high_precision,..."), validated."""
    out = []
    for gemm, value in pins.items():
        if gemm not in GEMMS:
            raise ValueError(f"pin_gemm_precision: unknown GEMM {gemm!r}, expected one of {GEMMS}")
        if value not in _PIN_NAMES:
            raise ValueError(f"pin_gemm_precision: {gemm}={value!r}, expected one of {sorted(_PIN_NAMES)} or None")
        out.append(f"{gemm}={_PIN_NAMES[value]}")
    return ",".join(sorted(out))


def _parse_pins(pins: str) -> Dict[str, str]:
    """A `pins_key` string back to {gemm: HIGH | RECIPE}."""
    return dict(p.split("=") for p in pins.split(",")) if pins else {}


def with_default_pins(pins: str, **defaults: str) -> str:
    """`pins` (a `pins_key` string) plus `defaults` (gemm=HIGH|RECIPE) for the GEMMs it leaves free."""
    have = _parse_pins(pins)
    for gemm, value in defaults.items():
        have.setdefault(gemm, value)
    return ",".join(f"{g}={v}" for g, v in sorted(have.items()))


def decisions() -> Dict[int, Decision]:
    return _DECISIONS


# ---- the cost table -------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def cost_table(table: Optional[str], device: str) -> CostTable:
    """The policy's table for a device name: an explicit file, else the user's cache over the
    shipped table (one object per process: measurements are added to it)."""
    if table is not None:
        return CostTable.load(table)
    merged = CostTable(device)
    cached = cache_path(device)
    if os.path.exists(cached):
        merged.merge(CostTable.load(cached))
    shipped = shipped_table_path(device)
    if shipped is not None:
        merged.merge(CostTable.load(shipped))
    return merged


def _multi_process() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


class _Costs:
    """Predictions for one (recipe, device), measuring on first use what the table lacks."""

    def __init__(self, policy: GemmPolicy, recipe, device: torch.device):
        self.policy, self.recipe, self.device = policy, recipe, device
        self.format_name = calibrate.format_name_of(recipe)
        self.name = calibrate.device_name(device)
        self.table = cost_table(policy.table, self.name)
        self.measured = False

    def _missing(self, what: str):
        if not self.policy.calibrate:
            why = "GemmPolicy(calibrate=False)"
        elif _multi_process():
            why = "a multi-process run (ranks would measure different GPUs)"
        else:
            return
        raise RuntimeError(
            f"GemmPolicy: the cost table for {self.name!r} cannot predict {what} and {why} does "
            f"not measure it: measure in one process first (e.g. a single-process step with the same shapes, "
            f"cached in {cache_path(self.name)}), or pass GemmPolicy(table=...)")

    def gemm(self, format_name: str, gemm: str, mnk) -> float:
        ms = self.table.gemm_ms(format_name, gemm, *mnk)
        if ms is None:
            self._missing(f"the {format_name} {gemm} GEMM {mnk}")
            ms = calibrate.measure_gemm(None if format_name == BF16 else self.recipe, gemm, *mnk, self.device)
            self.table.add_gemm(format_name, gemm, *mnk, ms)
            self.measured = True
        return ms

    def quantize(self, role: str, rows: int, cols: int, rowwise: bool, columnwise: bool) -> float:
        if not (rowwise or columnwise):
            return 0.0
        ms = self.table.quantize_ms(self.format_name, role, rows * cols, rowwise, columnwise)
        if ms is None:
            self._missing(f"the {self.format_name} quantize of a {role} ({rows}, {cols})")
            ms = calibrate.measure_quantize(self.recipe, role, rows, cols, rowwise, columnwise, self.device)
            self.table.add_quantize(self.format_name, role, rows * cols, rowwise, columnwise, ms)
            self.measured = True
        return ms

    def save(self) -> None:
        if self.measured and self.policy.table is None:
            self.table.save(cache_path(self.name))


def _predict(costs: _Costs, m: int, n: int, k: int, q: Dict[str, bool], needed) -> Tuple[float, dict]:
    """Predicted ms of one forward + backward with GEMM g in the recipe's format where q[g]."""
    shapes = gemm_shapes(m, n, k)
    per_gemm = {g: costs.gemm(costs.format_name if q[g] else BF16, g, shapes[g]) for g in needed}
    total = sum(per_gemm.values())
    total += costs.quantize("input", m, k, q["fprop"], q["wgrad"] and "wgrad" in needed)
    total += costs.quantize("weight", n, k, q["fprop"], False)
    if "dgrad" in needed:  # backward quantizes the weight again, columnwise
        total += costs.quantize("weight", n, k, False, q["dgrad"])
    total += costs.quantize("grad", m, n, q["dgrad"] and "dgrad" in needed, q["wgrad"] and "wgrad" in needed)
    return total, per_gemm


def decide(policy: Optional[GemmPolicy], recipe, device, m: int, n: int, k: int, training: bool,
           pins: Dict[str, str]) -> Decision:
    """The choice for one Linear shape (see the module docstring). `training` (grad mode on):
    all three GEMMs count, else fprop only. Which tensors require grad does not enter: a fused
    norm + quantize asks before its output (the GEMM's input) exists, and must get the same answer."""
    needed = GEMMS if training else ("fprop",)
    format_name = calibrate.format_name_of(recipe)
    if policy is None:  # pins only
        hp = frozenset(g for g, v in pins.items() if v == HIGH)
        return Decision(format_name, (m, n, k), hp, dict(pins))
    costs = _Costs(policy, recipe, device)
    choices = []
    for bits in itertools.product((False, True), repeat=len(needed)):
        q = dict(zip(needed, bits))
        if any((pins.get(g) == HIGH and q[g]) or (pins.get(g) == RECIPE and not q[g]) for g in needed):
            continue
        q.update({g: False for g in GEMMS if g not in needed})
        total, _ = _predict(costs, m, n, k, q, needed)
        choices.append((total * (1 + policy.margin) if any(bits) else total, total, q))
    _, predicted, q = min(choices, key=lambda c: c[0])
    all_bf16 = {g: pins.get(g) == RECIPE for g in GEMMS}
    all_recipe = {g: pins.get(g) != HIGH for g in GEMMS}
    bf16_ms, _ = _predict(costs, m, n, k, all_bf16, needed)
    recipe_ms, _ = _predict(costs, m, n, k, all_recipe, needed)
    per_fmt = {g: costs.gemm(costs.format_name, g, gemm_shapes(m, n, k)[g]) for g in needed}
    costs.save()
    hp = frozenset(g for g in GEMMS if not q[g])
    return Decision(format_name, (m, n, k), hp, dict(pins), predicted, bf16_ms, recipe_ms,
                    {g: (costs.gemm(BF16, g, gemm_shapes(m, n, k)[g]), per_fmt[g]) for g in needed})


@functools.lru_cache(maxsize=4096)
def _cached_decision(policy: str, key: str, device: str, m: int, n: int, k: int, training: bool,
                     pins: str) -> Decision:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # measuring runs real kernels, also while dynamo traces
        return decide(policy_from_key(policy), RecipeKey.recipe(key), torch.device(device), m, n, k, training,
                      _parse_pins(pins))


@torch._dynamo.assume_constant_result
def key_with_policy_precision(key: str, policy: str, pins: str, uid: int, device: str, m: int, n: int, k: int,
           training: bool) -> str:
    """The Linear op's recipe key with the GEMMs this call keeps in high precision (a trace-time
    constant). Records the decision under the GEMM's `uid` for `precision_report`."""
    if RecipeKey.base(key) == RecipeKey.HIGH_PRECISION:
        return key
    decision = _cached_decision(policy, key, device, m, n, k, training, pins)
    _DECISIONS[uid] = decision
    return RecipeKey.with_high_precision_gemms(key, decision.high_precision)
