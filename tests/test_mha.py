"""te.MultiheadAttention and the TransformerLayer built on it: hand-written fp32 references (GQA,
RoPE, fused/interleaved QKV, cross attention, packed "thd"), every recipe, fullgraph compile, a
Llama-configured TransformerLayer against a hand-written Llama block, and errors."""
import math

import pytest
import torch
import torch.nn.functional as F
from compile_cases import assert_matches_eager, compile_for
from linear_cases import RECIPES, backend_params, recipe_ctx
from torch._dynamo.utils import counters

import transformer_engine_proto as te

H, HEADS, GROUPS, S, B = 64, 4, 2, 8, 2
D = H // HEADS


def _init(m, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.dim() == 1 and "norm" in _name(m, p) else 0))
    return m


def _name(m, p):
    return next(n for n, q in m.named_parameters() if q is p)


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, base=10000.0):
    """Llama RoPE on x [..., s, heads, d] (positions pos [s] or broadcastable to x[..., 0, 0])."""
    d = x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[..., None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :], torch.cat([ang.sin(), ang.sin()], -1)[..., None, :]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attend(q, k, v, causal=True):
    """q [b, s, h, d], k/v [b, s, g, d]: explicit softmax attention (GQA by repeating KV heads)."""
    rep = q.shape[2] // k.shape[2]
    q = q.transpose(1, 2)
    k, v = k.transpose(1, 2).repeat_interleave(rep, 1), v.transpose(1, 2).repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    o = torch.softmax(s, -1) @ v
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def _split(w_or_y, interleaved, h=HEADS, g=GROUPS, d=D):
    """Split a fused QKV output [..., (h + 2g) d] into q [..., h, d], k, v [..., g, d] (reference)."""
    lead = w_or_y.shape[:-1]
    if interleaved:
        t = w_or_y.reshape(*lead, g, h // g + 2, d)
        return t[..., : h // g, :].reshape(*lead, h, d), t[..., -2, :], t[..., -1, :]
    q, k, v = w_or_y.split([h * d, g * d, g * d], -1)
    return q.reshape(*lead, h, d), k.reshape(*lead, g, d), v.reshape(*lead, g, d)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("input_layernorm,normalization,interleaved",
                         [(True, "RMSNorm", False), (True, "LayerNorm", True), (False, "LayerNorm", True)])
def test_mha_self_attention_matches_reference(fmt, input_layernorm, normalization, interleaved):
    m = _init(te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0,
                                    input_layernorm=input_layernorm, normalization=normalization,
                                    qkv_weight_interleaved=interleaved, qkv_format=fmt, fuse_qkv_params=True))
    x = torch.randn(B, S, H)
    xin = x.transpose(0, 1) if fmt == "sbhd" else x
    freqs = te.RotaryPositionEmbedding(D)(S)
    out = m(xin, rotary_pos_emb=freqs)
    h = x
    qkv = m.layernorm_qkv if input_layernorm else m.qkv
    if input_layernorm:
        w, b = qkv.layer_norm_weight, qkv.layer_norm_bias
        h = _rms(x, w) if normalization == "RMSNorm" else F.layer_norm(x, (H,), w, b, 1e-5)
    q, k, v = _split(F.linear(h, qkv.weight, qkv.bias), interleaved)
    pos = torch.arange(S)
    ref = F.linear(_attend(_rope(q, pos), _rope(k, pos), v), m.proj.weight, m.proj.bias)
    ref = ref.transpose(0, 1) if fmt == "sbhd" else ref
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_mha_cross_attention_and_return_bias():
    m = _init(te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, attention_type="cross",
                                    attn_mask_type="no_mask", qkv_format="bshd", return_bias=True,
                                    qkv_weight_interleaved=False))
    x, enc = torch.randn(B, S, H), torch.randn(B, S + 3, H)
    out, bias = m(x, encoder_output=enc)
    q = F.linear(x, m.query_layer.weight, m.query_layer.bias).reshape(B, S, HEADS, D)
    kv = m.key_value
    k = F.linear(enc, kv.key_weight, kv.key_bias).reshape(B, S + 3, GROUPS, D)
    v = F.linear(enc, kv.value_weight, kv.value_bias).reshape(B, S + 3, GROUPS, D)
    ref = F.linear(_attend(q, k, v, causal=False), m.proj.weight)  # bias returned, not added
    assert bias is m.proj.bias
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", backend_params())
def test_mha_thd_equals_each_sequence_alone(backend):
    """Packed sequences with RoPE (positions restart per sequence) and a causal document mask give
    each sequence's own bshd result, and a new split of the same token count does not recompile."""
    kw = dict(num_gqa_groups=GROUPS, attention_dropout=0.0, input_layernorm=True, normalization="RMSNorm")
    thd = _init(te.MultiheadAttention(H, HEADS, qkv_format="thd", **kw))
    bshd = te.MultiheadAttention(H, HEADS, qkv_format="bshd", **kw)
    bshd.load_state_dict(thd.state_dict())
    freqs = te.RotaryPositionEmbedding(D)(16)
    counters.clear()
    torch._dynamo.reset()
    cthd = compile_for(thd, backend)
    for split in ([0, 3, 8, 12], [0, 7, 9, 12]):
        cu = torch.tensor(split, dtype=torch.int32)
        x = torch.randn(12, H)
        out = cthd(x, rotary_pos_emb=freqs, cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="padding_causal")
        for a, b in zip(split[:-1], split[1:]):
            ref = bshd(x[a:b][None], rotary_pos_emb=freqs)[0]
            torch.testing.assert_close(out[a:b], ref, rtol=1e-5, atol=1e-5)
    assert sum(counters["graph_break"].values()) == 0 and counters["stats"]["unique_graphs"] == 1


