"""DotProductAttention / MultiheadAttention reject a mask whose shape breaks TE's convention
(padding [b, 1, 1, s] or a (q, kv) pair; "arbitrary" broadcastable to [b, h, s_q, s_kv]), eagerly
and under torch.compile(fullgraph=True) with our type and message; mask types that do not read a
mask ignore it, as TE does."""
import re

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_proto as te

B, H, D, S = 2, 4, 8, 6
TAKERS = "'padding', 'padding_causal', 'padding_causal_bottom_right'.*'arbitrary'"


def _qkv(b=B, sq=S, skv=S):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, H, D, generator=g), torch.randn(b, skv, H, D, generator=g),
            torch.randn(b, skv, H, D, generator=g))


def _dpa(mask_type, **kw):
    return te.DotProductAttention(H, D, qkv_format="bshd", attn_mask_type=mask_type, name="attn", **kw)


@pytest.mark.parametrize("window", [None, (2, 0)], ids=["nowin", "w2_0"])
@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "causal_bottom_right"])
def test_mask_type_that_does_not_read_the_mask_ignores_it(mask_type, window):
    """TE reads attention_mask for the padding types and "arbitrary" only (its tests pass a causal
    mask with "causal"): the output is the one without the mask, even for an all-masked one."""
    masked_out = torch.ones(B, 1, 1, S, dtype=torch.bool)
    want = _dpa(mask_type, window_size=window)(*_qkv())
    torch.testing.assert_close(_dpa(mask_type, window_size=window)(*_qkv(), attention_mask=masked_out), want,
                               rtol=0, atol=0)
    got = _dpa("padding", window_size=window)(*_qkv(), attention_mask=masked_out, attn_mask_type=mask_type)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # per-call override


def test_mha_causal_with_a_causal_mask_as_te_tests_pass_it():
    """TE's test_mha_accuracy / test_gpt_accuracy: attn_mask_type "causal" with the causal mask
    (True above the diagonal) gives causal attention, eager and compiled."""
    torch.manual_seed(0)
    m = te.MultiheadAttention(32, H, attn_mask_type="causal", attention_dropout=0.0, name="mha")
    x = torch.randn(S, B, 32)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    want = m(x)
    torch.testing.assert_close(m(x, attention_mask=causal), want, rtol=0, atol=0)
    torch._dynamo.reset()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, attention_mask=causal), want, rtol=0, atol=0)
    assert not torch.allclose(want, m(x, attn_mask_type="no_mask"))  # causal, not unmasked


@pytest.mark.parametrize("shape", [(S, S), (1, 1, S, S), (B, 1, S, S), (1, H, 1, S), (B, H, S, S)])
def test_arbitrary_mask_broadcast_shapes_match_the_full_mask(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(1)) > 0.5
    m = _dpa("arbitrary")
    torch.testing.assert_close(m(*_qkv(), attention_mask=mask), m(*_qkv(), attention_mask=mask.expand(B, H, S, S)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(3, S, S), (B, H, S, S - 1), (B, 3, S, S), (1, B, H, S, S)])
def test_arbitrary_mask_of_wrong_shape_names_the_expected_shape(shape):
    bad = torch.zeros(shape, dtype=torch.bool)
    expected = f"broadcastable to [b, h, s_q, s_kv] = [{B}, {H}, {S}, {S}], got {shape}"
    with pytest.raises(ValueError, match="^DotProductAttention attn: an 'arbitrary' attention_mask must be "
                                         + re.escape(expected) + "$"):
        _dpa("arbitrary")(*_qkv(), attention_mask=bad)


def test_arbitrary_mask_type_and_dtype():
    with pytest.raises(ValueError, match="'arbitrary' needs a bool attention_mask broadcastable"):
        _dpa("arbitrary")(*_qkv())
    with pytest.raises(TypeError, match="'arbitrary' attention_mask must be bool.*got torch.float32"):
        _dpa("arbitrary")(*_qkv(), attention_mask=torch.zeros(S, S))
    m = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    with pytest.raises(TypeError, match="'arbitrary' takes one attention_mask tensor, got tuple"):
        _dpa("arbitrary")(*_qkv(), attention_mask=(m, m))


def test_padding_mask_of_batch_one_is_not_broadcast():
    with pytest.raises(ValueError, match=r"^DotProductAttention attn: the q padding attention_mask must be "
                                         r"\[b, 1, 1, s_q\] = \[2, 1, 1, 6\], got \(1, 1, 1, 6\); a padding mask is "
                                         "not broadcast over the batch"):
        _dpa("padding")(*_qkv(), attention_mask=torch.zeros(1, 1, 1, S, dtype=torch.bool))
    ok = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"the kv padding attention_mask must be .*got \(1, 1, 1, 6\); a padding"):
        _dpa("padding_causal")(*_qkv(), attention_mask=(ok, ok[:1]))


@pytest.mark.parametrize("shape", [(B, S), (B, 1, S, 1), (B, 1, 1, S - 1)])
def test_padding_mask_must_be_b_1_1_s(shape):
    with pytest.raises(ValueError, match=r"the q padding attention_mask must be \[b, 1, 1, s_q\] = \[2, 1, 1, 6\]"):
        _dpa("padding")(*_qkv(), attention_mask=torch.zeros(shape, dtype=torch.bool))


