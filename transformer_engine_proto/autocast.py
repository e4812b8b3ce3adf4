"""`autocast(enabled=True, recipe=...)` and TE's older `fp8_autocast(enabled=True, fp8_recipe=...)`:
which recipe modules use now.

The state is per thread, as torch.autocast's: a thread sees only the autocast blocks it entered.
It is a plain Python object (an attribute of a threading.local) that torch.compile reads and
guards on, so entering autocast with another recipe recompiles instead of silently reusing a
graph traced for the old one; the guards read the calling thread's state.
On entry (outside compiled code) live modules, a registry shared by all threads, are told the
recipe so they can allocate the recipe's state buffers eagerly. Delayed scaling's update runs
eagerly around an outermost training block: its forward half when the block exits (TE's timing),
its gradient half when the next one is entered; a compiled graph only reads the scales and records
amaxes.
Entry takes the recipe's key from its fields then: modules read the copy registered with the key
(`entered_recipe`), so a block keeps the settings it entered with when the recipe is edited
inside it, and an edit takes effect at the next entry (a new key: compiled code recompiles).
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

from . import recipe as _recipe

__all__ = ["autocast", "fp8_autocast", "is_fp8_enabled", "get_fp8_recipe", "get_fp8_recipe_key", "FP8GlobalState",
           "in_activation_recompute_phase", "get_gemm_policy_key", "in_training_autocast", "checkpoint_scales",
           "entered_recipe"]


@dataclass
class _State:
    enabled: bool = False
    recipe: Optional[_recipe.Recipe] = None  # the user's object (TE's get_fp8_recipe); None unless enabled
    entered: Optional[_recipe.Recipe] = None  # its fields at entry: the copy registered with `key`
    # The recipe's registry key (a string, from its fields at entry): compiled code reads this, so
    # dynamo guards on a plain constant, which changes when the recipe is edited.
    key: str = "high_precision"
    group: object = None  # amax_reduction_group / fp8_group, as given (FP8GlobalStateManager.get_fp8_group)
    first_module_pending: bool = True  # FP8GlobalStateManager.is_first_fp8_module
    policy: str = ""  # the GemmPolicy's registry key ("" off): per-GEMM precision choice (precision/)
    # grad mode at entry. Delayed scaling moves its scales only in blocks entered with grad enabled,
    # as TE (which updates them at such a block's exit); an evaluation block records its amaxes only
    training: bool = True


class _ThreadState(threading.local):
    """`state` and `recompute_phase` are this thread's (set up on a thread's first read); the
    class attributes are shared by all threads."""

    modules: "weakref.WeakSet" = weakref.WeakSet()  # modules to prepare on autocast entry
    registrations = 0  # modules registered so far: a block's exit sees whether `modules` grew
    lock = threading.RLock()  # guards `modules` and the preparation of modules

    def __init__(self):
        self.state = _State()
        # True while `te.checkpoint` recomputes a forward in backward: modules then use the scales of
        # the first forward and record no amax (delayed scaling). A trace-time constant under compile.
        self.recompute_phase = False
        # a deque while `te.checkpoint` runs eagerly: its first forward appends each delayed-scaling
        # GEMM's forward scales, its recompute takes them back in the same order (autocast's exit
        # rewrites the scale buffers in between). None otherwise, and always under torch.compile.
        self.checkpoint_scales = None
        # `is_first_microbatch` for GEMM modules called without one (None: no weight cache):
        # make_graphed_callables's weight caching captures whole models this way (an nn.Sequential
        # passes no keywords); `te.checkpoint`'s recompute runs in its first forward's value
        self.first_microbatch = None

    @classmethod
    def register_module(cls, module) -> None:
        with cls.lock:
            cls.modules.add(module)
            cls.registrations += 1


FP8GlobalState = _ThreadState()


def get_fp8_recipe_key() -> str:
    return FP8GlobalState.state.key


def get_gemm_policy_key() -> str:
    """The active GemmPolicy's registry key, "" when none (a string: compiled code guards on it)."""
    return FP8GlobalState.state.policy


def in_activation_recompute_phase() -> bool:
    """Whether the running forward is `te.checkpoint`'s recompute (TE's
    `FP8GlobalStateManager.in_fp8_activation_recompute_phase`)."""
    return FP8GlobalState.recompute_phase


class first_microbatch_default:
    """Within the block, GEMM modules called without `is_first_microbatch` use `first`."""

    def __init__(self, first):
        self.first = first

    def __enter__(self):
        self.prev, FP8GlobalState.first_microbatch = FP8GlobalState.first_microbatch, self.first

    def __exit__(self, *exc):
        FP8GlobalState.first_microbatch = self.prev


def checkpoint_scales():
    """`te.checkpoint`'s deque of forward scales (eager), or None."""
    return FP8GlobalState.checkpoint_scales


