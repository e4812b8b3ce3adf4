"""TE's tests/pytorch/test_recipe.py reads internals of our objects by TE's names: the NVFP4
tensor's encoding flags, `fp8_meta`'s keys and TE's delayed-scaling update functions. These
tests use them the way TE's tests do, on CPU."""
import io

import pytest
import torch

from transformer_engine_proto.tensor.nvfp4 import NVFP4Quantizer


@pytest.mark.parametrize("row_scaled", [False, True])
@pytest.mark.parametrize("use_4over6", [False, True])
def test_nvfp4_tensor_reports_its_encoding_options(row_scaled, use_4over6):
    m, n = 32, 64
    q = NVFP4Quantizer(columnwise=not row_scaled, row_scaled_nvfp4=row_scaled, nvfp4_use_4over6=use_4over6)
    t = q(torch.rand(m, n))
    assert t._row_scaled_nvfp4 == row_scaled and t._nvfp4_use_4over6 == use_4over6
    assert t._nvfp4_e4m3_max == 448
    assert t._amax_rowwise.numel() == (m if row_scaled else 1)
    again = q(t.dequantize())
    assert again._row_scaled_nvfp4 == row_scaled and again._nvfp4_use_4over6 == use_4over6
    if not use_4over6:
        assert torch.equal(again._rowwise_data, t._rowwise_data)
    torch.testing.assert_close(again.dequantize(), t.dequantize())
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)  # the flag travels with the tensor
    assert loaded._nvfp4_use_4over6 == use_4over6 and loaded._row_scaled_nvfp4 == row_scaled


def test_nvfp4_e4m3_bound_is_reported():
    t = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)(torch.rand(16, 32))
    assert t._nvfp4_e4m3_max == 256 and t._nvfp4_use_4over6


# ---- delayed scaling: fp8_meta keys and TE's update functions -------------------------------
import transformer_engine_proto as te  # noqa: E402
from transformer_engine_proto import recipe as R  # noqa: E402
from transformer_engine_proto.constants import FP8TensorMeta  # noqa: E402
from transformer_engine_proto.quantization import (  # noqa: E402
    FP8GlobalStateManager,
    NVFP4BlockScalingRecipeState,
    QuantizerRole,
    _amax_and_scale_update,
    _default_sf_compute,
)


def _linear_meta(recipe, steps=2):
    torch.manual_seed(0)
    module = te.Linear(16, 16, device="cpu")
    for _ in range(steps):
        with te.autocast(recipe=recipe):
            y = module(torch.randn(16, 16))
        y.sum().backward()
    return module, module.fp8_meta


def test_meta_tensor_key_finds_the_module_state():
    recipe = R.DelayedScaling(amax_history_len=4)
    module, meta = _linear_meta(recipe)
    fwd = meta[FP8GlobalStateManager.get_meta_tensor_key(forward=True)]
    bwd = meta[FP8GlobalStateManager.get_meta_tensor_key(forward=False)]
    assert isinstance(fwd, FP8TensorMeta) and isinstance(bwd, FP8TensorMeta)
    assert fwd.amax_history.shape[1] == 3 and bwd.amax_history.shape[1] == 2  # TE's slots per GEMM
    (gemm, _), = module.gemm_weights()
    torch.testing.assert_close(fwd.scale[:2], gemm.fp8_scale.cpu())
    torch.testing.assert_close(fwd.amax_history[:, :2], gemm.amax_history.cpu())
    torch.testing.assert_close(bwd.scale[:1], gemm.grad_fp8_scale.cpu())
    assert fwd.amax_history[:, :2].abs().sum() > 0  # real recorded amaxes, not a placeholder


@pytest.mark.parametrize("case, amax, expected", [
    ("zero", 0.0, 1.0), ("normal", 2.0, 448.0 / 2.0 / 4), ("inf", float("inf"), 1.0), ("nan", float("nan"), 1.0)])
@pytest.mark.parametrize("via_recipe_fn", [False, True])
def test_scale_update_scenarios(case, amax, expected, via_recipe_fn):
    fn = (lambda a, s, m, r: _default_sf_compute(a, s, m, r.margin)) if via_recipe_fn else None
    recipe = R.DelayedScaling(margin=2, scaling_factor_compute_algo=fn)
    meta = FP8TensorMeta(scale=torch.ones(1), scale_inv=torch.ones(1), amax_history=torch.tensor([[amax]]))
    _amax_and_scale_update(meta.amax_history, meta.scale, 448.0, recipe)
    torch.testing.assert_close(meta.scale, torch.tensor([expected]))
    assert meta.amax_history.item() == 0  # rolled: row 0 is free for the next amax


