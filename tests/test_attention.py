"""te.DotProductAttention and te.RotaryPositionEmbedding against float64 references (every mask
type, format, GQA, windows, packed "thd"), torch.compile fullgraph with 0 graph breaks, and errors."""
import pytest
import torch
from attention_ref import ref_allowed, ref_attention
from torch._dynamo.utils import counters

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.module.rope import apply_rotary_pos_emb

MASKS = ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right"]
WINDOWS = [None, (2, 0), (3, 1)]
B, H, D, SQ = 2, 4, 8, 6
LEN_Q, LEN_KV_SHORT = [6, 4], 3  # actual lengths (padding masks): kv lengths are [skv, skv - 3]
# max |out - float64 reference|; measured over every mask x window x format x skv x GQA: 4.4e-7 (fp32),
# 8.2e-3 (bf16); packed "thd": 3.1e-7 / 6.4e-3
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


def _to(fmt, t):  # [b, s, h, d] -> fmt
    return t.transpose(0, 1) if fmt == "sbhd" else t


def _case(mask_type, window, skv, groups, dtype, fmt, seed=0):
    """(module output, float64 reference output in the same layout)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, SQ, H, D, generator=g).to(dtype)
    k = torch.randn(B, skv, groups, D, generator=g).to(dtype)
    v = torch.randn(B, skv, groups, D, generator=g).to(dtype)
    len_kv = [skv, skv - LEN_KV_SHORT]
    kw = {}
    if "padding" in mask_type:
        mq = (torch.arange(SQ)[None] >= torch.tensor(LEN_Q)[:, None])[:, None, None]
        mk = (torch.arange(skv)[None] >= torch.tensor(len_kv)[:, None])[:, None, None]
        kw["attention_mask"] = (mq, mk)
    m = te.DotProductAttention(H, D, num_gqa_groups=groups, qkv_format=fmt, attn_mask_type=mask_type,
                               window_size=window)
    out = m(_to(fmt, q), _to(fmt, k), _to(fmt, v), **kw)
    allowed = torch.stack([ref_allowed(SQ, skv, mask_type, window, LEN_Q[i], len_kv[i]) for i in range(B)])[:, None]
    ref = ref_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed)
    ref = _to(fmt, ref.transpose(1, 2).reshape(B, SQ, H * D))
    return out, ref


@pytest.mark.parametrize("window", WINDOWS, ids=["nowin", "w2_0", "w3_1"])
@pytest.mark.parametrize("mask_type", MASKS)
def test_dpa_matches_float64_every_mask_format_gqa(mask_type, window):
    for fmt, skv, groups, dtype in [("bshd", 6, 4, torch.float32), ("sbhd", 9, 2, torch.float32),
                                    ("bshd", 9, 1, torch.bfloat16), ("sbhd", 6, 2, torch.bfloat16)]:
        out, ref = _case(mask_type, window, skv, groups, dtype, fmt)
        assert out.dtype == dtype and out.shape == ref.shape
        err = (out.double() - ref).abs().max().item()
        assert err <= TOL[dtype], (fmt, skv, groups, dtype, err)


def test_dpa_padding_rows_are_zero_and_cu_seqlens_equal_mask():
    q, k, v = (torch.randn(B, SQ, H, D) for _ in range(3))
    m = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="padding_causal")
    lens = torch.tensor([6, 4], dtype=torch.int32)
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0, dtype=torch.int32)])
    mask = (torch.arange(SQ)[None] >= lens[:, None])[:, None, None]
    a = m(q, k, v, attention_mask=mask)
    b = m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert a[1, 4:].abs().max() == 0 and a[1, :4].abs().min() > 0


def test_dpa_arbitrary_mask_and_softmax_scale():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, SQ, H, D, generator=g) for _ in range(3))
    masked = torch.rand(B, H, SQ, SQ, generator=g) > 0.6
    masked[0, 0, 2] = True  # a fully masked row: zeros
    m = te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type="arbitrary", softmax_scale=0.3)
    out = m(q, k, v, attention_mask=masked)
    ref = ref_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ~masked, scale=0.3)
    assert (out.double() - ref.transpose(1, 2).reshape(B, SQ, H * D)).abs().max() < TOL[torch.float32]
    assert out[0, 2, :D].abs().max() == 0


def _thd_case(cu_q, cu_kv, mask_type, window, groups=2, total_q=None, total_kv=None, dtype=torch.float32):
    """Packed q/k/v, the module output and the reference: each sequence on its own through the
    float64 reference (tokens past cu[-1] must come out zero)."""
    g = torch.Generator().manual_seed(2)
    tq, tk = total_q or int(cu_q[-1]), total_kv or int(cu_kv[-1])
    q = torch.randn(tq, H, D, generator=g).to(dtype)
    k = torch.randn(tk, groups, D, generator=g).to(dtype)
    v = torch.randn(tk, groups, D, generator=g).to(dtype)
    m = te.DotProductAttention(H, D, num_gqa_groups=groups, qkv_format="thd", attn_mask_type=mask_type,
                               window_size=window)
    out = m(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
    ref = torch.zeros(tq, H * D, dtype=torch.float64)
    for i in range(len(cu_q) - 1):
        a, b, c, d = int(cu_q[i]), int(cu_q[i + 1]), int(cu_kv[i]), int(cu_kv[i + 1])
        ref_type = mask_type.replace("padding_", "").replace("padding", "no_mask")
        allowed = ref_allowed(b - a, d - c, ref_type, window)
        r = ref_attention(q[a:b].transpose(0, 1)[None], k[c:d].transpose(0, 1)[None], v[c:d].transpose(0, 1)[None],
                          allowed)
        ref[a:b] = r[0].transpose(0, 1).reshape(b - a, H * D)
    return out, ref


@pytest.mark.parametrize("window", [None, (2, 0), (1, 2)], ids=["nowin", "w2_0", "w1_2"])
@pytest.mark.parametrize("mask_type", ["padding", "padding_causal", "padding_causal_bottom_right", "causal"])
def test_dpa_thd_packed_sequences_match_per_sequence_reference(mask_type, window):
    cu_q = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
    cu_kv = torch.tensor([0, 5, 9, 15], dtype=torch.int32)  # cross: different kv lengths per sequence
    for cu_k, tq, tk in [(cu_q, None, None), (cu_kv, None, None), (cu_q, 14, 13)]:  # last: padded tails
        out, ref = _thd_case(cu_q, cu_k, mask_type, window, total_q=tq, total_kv=tk)
        assert out.shape == (tq or 12, H * D)
        assert (out.double() - ref).abs().max() < TOL[torch.float32], (mask_type, window, cu_k)
    out, ref = _thd_case(cu_q, cu_kv, mask_type, window, dtype=torch.bfloat16)
    assert (out.double() - ref).abs().max() < TOL[torch.bfloat16]


def test_dpa_backward_matches_float64_autograd():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, SQ, H, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, 9, 2, D, generator=g, requires_grad=True) for _ in range(2))
    lens_kv = torch.tensor([9, 5])
    mask = (torch.arange(9)[None] >= lens_kv[:, None])[:, None, None]
    qmask = torch.zeros(B, 1, 1, SQ, dtype=torch.bool)
    m = te.DotProductAttention(H, D, num_gqa_groups=2, qkv_format="bshd",
                               attn_mask_type="padding_causal_bottom_right", window_size=(2, 0))
    out = m(q, k, v, attention_mask=(qmask, mask))
    gout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), gout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    allowed = torch.stack([ref_allowed(SQ, 9, "padding_causal_bottom_right", (2, 0), SQ, int(n)) for n in lens_kv])
    ref = ref_attention(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2), allowed[:, None])
    ref_grads = torch.autograd.grad(ref.transpose(1, 2).reshape(out.shape), (q64, k64, v64), gout.double())
    for a, r in zip(grads, ref_grads):
        assert torch.isfinite(a).all() and (a.double() - r).abs().max() < 1e-5


def _compiled(m, backend="aot_eager"):
    torch._dynamo.reset()
    counters.clear()
    return torch.compile(m, fullgraph=True, backend=backend)


def test_dpa_compiles_fullgraph_every_mask():
    for mask_type in MASKS + ["arbitrary"]:
        m = te.DotProductAttention(H, D, num_gqa_groups=2, qkv_format="sbhd", attn_mask_type=mask_type,
                                   window_size=(3, 1))
        q = torch.randn(SQ, B, H, D, requires_grad=True)
        k, v = torch.randn(SQ, B, 2, D), torch.randn(SQ, B, 2, D)
        kw = {}
        if "padding" in mask_type:
            kw["attention_mask"] = torch.tensor([False] * 5 + [True])[None, None, None].expand(B, 1, 1, SQ)
        if mask_type == "arbitrary":
            kw["attention_mask"] = torch.rand(B, 1, SQ, SQ) > 0.5
        cm = _compiled(m)
        out = cm(q, k, v, **kw)
        out.sum().backward()
        torch.testing.assert_close(out, m(q, k, v, **kw), rtol=0, atol=0)
        assert sum(counters["graph_break"].values()) == 0, mask_type


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_dpa_thd_compiles_once_for_any_split_of_the_same_tokens(backend):
    m = te.DotProductAttention(H, D, num_gqa_groups=2, qkv_format="thd", attn_mask_type="padding_causal",
                               window_size=(4, 0))
    cm = _compiled(m, backend)
    for cu in ([0, 3, 8, 12], [0, 6, 7, 12], [0, 1, 2, 12]):
        cu = torch.tensor(cu, dtype=torch.int32)
        q = torch.randn(12, H, D, requires_grad=True)
        k, v = torch.randn(12, 2, D), torch.randn(12, 2, D)
        out = cm(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        out.sum().backward()
        torch.testing.assert_close(out, m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu), rtol=1e-5, atol=1e-5)
        assert torch.isfinite(q.grad).all()
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1


def test_dpa_errors_name_the_layer_and_problem():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by num_gqa_groups=4"):
        te.DotProductAttention(6, 8, num_gqa_groups=4)
    with pytest.raises(ValueError, match="qkv_format must be one of"):
        te.DotProductAttention(4, 8, qkv_format="bhsd")
    with pytest.raises(ValueError, match="attn_mask_type must be one of"):
        te.DotProductAttention(4, 8, attn_mask_type="sliding")
    with pytest.raises(ValueError, match="window_size"):
        te.DotProductAttention(4, 8, window_size=(3,))
    with pytest.raises(NotImplementedError, match="context parallelism"):
        te.DotProductAttention(4, 8, cp_group=object())
    m = te.DotProductAttention(4, 8, qkv_format="thd", name="attn0")
    t = torch.randn(5, 4, 8)
    with pytest.raises(ValueError, match="attn0.*'thd' needs cu_seqlens_q and cu_seqlens_kv"):
        m(t, t, t)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="attn0.*mask from cu_seqlens"):
        m(t, t, t, cu_seqlens_q=cu, cu_seqlens_kv=cu, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match="attn0.*4D tensor for qkv_format 'bshd'"):
        m(t, t, t, qkv_format="bshd")
    m = te.DotProductAttention(4, 8, num_gqa_groups=2, qkv_format="bshd", attn_mask_type="padding")
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ValueError, match="expected 4 query heads and 2 key/value heads"):
        m(q, q, q)
    with pytest.raises(ValueError, match="needs attention_mask or cu_seqlens"):
        m(q, q[:, :, :2], q[:, :, :2])


FP8_ATTENTION_FLAGS = {"fp8_dpa": dict(fp8_dpa=True), "fp8_mha": dict(fp8_mha=True),
                       "both": dict(fp8_dpa=True, fp8_mha=True)}


def fp8_attention_refusal(call, recipe, who):
    """`call()` under `recipe` raises NotImplementedError whose first line names the layer, the
    flags the recipe sets and the way out."""
    on = [f for f in ("fp8_dpa", "fp8_mha") if getattr(recipe, f)]
    with te.autocast(recipe=recipe), pytest.raises(NotImplementedError) as info:
        call()
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"{who}: the te.autocast recipe {type(recipe).__name__} sets "
                            + " and ".join(f"{f}=True" for f in on)), first
    assert "attention runs in high precision" in first, first
    assert first.endswith("Build the recipe with " + ", ".join(f"{f}=False" for f in on)
                          + "; its other settings still apply to the Linear layers"), first


@pytest.mark.parametrize("flags", FP8_ATTENTION_FLAGS.values(), ids=FP8_ATTENTION_FLAGS.keys())
@pytest.mark.parametrize("recipe_cls", [R.DelayedScaling, R.Float8CurrentScaling, R.MXFP8BlockScaling,
                                        R.Float8BlockScaling, R.NVFP4BlockScaling])
def test_dpa_refuses_a_recipe_asking_for_fp8_attention(recipe_cls, flags):
    """FP8 attention is not implemented: a recipe asking for it is an error, not a silent
    high-precision run."""
    m = te.DotProductAttention(4, 8, name="attn0")
    q = torch.randn(5, 2, 4, 8)
    fp8_attention_refusal(lambda: m(q, q, q), recipe_cls(**flags), "DotProductAttention attn0")


@pytest.mark.parametrize("flags", FP8_ATTENTION_FLAGS.values(), ids=FP8_ATTENTION_FLAGS.keys())
def test_dpa_refuses_fp8_attention_under_compile(flags):
    """The same error, first line first, from a fullgraph compile; a graph traced under a recipe
    without the flags does not hide it (the recipe is guarded)."""
    m = te.DotProductAttention(4, 8, name="attn0")
    cm = _compiled(m)
    q = torch.randn(5, 2, 4, 8)
    with te.autocast(recipe=R.Float8CurrentScaling()):
        torch.testing.assert_close(cm(q, q, q), m(q, q, q), rtol=0, atol=0)
    fp8_attention_refusal(lambda: cm(q, q, q), R.Float8CurrentScaling(**flags), "DotProductAttention attn0")


# ---- RoPE ----------------------------------------------------------------------------------------
def _rope_ref(x, pos, dim, base=10000.0):
    """Llama / GPT-NeoX RoPE in float64: x [..., d], pos broadcastable to x[..., 0]."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = pos.double()[..., None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    xr, xp = x[..., :dim].double(), x[..., dim:].double()
    x1, x2 = xr.chunk(2, -1)
    return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, xp], -1)


