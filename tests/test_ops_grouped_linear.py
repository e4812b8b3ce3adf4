"""te.ops.GroupedLinear (ops_api/grouped_linear.py): TE's grouped-GEMM operation against plain torch
per group, against te.GroupedLinear under a recipe, inside an MoE MLP `Sequential` (eager ==
compiled), main_grad accumulation, and the arguments it refuses."""
import pytest
import torch
import torch.nn.functional as F

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R

ops = te.ops
SPLITS = [5, 0, 11, 16]


def _op(bias=True, **kw):
    torch.manual_seed(0)
    op = ops.GroupedLinear(len(SPLITS), 32, 16, bias=bias, device="cpu", **kw)
    with torch.no_grad():
        for b in op.biases if bias else ():
            b.normal_()
    return op


@pytest.mark.parametrize("bias", [True, False])
def test_matches_a_linear_per_group(bias):
    op = _op(bias)
    x = torch.randn(sum(SPLITS), 32, dtype=torch.float64).float().requires_grad_()
    dy = torch.randn(sum(SPLITS), 16)
    y = op(x, torch.tensor(SPLITS, dtype=torch.int32))
    y.backward(dy)
    xr = x.detach().double().requires_grad_()
    ws = [w.detach().double().requires_grad_() for w in op.weights]
    bs = [b.detach().double().requires_grad_() if bias else None for b in op.biases]
    ref = torch.cat([F.linear(xi, w, b) for xi, w, b in zip(xr.split(SPLITS), ws, bs)])
    ref.backward(dy.double())
    torch.testing.assert_close(y, ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad.float(), rtol=1e-5, atol=1e-5)
    for i in range(len(SPLITS)):
        torch.testing.assert_close(getattr(op, f"weight{i}").grad, ws[i].grad.float(), rtol=1e-5, atol=1e-5)
        if bias:
            torch.testing.assert_close(getattr(op, f"bias{i}").grad, bs[i].grad.float(), rtol=1e-5, atol=1e-5)
    assert sorted(op.state_dict()) == ["_extra_state"] + [f"{p}{i}" for p in ("bias", "weight") if bias or p == "weight"
                                                           for i in range(len(SPLITS))]


def test_same_bits_as_the_module_under_a_recipe():
    """The operation is te.GroupedLinear with TE's op arguments: same weights, same bits."""
    op = _op()
    module = te.GroupedLinear(len(SPLITS), 32, 16, device="cpu")
    module.load_state_dict(op.state_dict())
    x = torch.randn(sum(SPLITS), 32)
    with te.autocast(recipe=R.Float8CurrentScaling()):
        quantized = op(x, SPLITS)
        assert torch.equal(quantized, module(x, SPLITS))
    assert not torch.equal(quantized, op(x, SPLITS))  # the recipe did quantize


def test_moe_mlp_sequential_compiles_to_eager_bits():
    """GroupedLinear -> ScaledSwiGLU (routing weights) -> GroupedLinear: extra inputs in order,
    fullgraph compiled equal to eager (split sizes as a list under compile)."""
    torch.manual_seed(0)
    mlp = ops.Sequential(ops.GroupedLinear(len(SPLITS), 32, 64, device="cpu"), ops.ScaledSwiGLU(),
                         ops.GroupedLinear(len(SPLITS), 32, 32, device="cpu"))
    assert mlp.num_extra_inputs == 3
    x, probs = torch.randn(sum(SPLITS), 32), torch.rand(sum(SPLITS))
    eager = mlp(x, SPLITS, probs, SPLITS)
    compiled = torch.compile(mlp, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, SPLITS, probs, SPLITS), eager)


def test_accumulates_into_main_grad():
    op = _op(accumulate_into_main_grad=True)
    for w in op.weights:
        w.main_grad = torch.ones_like(w, dtype=torch.float32)
    x = torch.randn(sum(SPLITS), 32)
    op(x, SPLITS).sum().backward()
    for w, xi in zip(op.weights, x.split(SPLITS)):
        want = 1 + torch.ones(16, xi.shape[0]) @ xi
        torch.testing.assert_close(w.main_grad, want, rtol=1e-5, atol=1e-5)
        assert w.grad is None or not w.grad.any()


def test_refusals_name_the_argument():
    for kw in (dict(scale_bias=True), dict(rng_state_tracker_function=lambda: 0)):
        with pytest.raises(NotImplementedError, match=f"te.ops.GroupedLinear: {next(iter(kw))}"):
            ops.GroupedLinear(2, 8, 8, device="cpu", **kw)
    with pytest.raises(ValueError, match="m_splits"):
        _op()(torch.randn(sum(SPLITS) + 1, 32), SPLITS)


def test_delay_wgrad_compute_leaves_the_weight_gradients_for_backward_dw():
    """As TE's op: backward gives the input's gradient, `backward_dw()` the parameters' (those of
    the op without delay, bit for bit)."""
    x = torch.randn(sum(SPLITS), 32)
    grads = []
    for delay in (True, False):
        op = _op(delay_wgrad_compute=delay)
        xi = x.clone().requires_grad_()
        op(xi, SPLITS).pow(2).sum().backward()
        if delay:
            assert all(p.grad is None for p in op.parameters()) and xi.grad is not None
            op.backward_dw()
        grads.append([xi.grad] + [p.grad for p in op.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
