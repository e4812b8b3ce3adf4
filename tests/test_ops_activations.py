"""te.ops activations (transformer_engine_proto/ops_api/activations.py) against TE's formulas written
out in plain torch: forward, backward, the bfloat16 rounding, the gated half, the interleaved
layout, and the parameters of the clamped / soft-capped SwiGLU forms."""
import pytest
import torch
import torch.nn.functional as F
from test_ops_api import _close, _fwd_bwd, _x, ops


def _gelu(t):
    return F.gelu(t, approximate="tanh")


def _qgelu(t):
    return t * torch.sigmoid(1.702 * t)


def _srelu(t):
    return F.relu(t) ** 2


def _gated(act):
    def ref(t):
        a, b = t.chunk(2, -1)  # TE gates the first half
        return act(a) * b
    return ref


ACTIVATIONS = {
    "GELU": _gelu, "QGELU": _qgelu, "ReLU": F.relu, "SReLU": _srelu, "SiLU": F.silu,
    "GLU": _gated(torch.sigmoid), "GEGLU": _gated(_gelu), "QGEGLU": _gated(_qgelu), "ReGLU": _gated(F.relu),
    "SReGLU": _gated(_srelu), "SwiGLU": _gated(F.silu),
}


def _clamped_swiglu(t, limit=7.0, alpha=1.702, offset=1.0):
    """GPT-OSS's activation written out (its halves are TE's: gates first)."""
    gate, linear = t.chunk(2, -1)
    bound = torch.tensor(limit, dtype=t.dtype)
    gate, linear = torch.minimum(gate, bound), torch.maximum(torch.minimum(linear, bound), -bound)
    return gate * torch.sigmoid(alpha * gate) * (linear + offset)


def _situglu(t, beta1=4.0, beta2=25.0):
    a, b = t.chunk(2, -1)
    return beta1 * torch.tanh(a / beta1) * torch.sigmoid(a) * (beta2 * torch.tanh(b / beta2))


ACTIVATIONS.update(ClampedSwiGLU=_clamped_swiglu, SiTUGLU=_situglu)


@pytest.mark.parametrize("name,kwargs,ref", [
    ("ClampedSwiGLU", dict(limit=2.0, alpha=1.0, glu_linear_offset=0.0),
     lambda t: _clamped_swiglu(t, 2.0, 1.0, 0.0)),
    ("SiTUGLU", dict(beta1=1.5, beta2=3.0), lambda t: _situglu(t, 1.5, 3.0)),
])
def test_glu_variants_take_their_parameters(name, kwargs, ref):
    """Inputs well past the clamp / soft cap: the parameters shape the output and its gradient (the
    clamped region passes none), in eager and fullgraph compiled alike."""
    torch.manual_seed(0)
    x = (_x(4, 16, dtype=torch.float64) * 4).float()
    op = getattr(ops, name)(**kwargs)
    out, grads = _fwd_bwd(op, x.detach().requires_grad_())
    ref_out, ref_grads = _fwd_bwd(ref, x.double().detach().requires_grad_())
    _close(out, ref_out.float())
    _close(grads[0], ref_grads[0].float())
    assert not torch.allclose(out, getattr(ops, name)()(x))  # the defaults differ from these parameters
    if name == "ClampedSwiGLU":
        assert (grads[0][:, 8:][x[:, 8:].abs() > 2.0] == 0).all()  # clamped linear half: no gradient
    compiled = torch.compile(op, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), op(x))
    blocks = ops.Sequential(getattr(ops, name)(glu_interleave_size=4, **kwargs))
    interleaved = torch.stack([x[:, :8].reshape(4, 2, 4), x[:, 8:].reshape(4, 2, 4)], dim=2).reshape(4, 16)
    _close(blocks(interleaved), ref_out.float())


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_matches_torch(name):
    torch.manual_seed(0)
    x = _x(4, 3, 16, dtype=torch.float64)
    op = getattr(ops, name)()
    out, grads = _fwd_bwd(op, x.float().detach().requires_grad_())
    ref, ref_grads = _fwd_bwd(ACTIVATIONS[name], x)
    _close(out, ref.float())
    _close(grads[0], ref_grads[0].float())
    # bfloat16 in, bfloat16 out: computed in float32 and rounded once, as TE's kernels
    xb = x.detach().bfloat16()
    assert torch.equal(op(xb), ACTIVATIONS[name](xb.float()).bfloat16())


def test_glu_gates_the_first_half_unlike_torch():
    x = torch.randn(8, 6)
    a, b = x.chunk(2, -1)
    assert torch.equal(ops.GLU()(x), torch.sigmoid(a) * b)
    assert not torch.allclose(ops.GLU()(x), F.glu(x, -1))  # torch gates the second half


