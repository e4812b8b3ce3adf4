"""te.ops compute dtypes as TE's ops choose them: a linear op computes in its weight's dtype, an
activation in its input's, and torch.autocast's dtype wins over both; input gradients come back
in the input's dtype and parameter gradients in the parameter's."""
import pytest
import torch

import transformer_engine_proto as te

ops = te.ops


@pytest.mark.parametrize("weight_dtype, input_dtype", [(torch.float32, torch.float16),
                                                        (torch.bfloat16, torch.float32)])
def test_linear_computes_in_the_weight_dtype(weight_dtype, input_dtype):
    torch.manual_seed(0)
    op = ops.Linear(16, 8, dtype=weight_dtype)
    x = torch.randn(4, 16, dtype=input_dtype, requires_grad=True)
    y = op(x)
    y.backward(torch.ones_like(y))
    assert y.dtype == weight_dtype
    assert x.grad.dtype == input_dtype and op.weight.grad.dtype == weight_dtype
    ref = torch.nn.functional.linear(x.detach().to(weight_dtype), op.weight.detach(), op.bias.detach())
    torch.testing.assert_close(y.detach(), ref)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_torch_autocast_dtype_wins(autocast_dtype):
    torch.manual_seed(0)
    model = ops.Sequential(ops.Linear(16, 32, bias=False), ops.SwiGLU())
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=autocast_dtype):
        y = model(x)
    y.backward(torch.ones_like(y))
    assert y.dtype == autocast_dtype
    assert x.grad.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=autocast_dtype):
        assert ops.GELU()(torch.randn(4, 16)).dtype == autocast_dtype
