"""te.ops compute dtypes as TE's ops choose them: a linear op computes in its weight's dtype, an
activation in its input's, and torch.autocast's dtype wins over both (also for te.LayerNorm /
te.RMSNorm, which are TE's norm ops); input gradients come back in the input's dtype and
parameter gradients in the parameter's."""
import pytest
import torch
from linear_cases import fresh_dynamo, graph_breaks

import transformer_engine_proto as te
from transformer_engine_proto.custom_ops.norm import norm

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


NORMS = {"LayerNorm": te.LayerNorm, "RMSNorm": te.RMSNorm, "ops.LayerNorm": ops.LayerNorm,
         "ops.RMSNorm": ops.RMSNorm}


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(NORMS))
def test_norm_under_torch_autocast_computes_in_its_dtype(name, autocast_dtype):
    """TE's test_sanity_normalization_amp: fp32 parameters and input under torch.autocast give an
    output in the autocast dtype (the norm of the operands cast to it) and fp32 gradients."""
    torch.manual_seed(0)
    m = NORMS[name](32, device="cpu")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(4, 3, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=autocast_dtype):
        y = m(x)
    y.sum().backward()
    assert y.dtype == autocast_dtype
    assert x.grad.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in m.parameters())
    bias = getattr(m, "bias", None)
    cast = lambda t: None if t is None else t.detach().to(autocast_dtype)  # noqa: E731
    assert torch.equal(y.detach(), norm(cast(x), cast(m.weight), cast(bias), m.eps, name.split(".")[-1]))
    assert m(x).dtype == torch.float32  # outside autocast: the input's dtype


def test_norm_under_torch_autocast_compiles():
    m = te.RMSNorm(32, device="cpu")
    fresh_dynamo()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), m(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert graph_breaks() == 0
