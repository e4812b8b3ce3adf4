"""Per-tensor FP8 numerics against an independent float64 implementation written here."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer, Float8Quantizer

FMT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def ref_scale(amax, fmt_max, margin=0, pow2=False):
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    # the spec computes in float32: emulate the float32 divisions
    scale = float(torch.tensor(fmt_max, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
                  / torch.tensor(2.0**margin))
    if math.isinf(scale):
        scale = float(torch.finfo(torch.float32).max)
    if pow2:
        scale = 2.0 ** math.floor(math.log2(scale))
    return scale


def ref_cast(x64, scale, fp8_dtype):
    """Scale in float32 (as the spec does), clamp to +-max, round-to-nearest-even by torch's cast."""
    m = FMT_MAX[fp8_dtype]
    y = (x64.float() * torch.tensor(scale, dtype=torch.float32)).double()
    return y.clamp(-m, m).float().to(fp8_dtype)


shapes = st.tuples(st.integers(1, 40), st.integers(1, 70))
kinds = st.sampled_from(["normal", "large", "tiny", "zeros", "denormal"])
fp8_dtypes = st.sampled_from([torch.float8_e4m3fn, torch.float8_e5m2])


def _draw_x(shape, kind, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    scale = {"normal": 1.0, "large": 3e4, "tiny": 1e-6, "zeros": 0.0, "denormal": 1e-40}[kind]
    return (x * scale).float()


@given(shapes, kinds, fp8_dtypes, st.integers(0, 3), st.booleans(), st.integers(0, 999))
def test_current_scaling_matches_reference(shape, kind, fp8_dtype, margin, pow2, seed):
    x = _draw_x(shape, kind, seed)
    q = Float8CurrentScalingQuantizer(fp8_dtype, margin=margin, force_pow_2_scales=pow2)
    t = q.quantize(x)
    amax = x.abs().max().item()
    scale = ref_scale(amax, FMT_MAX[fp8_dtype], margin, pow2)
    expected = ref_cast(x.double(), scale, fp8_dtype)
    assert torch.equal(t._data.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(t._transpose.view(torch.uint8), expected.t().contiguous().view(torch.uint8))
    assert t._scale_inv.item() == pytest.approx(1.0 / scale, rel=1e-7)


def test_scale_rule_edges():
    fp8 = torch.float8_e4m3fn
    q = Float8CurrentScalingQuantizer(fp8)
    assert q.quantize(torch.zeros(4, 4))._scale_inv.item() == 1.0  # amax 0 -> scale 1
    x = torch.full((2, 2), 448.0)
    assert q.quantize(x)._scale_inv.item() == 1.0
    assert Float8CurrentScalingQuantizer(fp8, margin=1).quantize(x)._scale_inv.item() == 2.0
    # E4M3 / E5M2 saturate at their max instead of producing NaN/Inf
    t = Float8CurrentScalingQuantizer(fp8).quantize(torch.tensor([[1.0, 1e-3, -1.0]]))
    assert t._data.float().abs().max().item() == 448.0
    big = torch.tensor([[float("inf"), 1.0]])
    assert t.__class__ is type(Float8CurrentScalingQuantizer(torch.float8_e5m2).quantize(big))
    deq = Float8CurrentScalingQuantizer(torch.float8_e5m2).quantize(big).dequantize()
    assert deq[0, 0].item() == math.inf and deq[0, 1].item() == 1.0  # inf stays inf in E5M2
    # a tiny amax whose scale overflows float32 is clamped to float32 max (no inf scale)
    tiny = torch.tensor([[1e-44, 0.0]])
    s_inv = q.quantize(tiny)._scale_inv.item()
    assert s_inv > 0 and math.isfinite(1.0 / s_inv)


def test_delayed_scaling_uses_given_scale_and_accumulates_amax():
    scale = torch.tensor([4.0])
    amax = torch.zeros(1)
    q = Float8Quantizer(scale, amax, torch.float8_e4m3fn)
    x = torch.tensor([[1.0, -3.0], [200.0, 0.5]])
    t = q.quantize(x)
    assert amax.item() == 200.0  # recorded for the next step's scale
    assert t._scale_inv.item() == 0.25
    expected = ref_cast(x.double(), 4.0, torch.float8_e4m3fn)  # 800 saturates to 448
    assert torch.equal(t._data.view(torch.uint8), expected.view(torch.uint8))
    q.quantize(torch.tensor([[5.0]]))
    assert amax.item() == 200.0  # max-accumulated across micro-batches until the history rolls
    # quantizers compare by settings, not by their state tensors
    assert q == Float8Quantizer(torch.tensor([9.0]), torch.zeros(1), torch.float8_e4m3fn)
    assert q.stateless() == q and q.stateless().scale is None


def test_quantizer_bound_to_a_slot_of_shared_buffers():
    """with_scale_state(scales, amaxes, slot): a GEMM's input and weight read one (2,) scale buffer and
    record into one (2,) amax buffer; each slot behaves as its own one-element buffers, amax None
    records nothing, and a slot outside the buffers is refused by name."""
    x = torch.tensor([[1.0, -3.0], [200.0, 0.5]])
    scales, amaxes = torch.tensor([4.0, 0.5]), torch.tensor([1.0, 7.0])
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn)
    for slot in (0, 1):
        alone = Float8Quantizer(scales[slot:slot + 1].clone(), amaxes[slot:slot + 1].clone(), torch.float8_e4m3fn)
        want = alone.quantize(x)
        got = q.with_scale_state(scales, amaxes, slot).quantize(x)
        assert torch.equal(got._data.view(torch.uint8), want._data.view(torch.uint8))
        assert got._scale_inv.item() == want._scale_inv.item() == 1 / scales[slot].item()
        assert amaxes[slot].item() == alone.amax.item() == 200.0
    assert torch.equal(amaxes, torch.tensor([200.0, 200.0]))
    amaxes.zero_()
    again = q.with_scale_state(scales, None, 1).quantize(x)  # backward's re-quantize: amax recorded already
    assert torch.equal(again._data.view(torch.uint8), want._data.view(torch.uint8)) and not amaxes.any()
    with pytest.raises(ValueError, match="slot 2 is not an element of scale"):
        q.with_scale_state(scales, torch.zeros(2), 2).quantize(x)
    with pytest.raises(ValueError, match="slot 1 is not an element of amax_out"):
        q.with_scale_state(scales, torch.zeros((1, 2)), 1).quantize(x)
    # a one-element amax is its own slot: backward's gradient reads scale slot 2, records into its (1,)
    grad_amax = torch.zeros(1)
    got = q.with_scale_state(torch.tensor([4.0, 0.5, 2.0]), grad_amax, 2).quantize(x)
    assert got._scale_inv.item() == 0.5 and grad_amax.item() == 200.0
    with pytest.raises(RuntimeError, match="scale/amax"):  # only a bound copy may leave the amax out
        Float8Quantizer(torch.ones(1), None).quantize(x)


def test_bad_quantizer_arguments():
    with pytest.raises(TypeError, match="fp8_dtype"):
        Float8CurrentScalingQuantizer(torch.float16)
    with pytest.raises(TypeError, match="scale"):
        Float8Quantizer(torch.ones(2), torch.zeros(1))
    with pytest.raises(TypeError, match="amax"):
        Float8Quantizer(torch.ones(1), torch.zeros(1, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="scale/amax"):
        Float8Quantizer(torch.ones(1), torch.zeros(1)).stateless().quantize(torch.ones(2, 2))
    with pytest.raises(TypeError, match="scale"):
        Float8Quantizer(torch.ones(1, dtype=torch.bool), torch.zeros(1))
    # a real scale of another dtype (TE's tests pass torch.tensor([1])) is read as float32
    q = Float8Quantizer(torch.tensor([2]), torch.zeros(1))
    assert q.scale.dtype == torch.float32 and q.scale.item() == 2.0
    assert q.quantize(torch.tensor([[3.0]])).dequantize().item() == 3.0


def test_transpose_and_usage_are_exact_relayouts():
    x = torch.randn(48, 80)
    t = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, columnwise_usage=False).quantize(x)
    ref = t.dequantize()
    t.update_usage(columnwise_usage=True)
    assert torch.equal(t._transpose.view(torch.uint8), t._data.t().contiguous().view(torch.uint8))
    tt = t.t()
    assert tt.shape == (80, 48)
    torch.testing.assert_close(tt.dequantize(), ref.t(), rtol=0, atol=0)
    t.update_usage(rowwise_usage=False)
    torch.testing.assert_close(t.dequantize(), ref, rtol=0, atol=0)
    t.update_usage(rowwise_usage=True)
    torch.testing.assert_close(t.dequantize(), ref, rtol=0, atol=0)


@pytest.mark.parametrize("num", [448.0, 57344.0, 448.0 * 6.0, 1.0])
def test_true_div_is_the_fp32_ieee_quotient(num):
    """The scale division runs in float64 and rounds once (so inductor cannot lower it to Triton's
    approximate fp32 division on CUDA); that must equal the correctly rounded fp32 quotient bit
    for bit, over random bit patterns (subnormal, huge, zero, inf and NaN included)."""
    from transformer_engine_proto.kernels.reference.common import true_div

    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**31 - 1, (1 << 20,), generator=g, dtype=torch.int64).to(torch.int32)
    den = torch.cat([bits.view(torch.float32), torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-45])])
    want = torch.full_like(den, num) / den  # fp32 tensor / tensor: IEEE on CPU
    got = true_div(num, den)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
