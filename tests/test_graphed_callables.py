"""te.make_graphed_callables: CUDA-graphed eager training equals ungraphed eager training bit for
bit over several steps for every recipe (losses, weights, delayed-scaling buffers). The cuda
tests run on the GPU machine (qa/L1_gpu.sh); the argument checks run anywhere."""
import copy

import pytest
import torch
from linear_cases import RECIPE_IDS, RECIPES, fold_last_grad_amaxes

import transformer_engine_proto as te

STEPS = 6


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(te.LayerNormLinear(128, 256), torch.nn.GELU(), te.Linear(256, 128)).to(
        device="cuda", dtype=torch.bfloat16)


def _train(model, step_fn, recipe):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        loss = step_fn(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    fold_last_grad_amaxes(recipe)
    return losses


@pytest.mark.cuda
@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_graphed_training_matches_eager(rid):
    recipe = RECIPES[rid]
    ref = _model()
    graphed_model = copy.deepcopy(ref)
    sample = (torch.randn(64, 128, device="cuda", dtype=torch.bfloat16),)
    graphed = te.make_graphed_callables(graphed_model, sample, fp8_enabled=recipe is not None, fp8_recipe=recipe)
    assert graphed is graphed_model  # modules come back with a graphed forward, as in torch

    def eager_step(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return ref(x)

    losses_ref = _train(ref, eager_step, recipe)
    losses_graphed = _train(graphed_model, graphed, recipe)  # no autocast here: the graphed callable enters it
    for a, b in zip(losses_ref, losses_graphed):
        assert torch.equal(a, b), (losses_ref, losses_graphed)
    for (name, a), b in zip(ref.state_dict().items(), graphed_model.state_dict().values()):
        assert torch.equal(a, b), name  # weights and every delayed-scaling buffer
    if rid == "delayed":  # replays did advance the state in place
        h = graphed_model[2].gemm.amax_history
        assert h[-STEPS:].gt(0).all() and not h[0].any()  # rolled at each exit: the steps at the end


@pytest.mark.cuda
def test_graphed_function_and_tuple_of_modules():
    recipe = RECIPES["current"]
    a, b = _model(), _model()
    fn = lambda x: a(x) * 2  # noqa: E731
    sample = (torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
    g_fn, g_b = te.make_graphed_callables((fn, b), (sample, sample), recipe=recipe, enabled=True)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=recipe):
        want = a(x) * 2
    assert torch.equal(g_fn(x), want)
    assert g_b(x).shape == (64, 128)
    # TE's reset(): the graphs are dropped, the module runs its own forward, the function refuses
    assert "forward" in b.__dict__
    g_b.reset()
    g_fn.reset()
    assert "forward" not in b.__dict__ and g_b is b
    with te.autocast(recipe=recipe):
        assert torch.equal(b(x), _model()(x))
    with pytest.raises(RuntimeError, match="graphed callable was reset"):
        g_fn(x)


def test_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="make_graphed_callables captures CUDA graphs and needs a CUDA device"):
        te.make_graphed_callables(te.Linear(16, 16), (torch.randn(4, 16),))


def test_unsupported_arguments():
    with pytest.raises(NotImplementedError, match=r"arguments not supported: \['_order'\]"):
        te.make_graphed_callables(te.Linear(16, 16), (torch.randn(4, 16),), _order=[1, -1])
    with pytest.raises(ValueError, match="recipe / fp8_recipe given twice"):
        te.make_graphed_callables(te.Linear(16, 16), (torch.randn(4, 16),), recipe=RECIPES["current"],
                                  fp8_recipe=RECIPES["delayed"])