# relative Frobenius error of a recipe's output / input grad vs high precision, measured (s=16,
# b=2, hidden 64, 4 heads, 2 KV groups, RoPE): fp8 recipes 0.075 / 0.126, nvfp4 0.29 / 0.39 (QKV,
# then proj quantized; input grad through both). Bounds: 1.5x the measurement.
RECIPE_TOL = {"high_precision": (0.0, 0.0), "delayed": (0.12, 0.19), "current": (0.12, 0.19),
              "mxfp8": (0.12, 0.19), "block": (0.12, 0.19), "nvfp4": (0.45, 0.6)}


@pytest.mark.parametrize("rid", list(RECIPES))
def test_mha_every_recipe_trains_close_to_high_precision(rid):
    m = _init(te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, input_layernorm=True,
                                    normalization="RMSNorm", bias=False), scale=0.2)
    x = torch.randn(S * 2, B, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    freqs = te.RotaryPositionEmbedding(D)(2 * S)
    ref = m(x, rotary_pos_emb=freqs)
    (gx_ref,) = torch.autograd.grad(ref.square().sum(), x)
    with recipe_ctx(RECIPES[rid]):
        out = m(x, rotary_pos_emb=freqs)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    grads = torch.autograd.grad(m(x, rotary_pos_emb=freqs).sum(), list(m.parameters()))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert torch.isfinite(out).all() and torch.isfinite(gx).all() and all(torch.isfinite(g).all() for g in grads)
    errs = rel(out, ref), rel(gx, gx_ref)
    assert errs[0] <= RECIPE_TOL[rid][0] and errs[1] <= RECIPE_TOL[rid][1], errs
    assert (errs[0] > 0) == (RECIPES[rid] is not None), errs  # the recipe reaches QKV / proj


@pytest.mark.parametrize("backend", backend_params())
def test_mha_compiles_fullgraph_under_a_recipe(backend):
    m = _init(te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, input_layernorm=True,
                                    window_size=(4, 0)))
    x = torch.randn(S, B, H, requires_grad=True)
    freqs = te.RotaryPositionEmbedding(D)(S)
    counters.clear()
    torch._dynamo.reset()
    cm = compile_for(m, backend)
    with te.autocast(recipe=RECIPES["current"]):
        out, ref = cm(x, rotary_pos_emb=freqs), m(x, rotary_pos_emb=freqs)
    out.sum().backward()
    assert_matches_eager(out, ref, backend, "output")
    assert sum(counters["graph_break"].values()) == 0


# ---- TransformerLayer as a Llama block ----------------------------------------------------------
def _llama_block(x, w, heads, groups, eps):
    """A hand-written Llama decoder block (HF LlamaDecoderLayer's math), x [s, b, h], fp32."""
    s, b, hid = x.shape
    d = hid // heads
    h = _rms(x, w["ln1"], eps)
    q = (h @ w["q"].T).view(s, b, heads, d).transpose(0, 1)
    k = (h @ w["k"].T).view(s, b, groups, d).transpose(0, 1)
    v = (h @ w["v"].T).view(s, b, groups, d).transpose(0, 1)
    pos = torch.arange(s)
    x = x + (_attend(_rope(q, pos), _rope(k, pos), v).transpose(0, 1) @ w["o"].T)
    h = _rms(x, w["ln2"], eps)
    return x + (F.silu(h @ w["gate"].T) * (h @ w["up"].T)) @ w["down"].T


def _llama_layer(ffn=128, eps=1e-6):
    return te.TransformerLayer(H, ffn, HEADS, num_gqa_groups=GROUPS, normalization="RMSNorm", activation="swiglu",
                               bias=False, self_attn_mask_type="causal", hidden_dropout=0.0, attention_dropout=0.0,
                               layernorm_epsilon=eps)