def test_swiglu_interleaved_layout():
    torch.manual_seed(0)
    gates, values = torch.randn(5, 8), torch.randn(5, 8)
    # blocks of 2: [a1 a2 b1 b2 a3 a4 b3 b4 ...]
    interleaved = torch.stack([gates.reshape(5, 4, 2), values.reshape(5, 4, 2)], dim=2).reshape(5, 16)
    want = F.silu(gates) * values
    _close(ops.SwiGLU(glu_interleave_size=2)(interleaved), want, 1e-6)
    _close(ops.SwiGLU()(torch.cat([gates, values], -1)), want, 1e-6)


SCALED = {"ScaledSReLU": "SReLU", "ScaledSwiGLU": "SwiGLU", "ScaledSiTUGLU": "SiTUGLU",
          "ScaledClampedQGeGLU": "ClampedSwiGLU"}


@pytest.mark.parametrize("name", list(SCALED))
def test_row_scaled_activations(name):
    """op(x, scales) = activation(x) * scales[..., None], with gradients for both x and the scales
    (float64 reference), one bfloat16 rounding after the scale, as an extra input of a Sequential,
    compiled fullgraph, and a clear error for scales of the wrong shape."""
    torch.manual_seed(0)
    x, scales = _x(5, 3, 16, dtype=torch.float64), _x(5, 3, dtype=torch.float64)
    ref = ACTIVATIONS[SCALED[name]]
    op = getattr(ops, name)()
    out, grads = _fwd_bwd(op, x.float().detach().requires_grad_(), scales.float().detach().requires_grad_())
    ref_out, ref_grads = _fwd_bwd(lambda a, s: ref(a) * s.unsqueeze(-1), x, scales)
    _close(out, ref_out.float())
    _close(grads[0], ref_grads[0].float())
    _close(grads[1], ref_grads[1].float())
    assert grads[1].abs().sum() > 0  # the scales do get a gradient
    xb, sb = x.detach().bfloat16(), scales.detach().bfloat16()
    assert torch.equal(op(xb, sb), (ref(xb.float()) * sb.float().unsqueeze(-1)).bfloat16())
    seq = ops.Sequential(op, ops.Identity())
    assert seq.num_extra_inputs == 1 and torch.equal(seq(xb, sb), op(xb, sb))
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(xb, sb), op(xb, sb))
    with pytest.raises(ValueError, match=f"{name}: scales must have the input's shape without its last dim"):
        op(xb, sb[:, :1])


@pytest.mark.parametrize("name", ["ScaledSwiGLU", "ScaledSiTUGLU", "ScaledClampedQGeGLU"])
def test_scaled_glus_take_their_parameters_and_refuse_recompute(name):
    """TE's arguments: the interleave size positionally, the base op's parameters by keyword;
    activation_recompute_in_mlp=True is refused as in TE (ScaledSReLU keeps it)."""
    params = {"ScaledSiTUGLU": dict(beta1=1.5, beta2=3.0),
              "ScaledClampedQGeGLU": dict(limit=2.0, alpha=1.0, glu_linear_offset=0.0)}.get(name, {})
    op = getattr(ops, name)(4, **params)
    base = getattr(ops, SCALED[name])(glu_interleave_size=4, **params)
    x, scales = torch.randn(6, 16) * 4, torch.rand(6)
    assert op.glu_interleave_size == 4 and op.activation_recompute_in_mlp is False
    _close(op(x, scales), base(x) * scales.unsqueeze(-1))
    with pytest.raises(ValueError, match="does not support activation recomputation"):
        getattr(ops, name)(activation_recompute_in_mlp=True)
    assert ops.ScaledSReLU(activation_recompute_in_mlp=True).activation_recompute_in_mlp


@pytest.mark.parametrize("name", ["GELU", "SwiGLU"])
def test_cache_quantized_input_saves_fp8_and_differentiates_there(name):
    """cache_quantized_input=True: the same forward; the backward is the activation's gradient at
    the input's FP8 (E4M3, current scaling) copy, the one TE's op saves."""
    from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer
    torch.manual_seed(0)
    x = _x(8, 32)
    y, (dx,) = _fwd_bwd(getattr(ops, name)(cache_quantized_input=True), x)
    _close(y, ACTIVATIONS[name](x))
    x_fp8 = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)(x.detach()).dequantize().requires_grad_()
    assert not torch.equal(x_fp8, x)
    _, (dx_ref,) = _fwd_bwd(ACTIVATIONS[name], x_fp8)
    _close(dx, dx_ref)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cache_quantized_input_compiles_fullgraph(backend):
    """cache_quantized_input=True under torch.compile(fullgraph=True): the forward and the
    FP8-saved backward are eager's, bitwise under aot_eager; inductor fuses the float32 math (its
    CPU sigmoid differs from ATen's in the last bit even without the cache), so there to rounding."""
    torch.manual_seed(0)
    op = ops.SwiGLU(cache_quantized_input=True)
    x = _x(8, 32)
    y, (dx,) = _fwd_bwd(op, x)
    y_c, (dx_c,) = _fwd_bwd(torch.compile(op, backend=backend, fullgraph=True), x)
    if backend == "aot_eager":
        assert torch.equal(y_c, y) and torch.equal(dx_c, dx)
    else:
        _close(y_c, y)
        _close(dx_c, dx)
