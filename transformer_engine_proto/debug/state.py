"""Debug-session state: which GEMMs take the debug path, from TE's routing calls.

* `SESSION.active` is True from `nvdlfw_inspect.api.initialize(..., feature_dirs=[FEATURE_DIR])`
  (our namespace API is built then) until `debug_api.end_debug()`. Modules read it at forward
  start; while it is False they run exactly their normal code.
* At forward start a module names its GEMMs (TE style: the module's `name`, plus `.fc1` / `.fc2`
  when it has several) -- `begin_forward`.
* The routing calls (inspect_tensor_enabled, inspect_tensor_postquantize_enabled,
  modify_tensor_enabled, fp8_gemm_enabled) run in eager Python once per (layer, iteration, recipe
  on/off) and give a `LayerPlan` -- `layer_plan`.
* Whether a layer takes the debug GEMM path is published as one attribute of `ROUTES` per
  (layer, recipe on/off): the layer name, or None for the fast path. Compiled code reads that
  attribute (after a trace-time-only call that computes it) so dynamo guards on it: a changed
  decision recompiles once per distinct value (dynamo keeps every graph it made) and a steady one
  never does. `debug_api.step()` refreshes all published decisions for the new iteration before
  the next compiled call checks its guards.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

__all__ = ["SESSION", "ROUTES", "LayerPlan", "TensorPlan", "TENSOR_GEMMS", "INPUT_TENSORS",
           "OUTPUT_TENSORS", "GEMMS", "MODIFY", "QUANTIZE", "HIGH", "begin_forward", "route",
           "layer_plan", "current_iteration", "te_api", "start", "stop", "on_step", "new_uid",
           "tp_group_of", "TP_GROUPS", "on_session_reset", "debug_manager"]

GEMMS = ("fprop", "dgrad", "wgrad")
# tensor -> (gemm using its rowwise form, gemm using its columnwise form) -- TE's table
TENSOR_GEMMS = {
    "activation": ("fprop", "wgrad"),
    "weight": ("fprop", "dgrad"),
    "gradient": ("dgrad", "wgrad"),
    "output": ("fprop", None),
    "dgrad": ("dgrad", None),
    "wgrad": ("wgrad", None),
}
INPUT_TENSORS = ("activation", "weight", "gradient")
OUTPUT_TENSORS = ("output", "dgrad", "wgrad")
MODIFY, QUANTIZE, HIGH = "modify_tensor()", "FP8 quantization", "High precision"


@dataclass(frozen=True)
class TensorPlan:
    """Routing results for one tensor of a layer: inspect_tensor enabled, and per GEMM the plan
    (MODIFY / QUANTIZE / HIGH) and whether inspect_tensor_postquantize is enabled."""

    inspect: bool
    plans: Tuple[Tuple[str, str], ...]
    postquantize: Tuple[Tuple[str, bool], ...] = ()

    def plan(self, gemm: str) -> str:
        return dict(self.plans).get(gemm, HIGH)

    def post(self, gemm: str) -> bool:
        return dict(self.postquantize).get(gemm, False)


@dataclass(frozen=True)
class LayerPlan:
    name: str
    iteration: int
    recipe_on: bool
    tensors: Tuple[Tuple[str, TensorPlan], ...]
    # the first iteration at which a routing call may answer differently (TE's rule: a bare bool
    # answer asks again next iteration, `(b, n)` at n, `(b, None)` never); None: never again
    next_ask: Optional[int] = None

    def tensor(self, name: str) -> TensorPlan:
        return dict(self.tensors)[name]

    @property
    def active(self) -> bool:
        """TE's rule: any routing call asked for something, or some GEMM leaves the recipe."""
        for name, tp in self.tensors:
            if tp.inspect or any(p for _, p in tp.postquantize) or any(p == MODIFY for _, p in tp.plans):
                return True
            if self.recipe_on and name in INPUT_TENSORS and any(p == HIGH for _, p in tp.plans):
                return True
        return False

    @staticmethod
    def default(name: str, recipe_on: bool, iteration: int = 0, next_ask: Optional[int] = None) -> "LayerPlan":
        plan = QUANTIZE if recipe_on else HIGH
        tensors = tuple((t, TensorPlan(False, tuple((g, plan if t in INPUT_TENSORS else HIGH)
                                                     for g in TENSOR_GEMMS[t] if g is not None)))
                        for t in INPUT_TENSORS + OUTPUT_TENSORS)
        return LayerPlan(name, iteration, recipe_on, tensors, next_ask)