def test_scale_update_uses_the_history_by_the_recipe():
    hist = torch.tensor([[1.0, 3.0], [4.0, 0.5], [2.0, 1.0]])
    for algo, amax in (("max", hist.amax(0)), ("most_recent", hist[0])):
        h, scale = hist.clone(), torch.ones(2)
        _amax_and_scale_update(h, scale, 448.0, R.DelayedScaling(amax_compute_algo=algo, margin=0))
        torch.testing.assert_close(scale, 448.0 / amax)
        torch.testing.assert_close(h, torch.cat([torch.zeros(1, 2), hist[2:], hist[:1]]))


def test_default_sf_compute_as_the_recipe_function_matches_the_default():
    plain = _linear_meta(R.DelayedScaling(margin=1, amax_history_len=8), steps=3)[1]
    wrapped = _linear_meta(R.DelayedScaling(margin=1, amax_history_len=8, scaling_factor_compute_algo=(
        lambda a, s, m, r: _default_sf_compute(a, s, m, r.margin))), steps=3)[1]
    for key in ("scaling_fwd", "scaling_bwd"):
        torch.testing.assert_close(wrapped[key].scale, plain[key].scale)
        assert not torch.equal(plain[key].scale, torch.ones_like(plain[key].scale))


# ---- NVFP4BlockScalingRecipeState -------------------------------------------------------------
def test_nvfp4_recipe_state_quantizers_by_role():
    recipe = R.NVFP4BlockScaling(disable_rht=True, disable_2d_quantization=True, nvfp4_4over6="weights",
                                 nvfp4_4over6_e4m3_use_256="all", row_scaled_activation=True)
    fwd = NVFP4BlockScalingRecipeState(recipe, mode="forward", num_quantizers=3).make_quantizers()
    assert [q.row_scaled_nvfp4 for q in fwd] == [True, False, True]
    assert [q.nvfp4_use_4over6 for q in fwd] == [False, True, False]
    assert [q.nvfp4_e4m3_max for q in fwd] == [448, 256, 448]
    roles = [QuantizerRole(module_type="linear", tensor_type=t)
             for t in ("input", "weight", "grad_output", "grad_input")]
    bwd = NVFP4BlockScalingRecipeState(recipe, mode="backward", num_quantizers=4, roles=roles).make_quantizers()
    assert [q.row_scaled_nvfp4 for q in bwd] == [False] * 4  # row scaling is a forward setting
    assert [q.stochastic_rounding for q in bwd] == [False, False, True, True]
    assert [q.nvfp4_use_4over6 for q in bwd] == [False, True, False, False]
    with pytest.raises(TypeError, match="NVFP4BlockScaling"):
        NVFP4BlockScalingRecipeState(R.MXFP8BlockScaling(), mode="forward")


def test_module_quantizers_follow_the_recipe_and_a_type_change_warns():
    """`module.quantizers` (TE's per-GEMM scaling_fwd / scaling_bwd lists) are the last recipe's;
    a forward under a recipe of another type warns once, TE's words, and the same type again does
    not."""
    import warnings

    from transformer_engine_proto.tensor import Float8BlockQuantizer, Float8Quantizer

    lin = te.LayerNormMLP(32, 64, device="cpu")
    assert lin.quantizers == {"scaling_fwd": [], "scaling_bwd": []}
    x = torch.randn(8, 32)
    with te.autocast(recipe=R.DelayedScaling()):
        lin(x)
    q = lin.quantizers
    assert len(q["scaling_fwd"]) == 6 and len(q["scaling_bwd"]) == 4  # two GEMMs
    assert all(isinstance(t, Float8Quantizer) for t in q["scaling_fwd"] + q["scaling_bwd"])
    assert q["scaling_bwd"][0].fp8_dtype == torch.float8_e5m2  # HYBRID: gradients in E5M2
    with pytest.warns(UserWarning, match="Recipe type changed from DelayedScaling to Float8BlockScaling"):
        with te.autocast(recipe=R.Float8BlockScaling()):
            lin(torch.randn(128, 32))
    assert all(isinstance(t, Float8BlockQuantizer) for t in lin.quantizers["scaling_fwd"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=R.Float8BlockScaling(fp8_format=R.Format.E4M3)):
            lin(torch.randn(128, 32))
        lin(torch.randn(128, 32))  # no recipe: no type to compare
