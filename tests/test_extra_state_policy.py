"""module/extra_state_policy.py: TE's classification of pickled `_extra_state` payloads."""
import pickle

import pytest
import torch

import transformer_engine_proto as te
import transformer_engine_proto.distributed  # noqa: F401  (registers its derived recipe's policy)
from transformer_engine_proto import extra_state_policy as P
from transformer_engine_proto import recipe as R


def _payload(recipe, delayed_state=False):
    state = {"recipe": recipe, "extra_fp8_variables": {}}
    if delayed_state:
        state.update(scale_fwd=torch.ones(1), amax_history_fwd=torch.zeros(1, 1))
    return pickle.dumps(state)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_every_recipe_class_has_a_policy_under_tes_module_name():
    for cls in _subclasses(R.Recipe):
        assert ("transformer_engine.common.recipe", cls.__name__) in P._RECIPE_POLICIES, cls
        assert (cls.__module__, cls.__name__) in P._RECIPE_POLICIES, cls
    assert P.is_stateless_recipe(R.MXFP8BlockScaling()) and not P.is_stateless_recipe(R.DelayedScaling())
    custom = R.CustomRecipe(qfactory=lambda role: None)
    assert P.recipe_extra_state_policy(custom) is P.CheckpointExtraStatePolicy.DYNAMIC


@pytest.mark.parametrize("payload", [
    _payload(R.Float8CurrentScaling()), _payload(R.NVFP4BlockScaling()), pickle.dumps({}), b""],
    ids=["current", "nvfp4", "empty-dict", "no-bytes"])
def test_payloads_without_state_are_ignored(payload, monkeypatch):
    monkeypatch.delenv(P.UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    assert not P.should_load_extra_state_pickle(payload, "layer")


@pytest.mark.parametrize("payload", [
    _payload(R.DelayedScaling()), _payload(R.Float8CurrentScaling(), delayed_state=True),
    pickle.dumps({"recipe": object()}), pickle.dumps({"scale_inv_fwd": torch.ones(1)}), b"not a pickle"],
    ids=["delayed", "state-keys", "unknown-global", "no-recipe", "malformed"])
def test_payloads_that_may_hold_state_need_the_opt_in(payload, monkeypatch):
    monkeypatch.delenv(P.UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    with pytest.raises(RuntimeError, match="layer.*NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1"):
        P.should_load_extra_state_pickle(payload, "layer")
    monkeypatch.setenv(P.UNSAFE_PICKLE_EXTRA_STATE_ENV, "1")
    assert P.should_load_extra_state_pickle(payload, "layer")


def test_our_modules_load_their_own_delayed_state_without_the_opt_in(monkeypatch):
    """The policy calls a delayed-scaling payload unsafe; the modules' allow-list reader loads it."""
    monkeypatch.delenv(P.UNSAFE_PICKLE_EXTRA_STATE_ENV, raising=False)
    src = te.Linear(16, 16, params_dtype=torch.float32, device="cpu")
    with te.autocast(recipe=R.DelayedScaling()):
        src(torch.randn(8, 16)).sum().backward()
    extra = src.state_dict()["_extra_state"]
    with pytest.raises(RuntimeError, match="NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"):
        P.should_load_extra_state_pickle(extra.numpy().tobytes(), "linear")
    dst = te.Linear(16, 16, params_dtype=torch.float32, device="cpu")
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.gemm.amax_history, src.gemm.amax_history) and dst.gemm.amax_history.abs().sum() > 0