class _Routes:
    """Published decisions: attribute `slot` -> layer name (debug path) or None (fast path)."""

    none = None


ROUTES = _Routes()
_SLOTS: Dict[Tuple[str, bool], str] = {}  # (layer, recipe on) -> attribute of ROUTES (kept across sessions)


class _Session:
    def __init__(self):
        self.active = False
        self.reset()

    def reset(self):
        self.owners: Dict[int, str] = {}  # GEMM uid -> layer name (from its module, at forward start)
        self.plans: Dict[Tuple[str, bool], LayerPlan] = {}
        self.logged = set()
        self.config_checked = False


SESSION = _Session()
_uids = itertools.count()


def new_uid() -> int:
    """A GEMM's identity in the name registry (an int constant under torch.compile)."""
    return next(_uids)


# ---- nvdlfw_inspect access ----------------------------------------------------------------------
def debug_manager():
    import nvdlfw_inspect.api as debug_api

    return debug_api.DEBUG_MANAGER


def current_iteration() -> int:
    m = debug_manager()
    return 0 if m is None else int(m._trainer_iteration_count)


def te_api():
    import nvdlfw_inspect.api as debug_api

    return debug_api.transformer_engine


def log_message(msg: str, layer_name: Optional[str] = None) -> None:
    """Log once per (layer, message) to the main nvdlfw_inspect log."""
    import nvdlfw_inspect.api as debug_api

    if debug_api.DEBUG_MANAGER is not None:
        debug_api.log_message(msg, layer_name=layer_name, extra_cachable_args=(msg,))


# ---- session lifecycle (called by the namespace API) -----------------------------------------------
_PENDING = "<decision pending>"  # no graph is ever compiled with this value


def _clear_routes() -> None:
    """A new (or ended) session invalidates every published decision: compiled graphs guarded on
    the old values retrace once, and the trace recomputes the decision for the new config."""
    for slot in _SLOTS.values():
        setattr(ROUTES, slot, _PENDING)


_RESET_HOOKS = []  # called when a session starts or stops (debug_gemm's saved operands)


def on_session_reset(fn) -> None:
    """Call `fn()` whenever a session starts or stops: how modules above this one (debug_gemm)
    drop per-session state without this module importing them."""
    _RESET_HOOKS.append(fn)


def _reset_side_state() -> None:
    from . import stats

    stats.BUFFERS.reset()
    for fn in _RESET_HOOKS:
        fn()


def start() -> None:
    SESSION.reset()
    _clear_routes()
    _reset_side_state()
    SESSION.active = True


def stop() -> None:
    SESSION.active = False
    SESSION.reset()
    _clear_routes()
    _reset_side_state()


def on_step() -> None:
    """After the iteration count advanced: log the stats of the finished step, then re-run the
    routing calls of every known layer for the new iteration and publish the decisions."""
    from . import stats

    stats.BUFFERS.log_all()
    for key in list(SESSION.plans):
        _publish(key[0], key[1], layer_plan(*key))


# ---- forward start: names ----------------------------------------------------------------------
# layer name -> name of the TP group its weights are sharded over (kept across sessions: set at
# trace time, which a new session does not repeat for graphs it does not retrace)
TP_GROUPS: Dict[str, Optional[str]] = {}


@torch._dynamo.assume_constant_result
def _register(uid: int, name: str, tp_group_name: Optional[str]) -> int:
    SESSION.owners[uid] = name
    TP_GROUPS[name] = tp_group_name
    return 0


def _sharded_weight_group(module) -> Optional[str]:
    """The TP group name when `module`'s GEMM weights are TP shards (column / row parallel, or a
    LayerNormMLP with tp_size > 1), else None."""
    if getattr(module, "tp_size", 1) < 2 or getattr(module, "parallel_mode", "column") is None:
        return None
    return getattr(module, "_tp_group_name", None)


def begin_forward(module) -> None:
    """Name `module`'s GEMMs for the debug calls (runs at trace time only under torch.compile)."""
    gemms = [(attr, child) for attr, child in module._modules.items()
             if child is not None and hasattr(child, "_debug_uid")]
    tp = _sharded_weight_group(module)
    for attr, gemm in gemms:
        _register(gemm._debug_uid, module.name if len(gemms) == 1 else f"{module.name}.{attr}", tp)


def tp_group_of(layer: str):
    """The process group `layer`'s weights are TP-sharded over (TE's `tp_group` argument), or None."""
    name = TP_GROUPS.get(layer)
    if name is None:
        return None
    from ..distributed import tp

    return tp.group_by_name(name)


