"""Quantize and dequantize are differentiable with a straight-through gradient (as TE's), for
every format, eager and compiled; bare storages and calls below autograd record nothing."""
import pytest
import torch
from format_cases import FORMAT_CASES

from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer
from transformer_engine_proto.tensor.quantized_tensor import QuantizedTensor

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _quantizer(case, device):
    q = case.make(True, True)
    if q.has_scale_state():  # delayed scaling: its scale / amax state on the input's device
        q = q.with_scale_state(q.scale.to(device), q.amax.to(device))
    return q


def _input(case, device):
    m, k = 64 * case.m_multiple, 64 * case.k_multiple
    return torch.randn(m, k, device=device, requires_grad=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_quantize_dequantize_pass_the_gradient_straight_through(case, device):
    x = _input(case, device)
    t = _quantizer(case, device)(x)
    assert isinstance(t, QuantizedTensor) and t.requires_grad and t.grad_fn is not None
    y = t.dequantize()
    assert y.requires_grad
    g = torch.randn_like(x)
    (y * g).sum().backward()
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("case", FORMAT_CASES[:2], ids=repr)
def test_a_quantized_leaf_gets_its_gradient_through_dequantize(case):
    t = case.make(True, True)(torch.randn(64 * case.m_multiple, 64 * case.k_multiple))
    assert not t.requires_grad and t.grad_fn is None  # no grad asked: no graph
    t.requires_grad_(True)
    w = torch.randn(t.shape[-1], 8)
    (t.dequantize() @ w).sum().backward()
    assert torch.equal(t.grad, (torch.ones(t.shape[0], 8) @ w.t()).to(t.dtype))


def test_bare_storages_and_no_grad_record_nothing():
    x = torch.randn(16, 32, requires_grad=True)
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    bare = q.quantize(x, internal=True)
    assert not isinstance(bare, torch.Tensor) and not bare.dequantize().requires_grad
    with torch.no_grad():
        assert not q(x).requires_grad


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_equals_eager(backend):
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)

    def f(x):
        return (q(x).dequantize() * x).sum()

    x = torch.randn(32, 64) * 4
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    f(xe).backward()
    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(xc).backward()
    assert torch.equal(xe.grad, xc.grad)