def test_llama_transformer_layer_matches_hand_written_block():
    g = torch.Generator().manual_seed(7)
    ffn, eps = 128, 1e-6
    kvd = GROUPS * D
    w = {"q": (H, H), "k": (kvd, H), "v": (kvd, H), "o": (H, H), "gate": (ffn, H), "up": (ffn, H), "down": (H, ffn)}
    w = {n: torch.randn(shape, generator=g) * 0.1 for n, shape in w.items()}
    w["ln1"], w["ln2"] = 1 + 0.1 * torch.randn(H, generator=g), 1 + 0.1 * torch.randn(H, generator=g)
    layer = _llama_layer(ffn, eps)
    with torch.no_grad():  # copy the weights in
        qkv = layer.self_attention.layernorm_qkv
        qkv.query_weight.copy_(w["q"]), qkv.key_weight.copy_(w["k"]), qkv.value_weight.copy_(w["v"])
        qkv.layer_norm_weight.copy_(w["ln1"])
        layer.self_attention.proj.weight.copy_(w["o"])
        layer.layernorm_mlp.fc1_weight.copy_(torch.cat([w["gate"], w["up"]]))
        layer.layernorm_mlp.fc2_weight.copy_(w["down"])
        layer.layernorm_mlp.layer_norm_weight.copy_(w["ln2"])
    x = torch.randn(S, B, H, generator=g)
    out = layer(x, rotary_pos_emb=te.RotaryPositionEmbedding(D)(S))
    torch.testing.assert_close(out, _llama_block(x, w, HEADS, GROUPS, eps), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rid", ["current", "mxfp8"])
def test_llama_transformer_layer_trains_under_a_recipe(rid):
    torch.manual_seed(0)
    layer = _llama_layer()
    g = torch.Generator().manual_seed(8)
    x, target = torch.randn(16, B, H, generator=g), torch.randn(16, B, H, generator=g)
    freqs = te.RotaryPositionEmbedding(D)(16)
    opt = torch.optim.Adam(layer.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        with te.autocast(recipe=RECIPES[rid]):
            loss = F.mse_loss(layer(x, rotary_pos_emb=freqs), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.8 * losses[0], losses


def test_transformer_layer_every_mask_type_and_old_state_dict():
    layer = _llama_layer()
    x = torch.randn(S, B, H)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    mask[1, ..., 5:] = True
    for mt in ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"]:
        y = layer(x, attention_mask=mask if "padding" in mt else None, self_attn_mask_type=mt, window_size=(3, 0))
        assert y.shape == x.shape and torch.isfinite(y).all()
    # older keys: top-level qkv. / proj., mlp., the norms at norm., one fused [Q; K; V] QKV weight
    sd, qkv = layer.state_dict(), "self_attention.layernorm_qkv."
    old = {k.replace(qkv, "qkv.").replace("self_attention.proj.", "proj.").replace("layernorm_mlp.", "mlp.")
           .replace("layer_norm_", "norm."): v for k, v in sd.items() if not k.endswith(("query_weight", "key_weight",
                                                                                        "value_weight"))}
    old["qkv.weight"] = torch.cat([sd[qkv + f"{n}_weight"] for n in ("query", "key", "value")])
    assert "qkv.weight" in old and "mlp.norm.weight" in old
    fresh = _llama_layer()
    fresh.load_state_dict(old)
    assert torch.equal(fresh(x), layer(x))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_mha_refuses_a_recipe_asking_for_fp8_attention(compiled):
    """Refused by MultiheadAttention itself (its name, before any projection runs), and so by
    the TransformerLayer built on it; eager and under a fullgraph compile."""
    from test_attention import fp8_attention_refusal

    m = te.MultiheadAttention(H, HEADS, num_gqa_groups=GROUPS, attention_dropout=0.0, name="mha0")
    layer = te.TransformerLayer(H, 128, HEADS, hidden_dropout=0.0, attention_dropout=0.0, name="block0")
    x = torch.randn(S, B, H)
    for mod, who in ((m, "MultiheadAttention mha0"), (layer, "MultiheadAttention block0.self_attention")):
        if compiled:
            torch._dynamo.reset()
        fn = torch.compile(mod, fullgraph=True, backend="aot_eager") if compiled else mod
        for flags in (dict(fp8_mha=True), dict(fp8_dpa=True)):
            fp8_attention_refusal(lambda fn=fn: fn(x), te.recipe.Float8CurrentScaling(**flags), who)


def test_mha_errors_name_the_layer_and_problem():
    with pytest.raises(NotImplementedError, match="userbuffers.*ub_overlap_ag"):
        te.MultiheadAttention(H, HEADS, ub_overlap_ag=True)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by num_gqa_groups=3"):
        te.MultiheadAttention(H, HEADS, num_gqa_groups=3)
    with pytest.raises(ValueError, match="set_parallel_mode"):
        te.MultiheadAttention(H, HEADS, tp_size=2)
    with pytest.raises(TypeError, match="unsupported arguments"):
        te.MultiheadAttention(H, HEADS, fp8_mha=True)
    m = te.MultiheadAttention(H, HEADS, attention_type="cross", name="xattn")
    with pytest.raises(ValueError, match="xattn.*needs encoder_output"):
        m(torch.randn(S, B, H))
    m = te.MultiheadAttention(H, HEADS, qkv_format="thd", name="packed")
    with pytest.raises(ValueError, match="packed.*2D for qkv_format 'thd'"):
        m(torch.randn(S, B, H))
    with pytest.raises(ValueError, match="'thd' needs cu_seqlens_q"):
        m(torch.randn(S, H))
    with pytest.raises(NotImplementedError, match="layer_type='decoder' with parallel_attention_mlp=True"):
        te.TransformerLayer(H, 128, HEADS, layer_type="decoder", parallel_attention_mlp=True)
