"""Shared cases for the Linear op/module tests (test_linear_*.py): the six recipes and helpers."""
import contextlib

import torch
from torch._dynamo.utils import counters

from transformer_engine_proto import recipe as R
from transformer_engine_proto.autocast import FP8GlobalState, autocast

# NVFP4 draws random bits for stochastic rounding of gradients; anything that compares two runs
# (opcheck, eager vs compiled) needs it off. The RHT sign vector is seeded, so it stays on.
RECIPES = {
    "high_precision": None,
    "delayed": R.DelayedScaling(),
    "current": R.Float8CurrentScaling(),
    "mxfp8": R.MXFP8BlockScaling(),
    "block": R.Float8BlockScaling(),
    "nvfp4": R.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
RECIPE_IDS = list(RECIPES)
QUANTIZED_IDS = [k for k in RECIPES if RECIPES[k] is not None]


def recipe_ctx(recipe):
    """autocast for a quantized recipe; a no-op context for high precision (recipe None)."""
    if recipe is None:
        return contextlib.nullcontext()
    return autocast(recipe=recipe)


def fresh_dynamo():
    """Forget every compiled graph (Linear.forward's cache is shared by all instances, so tests
    that compile many modules would otherwise hit the recompile limit) and zero the counters."""
    torch._dynamo.reset()
    counters.clear()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@contextlib.contextmanager
def forget_modules(*modules):
    """Take modules out of autocast's registry afterwards, so a module a recipe cannot quantize
    (kept alive by a failure traceback) does not break `autocast` entry in later tests."""
    try:
        yield
    finally:
        for m in modules:
            FP8GlobalState.modules.discard(m)
