"""TE's policy for pickled `_extra_state` payloads (`transformer_engine.pytorch._extra_state`).

A TE checkpoint keeps a module's FP8 state as a pickle, and unpickling runs code. TE classifies a
payload without loading it: a stateless recipe's payload carries nothing to load and is ignored;
one that holds delayed-scaling state, or that cannot be classified, is loaded only where the user
opted in (`NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`), else refused with an advisory.

This package's own modules do not need the opt-in: they read `_extra_state` through an allow-list
unpickler that builds only tensors, containers and recipes (module/fp8_state.py). The policy is
here, with TE's names, for code that unpickles such payloads itself, as TE's does.
"""
from __future__ import annotations

import enum
import os
import pickletools
from typing import Dict, Iterator, Optional, Tuple

from . import recipe as R

__all__ = ["CheckpointExtraStatePolicy", "UNSAFE_PICKLE_EXTRA_STATE_ENV", "recipe_extra_state_policy",
           "is_stateless_recipe", "register_recipe_policy", "should_load_extra_state_pickle",
           "extra_state_pickle_advisory"]

UNSAFE_PICKLE_EXTRA_STATE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
_TE_RECIPE_MODULE = "transformer_engine.common.recipe"
# the keys of delayed scaling's state in a pickled payload (TE's and this package's layout)
_DELAYED_STATE_KEYS = frozenset({"scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"})


class CheckpointExtraStatePolicy(enum.Enum):
    """What a recipe's pickled `_extra_state` needs: nothing (STATELESS), the unsafe opt-in
    (STATEFUL_FP8_DELAYED_SCALING), or a look at the payload (DYNAMIC: a CustomRecipe may or may
    not carry delayed-scaling state)."""

    STATELESS = "stateless"
    STATEFUL_FP8_DELAYED_SCALING = "stateful_fp8_delayed_scaling"
    DYNAMIC = "dynamic"


# (module, class name) of every recipe class -> its policy; each class is listed under TE's module
# name and under ours, since a payload names whichever class pickled it
_RECIPE_POLICIES: Dict[Tuple[str, str], CheckpointExtraStatePolicy] = {}


def register_recipe_policy(cls: type, policy: CheckpointExtraStatePolicy) -> None:
    """Declare the checkpoint policy of a recipe class (a derived recipe registers its own)."""
    for module in (_TE_RECIPE_MODULE, cls.__module__):
        _RECIPE_POLICIES[(module, cls.__name__)] = policy


for _cls, _policy in ((R.DelayedScaling, CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING),
                      (R.Float8CurrentScaling, CheckpointExtraStatePolicy.STATELESS),
                      (R.MXFP8BlockScaling, CheckpointExtraStatePolicy.STATELESS),
                      (R.Float8BlockScaling, CheckpointExtraStatePolicy.STATELESS),
                      (R.NVFP4BlockScaling, CheckpointExtraStatePolicy.STATELESS),
                      (R.CustomRecipe, CheckpointExtraStatePolicy.DYNAMIC)):
    register_recipe_policy(_cls, _policy)


def recipe_extra_state_policy(recipe: R.Recipe) -> Optional[CheckpointExtraStatePolicy]:
    cls = type(recipe)
    return _RECIPE_POLICIES.get((cls.__module__, cls.__name__))


def is_stateless_recipe(recipe: R.Recipe) -> bool:
    return recipe_extra_state_policy(recipe) is CheckpointExtraStatePolicy.STATELESS


def extra_state_pickle_advisory(context: str) -> str:
    return (f"{context}: refusing to unpickle a Transformer Engine `_extra_state` payload: it may hold "
            f"delayed-scaling FP8 state, and unpickling can run arbitrary code. If the checkpoint is from a "
            f"trusted source, set {UNSAFE_PICKLE_EXTRA_STATE_ENV}=1 to load it.")


def should_load_extra_state_pickle(data: bytes, context: str) -> bool:
    """False: the payload holds nothing to load (ignore it). True: it holds state and the user
    opted in to unpickling. Otherwise a RuntimeError with the advisory naming the opt-in."""
    if not _needs_loading(data):
        return False
    if os.environ.get(UNSAFE_PICKLE_EXTRA_STATE_ENV, "0") == "1":
        return True
    raise RuntimeError(extra_state_pickle_advisory(context))


def _needs_loading(data: bytes) -> bool:
    """Whether a payload may hold state, read from its opcodes without running it (a payload
    that cannot be read is assumed to)."""
    if not data:
        return False
    try:
        keys, globals_ = set(), []
        for kind, value in _strings_and_globals(data):
            if kind == "str":
                keys.add(value)
            else:
                globals_.append(value)
    except Exception:  # a malformed pickle: only the user can vouch for it
        return True
    has_delayed_state = bool(keys & _DELAYED_STATE_KEYS)
    if not globals_ and not has_delayed_state:
        return False  # no global: nothing can be built or run, and no state (an old empty dict)
    if "recipe" not in keys or has_delayed_state:
        return True  # TE 1.x (delayed scaling, no recipe stored) or delayed state present
    policies = {_RECIPE_POLICIES.get(g) for g in globals_} - {None}
    return not policies or CheckpointExtraStatePolicy.STATEFUL_FP8_DELAYED_SCALING in policies


def _strings_and_globals(data: bytes) -> Iterator[Tuple[str, object]]:
    """("str", text) for each string the pickle pushes, ("global", (module, name)) for each global it
    resolves (GLOBAL names both; STACK_GLOBAL takes the last two strings pushed)."""
    strings = []
    for op, arg, _ in pickletools.genops(data):
        if isinstance(arg, (str, bytes)) and ("STRING" in op.name or "UNICODE" in op.name):
            text = arg.decode("utf-8", "replace") if isinstance(arg, bytes) else arg
            strings.append(text)
            yield "str", text
        elif op.name == "GLOBAL" and isinstance(arg, str) and len(arg.split()) == 2:
            yield "global", tuple(arg.split())
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            yield "global", (strings[-2], strings[-1])
