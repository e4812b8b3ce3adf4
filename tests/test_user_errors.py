"""Ordinary slips get an error that says what to do: a recipe class where an instance is needed;
a checkpoint whose delayed-scaling history has another length loads."""
import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R

CLASSES = [R.Float8CurrentScaling, R.MXFP8BlockScaling, R.DelayedScaling]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("entry", ["autocast", "convert_model", "quantized_model_init"])
def test_recipe_class_instead_of_instance_says_pass_an_instance(entry, cls):
    calls = {
        "autocast": lambda: te.autocast(recipe=cls).__enter__(),
        "convert_model": lambda: te.convert_model(torch.nn.Sequential(torch.nn.Linear(32, 32)), recipe=cls),
        "quantized_model_init": lambda: te.quantized_model_init(recipe=cls).__enter__(),
    }
    with pytest.raises(TypeError, match=rf"{entry}.*pass an instance: {cls.__name__}\(\)"):
        calls[entry]()


def test_not_a_recipe_names_the_type():
    with pytest.raises(TypeError, match="recipe must be a transformer_engine_proto.recipe.Recipe instance, got str"):
        te.autocast(recipe="fp8").__enter__()


@pytest.mark.parametrize("saved_len,loaded_len", [(2048, 16), (16, 2048)])
def test_checkpoint_with_another_amax_history_len_loads(saved_len, loaded_len):
    """The history takes the checkpoint's length (a fresh module allocates 1024 rows, a longer
    recipe grows it); training continues with either recipe."""
    torch.manual_seed(0)
    src = te.Linear(32, 32)
    with te.autocast(recipe=R.DelayedScaling(amax_history_len=saved_len)):
        for _ in range(3):
            src(torch.randn(8, 32)).sum().backward()
    state = src.state_dict()
    names = ("amax_history", "grad_amax_history", "fp8_scale", "grad_fp8_scale")
    saved = {name: getattr(src.gemm, name).clone() for name in names}  # autocast below grows src's too
    dst = te.Linear(32, 32)
    with te.autocast(recipe=R.DelayedScaling(amax_history_len=loaded_len)):
        dst(torch.randn(8, 32))  # allocates the history for this recipe first
    dst.load_state_dict(state)
    for name in names:
        assert torch.equal(getattr(dst.gemm, name), saved[name]), name
    for length in (saved_len, loaded_len):
        with te.autocast(recipe=R.DelayedScaling(amax_history_len=length)):
            y = dst(torch.randn(8, 32))
        y.sum().backward()
        assert torch.isfinite(y).all()


def test_longer_history_keeps_the_recorded_amaxes():
    m = te.Linear(32, 32)
    with te.autocast(recipe=R.DelayedScaling(amax_history_len=4)):
        m(torch.randn(8, 32)).sum().backward()
    before = m.gemm.amax_history[:4].clone()
    with te.autocast(recipe=R.DelayedScaling(amax_history_len=2048)):
        pass
    assert m.gemm.amax_history.shape[0] == 2048
    assert torch.equal(m.gemm.amax_history[:4], before)
