"""TransformerLayer / MultiheadAttention with TE's arguments: the residual variants
(`apply_residual_connection_post_layernorm`, `output_layernorm`, `parallel_attention_mlp`),
`fuse_qkv_params` and TE's parameter names (`layernorm_qkv`, `query_weight`, `layernorm_mlp`), each
against a plain-torch computation, eager and compiled (aot_eager, inductor)."""
import math

import pytest
import torch
import torch.nn.functional as F
from compile_cases import assert_matches_eager, compile_for
from linear_cases import RECIPES, backend_params, fresh_dynamo, graph_breaks, recipe_ctx
from torch import nn

import transformer_engine_proto as te

H, HEADS, S, B, EPS = 64, 4, 8, 2, 1e-5
D = H // HEADS


def _randomize(m, seed=1):
    """Parameters away from their init (norm gammas around 1), so every parameter matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            gamma = name.endswith(("norm_weight", "layernorm.weight"))
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if gamma else 0.0))
    return m


def _layer(**kw):
    torch.manual_seed(0)
    return _randomize(te.TransformerLayer(H, 2 * H, HEADS, hidden_dropout=0.0, attention_dropout=0.0, **kw))


def _causal_attention(q, k, v):
    """q, k, v [s, b, heads, d] -> [s, b, heads * d]: explicit softmax(QK^T / sqrt(d)) V, causal."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(scores, -1) @ v).permute(2, 0, 1, 3).reshape(S, -1, H)


def _qkv_rows(qkv_linear):
    """The QKV weight and bias as one [Q; K; V] tensor (de-interleaving a fused interleaved one)."""
    names = qkv_linear.weight_names
    w = torch.cat([getattr(qkv_linear, n) for n in names])
    b = torch.cat([getattr(qkv_linear, n) for n in qkv_linear.bias_names])
    return w, b


def _reference(layer, x):
    """TE's TransformerLayer forward (transformer.py) in plain torch, from the layer's parameters."""
    sa, mlp = layer.self_attention, layer.layernorm_mlp
    post_ln, output_ln = layer.apply_residual_connection_post_layernorm, layer.output_layernorm
    qkv_linear = sa.qkv_linear
    h = x if output_ln else F.layer_norm(x, (H,), qkv_linear.layer_norm_weight, qkv_linear.layer_norm_bias, EPS)
    w, b = _qkv_rows(qkv_linear)
    y = F.linear(h, w, b)
    if sa.qkv_weight_interleaved:  # rows grouped per head: [heads, (q, k, v), d]
        q, k, v = y.view(S, -1, HEADS, 3, D).unbind(3)
    else:
        q, k, v = (t.reshape(S, -1, HEADS, D) for t in y.split(H, -1))
    attn = F.linear(_causal_attention(q, k, v), sa.proj.weight, sa.proj.bias)

    def mlp_block(t):
        n = F.layer_norm(t, (H,), mlp.layer_norm_weight, mlp.layer_norm_bias, EPS)
        return n, F.linear(F.gelu(F.linear(n, mlp.fc1_weight, mlp.fc1_bias), approximate="tanh"),
                           mlp.fc2_weight, mlp.fc2_bias)

    if layer.parallel_attention_mlp:
        return x + attn + mlp_block(x)[1]
    x1 = (h if post_ln and not output_ln else x) + attn
    n, m = mlp_block(x1)
    out = (n if post_ln else x1) + m
    return F.layer_norm(out, (H,), layer.layernorm.weight, layer.layernorm.bias, EPS) if output_ln else out


CONFIGS = {
    "pre_ln": {},
    "post_ln_residual": dict(apply_residual_connection_post_layernorm=True),
    "output_layernorm": dict(output_layernorm=True),
    "post_ln_residual_output_layernorm": dict(apply_residual_connection_post_layernorm=True, output_layernorm=True),
    "parallel_attention_mlp": dict(parallel_attention_mlp=True),
}


