"""Recipes are edited in place, as TE's: each edit is checked, takes effect at the next autocast
entry (a new key: eager reads the new settings, compiled code recompiles), and does not reach an
autocast block already open."""
import copy
import dataclasses

import pytest
import torch
from linear_cases import fresh_dynamo, unique_graphs

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.autocast import get_fp8_recipe_key
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey


def _mxfp8_quantizer(role):  # the key asks a CustomRecipe's factory (its identity quantizers pick GEMMs)
    return te.MXFP8Quantizer()


# (recipe factory, field, new value) for every recipe class
EDITS = {
    "delayed-margin": (R.DelayedScaling, "margin", 2),
    "delayed-history": (R.DelayedScaling, "amax_history_len", 16),
    "current-override": (R.Float8CurrentScaling, "backward_override", "high_precision"),
    "current-qparams": (R.Float8CurrentScaling, "fp8_quant_fwd_inp", R.QParams(amax_epsilon=1e-3)),
    "mxfp8-format": (R.MXFP8BlockScaling, "fp8_format", R.Format.HYBRID),
    "block-dim": (R.Float8BlockScaling, "x_block_scaling_dim", 2),
    "nvfp4-role": (R.NVFP4BlockScaling, "fp4_quant_fwd_inp", R.QParams()),
    "nvfp4-switch": (R.NVFP4BlockScaling, "disable_stochastic_rounding", True),
    "custom-alignment": (lambda: R.CustomRecipe(qfactory=_mxfp8_quantizer), "quantization_alignment", 64),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_an_edited_field_changes_the_key_to_that_of_an_equal_fresh_recipe(name):
    make, field, value = EDITS[name]
    recipe = make()
    before = RecipeKey.of(recipe)
    setattr(recipe, field, value)
    assert getattr(recipe, field) == value
    key = RecipeKey.of(recipe)
    assert key != before and f"{field}={value!r}" in key
    fresh = make()
    setattr(fresh, field, value)
    assert RecipeKey.of(fresh) == key and fresh == recipe
    assert RecipeKey.recipe(before) != recipe  # the old key still names the old settings


def test_te_sanity_nvfp4_role_edits_reach_the_quantizers():
    """TE's tests/pytorch/test_sanity.py, at module level."""
    nvfp4_recipe = R.NVFP4BlockScaling()
    nvfp4_recipe.fp4_quant_fwd_inp = R.QParams()
    nvfp4_recipe.fp4_quant_fwd_weight = R.QParams(fp4_2d_quantization=True)
    nvfp4_recipe.fp4_quant_bwd_grad = R.QParams()
    q = RecipeKey.quantizers(RecipeKey.of(nvfp4_recipe))
    assert not q.input.with_rht and q.weight.with_2d_quantization
    assert not q.grad_output.with_rht and not q.grad_output.stochastic_rounding
    default = RecipeKey.quantizers(RecipeKey.of(R.NVFP4BlockScaling()))
    assert default.input.with_rht and default.grad_output.with_rht and default.grad_output.stochastic_rounding


def test_an_nvfp4_switch_rewrites_the_roles_it_governs():
    r = R.NVFP4BlockScaling()
    r.disable_rht = True
    assert not r.fp4_quant_fwd_inp.random_hadamard_transform and not r.fp4_quant_bwd_grad.random_hadamard_transform
    assert r.fp4_quant_bwd_grad.stochastic_rounding and r.fp4_quant_fwd_weight.fp4_2d_quantization  # others kept
    assert r == R.NVFP4BlockScaling(disable_rht=True)
    r.disable_rht = False
    assert r == R.NVFP4BlockScaling()
    with pytest.raises(ValueError, match=r"fp4_quant_fwd_inp.random_hadamard_transform=True contradicts disable_rht"):
        R.NVFP4BlockScaling(disable_rht=True).fp4_quant_fwd_inp = R.QParams(random_hadamard_transform=True)
    # recipe.replace edits a copy (roles follow the switch); dataclasses.replace constructs anew
    edited = R.replace(r, disable_rht=True)
    assert edited == R.NVFP4BlockScaling(disable_rht=True) and r == R.NVFP4BlockScaling()
    assert dataclasses.replace(r, disable_rht=True) == edited


@pytest.mark.parametrize("make, field, value, error, match", [
    (R.DelayedScaling, "margin", -1, ValueError, r"DelayedScaling.margin must be a finite number >= 0"),
    (R.DelayedScaling, "amax_history_len", 0, ValueError, r"DelayedScaling.amax_history_len must be an int >= 1"),
    (R.DelayedScaling, "backward_override", "high_precision", ValueError, r"DelayedScaling supports backward_overr"),
    (R.Float8CurrentScaling, "backward_override", "fast", ValueError, r"Float8CurrentScaling.backward_override"),
    (R.Float8CurrentScaling, "fp8_quant_fwd_inp", R.QParams(amax_epsilon=-1.0), ValueError,
     r"Float8CurrentScaling.fp8_quant_fwd_inp.amax_epsilon must be"),
    (R.Float8CurrentScaling, "fp8_format", R.Format.E2M1, TypeError, r"Float8CurrentScaling.fp8_format must be"),
    (R.MXFP8BlockScaling, "margin", 1, ValueError, r"MXFP8BlockScaling.margin is not used"),
    (R.Float8BlockScaling, "w_block_scaling_dim", 3, ValueError, r"Float8BlockScaling.w_block_scaling_dim must be"),
    (R.NVFP4BlockScaling, "fp4_quant_fwd_weight", "2d", TypeError, r"NVFP4BlockScaling.fp4_quant_fwd_weight must"),
    (R.NVFP4BlockScaling, "disable_rht", 1, TypeError, r"NVFP4BlockScaling.disable_rht must be a bool"),
    (R.DelayedScaling, "amax_histroy_len", 16, AttributeError, r"DelayedScaling has no field 'amax_histroy_len'"),
])
def test_a_bad_edit_names_the_recipe_and_field_and_changes_nothing(make, field, value, error, match):
    recipe = make()
    key = RecipeKey.of(recipe)
    with pytest.raises(error, match=match):
        setattr(recipe, field, value)
    assert RecipeKey.of(recipe) == key and recipe == make() and not hasattr(recipe, "amax_histroy_len")


def test_recipes_compare_by_value_and_are_unhashable_qparams_are_frozen():
    a, b = R.Float8CurrentScaling(), R.Float8CurrentScaling()
    assert a == b and a is not b
    b.margin = 1
    assert a != b
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.fp8_quant_fwd_inp.amax_epsilon = 1.0  # as in TE: assign a new QParams to the recipe instead
    assert hash(R.QParams()) == hash(R.QParams())


# ---- the edit's effect on a Linear -------------------------------------------------------------
def _linear():
    torch.manual_seed(0)
    return te.Linear(64, 32, bias=False, device="cpu")


def _step(module, recipe, fn=None):
    """Output, input grad and weight grad of one forward + backward under `recipe`."""
    module.weight.grad = None
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    with te.autocast(recipe=recipe):
        y = (module if fn is None else fn)(x)
    y.backward(g)
    return y.detach(), x.grad, module.weight.grad.clone()


def _equal(a, b):
    return all(torch.equal(s, t) for s, t in zip(a, b))


def test_eager_linear_uses_the_edited_backward_override():
    lin = _linear()
    recipe = R.Float8CurrentScaling()
    plain = _step(lin, recipe)
    recipe.backward_override = "high_precision"
    edited = _step(lin, recipe)
    assert _equal(edited, _step(lin, R.Float8CurrentScaling(backward_override="high_precision")))
    assert torch.equal(edited[0], plain[0])  # the forward stays the recipe's
    assert not torch.equal(edited[1], plain[1]) and not torch.equal(edited[2], plain[2])
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    assert torch.equal(edited[1], g @ lin.weight.detach())  # dgrad on the high-precision weight


def _scales(module):
    """The input / weight scales, which the block's exit updates with the block's recipe (the
    gradient scale moves at the next entry, with that block's recipe, whichever model it runs)."""
    gemm = module.gemm_weights()[0][0]
    return (gemm.fp8_scale.clone(),)


def test_eager_delayed_scaling_uses_the_edited_margin():
    """Delayed scaling's update (at the blocks' exits) reads the margin."""
    edited_lin, fresh_lin, plain_lin = _linear(), _linear(), _linear()
    recipe = R.DelayedScaling(amax_history_len=4)
    _step(edited_lin, recipe)
    recipe.margin = 1
    edited = _step(edited_lin, recipe)
    _step(fresh_lin, R.DelayedScaling(amax_history_len=4))
    assert _equal(edited, _step(fresh_lin, R.DelayedScaling(amax_history_len=4, margin=1)))
    assert _equal(_scales(edited_lin), _scales(fresh_lin))
    plain = R.DelayedScaling(amax_history_len=4)
    _step(plain_lin, plain)
    _step(plain_lin, plain)
    for s_edited, s_plain in zip(_scales(edited_lin), _scales(plain_lin)):
        assert torch.equal(s_edited * 2, s_plain)  # 2**-margin


def test_an_edit_inside_an_open_block_does_not_reach_it():
    lin, reference = _linear(), _linear()
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    recipe = R.DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=recipe):
        key = get_fp8_recipe_key()
        lin(x).backward(g)
        recipe.margin = 1
        recipe.amax_history_len = 8
        lin(x).backward(g)  # its update is the block's: margin 0, history 4
        assert te.get_fp8_recipe() is recipe  # the user's object, edits included (as TE's)
        assert get_fp8_recipe_key() == key
    unedited = R.DelayedScaling(amax_history_len=4)
    with te.autocast(recipe=unedited):
        reference(x).backward(g)
        reference(x).backward(g)
    assert _equal(_scales(lin), _scales(reference))
    with te.autocast(recipe=recipe):  # the next entry takes the edits
        assert RecipeKey.recipe(get_fp8_recipe_key()) == R.DelayedScaling(amax_history_len=8, margin=1)


def test_compiled_linear_recompiles_after_an_edit_and_matches_eager():
    fresh_dynamo()
    lin = _linear()
    compiled = torch.compile(lin, backend="aot_eager", fullgraph=True)
    recipe = R.Float8CurrentScaling()
    plain = _step(lin, recipe, compiled)
    assert _equal(plain, _step(lin, recipe, compiled))
    graphs = unique_graphs()
    recipe.backward_override = "high_precision"
    edited = _step(lin, recipe, compiled)
    assert unique_graphs() > graphs  # a new key: recompiled
    eager = _step(lin, R.Float8CurrentScaling(backward_override="high_precision"))
    assert _equal(edited, eager)
    assert not torch.equal(edited[1], plain[1])
    graphs = unique_graphs()
    recipe.backward_override = None  # back to the first settings: the first graph again
    assert _equal(_step(lin, recipe, compiled), plain) and unique_graphs() == graphs


def test_a_copied_recipe_is_independent():
    a = R.NVFP4BlockScaling()
    b = copy.copy(a)
    b.disable_rht = True
    assert a == R.NVFP4BlockScaling() and a.fp4_quant_fwd_inp.random_hadamard_transform