def in_training_autocast() -> bool:
    """Whether the active autocast block was entered with grad enabled (delayed scaling then
    updates its scales; a trace-time constant under compile)."""
    return FP8GlobalState.state.training


def is_fp8_enabled() -> bool:
    return FP8GlobalState.state.enabled


def get_fp8_recipe() -> Optional[_recipe.Recipe]:
    return FP8GlobalState.state.recipe  # one read of the thread-local: every Linear call asks


def entered_recipe() -> Optional[_recipe.Recipe]:
    """The active recipe's settings as the block entered with them (a copy that edits of the
    user's recipe inside the block do not reach): what modules read its fields from."""
    return FP8GlobalState.state.entered


def _default_recipe() -> _recipe.Recipe:
    return _recipe.DelayedScaling()


def _reject_recipe_as_enabled(enabled, fix: str) -> None:
    if isinstance(enabled, _recipe.Recipe):
        name = fix.split("(")[0]
        raise TypeError(f"{name}: the first argument is `enabled`, got the recipe {type(enabled).__name__}; "
                        f"pass it by keyword: {fix}")


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Optional[_recipe.Recipe] = None,
             amax_reduction_group=None, _graph: bool = False, gemm_policy=None):
    """Run the enclosed TE-proto modules in low precision with `recipe` (default DelayedScaling).
    `gemm_policy`: a `GemmPolicy` to run each GEMM in the recipe's format only where it is
    predicted faster than bf16 (None: every GEMM in the recipe's format)."""
    _reject_recipe_as_enabled(enabled, "autocast(recipe=...)")
    if calibrating:
        raise NotImplementedError("calibrating=True is not supported by transformer_engine_proto")
    if recipe is None:
        recipe = _default_recipe()
    _recipe.require_recipe(recipe, "autocast")
    import torch

    from .custom_ops.recipe_key import RecipeKey
    from .precision.policy import policy_key

    # is_dynamo_compiling, not is_compiling: the latter is process-wide, True in every thread while
    # one thread compiles
    if torch.compiler.is_dynamo_compiling():
        raise RuntimeError("enter autocast outside the torch.compile'd region (compile the model, not the context)")
    key = RecipeKey.of(recipe if enabled else None)  # the recipe's fields now: later edits do not reach it
    entered = RecipeKey.recipe(key)
    saved = FP8GlobalState.state
    # delayed scaling's update, around an outermost training block: its gradient half on entry
    # (the last backward's amax, before this forward reads the scale), its forward half on exit
    advance = (enabled and isinstance(entered, _recipe.DelayedScaling) and torch.is_grad_enabled()
               and not saved.enabled)
    # the GEMMs whose delayed-scaling scales autocast moves (all but those FSDP2's pre-all-gather hook
    # updates itself), found once for the entry's and the exit's update
    updated, registrations = [], FP8GlobalState.registrations
    if enabled:
        with FP8GlobalState.lock:
            named_gemms = []
            for module in list(FP8GlobalState.modules):
                for gemm in module.prepare_for_recipe(recipe, entered, key):
                    named_gemms.append((module.name, gemm))
                    if gemm.scales_updated_by_autocast:
                        updated.append(gemm)
            if isinstance(entered, _recipe.DelayedScaling):
                from .custom_ops.delayed_scaling import poll_nonfinite

                poll_nonfinite(named_gemms)
            if advance:
                _update_delayed_scaling(entered, updated, forward_half=False, grad_half=True)
    FP8GlobalState.state = _State(enabled=bool(enabled), recipe=recipe if enabled else None, entered=entered,
                                  key=key, group=amax_reduction_group,
                                  policy="" if gemm_policy is None else policy_key(gemm_policy),
                                  training=torch.is_grad_enabled())
    try:
        yield
    finally:
        FP8GlobalState.state = saved
        from .custom_ops import shared_input

        shared_input.clear()  # quantized inputs shared within the forward
        if advance:
            with FP8GlobalState.lock:
                if registrations != FP8GlobalState.registrations:  # modules built inside the block
                    updated = [g for m in list(FP8GlobalState.modules) for g, _ in m.gemm_weights()
                               if g.scales_updated_by_autocast]
                _update_delayed_scaling(entered, updated, forward_half=True, grad_half=False)


def _update_delayed_scaling(recipe, gemms: list, forward_half: bool, grad_half: bool) -> None:
    """One half of delayed scaling's update for `gemms` (one launch per device)."""
    from .custom_ops.delayed_scaling import update_delayed_scaling

    update_delayed_scaling(gemms, recipe, forward_half, grad_half)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Optional[_recipe.Recipe] = None,
                 fp8_group=None, _graph: bool = False):
    """TE's older name and keywords for `autocast` (`fp8_recipe` is `recipe`, `fp8_group` is
    `amax_reduction_group`)."""
    _reject_recipe_as_enabled(enabled, "fp8_autocast(fp8_recipe=...)")
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group,
                    _graph=_graph)
