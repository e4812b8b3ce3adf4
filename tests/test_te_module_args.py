"""TE's module arguments and parameter layout as TE's own tests use them: the fused modules'
parameter names and order, LayerNormMLP's `checkpoint`, and (test_te_layer_args.py) the
TransformerLayer / MultiheadAttention arguments. Each against a plain-torch computation, eager and
compiled (aot_eager, inductor)."""
import pytest
import torch
import torch.nn.functional as F
from compile_cases import assert_matches_eager, compile_for
from linear_cases import RECIPES, backend_params, fresh_dynamo, graph_breaks, recipe_ctx
from torch import nn

import transformer_engine_proto as te


def _run(m, x, grad_out, recipe=None):
    """[output, input grad, every parameter's grad in `parameters()` order], as TE's tests collect."""
    for p in m.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    with recipe_ctx(recipe):
        out = m(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(grad_out)
    return [out.detach(), x.grad] + [p.grad for p in m.parameters()]


def _randomize(m, seed=1):
    """Parameters away from their init (gammas around 1), so every parameter matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if name.endswith("norm_weight") else 0.0))


# ---- the fused modules' parameters: TE's names, in TE's order -------------------------------------------

@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_modules_register_te_parameter_names_in_te_order(normalization, bias):
    ln = ["layer_norm_weight"] + (["layer_norm_bias"] if normalization == "LayerNorm" else [])
    lnl = te.LayerNormLinear(16, 32, bias=bias, normalization=normalization)
    assert [n for n, _ in lnl.named_parameters()] == ln + ["weight"] + (["bias"] if bias else [])
    mlp = te.LayerNormMLP(16, 32, bias=bias, normalization=normalization)
    assert [n for n, _ in mlp.named_parameters()] == ln + (
        ["fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"] if bias else ["fc1_weight", "fc2_weight"])
    assert (mlp.layer_norm_bias is None) == (normalization == "RMSNorm")


class _TorchLayerNormLinear(nn.Module):
    def __init__(self, h, out, bias):
        super().__init__()
        self.layernorm = nn.LayerNorm(h, eps=1e-5)
        self.linear = nn.Linear(h, out, bias=bias)

    def forward(self, x):
        return self.linear(self.layernorm(x))


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_linear_grads_zip_with_a_torch_reference(bias):
    """TE's test_layernorm_linear_accuracy: the parameters are shared by assignment and the grads
    compared pairwise in `parameters()` order."""
    torch.manual_seed(0)
    m = te.LayerNormLinear(32, 64, bias=bias)
    _randomize(m)
    ref = _TorchLayerNormLinear(32, 64, bias)
    with torch.no_grad():
        ref.layernorm.weight = nn.Parameter(m.layer_norm_weight.clone())
        ref.layernorm.bias = nn.Parameter(m.layer_norm_bias.clone())
        ref.linear.weight = nn.Parameter(m.weight.clone())
        if bias:
            ref.linear.bias = nn.Parameter(m.bias.clone())
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 64)
    got, want = _run(m, x, g), _run(ref, x, g)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_layer_norm_parameters_can_be_replaced_by_assignment():
    """TE's tests share weights with `module.layer_norm_weight = Parameter(...)`: forward uses it."""
    m = te.LayerNormMLP(16, 32)
    new_w, new_b = nn.Parameter(torch.rand(16) + 0.5), nn.Parameter(torch.randn(16))
    m.layer_norm_weight, m.layer_norm_bias = new_w, new_b
    x = torch.randn(4, 16)
    h = F.gelu(F.linear(F.layer_norm(x, (16,), new_w, new_b, 1e-5), m.fc1_weight, m.fc1_bias), approximate="tanh")
    torch.testing.assert_close(m(x), F.linear(h, m.fc2_weight, m.fc2_bias), rtol=1e-5, atol=1e-5)
    assert next(m.parameters()) is new_w


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
def test_checkpoints_with_the_norm_under_norm_dot_load(kind):
    """State dicts written when the norm's parameters lived at `norm.weight` / `norm.bias` load."""
    make = (lambda: te.LayerNormLinear(16, 32)) if kind == "LayerNormLinear" else (lambda: te.LayerNormMLP(16, 32))
    src, dst = make(), make()
    _randomize(src)
    old = {k.replace("layer_norm_", "norm."): v for k, v in src.state_dict().items()}
    assert "norm.weight" in old
    dst.load_state_dict(old)
    assert torch.equal(dst.layer_norm_weight, src.layer_norm_weight)
    assert torch.equal(dst.layer_norm_bias, src.layer_norm_bias)


# ---- LayerNormMLP(checkpoint=True) ---------------------------------------------------------------------

def _mlp_pair(**kw):
    torch.manual_seed(0)
    ref = te.LayerNormMLP(32, 64, **kw)
    ckpt = te.LayerNormMLP(32, 64, checkpoint=True, **kw)
    _randomize(ref)
    ckpt.load_state_dict(ref.state_dict())
    return ref, ckpt


@pytest.mark.parametrize("rid", ["high_precision", "current", "delayed"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_layernorm_mlp_checkpoint_equals_no_checkpoint_bitwise(rid, activation):
    """TE's test_layernorm_mlp_accuracy_checkpoint: outputs and every grad bit for bit."""
    ref, ckpt = _mlp_pair(activation=activation, return_bias=True)
    x, g = torch.randn(16, 2, 32), torch.randn(16, 2, 32)
    for step in range(2):  # delayed scaling: the second step runs on the first one's scales
        for a, b in zip(_run(ckpt, x, g, RECIPES[rid]), _run(ref, x, g, RECIPES[rid])):
            assert (a is None and b is None) or torch.equal(a, b), f"step {step}"


def _saved_numel(m, x):
    """Elements that autograd keeps for backward of one forward (outside checkpoint's own hooks)."""
    numel = [0]

    def pack(t):
        numel[0] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(x.requires_grad_())
    return numel[0]


def test_layernorm_mlp_checkpoint_keeps_no_activations():
    ref, ckpt = _mlp_pair()
    x = torch.randn(64, 32)
    assert _saved_numel(ref, x) >= 64 * 64  # fc2's input at least
    assert _saved_numel(ckpt, x) == x.numel()  # the input only


def _assert_steps_match_eager(eager_m, compiled, x, g, rid, backend):
    """Two training steps of the compiled module equal the eager one's (output and grads), no graph break."""
    for step in range(2):
        want, got = _run(eager_m, x, g, RECIPES[rid]), _run(compiled, x, g, RECIPES[rid])
        for i, (a, b) in enumerate(zip(got, want)):
            assert_matches_eager(a, b, backend, f"step {step} tensor {i}")
    assert graph_breaks() == 0


@pytest.mark.parametrize("backend,rid", backend_params(["high_precision", "delayed"], ci=("high_precision", "delayed")))
def test_layernorm_mlp_checkpoint_compiled_matches_eager(backend, rid):
    fresh_dynamo()
    eager_m, compiled = _mlp_pair(activation="swiglu")[1], compile_for(_mlp_pair(activation="swiglu")[1], backend)
    x, g = torch.randn(16, 2, 32), torch.randn(16, 2, 32)
    _assert_steps_match_eager(eager_m, compiled, x, g, rid, backend)


def test_layernorm_mlp_checkpoint_must_be_a_bool():
    with pytest.raises(TypeError, match=r"LayerNormMLP .*checkpoint must be a bool"):
        te.LayerNormMLP(16, 32, checkpoint="yes")


# ---- LayerNormMLP's clamped_swiglu and TE's activation_params -------------------------------------------

def _torch_clamped_swiglu_mlp(m, x, limit, alpha, offset):
    """LayerNormMLP(activation="clamped_swiglu") written out in plain torch, TE's formula."""
    h = F.layer_norm(x, (x.shape[-1],), m.layer_norm_weight, m.layer_norm_bias, m.eps)
    h = F.linear(h, m.fc1_weight, m.fc1_bias)
    gate, linear = h.chunk(2, -1)
    gate = gate.clamp(max=limit)
    h = gate * torch.sigmoid(alpha * gate) * (linear.clamp(-limit, limit) + offset)
    return F.linear(h, m.fc2_weight, m.fc2_bias)


@pytest.mark.parametrize("params,expect", [(None, (7.0, 1.702, 1.0)),
                                           ({"limit": 0.5, "alpha": 2.0, "glu_linear_offset": 0.0}, (0.5, 2.0, 0.0))])
def test_layernorm_mlp_clamped_swiglu_is_tes_formula(params, expect):
    torch.manual_seed(0)
    m = te.LayerNormMLP(32, 48, activation="clamped_swiglu", activation_params=params, device="cpu")
    _randomize(m)
    x = torch.randn(8, 32) * 3  # values past the clamp
    torch.testing.assert_close(m(x), _torch_clamped_swiglu_mlp(m, x, *expect), rtol=1e-5, atol=1e-5)
    assert m.fc1_weight.shape == (96, 32)  # gated: fc1 twice the ffn width


@pytest.mark.parametrize("backend,rid", backend_params(["current"], ci=("current",)))
def test_layernorm_mlp_clamped_swiglu_compiled_matches_eager(backend, rid):
    fresh_dynamo()
    torch.manual_seed(0)
    eager_m = te.LayerNormMLP(32, 64, activation="clamped_swiglu", activation_params={"limit": 1.0}, device="cpu")
    compiled = compile_for(eager_m, backend)
    x, g = torch.randn(16, 2, 32) * 2, torch.randn(16, 2, 32)
    _assert_steps_match_eager(eager_m, compiled, x, g, rid, backend)


def test_layernorm_mlp_activation_params_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"activation_params apply to activation='clamped_swiglu' only"):
        te.LayerNormMLP(16, 32, activation="gelu", activation_params={"limit": 1.0}, device="cpu")
    with pytest.raises(ValueError, match=r"unknown activation_params \['beta'\]"):
        te.LayerNormMLP(16, 32, activation="clamped_swiglu", activation_params={"beta": 1.0}, device="cpu")
    te.LayerNormMLP(16, 32, activation="gelu", activation_params=None, device="cpu")  # TE's tests pass None


def test_transformer_layer_hands_activation_params_to_its_mlp():
    layer = te.TransformerLayer(32, 64, 4, activation="clamped_swiglu", activation_params={"limit": 3.0}, device="cpu")
    assert layer.layernorm_mlp.activation_params == {"limit": 3.0}
    with pytest.raises(ValueError, match=r"activation_params apply to activation='clamped_swiglu' only"):
        te.TransformerLayer(32, 64, 4, activation="gelu", activation_params={"limit": 3.0}, device="cpu")
