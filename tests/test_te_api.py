"""TE's public names as a TE training script uses them: fp8_autocast with TE's keywords, and the
capability queries (answered for this package on each device)."""
import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import recipe

FP8_AVAILABLE, REASON = te.is_fp8_available(return_reason=True)  # module level, as TE's tests do


def test_fp8_autocast_takes_te_keywords():
    torch.manual_seed(0)
    model = te.Linear(64, 32)
    x = torch.randn(32, 64)
    r = recipe.Float8CurrentScaling()
    with te.fp8_autocast(enabled=True, calibrating=False, fp8_recipe=r, fp8_group=None):
        assert te.get_fp8_recipe() is r
        y = model(x)
    with te.autocast(enabled=True, recipe=r):
        y_ref = model(x)
    assert torch.equal(y, y_ref)
    with te.fp8_autocast(enabled=False, fp8_recipe=r):
        assert te.get_fp8_recipe() is None


@pytest.mark.parametrize("call", [lambda r: te.autocast(r), lambda r: te.fp8_autocast(r)])
def test_a_recipe_passed_as_enabled_is_an_error(call):
    with pytest.raises(TypeError, match=r"first argument is `enabled`.*Float8CurrentScaling"):
        with call(recipe.Float8CurrentScaling()):
            pass


def test_capability_queries_on_cpu(monkeypatch):
    """Without a GPU every recipe runs on the reference kernels (a GPU machine is made to look like one)."""
    assert (FP8_AVAILABLE, REASON) == te.is_fp8_available(return_reason=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fp8_ok, reason = te.is_fp8_available(return_reason=True)
    assert fp8_ok is True and "CPU" in reason
    for query in (te.is_bf16_available, te.is_fp8_available, te.is_fp8_block_scaling_available,
                  te.is_mxfp8_available, te.is_nvfp4_available):
        assert query() is True
        ok, reason = query(return_reason=True)
        assert ok is True and "reference kernels" in reason
    assert te.get_device_compute_capability() == (0, 0)


@pytest.mark.parametrize("cc, expect", [
    ((8, 0), dict(bf16=True, fp8=False, block=False, mxfp8=False, nvfp4=False)),
    ((9, 0), dict(bf16=True, fp8=True, block=True, mxfp8="emulated", nvfp4="emulated")),
    ((10, 0), dict(bf16=True, fp8=True, block=True, mxfp8=True, nvfp4=True)),
])
def test_capability_queries_by_compute_capability(monkeypatch, cc, expect):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cc)
    queries = dict(bf16=te.is_bf16_available, fp8=te.is_fp8_available, block=te.is_fp8_block_scaling_available,
                   mxfp8=te.is_mxfp8_available, nvfp4=te.is_nvfp4_available)
    assert te.get_device_compute_capability() == cc
    for name, want in expect.items():
        ok, reason = queries[name](return_reason=True)
        assert ok is bool(want), (name, reason)
        if want == "emulated":
            assert "emulated" in reason
        elif want is False:
            assert f"{cc[0]}.{cc[1]}" in reason
        else:
            assert reason == ""


def test_quantizer_role_is_a_top_level_name():
    """TE exports `QuantizerRole` from `transformer_engine.pytorch` (its tests build one per weight)."""
    from transformer_engine_proto.quantization import QuantizerRole
    assert te.QuantizerRole is QuantizerRole
    assert te.QuantizerRole(tensor_type="weight").tensor_type == "weight"
