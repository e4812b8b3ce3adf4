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


def fold_last_grad_amaxes(recipe):
    """Enter and leave one training autocast block: delayed scaling's gradient half runs on entry,
    so every live module's last gradient amax is folded in before states are compared."""
    with recipe_ctx(recipe):
        pass


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


# ---- compile backends -------------------------------------------------------------------------------
# Every compiled-vs-eager test runs under aot_eager (the op bodies as eager runs them: bitwise) and
# under inductor (what users run: the bodies inlined, fused and partitioned by inductor). On CPU,
# inductor compiles the reference kernels to C++: seconds a graph for the FP8 recipes, minutes for
# MXFP8 / NVFP4. CI runs inductor for the recipes in INDUCTOR_IN_CI; the other inductor cases are
# marked slow and run in the GPU suite's selection (qa/L1_gpu.sh: -m "cuda or slow"), or on CPU with
# TE_PROTO_RUN_SLOW=1.
BACKENDS = ("aot_eager", "inductor")
INDUCTOR_IN_CI = ("delayed",)


def backend_params(rids=None, ci=INDUCTOR_IN_CI):
    """pytest params `backend, rid` over BACKENDS x `rids` (or `backend` alone when rids is None),
    inductor cases outside `ci` marked slow."""
    import pytest

    if rids is None:
        return [pytest.param(b, id=b, marks=[] if b != "inductor" or ci else [pytest.mark.slow]) for b in BACKENDS]
    return [pytest.param(b, r, id=f"{b}-{r}", marks=[pytest.mark.slow] if b == "inductor" and r not in ci else [])
            for b in BACKENDS for r in rids]