# ---- routing ----------------------------------------------------------------------------------
def _answer(ret, default: bool, iteration: int, asks: list) -> bool:
    """A routing call's bool; appends to `asks` the iteration it wants to be asked again at."""
    if isinstance(ret, tuple):
        if len(ret) > 1 and ret[1] is not None:
            asks.append(int(ret[1]))
        return bool(ret[0]) if ret else default
    if isinstance(ret, dict) and not ret:  # nvdlfw's answer when no feature and no default exist
        return default
    asks.append(iteration + 1)
    return bool(ret)


def _compute_plan(name: str, recipe_on: bool, it: int) -> LayerPlan:
    fp8, asks = {}, []

    def _enabled(ret, default):
        return _answer(ret, default, it, asks)

    def fp8_gemm(g):
        if g not in fp8:
            fp8[g] = _enabled(te_api().fp8_gemm_enabled(layer_name=name, gemm=g, iteration=it), True)
        return fp8[g]

    tensors = []
    for t in INPUT_TENSORS + OUTPUT_TENSORS:
        inspect = _enabled(te_api().inspect_tensor_enabled(layer_name=name, tensor_name=t, iteration=it), False)
        plans, post = [], []
        for g in TENSOR_GEMMS[t]:
            if g is None:
                continue
            if _enabled(te_api().modify_tensor_enabled(layer_name=name, gemm=g, tensor_name=t, iteration=it), False):
                plans.append((g, MODIFY))
            elif t in INPUT_TENSORS and recipe_on and fp8_gemm(g):
                plans.append((g, QUANTIZE))
            else:
                plans.append((g, HIGH))
            if t in INPUT_TENSORS:
                post.append((g, _enabled(te_api().inspect_tensor_postquantize_enabled(
                    layer_name=name, tensor_name=t, gemm=g, iteration=it), False)))
        tensors.append((t, TensorPlan(inspect, tuple(plans), tuple(post))))
    return LayerPlan(name, it, recipe_on, tuple(tensors), min(asks) if asks else None)


def _log_plan(plan: LayerPlan) -> None:
    for t in INPUT_TENSORS:
        for g, p in plan.tensor(t).plans:
            key = (plan.name, t, g, p)
            if key not in SESSION.logged:
                SESSION.logged.add(key)
                log_message(f"Tensor: {t}, gemm {g} - {p}", plan.name)


def layer_plan(name: str, recipe_on: bool) -> LayerPlan:
    """The routing calls' answers for `name` at the current iteration (cached per iteration). As
    in TE, the calls are not repeated before the iteration their answers named (`next_ask`): until
    then the layer runs as if no feature were configured for it (the fast path), and for good
    when no answer names one. A feature that changes a GEMM asks again every iteration."""
    it = current_iteration()
    plan = SESSION.plans.get((name, recipe_on))
    if plan is not None and plan.iteration == it:
        return plan
    if plan is not None and (plan.next_ask is None or it < plan.next_ask):
        plan = LayerPlan.default(name, recipe_on, it, plan.next_ask)
        SESSION.plans[(name, recipe_on)] = plan
        return plan
    if not SESSION.config_checked:
        SESSION.config_checked = True
        from .config_check import check_session_config

        check_session_config(debug_manager())
    plan = _compute_plan(name, recipe_on, it)
    SESSION.plans[(name, recipe_on)] = plan
    _log_plan(plan)
    return plan


def _publish(name: str, recipe_on: bool, plan: LayerPlan) -> str:
    slot = _SLOTS.get((name, recipe_on))
    if slot is None:
        slot = _SLOTS[(name, recipe_on)] = f"r{len(_SLOTS)}_{int(recipe_on)}"
    setattr(ROUTES, slot, name if plan.active else None)
    return slot


@torch._dynamo.assume_constant_result
def _slot(uid: int, recipe_on: bool) -> str:
    name = SESSION.owners.get(uid)
    if name is None or not SESSION.active or debug_manager() is None:
        return "none"
    return _publish(name, recipe_on, layer_plan(name, recipe_on))


def route(gemm, recipe_on: bool) -> Optional[str]:
    """The layer name when `gemm` must take the debug path now, else None (the fast path).
    Under torch.compile `_slot` runs at trace time and the attribute read is what is guarded."""
    if not SESSION.active:
        return None
    return getattr(ROUTES, _slot(gemm._debug_uid, recipe_on))
