"""Norm ops and the fused modules: numerics, opcheck, and compiled == eager for every module type."""
import copy

import pytest
import torch
import torch.nn.functional as F
from compile_cases import assert_matches_eager, compile_for
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._dynamo.utils import counters

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops.norm import norm_fwd

RECIPES = [None, R.DelayedScaling(amax_history_len=4), R.Float8CurrentScaling(), R.MXFP8BlockScaling(),
           R.Float8BlockScaling(), R.NVFP4BlockScaling(disable_stochastic_rounding=True)]


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norm_matches_torch_and_grads(kind, zero_centered_gamma):
    torch.manual_seed(0)
    mod = (te.LayerNorm if kind == "LayerNorm" else te.RMSNorm)(64, eps=1e-5, zero_centered_gamma=zero_centered_gamma)
    with torch.no_grad():
        mod.weight.normal_()
        if mod.bias is not None:
            mod.bias.normal_()
    x = torch.randn(3, 5, 64, dtype=torch.float64).float().requires_grad_()
    gamma = mod.weight + 1 if zero_centered_gamma else mod.weight
    if kind == "LayerNorm":
        ref = F.layer_norm(x, (64,), gamma, mod.bias, 1e-5)
    else:
        ref = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-5) * gamma
    out = mod(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, mod.weight], g)
    refs = torch.autograd.grad(ref, [x, mod.weight], g)
    for a, b in zip(grads, refs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_opcheck(kind):
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    b = torch.randn(32, requires_grad=True) if kind == "LayerNorm" else None
    torch.library.opcheck(norm_fwd, (x, w, b, 1e-5, kind, False))


def _modules(kind, recipe_ok_features=64):
    h = recipe_ok_features
    return {
        "Linear": lambda: te.Linear(h, h),
        "LayerNormLinear": lambda: te.LayerNormLinear(h, 2 * h, normalization="RMSNorm"),
        "LayerNormMLP": lambda: te.LayerNormMLP(h, 2 * h, activation="swiglu"),
        "LayerNormMLP_gelu": lambda: te.LayerNormMLP(h, 2 * h, activation="gelu", normalization="LayerNorm"),
        "TransformerLayer": lambda: te.TransformerLayer(h, 2 * h, 2, hidden_dropout=0.0, attention_dropout=0.0),
    }[kind]


def _check_compiled_equal_eager(kind, recipe, dtype, backend):
    torch.manual_seed(0)
    m = _modules(kind)().to(dtype)
    mc = copy.deepcopy(m)
    torch._dynamo.reset()
    counters.clear()
    cm = compile_for(mc, backend)
    for _ in range(2):
        x = torch.randn(32, 2, 64, dtype=dtype, requires_grad=True)
        xc = x.detach().clone().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y, yc = m(x), cm(xc)
        y.float().square().mean().backward()
        yc.float().square().mean().backward()
        assert_matches_eager(yc, y, backend, "output")
        assert_matches_eager(xc.grad, x.grad, backend, "input grad")
        for (name, p), pc in zip(m.named_parameters(), mc.parameters()):
            assert_matches_eager(pc.grad, p.grad, backend, name)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


@settings(max_examples=8, deadline=None)
@given(kind=st.sampled_from(["LayerNormLinear", "LayerNormMLP", "LayerNormMLP_gelu", "TransformerLayer"]),
       recipe=st.sampled_from(RECIPES), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_modules_compiled_equal_eager_bitwise(kind, recipe, dtype):
    _check_compiled_equal_eager(kind, recipe, dtype, "aot_eager")


# inductor compiles each example's graph (seconds on CPU, minutes for MXFP8 / NVFP4): high precision
# and delayed scaling in CI, the other recipes slow
@pytest.mark.parametrize("recipe", RECIPES[:2], ids=["high_precision", "delayed"])
@settings(max_examples=2, deadline=None)
@given(kind=st.sampled_from(["LayerNormLinear", "LayerNormMLP", "LayerNormMLP_gelu", "TransformerLayer"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_modules_inductor_equal_eager(recipe, kind, dtype):
    _check_compiled_equal_eager(kind, recipe, dtype, "inductor")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES[2:], ids=["current", "mxfp8", "block", "nvfp4"])
@settings(max_examples=1, deadline=None)
@given(kind=st.sampled_from(["LayerNormLinear", "LayerNormMLP", "LayerNormMLP_gelu", "TransformerLayer"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_modules_inductor_equal_eager_other_recipes(recipe, kind, dtype):
    _check_compiled_equal_eager(kind, recipe, dtype, "inductor")


def test_layernorm_linear_returns_layernorm_output_and_bias():
    m = te.LayerNormLinear(64, 32, return_layernorm_output=True, return_bias=True)
    x = torch.randn(8, 64)
    with te.autocast(recipe=R.Float8CurrentScaling()):
        out, bias, ln_out = m(x)
    torch.testing.assert_close(ln_out, F.layer_norm(x, (64,), m.layer_norm_weight, m.layer_norm_bias, 1e-5))
    assert bias is m.bias and out.shape == (8, 32)
    ref = F.linear(ln_out, m.weight)  # bias returned, not added
    assert ((out - ref).norm() / ref.norm()) < 0.05


_ELEMENTWISE = {"gelu": lambda t: F.gelu(t, approximate="tanh"), "qgelu": lambda t: t * torch.sigmoid(1.702 * t),
                "relu": F.relu, "srelu": lambda t: F.relu(t) ** 2, "silu": F.silu}
_GATED = {"glu": torch.sigmoid, "swiglu": F.silu, "geglu": _ELEMENTWISE["gelu"], "qgeglu": _ELEMENTWISE["qgelu"],
          "reglu": F.relu, "sreglu": _ELEMENTWISE["srelu"]}


@pytest.mark.parametrize("activation", list(_ELEMENTWISE) + list(_GATED))
def test_layernorm_mlp_activations_match_high_precision_reference(activation):
    """TE's activation names and definitions; a gated one gates fc1's first half."""
    torch.manual_seed(0)
    m = te.LayerNormMLP(64, 128, activation=activation)
    x = torch.randn(16, 64)
    ln = F.layer_norm(x, (64,), m.layer_norm_weight, m.layer_norm_bias, 1e-5)
    h = F.linear(ln, m.fc1_weight, m.fc1_bias)
    if activation in _ELEMENTWISE:
        a = _ELEMENTWISE[activation](h)
    else:
        u, v = h.chunk(2, -1)
        a = _GATED[activation](u) * v
    ref = F.linear(a, m.fc2_weight, m.fc2_bias)
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)  # outside autocast: high precision
    with te.autocast(recipe=R.Float8CurrentScaling()):
        q = m(x)
    assert ((q - ref).norm() / ref.norm()) < 0.08


def test_transformer_layer_is_causal_and_checks_input():
    torch.manual_seed(0)
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(16, 2, 64)
    y = layer(x)
    x2 = x.clone()
    x2[10:] = torch.randn(6, 2, 64)  # changing later tokens must not change earlier outputs
    torch.testing.assert_close(layer(x2)[:10], y[:10])
    with pytest.raises(ValueError, match="3D"):
        layer(torch.randn(16, 64))
    with pytest.raises(ValueError, match="divisible"):
        te.TransformerLayer(64, 128, 5)


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="activation"):
        te.LayerNormMLP(64, 128, activation="tanhh")
    with pytest.raises(ValueError, match="normalization"):
        te.LayerNormLinear(64, 64, normalization="BatchNorm")
    with pytest.raises(TypeError, match="unsupported"):
        te.Linear(64, 64, ub_overlap_ag=True)  # tp_size etc. are supported (test_tensor_parallel.py)
    m = te.LayerNormMLP(48, 64)
    with te.autocast(recipe=R.MXFP8BlockScaling()):
        with pytest.raises(ValueError, match="32"):
            m(torch.randn(32, 48))


FUSABLE = [R.Float8CurrentScaling(), R.MXFP8BlockScaling(), R.Float8BlockScaling(),
           R.NVFP4BlockScaling(disable_stochastic_rounding=True)]


@pytest.mark.parametrize("recipe", FUSABLE, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("weight_grad", [True, False])
def test_fused_norm_quantize_equals_norm_then_linear(recipe, weight_grad):
    """LayerNormLinear quantizes inside the norm op (te_proto::norm_quantize_fwd) and hands the
    buffers to the linear op; the result is bitwise the unfused LayerNorm -> Linear."""
    torch.manual_seed(0)
    fused = te.LayerNormLinear(64, 32)
    norm, lin = te.LayerNorm(64), te.Linear(64, 32)
    with torch.no_grad():
        lin.weight.copy_(fused.weight)
        lin.bias.copy_(fused.bias)
    fused.weight.requires_grad_(weight_grad)
    lin.weight.requires_grad_(weight_grad)
    x = torch.randn(32, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = fused(x)
        y2 = lin(norm(x2))
    assert torch.equal(y, y2)
    y.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(fused.layer_norm_weight.grad, norm.weight.grad)
    if weight_grad:
        assert torch.equal(fused.weight.grad, lin.weight.grad)
