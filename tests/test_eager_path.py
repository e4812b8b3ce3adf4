"""Eager calls on plain tensors run the op bodies through an autograd.Function (custom_ops/eager_path.py);
the results must equal the custom-op path bit for bit, module state included."""
import copy

import pytest
import torch
from linear_cases import RECIPE_IDS, RECIPES, recipe_ctx

import transformer_engine_proto as te
from transformer_engine_proto.custom_ops import eager_path


def _run(model, recipe, x, dy, use_eager_path: bool, monkeypatch):
    if not use_eager_path:
        monkeypatch.setattr(eager_path, "takes_eager_path", lambda *args: False)
    x = x.clone().requires_grad_()
    outs, fns = [], set()
    for _ in range(2):  # a second step: delayed scaling reads the state the first one wrote
        with recipe_ctx(recipe):
            y = model(x)
        y.backward(dy)
        outs.append(y.detach())
        node = y.grad_fn
        while node is not None and node.next_functions:  # collect the autograd node names
            fns.add(type(node).__name__)
            node = next((f for f, _ in node.next_functions if f is not None), None)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [p.grad.clone() for p in model.parameters()]
    return outs + [x.grad] + grads, state, fns


@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_eager_path_equals_the_op_path(rid, monkeypatch):
    recipe = RECIPES[rid]
    torch.manual_seed(0)
    model = torch.nn.Sequential(te.LayerNormLinear(64, 64), te.Linear(64, 32))
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    fast, fast_state, fast_fns = _run(copy.deepcopy(model), recipe, x, dy, True, monkeypatch)
    slow, slow_state, slow_fns = _run(copy.deepcopy(model), recipe, x, dy, False, monkeypatch)
    assert any(n.startswith("Eager_") for n in fast_fns) and not any(n.startswith("Eager_") for n in slow_fns)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert fast_state.keys() == slow_state.keys()
    for k in fast_state:
        assert torch.equal(fast_state[k], slow_state[k]), k


def test_subclass_and_tracing_inputs_take_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert eager_path.takes_eager_path(torch.ones(1), torch.nn.Parameter(torch.ones(1)), None)
    with FakeTensorMode():
        assert not eager_path.takes_eager_path(torch.ones(1))
    from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer

    qt = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(torch.randn(16, 16))
    assert not eager_path.takes_eager_path(torch.ones(1), qt)
    assert not eager_path.takes_eager_path(torch.ones(1), [torch.ones(1), qt], "key", 3)


def test_functorch_transforms_and_their_tensors_take_the_op():
    """Inside a functorch transform, and for a wrapper tensor escaping one, the call goes through the
    op (the eager path calls autograd.Function's C entry, which handles neither)."""
    seen = []

    def f(x):
        seen.append((eager_path.takes_eager_path(x), eager_path.takes_eager_path(torch.ones(1))))
        leaked.append(x)
        return x.sum()

    leaked = []
    torch.func.grad(f)(torch.ones(3))
    assert seen == [(False, False)]
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])  # its transform has exited
    assert not eager_path.takes_eager_path(leaked[0])
    assert not eager_path.takes_eager_path(torch.ones(1), [leaked[0]])
    assert eager_path.takes_eager_path(torch.ones(1), [torch.ones(1)], None, "key", 3)