def test_padding_mask_for_cross_attention_and_pairs():
    q, k, v = _qkv(skv=9)
    mq, mkv = torch.zeros(B, 1, 1, S, dtype=torch.bool), torch.zeros(B, 1, 1, 9, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"\[2, 1, 1, 9\], got \(2, 1, 1, 6\); pass a \(q, kv\) pair when s_q != s_kv"):
        _dpa("padding")(q, k, v, attention_mask=mq)
    assert _dpa("padding")(q, k, v, attention_mask=(mq, mkv)).shape == (B, S, H * D)
    with pytest.raises(TypeError, match="one tensor .b, 1, 1, s. or a .q, kv. pair, got 3 items"):
        _dpa("padding")(q, k, v, attention_mask=(mq, mkv, mkv))
    with pytest.raises(TypeError, match="padding attention_mask must be bool .True = masked out., got torch.int64"):
        _dpa("padding")(q, k, v, attention_mask=(mq, mkv.long()))


# ---- under torch.compile(fullgraph=True): our type, our message first -----------------------------
def _bad_calls():
    q, k, v = _qkv()
    pad = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    return {
        "arbitrary_shape": (_dpa("arbitrary"), (q, k, v), dict(attention_mask=torch.zeros(3, S, S, dtype=torch.bool)),
                            ValueError, "DotProductAttention attn: an 'arbitrary' attention_mask must be broadcastable "
                                        "to [b, h, s_q, s_kv] = [2, 4, 6, 6], got (3, 6, 6)"),
        "padding_batch_one": (_dpa("padding"), (q, k, v), dict(attention_mask=pad[:1]), ValueError,
                              "DotProductAttention attn: the q padding attention_mask must be [b, 1, 1, s_q]"),
        "padding_no_mask": (_dpa("padding"), (q, k, v), {}, ValueError,
                            "DotProductAttention attn: attn_mask_type 'padding' needs attention_mask or cu_seqlens"),
        "qkv_dtypes": (_dpa("causal"), (q, k.double(), v), {}, TypeError,
                       "DotProductAttention attn: query/key/value dtypes must be one floating dtype"),
        "qkv_rank": (_dpa("causal"), (q[0], k, v), {}, ValueError,
                     "DotProductAttention attn: query_layer must be a 4D tensor for qkv_format 'bshd', got (6, 4, 8)"),
        "mask_type_name": (_dpa("causal"), (q, k, v), dict(attn_mask_type="sliding"), ValueError,
                           "DotProductAttention attn: attn_mask_type must be one of"),
        "bias": (_dpa("causal"), (q, k, v), dict(core_attention_bias_type="post_scale_bias"), NotImplementedError,
                 "DotProductAttention attn: attention bias / ALiBi"),
        "mha_encoder_output": (te.MultiheadAttention(32, H, name="mha"), (torch.randn(S, B, 32),),
                               dict(encoder_output=torch.randn(S, B, 32)), ValueError,
                               "MultiheadAttention mha: encoder_output is only used with attention_type='cross'"),
        "mha_rank": (te.MultiheadAttention(32, H, name="mha"), (torch.randn(S, 32),), {}, ValueError,
                     "MultiheadAttention mha: hidden_states must be 3D for qkv_format 'sbhd', got (6, 32)"),
    }


def _compiled_first_line(m, args, kw, exc_type, backend, dynamic=None):
    torch._dynamo.reset()
    fn = torch.compile(m, fullgraph=True, backend=backend, dynamic=dynamic)
    with pytest.raises(exc_type) as info:
        fn(*args, **kw)
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_compiled_errors_keep_type_and_message(case):
    m, args, kw, exc_type, first = _bad_calls()[case]
    assert _compiled_first_line(m, args, kw, exc_type, "aot_eager").startswith(first)
    with pytest.raises(exc_type) as info:  # eagerly: the plain type, the same message
        m(*args, **kw)
    assert type(info.value) is exc_type and str(info.value).startswith(first)


@pytest.mark.parametrize("case", ["padding_no_mask", "arbitrary_shape"])
def test_compiled_errors_keep_type_and_message_inductor(case):
    m, args, kw, exc_type, first = _bad_calls()[case]
    assert _compiled_first_line(m, args, kw, exc_type, "inductor").startswith(first)


def test_compiled_padding_batch_one_error_with_dynamic_shapes():
    m, args, kw, exc_type, first = _bad_calls()["padding_batch_one"]
    line = _compiled_first_line(m, args, kw, exc_type, "aot_eager", dynamic=True)
    assert line == first + " = [2, 1, 1, 6], got (1, 1, 1, 6); a padding mask is not broadcast over the batch"


def test_mask_checks_trace_without_graph_breaks_for_dynamic_batch():
    """The checks read only shapes: valid masks of two batch sizes run in one dynamic graph."""
    m_pad, m_arb = _dpa("padding_causal"), _dpa("arbitrary")
    for m, make in ((m_pad, lambda b: torch.arange(S)[None, None, None].expand(b, 1, 1, S) >= 4),
                    (m_arb, lambda b: torch.rand(b, 1, S, S, generator=torch.Generator().manual_seed(b)) > 0.5)):
        torch._dynamo.reset()
        counters.clear()
        cm = torch.compile(m, fullgraph=True, backend="aot_eager", dynamic=True)
        for b in (2, 3):
            q, k, v = _qkv(b=b)
            torch.testing.assert_close(cm(q, k, v, attention_mask=make(b)), m(q, k, v, attention_mask=make(b)),
                                       rtol=1e-6, atol=1e-6)
        assert sum(counters["graph_break"].values()) == 0
        assert counters["stats"]["unique_graphs"] == 1
