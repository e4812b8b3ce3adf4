"""`RecipeKey`: the grammar of the string a recipe crosses op boundaries as, built and read in one place."""
import pytest

from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey


def test_a_recipe_key_names_its_recipe_and_its_quantizers():
    recipe = R.Float8CurrentScaling()
    key = RecipeKey.of(recipe)
    assert key == repr(recipe)
    registered = RecipeKey.recipe(key)
    assert registered == recipe and registered is not recipe  # a copy: editing `recipe` cannot reach it
    assert RecipeKey.recipe(RecipeKey.of(None)) is None and RecipeKey.of(None) == RecipeKey.HIGH_PRECISION
    assert RecipeKey.quantizers(key).input is not None
    assert RecipeKey.quantizers(key) is RecipeKey.quantizers(key)  # cached, shared


def test_high_precision_gemms_round_trip():
    key = RecipeKey.of(R.MXFP8BlockScaling())
    derived = RecipeKey.with_high_precision_gemms(key, ["wgrad", "fprop"])
    assert derived == key + "|high_precision_gemms=fprop+wgrad"  # GEMMS order, not the caller's
    assert RecipeKey.high_precision_gemms(derived) == {"fprop", "wgrad"}
    assert RecipeKey.base(derived) == key and RecipeKey.high_precision_gemms(key) == frozenset()
    assert RecipeKey.recipe(derived) == RecipeKey.recipe(key)  # an equal recipe (keys are reprs)
    q = RecipeKey.quantizers(derived)
    assert q.high_precision_gemms == {"fprop", "wgrad"} and q.input == RecipeKey.quantizers(key).input
    assert RecipeKey.with_high_precision_gemms(key, []) == key
    assert RecipeKey.with_high_precision_gemms(RecipeKey.HIGH_PRECISION, ["dgrad"]) == RecipeKey.HIGH_PRECISION


def test_bad_keys_and_gemm_names_are_named():
    with pytest.raises(KeyError, match=r"was never registered \(RecipeKey.of\(recipe\) first\)"):
        RecipeKey.recipe("Float8CurrentScaling(nonsense=1)")
    with pytest.raises(ValueError, match=r"high-precision GEMMs \['bprop'\]: expected names among"):
        RecipeKey.with_high_precision_gemms(RecipeKey.of(R.Float8CurrentScaling()), ["bprop"])