@pytest.mark.parametrize("qkv", ["split", "fused", "fused_interleaved"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_transformer_layer_matches_te_forward_in_plain_torch(config, qkv):
    layer = _layer(fuse_qkv_params=qkv != "split", qkv_weight_interleaved=qkv == "fused_interleaved",
                   **CONFIGS[config])
    x = torch.randn(S, B, H, requires_grad=True)
    out = layer(x)
    ref = _reference(layer, x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    params = [p for p in layer.parameters()]
    for a, b in zip(torch.autograd.grad(out, [x] + params, g), torch.autograd.grad(ref, [x] + params, g)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_post_layernorm_residual_changes_the_output():
    """Guards the reference too: the variants are different functions of the same parameters."""
    base = _layer()
    x = torch.randn(S, B, H)
    outs = {}
    for name, kw in CONFIGS.items():
        layer = _layer(**kw)
        layer.load_state_dict(base.state_dict(), strict=False)
        outs[name] = layer(x)
    names = list(outs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not torch.allclose(outs[a], outs[b], atol=1e-3), (a, b)


def _names(**kw):
    return [n for n, _ in te.TransformerLayer(H, 2 * H, HEADS, **kw).named_parameters()]


def test_transformer_layer_parameter_names_are_te_s():
    qkv = "self_attention.layernorm_qkv."
    tail = ["self_attention.proj.weight", "self_attention.proj.bias", "layernorm_mlp.layer_norm_weight",
            "layernorm_mlp.layer_norm_bias", "layernorm_mlp.fc1_weight", "layernorm_mlp.fc1_bias",
            "layernorm_mlp.fc2_weight", "layernorm_mlp.fc2_bias"]
    split = [qkv + n for n in ("query_weight", "key_weight", "value_weight", "query_bias", "key_bias", "value_bias")]
    assert _names() == [qkv + "layer_norm_weight", qkv + "layer_norm_bias"] + split + tail
    assert _names(fuse_qkv_params=True) == [qkv + n for n in ("layer_norm_weight", "layer_norm_bias", "weight",
                                                              "bias")] + tail
    assert _names(output_layernorm=True, fuse_qkv_params=True) == (
        ["self_attention.qkv.weight", "self_attention.qkv.bias"] + tail + ["layernorm.weight", "layernorm.bias"])


def test_gqa_query_and_key_weights_as_te_s_test_gqa_reads_them():
    """TE's test_gqa.py: `self_attention.layernorm_qkv.query_weight` is [heads * d, hidden]."""
    layer = te.TransformerLayer(H, 2 * H, HEADS, num_gqa_groups=2, kv_channels=32)
    qkv = layer.self_attention.layernorm_qkv
    assert qkv.query_weight.shape == (32 * HEADS, H) and qkv.key_weight.shape == (32 * 2, H)
    assert qkv.value_weight.shape == (32 * 2, H) and qkv.gemm_weight().shape == (32 * 8, H)


class _TorchGPT(nn.Module):
    """TE's test_numerics.py reference for test_gpt_accuracy: nn.LayerNorm, nn.MultiheadAttention and
    a LayerNorm -> fc1 -> gelu -> fc2 MLP."""

    def __init__(self, parallel_attention_mlp):
        super().__init__()
        self.ln = nn.LayerNorm(H, eps=EPS)
        self.mhsa = nn.MultiheadAttention(H, HEADS, dropout=0.0, bias=True)
        self.ln_mlp, self.fc1, self.fc2 = nn.LayerNorm(H, eps=EPS), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)
        self.parallel = parallel_attention_mlp

    def forward(self, x, mask):
        b = self.mhsa(*(self.ln(x),) * 3, attn_mask=mask, need_weights=False)[0]

        def mlp(t):
            return self.fc2(F.gelu(self.fc1(self.ln_mlp(t)), approximate="tanh"))

        if self.parallel:
            return x + b + mlp(x)
        x = x + b
        return x + mlp(x)


@pytest.mark.parametrize("parallel_attention_mlp", [False, True])
def test_gpt_accuracy_as_te_tests_it(parallel_attention_mlp):
    """TE's test_gpt_accuracy on CPU: weights shared into torch's modules by TE's attribute names,
    a causal mask passed with the default "causal" mask type, then the output, the input grad and
    every parameter's grad compared pairwise in `parameters()` order."""
    torch.manual_seed(0)
    layer = _randomize(te.TransformerLayer(H, 4 * H, HEADS, layernorm_epsilon=EPS, fuse_qkv_params=True,
                                           qkv_weight_interleaved=False, parallel_attention_mlp=parallel_attention_mlp)
                       ).eval()
    ref = _TorchGPT(parallel_attention_mlp).eval()
    qkv, mlp = layer.self_attention.layernorm_qkv, layer.layernorm_mlp
    shared = {"ln.weight": qkv.layer_norm_weight, "ln.bias": qkv.layer_norm_bias, "mhsa.in_proj_weight": qkv.weight,
              "mhsa.in_proj_bias": qkv.bias, "mhsa.out_proj.weight": layer.self_attention.proj.weight,
              "mhsa.out_proj.bias": layer.self_attention.proj.bias, "ln_mlp.weight": mlp.layer_norm_weight,
              "ln_mlp.bias": mlp.layer_norm_bias, "fc1.weight": mlp.fc1_weight, "fc1.bias": mlp.fc1_bias,
              "fc2.weight": mlp.fc2_weight, "fc2.bias": mlp.fc2_bias}
    with torch.no_grad():  # as TE's test: assignment keeps each parameter's place in parameters()
        for name, p in shared.items():
            owner, _, attr = name.rpartition(".")
            setattr(ref.get_submodule(owner) if owner else ref, attr, nn.Parameter(p.clone()))
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    x = torch.randn(S, B, H)
    results = []
    for m in (layer, ref):
        xi = x.clone().requires_grad_()
        out = m(xi, attention_mask=mask) if m is layer else m(xi, mask)
        out.sum().backward()
        results.append([out, xi.grad] + [p.grad for p in m.parameters() if p.requires_grad])
    assert len(results[0]) == len(results[1])
    for i, (a, b) in enumerate(zip(*results)):
        assert a.shape == b.shape, i
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m, i=i: f"tensor {i}: {m}")


@pytest.mark.parametrize("config", ["post_ln_residual_output_layernorm", "parallel_attention_mlp"])
@pytest.mark.parametrize("backend,rid", backend_params(["delayed"]))
def test_transformer_layer_variants_compiled_match_eager(config, backend, rid):
    fresh_dynamo()
    eager_m, comp_m = _layer(**CONFIGS[config]), _layer(**CONFIGS[config])
    compiled = compile_for(comp_m, backend)
    x, g = torch.randn(S, B, H), torch.randn(S, B, H)
    for step in range(2):
        got, want = [], []
        for m, res in ((compiled, got), (eager_m, want)):
            xi = x.clone().requires_grad_()
            with recipe_ctx(RECIPES[rid]):
                out = m(xi)
            out.backward(g)
            res += [out.detach(), xi.grad]
        params = zip(comp_m.named_parameters(), eager_m.parameters())
        for (name, pc), pe in params:
            assert_matches_eager(pc.grad, pe.grad, backend, f"step {step} {name} grad")
            pc.grad = pe.grad = None
        for what, a, b in zip(("output", "input grad"), got, want):
            assert_matches_eager(a, b, backend, f"step {step} {what}")
    assert graph_breaks() == 0


# ---- fuse_qkv_params and parameters_split ------------------------------------------------------------

@pytest.mark.parametrize("input_layernorm", [True, False])
def test_mha_split_qkv_parameters_equal_the_fused_weight(input_layernorm):
    """fuse_qkv_params=False exposes [Q; K; V] as query/key/value parameters: same output as the
    fused non-interleaved weight, and their grads are the fused grad's row blocks."""
    kw = dict(num_gqa_groups=2, attention_dropout=0.0, input_layernorm=input_layernorm)
    fused = _randomize(te.MultiheadAttention(H, HEADS, fuse_qkv_params=True, qkv_weight_interleaved=False, **kw))
    split = te.MultiheadAttention(H, HEADS, **kw)
    assert split.qkv_weight_interleaved is False  # TE forces it off for separate parameters
    fq, sq = fused.qkv_linear, split.qkv_linear
    rows = [H, 2 * D, 2 * D]
    with torch.no_grad():
        fused_params = dict(fused.named_parameters())
        for name, p in split.named_parameters():
            if name in fused_params:  # the norm and proj
                p.copy_(fused_params[name])
        for name, w, b in zip(("query", "key", "value"), fq.weight.split(rows), fq.bias.split(rows)):
            getattr(sq, f"{name}_weight").copy_(w), getattr(sq, f"{name}_bias").copy_(b)
    x = torch.randn(S, B, H)
    out_f, out_s = fused(x), split(x)
    assert torch.equal(out_f, out_s)
    out_f.sum().backward(), out_s.sum().backward()
    for name, part in zip(("query", "key", "value"), fq.weight.grad.split(rows)):
        assert torch.equal(getattr(sq, f"{name}_weight").grad, part)
    for name, part in zip(("query", "key", "value"), fq.bias.grad.split(rows)):
        assert torch.equal(getattr(sq, f"{name}_bias").grad, part)


def test_mha_cross_attention_parameter_names():
    m = te.MultiheadAttention(H, HEADS, attention_type="cross", input_layernorm=True)
    assert [n for n, _ in m.named_parameters()] == [
        "layernorm_query.layer_norm_weight", "layernorm_query.layer_norm_bias", "layernorm_query.query_weight",
        "layernorm_query.query_bias", "key_value.key_weight", "key_value.value_weight", "key_value.key_bias",
        "key_value.value_bias", "proj.weight", "proj.bias"]
    m = te.MultiheadAttention(H, HEADS, attention_type="cross", fuse_qkv_params=True)
    assert [n for n, _ in m.named_parameters()] == [
        "query_layer.weight", "query_layer.bias", "key_value.weight", "key_value.bias", "proj.weight", "proj.bias"]


@pytest.mark.parametrize("split", [{"a": 16, "b_": 48}, ("a", "b")], ids=["dict", "names"])
def test_linear_parameters_split_matches_one_weight(split):
    lin = te.Linear(32, 64, parameters_split=split)
    names = [n for n, _ in lin.named_parameters()]
    assert names == ["a_weight", "b_weight", "a_bias", "b_bias"] and not hasattr(lin, "weight")
    x = torch.randn(5, 32)
    ref = F.linear(x, torch.cat([lin.a_weight, lin.b_weight]), torch.cat([lin.a_bias, lin.b_bias]))
    torch.testing.assert_close(lin(x), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend,rid", backend_params(["current"], ci=("current",)))
def test_split_qkv_compiled_matches_eager(backend, rid):
    fresh_dynamo()
    torch.manual_seed(0)
    m = _randomize(te.MultiheadAttention(H, HEADS, attention_dropout=0.0, input_layernorm=True))
    compiled = compile_for(m, backend)
    x = torch.randn(S, B, H)
    with recipe_ctx(RECIPES[rid]):
        want, got = m(x), compiled(x)
    assert_matches_eager(got, want, backend, "output")
    assert graph_breaks() == 0


def test_argument_errors_name_the_module_and_argument():
    with pytest.raises(ValueError, match=r"^TransformerLayer tl: fuse_wgrad_accumulation=True needs fuse_qkv_params"):
        te.TransformerLayer(H, 2 * H, HEADS, fuse_wgrad_accumulation=True, name="tl")
    with pytest.raises(ValueError, match=r"^TransformerLayer tl: parallel_attention_mlp=True does not go with"):
        te.TransformerLayer(H, 2 * H, HEADS, parallel_attention_mlp=True, output_layernorm=True, name="tl")
    with pytest.raises(TypeError, match=r"^TransformerLayer tl: apply_residual_connection_post_layernorm must be a "):
        te.TransformerLayer(H, 2 * H, HEADS, apply_residual_connection_post_layernorm="yes", name="tl")
    with pytest.raises(TypeError, match="ub_tp_comm_overlap"):
        te.TransformerLayer(H, 2 * H, HEADS, ub_tp_comm_overlap=True)
    with pytest.raises(ValueError, match=r"^MultiheadAttention mha: fuse_wgrad_accumulation=True needs fuse_qkv_"):
        te.MultiheadAttention(H, HEADS, fuse_wgrad_accumulation=True, name="mha")
    with pytest.raises(ValueError, match=r"^lin: parameters_split sizes \[16, 16\] do not add up to out_features=64"):
        te.Linear(32, 64, parameters_split={"a": 16, "b": 16}, name="lin")
    with pytest.raises(TypeError, match=r"^lin: parameters_split must be None, a dict"):
        te.Linear(32, 64, parameters_split=3, name="lin")
    with pytest.raises(RuntimeError, match=r"quantized_model_init cannot store a weight split into several parameters"):
        with te.quantized_model_init(enabled=True, recipe=te.recipe.Float8CurrentScaling()):
            te.TransformerLayer(H, 2 * H, HEADS)
    te.TransformerLayer(H, 2 * H, HEADS, fuse_qkv_params=True, fuse_wgrad_accumulation=True)  # fine together


def test_fsdp_quantized_gather_leaves_split_qkv_parameters_in_high_precision():
    """FSDP2's quantized all-gather swaps one weight parameter per GEMM; split Q, K, V parameters
    are gathered in high precision instead (a warning; strict=True refuses)."""
    from transformer_engine_proto.distributed import fsdp

    m = te.MultiheadAttention(H, HEADS, input_layernorm=True, name="mha")
    with pytest.warns(UserWarning, match=r"mha.layernorm_linear_qkv: its weight is split into parameters"):
        assert fsdp.enable_quantized_all_gather(m) == 1  # proj only
    with pytest.raises(ValueError, match=r"split into parameters .* build it with fuse_qkv_params=True"):
        fsdp.enable_quantized_all_gather(te.MultiheadAttention(H, HEADS), strict=True)
    assert fsdp.enable_quantized_all_gather(te.MultiheadAttention(H, HEADS, fuse_qkv_params=True)) == 2


def test_older_transformer_layer_state_dict_loads_into_split_or_fused_qkv():
    """Before TE's names: `self_attention.qkv.` held the input norm (`norm.`) and one [Q; K; V]
    weight, `mlp.` the MLP. It loads into the split parameters and into a fused non-interleaved
    weight; an interleaved one is refused (its rows would be misread)."""
    layer, x = _layer(), torch.randn(S, B, H)
    sd, qkv = layer.state_dict(), "self_attention.layernorm_qkv."
    old = {k.replace(qkv, "self_attention.qkv.").replace("layernorm_mlp.", "mlp.").replace("layer_norm_", "norm."): v
           for k, v in sd.items() if not k.startswith(tuple(qkv + n for n in ("query", "key", "value")))}
    for part in ("weight", "bias"):
        old["self_attention.qkv." + part] = torch.cat([sd[qkv + f"{n}_{part}"] for n in ("query", "key", "value")])
    for kw in ({}, dict(fuse_qkv_params=True, qkv_weight_interleaved=False)):
        fresh = te.TransformerLayer(H, 2 * H, HEADS, hidden_dropout=0.0, attention_dropout=0.0, **kw)
        fresh.load_state_dict(dict(old))
        assert torch.equal(fresh(x), layer(x))
    fused = te.TransformerLayer(H, 2 * H, HEADS, fuse_qkv_params=True, name="tl")
    with pytest.raises(ValueError, match=r"^TransformerLayer tl: this state dict's QKV weight has \[Q; K; V\] rows"):
        fused.load_state_dict(dict(old))


# ---- drop_path_rate (stochastic depth) ----------------------------------------------------------------

def _train_out(layer, x, seed=3):
    torch.manual_seed(seed)
    return layer.train()(x)


def test_drop_path_rate_zero_and_eval_are_the_identity():
    x = torch.randn(S, B, H)
    want = _train_out(_layer(), x)
    assert torch.equal(_train_out(_layer(drop_path_rate=0.0), x), want)
    assert torch.equal(_layer(drop_path_rate=0.5).eval()(x), _layer().eval()(x))


def test_drop_path_rate_one_drops_both_branches():
    x = torch.randn(S, B, H)
    assert torch.equal(_train_out(_layer(drop_path_rate=1.0), x), x)


def test_drop_path_drops_or_scales_each_dim0_slice():
    """attention + MLP as one branch (parallel_attention_mlp): per index of dim 0 (the sequence in
    sbhd, as TE's DropPath) the branch is either zero or the undropped branch / (1 - rate); both
    happen, and the same seed draws the same slices."""
    p = 0.5
    x = torch.randn(S, B, H)
    layer = _layer(parallel_attention_mlp=True, drop_path_rate=p)
    branch = _layer(parallel_attention_mlp=True)(x) - x
    got = _train_out(layer, x) - x
    kept = [not torch.equal(got[i], torch.zeros_like(got[i])) for i in range(S)]
    assert any(kept) and not all(kept)
    for i in range(S):
        if kept[i]:
            torch.testing.assert_close(got[i], branch[i] / (1 - p), rtol=1e-5, atol=1e-5)
    assert torch.equal(_train_out(layer, x), _train_out(layer, x))
    assert not torch.equal(_train_out(layer, x, seed=4), _train_out(layer, x))


def test_drop_path_compiled_matches_eager():
    """Traced with fullgraph (aot_eager): the same seed gives eager's output and input grad."""
    fresh_dynamo()
    eager_m, comp_m = _layer(drop_path_rate=0.5), _layer(drop_path_rate=0.5)
    compiled = torch.compile(comp_m, fullgraph=True, backend="aot_eager")
    x, g = torch.randn(S, B, H), torch.randn(S, B, H)
    res = []
    for m in (compiled, eager_m):
        xi = x.clone().requires_grad_()
        out = _train_out(m, xi)
        out.backward(g)
        res.append((out.detach(), xi.grad))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
    assert not torch.equal(res[1][0], _train_out(_layer(), x))  # something was dropped
    assert graph_breaks() == 0


def test_drop_path_rate_out_of_range_is_named():
    with pytest.raises(ValueError, match="TransformerLayer tl: drop_path_rate must be in"):
        te.TransformerLayer(H, 2 * H, HEADS, drop_path_rate=1.5, name="tl")


# ---- layer_type="decoder" and torch.autocast ----------------------------------------------------------

def test_decoder_layer_is_self_attention_cross_attention_mlp():
    """TE's decoder: x + attn(x), then + inter_attention(that, encoder_output), then + MLP."""
    layer = _layer(layer_type="decoder")
    x, enc = torch.randn(S, B, H), torch.randn(2 * S, B, H)
    x1 = x + layer.self_attention(x)
    x2 = x1 + layer.inter_attention(x1, encoder_output=enc)
    want = x2 + layer.layernorm_mlp(x2)
    torch.testing.assert_close(layer(x, encoder_output=enc), want)
    names = {n for n, _ in layer.named_parameters()}
    assert {"inter_attention.layernorm_query.layer_norm_weight", "inter_attention.proj.weight"} <= names
    assert any(n.startswith("inter_attention.key_value.") for n in names)
    # TE's test passes a padding mask with the default "no_mask" cross attention
    mask = torch.zeros(B, 1, 1, 2 * S, dtype=torch.bool)
    layer(x, encoder_output=enc, enc_dec_attn_mask=mask)
    with pytest.raises(ValueError, match="encoder_output / enc_dec_attn_mask need layer_type='decoder'"):
        _layer()(x, encoder_output=enc)
    with pytest.raises(ValueError, match="layer_type must be 'encoder' or 'decoder'"):
        te.TransformerLayer(H, 2 * H, HEADS, layer_type="t5")


@pytest.mark.parametrize("backend,rid", backend_params(["current"]))
def test_decoder_layer_compiled_matches_eager(backend, rid):
    fresh_dynamo()
    eager_m, comp_m = _layer(layer_type="decoder"), _layer(layer_type="decoder")
    compiled = compile_for(comp_m, backend)
    x, enc, g = torch.randn(S, B, H), torch.randn(S, B, H), torch.randn(S, B, H)
    outs = []
    for m in (compiled, eager_m):
        xi = x.clone().requires_grad_()
        with recipe_ctx(RECIPES[rid]):
            out = m(xi, encoder_output=enc)
        out.backward(g)
        outs.append((out.detach(), xi.grad))
    for what, a, b in zip(("output", "input grad"), *outs):
        assert_matches_eager(a, b, backend, what)
    for (name, pc), pe in zip(comp_m.named_parameters(), eager_m.parameters()):
        assert_matches_eager(pc.grad, pe.grad, backend, f"{name} grad")
    assert graph_breaks() == 0


@pytest.mark.parametrize("rid", ["high_precision", "current"])
def test_layer_under_torch_autocast_runs_in_its_dtype(rid):
    """As TE's: under torch.autocast the layer (its GEMMs and norms) computes in the autocast dtype,
    so the output has it, and every gradient comes back in its own tensor's dtype (fp32 here)."""
    layer = _layer()
    x = torch.randn(S, B, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with recipe_ctx(RECIPES[rid]):
            out = layer(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in layer.parameters())
    lin = te.Linear(H, H, params_dtype=torch.float32, device="cpu")
    xs = torch.randn(4, H)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(xs)
    assert y.dtype == torch.bfloat16
    want = F.linear(xs.bfloat16().float(), lin.weight.bfloat16().float(), lin.bias.bfloat16().float())
    torch.testing.assert_close(y.float(), want, rtol=1e-2, atol=1e-2)
