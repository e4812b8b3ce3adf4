"""TE's `backward_override` recipe field: "high_precision" keeps the forward in the recipe's format
and runs dgrad / wgrad on the original high-precision operands, eager and compiled alike; a
delayed-scaling override is refused, with its reason ("dequantized":
test_backward_override_dequantized.py)."""
import pytest
import torch
from linear_cases import fresh_dynamo

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

RECIPES = {"current": R.Float8CurrentScaling, "mxfp8": R.MXFP8BlockScaling, "block": R.Float8BlockScaling,
           "nvfp4": lambda **kw: R.NVFP4BlockScaling(disable_stochastic_rounding=True, **kw)}


def _run(recipe, compiled=None, weight=None):
    torch.manual_seed(0)
    lin = te.Linear(128, 128, bias=False, device="cpu")
    if weight is not None:
        with torch.no_grad():
            lin.weight.copy_(weight)
    fn = lin if compiled is None else torch.compile(lin, backend=compiled, fullgraph=True)
    x = torch.randn(128, 128, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(128, 128, generator=torch.Generator().manual_seed(2))
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = fn(x)
    y.backward(g)  # dy = g whatever y is: the backward GEMMs compare directly
    return y.detach(), x.grad, lin.weight.grad


@pytest.mark.parametrize("name", list(RECIPES))
def test_high_precision_backward_keeps_the_quantized_forward(name):
    plain, override = RECIPES[name](), RECIPES[name](backward_override="high_precision")
    assert RecipeKey.high_precision_gemms(RecipeKey.of(override)) == {"dgrad", "wgrad"}
    y, dx, dw = _run(override)
    y_plain, dx_plain, dw_plain = _run(plain)
    _, dx_hp, dw_hp = _run(None)
    assert torch.equal(y, y_plain)  # the forward is the recipe's
    assert torch.equal(dx, dx_hp) and torch.equal(dw, dw_hp)  # backward on the original operands
    assert not torch.equal(dx, dx_plain)  # which the plain recipe's quantized backward is not


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend):
    recipe = R.Float8CurrentScaling(backward_override="high_precision")
    eager = _run(recipe)
    fresh_dynamo()
    compiled = _run(recipe, compiled=backend)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_a_gemm_policy_adds_to_the_recipes_own_high_precision_gemms():
    key = RecipeKey.of(R.Float8CurrentScaling(backward_override="high_precision"))
    assert RecipeKey.high_precision_gemms(RecipeKey.with_high_precision_gemms(key, {"fprop"})) == \
        {"fprop", "dgrad", "wgrad"}
    assert RecipeKey.high_precision_gemms(RecipeKey.of(R.Float8CurrentScaling())) == frozenset()


def test_refused_values_name_the_reason(monkeypatch):
    with pytest.raises(ValueError, match="DelayedScaling supports backward_override=None only"):
        R.DelayedScaling(backward_override="high_precision")
    with pytest.raises(ValueError, match="DelayedScaling supports backward_override=None only"):
        R.DelayedScaling(backward_override="dequantized")
    with pytest.raises(ValueError, match="must be None, 'high_precision' or 'dequantized'"):
        R.Float8CurrentScaling(backward_override="fp32")
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")  # TE's default comes from it
    assert R.Float8BlockScaling().backward_override == "high_precision"
    assert R.CustomRecipe(qfactory=lambda role: None).backward_override == "high_precision"


def test_a_weight_stored_quantized_is_read_dequantized_for_a_high_precision_dgrad():
    """No high-precision copy exists: as in TE, dgrad runs in high precision on the stored weight
    dequantized (the forward stays in FP8)."""
    recipe = R.Float8CurrentScaling(backward_override="high_precision")
    with te.quantized_model_init(recipe=recipe):
        lin = te.Linear(128, 128, device="cpu", params_dtype=torch.float32)
    x = torch.randn(16, 128, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(x.grad, g @ lin.weight.dequantize(dtype=torch.float32), rtol=1e-6, atol=1e-6)
