"""A GEMM module's FP8 state in Transformer Engine's layout: `fp8_meta` and the `_extra_state`
checkpoint, read back here from TE's pickled form, and nothing but data accepted from it."""
import io
import os
import pickle
import sys
import types

import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R

RECIPE = R.DelayedScaling(amax_history_len=4)


def _trained(module, x, steps=3):
    for step in range(steps):
        with te.autocast(recipe=RECIPE):
            y = module(x * (step + 1))
        (y[0] if isinstance(y, tuple) else y).float().pow(2).sum().backward()
    return module


def test_fp8_meta_has_tes_slots():
    m = _trained(te.LayerNormMLP(32, 64), torch.randn(8, 32))
    meta = m.fp8_meta
    assert meta["recipe"] is RECIPE and meta["num_gemms"] == 2
    fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
    assert fwd.scale.shape == (6,) and bwd.scale.shape == (4,)
    assert fwd.amax_history.shape == (m.fc1.amax_history.shape[0], 6)
    for i, gemm in enumerate((m.fc1, m.fc2)):
        assert torch.equal(fwd.scale[3 * i:3 * i + 2], gemm.fp8_scale) and fwd.scale[3 * i + 2] == 1
        assert torch.equal(fwd.amax_history[:, 3 * i:3 * i + 2], gemm.amax_history)
        assert torch.equal(bwd.scale[2 * i:2 * i + 1], gemm.grad_fp8_scale) and bwd.scale[2 * i + 1] == 1
        assert torch.equal(bwd.amax_history[:, 2 * i:2 * i + 1], gemm.grad_amax_history)
    assert torch.equal(fwd.scale_inv, 1.0 / fwd.scale)
    assert (fwd.scale[0::3] != 1).all()  # trained: the input and weight scales moved


def test_checkpoint_round_trips_with_the_same_bytes():
    torch.manual_seed(0)
    m = _trained(te.Linear(32, 16), torch.randn(8, 32))
    state = m.state_dict()
    assert set(state) == {"weight", "bias", "_extra_state"} and state["_extra_state"].dtype == torch.uint8
    loaded = te.Linear(32, 16)
    loaded.load_state_dict(state)
    for name, buf in m.gemm.named_buffers():
        assert torch.equal(getattr(loaded.gemm, name), buf), name
    assert torch.equal(loaded.state_dict()["_extra_state"], state["_extra_state"])  # deterministic bytes
    x = torch.randn(8, 32)
    with te.autocast(recipe=RECIPE):
        assert torch.equal(loaded(x), m(x))


def _te_style_state(module, recipe_obj):
    """The dict TE's `get_extra_state` pickles, with torch's own tensor pickling."""
    meta = module.fp8_meta
    return {"recipe": recipe_obj, "scale_fwd": meta["scaling_fwd"].scale.clone(),
            "amax_history_fwd": meta["scaling_fwd"].amax_history.clone(),
            "scale_bwd": meta["scaling_bwd"].scale.clone(),
            "amax_history_bwd": meta["scaling_bwd"].amax_history.clone(),
            "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True}}


def _pickled_with_a_te_recipe(state):
    """pickle.dumps as TE does, the recipe a class of TE's module path `transformer_engine.common.recipe`."""
    fake = types.ModuleType("transformer_engine.common.recipe")

    class DelayedScaling:  # stands in for TE's class: only its pickled name matters
        pass

    DelayedScaling.__module__, DelayedScaling.__qualname__ = fake.__name__, "DelayedScaling"
    fake.DelayedScaling = DelayedScaling
    recipe_obj = DelayedScaling()
    recipe_obj.__dict__.update(margin=0, amax_history_len=4, amax_compute_algo="max")
    names = ("transformer_engine", "transformer_engine.common", fake.__name__)
    assert not any(n in sys.modules for n in names)
    sys.modules.update({n: types.ModuleType(n) for n in names[:2]}, **{fake.__name__: fake})
    try:
        return pickle.dumps(dict(state, recipe=recipe_obj))
    finally:
        for n in names:
            del sys.modules[n]


@pytest.mark.parametrize("form", ["uint8 tensor", "BytesIO"])
def test_a_te_checkpoint_loads(form):
    torch.manual_seed(0)
    src = _trained(te.Linear(32, 16), torch.randn(8, 32))
    with te.autocast(recipe=RECIPE):  # the last gradient amax into the scale, where TE's backward puts it
        pass
    state = _te_style_state(src, None)
    if form == "uint8 tensor":
        extra = torch.frombuffer(bytearray(_pickled_with_a_te_recipe(state)), dtype=torch.uint8)
    else:
        extra = io.BytesIO()
        torch.save(state, extra)
    dst = te.Linear(32, 16)
    dst.load_state_dict({"weight": src.weight.detach(), "bias": src.bias.detach(), "_extra_state": extra})
    for name in ("fp8_scale", "amax_history", "grad_fp8_scale", "grad_amax_history"):
        assert torch.equal(getattr(dst.gemm, name), getattr(src.gemm, name)), name
    x = torch.randn(8, 32)
    src.zero_grad(set_to_none=True)
    for _ in range(2):  # the loaded module computes, and its state moves, as the saved one's
        with te.autocast(recipe=RECIPE):
            y_src, y_dst = src(x), dst(x)
        assert torch.equal(y_dst, y_src)
        y_src.float().pow(2).sum().backward()
        y_dst.float().pow(2).sum().backward()
        assert torch.equal(dst.weight.grad, src.weight.grad)


def test_a_checkpoint_runs_no_code():
    evil = pickle.dumps({"scale_fwd": os.system})
    m = te.Linear(32, 16)
    state = dict(m.state_dict(), _extra_state=torch.frombuffer(bytearray(evil), dtype=torch.uint8))
    with pytest.raises(pickle.UnpicklingError, match=r"_extra_state\): posix.system is not allowed|"
                                                      r"_extra_state\): nt.system is not allowed"):
        m.load_state_dict(state)


def test_state_of_another_module_type_is_named():
    src = _trained(te.LayerNormMLP(32, 64), torch.randn(8, 32))
    extra = src.state_dict()["_extra_state"]
    dst = te.Linear(32, 32)
    with pytest.raises(ValueError, match=r"6 forward / 4 backward scaling slots, this module's 1 GEMM\(s\) need 3 / 2"):
        dst.load_state_dict({"weight": dst.weight.detach(), "bias": dst.bias.detach(), "_extra_state": extra})


def test_a_recipe_holding_a_function_is_left_out_of_the_checkpoint():
    recipe = R.DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax(0))
    m = te.Linear(32, 16)
    with te.autocast(recipe=recipe):
        m(torch.randn(8, 32)).sum().backward()
    loaded = te.Linear(32, 16)
    loaded.load_state_dict(m.state_dict())  # the lambda cannot be pickled, and a loader takes no code
    assert torch.equal(loaded.gemm.amax_history, m.gemm.amax_history)