def test_rope_matches_reference_in_every_format():
    rope = te.RotaryPositionEmbedding(8)
    freqs = rope(16)
    assert freqs.shape == (16, 1, 1, 8) and freqs.dtype == torch.float32
    x = torch.randn(5, 2, 3, 12)  # sbhd, head dim 12: 8 rotated, 4 pass through
    ref = _rope_ref(x, torch.arange(5)[:, None, None], 8)
    assert (apply_rotary_pos_emb(x, freqs, "sbhd").double() - ref).abs().max() < 1e-5
    got = apply_rotary_pos_emb(x.transpose(0, 1), freqs, "bshd")
    assert (got.double() - ref.transpose(0, 1)).abs().max() < 1e-5
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)  # thd: positions restart per sequence
    xt = torch.randn(7, 3, 12)
    pos = torch.tensor([0, 1, 0, 1, 2, 3, 4])
    got = apply_rotary_pos_emb(xt, freqs, "thd", cu_seqlens=cu)
    assert (got.double() - _rope_ref(xt, pos[:, None], 8)).abs().max() < 1e-5
    start = torch.tensor([3, 0])
    got = apply_rotary_pos_emb(x.transpose(0, 1), freqs, "bshd", start_positions=start)
    ref = _rope_ref(x.transpose(0, 1), (torch.arange(5)[None] + start[:, None])[..., None], 8)
    assert (got.double() - ref).abs().max() < 1e-5
    inter = te.RotaryPositionEmbedding(8, interleaved=True)(16)
    assert torch.equal(inter[:, 0, 0, 0::2], freqs[:, 0, 0, :4])
    assert torch.equal(inter[:, 0, 0, 1::2], freqs[:, 0, 0, :4])
    with pytest.raises(ValueError, match="cu_seqlens is required"):
        apply_rotary_pos_emb(xt, freqs, "thd")


def test_dpa_thd_padding_between_sequences():
    """cu_seqlens_*_padded (TE's pad_between_seqs): [a a a X b b X X c c c c X] gives the compact
    packing's result on the real tokens and zeros on the gaps."""
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    cu_pad = torch.tensor([0, 4, 8, 13], dtype=torch.int32)
    real = torch.tensor([0, 1, 2, 4, 5, 8, 9, 10, 11])
    q, k, v = (torch.randn(13, H, D) for _ in range(3))
    m = te.DotProductAttention(H, D, qkv_format="thd", attn_mask_type="padding_causal", window_size=(2, 0))
    out = m(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad)
    compact = m(q[real], k[real], v[real], cu_seqlens_q=cu, cu_seqlens_kv=cu)
    torch.testing.assert_close(out[real], compact, rtol=1e-6, atol=1e-6)
    gaps = torch.tensor([3, 6, 7, 12])
    assert out[gaps].abs().max() == 0
