"""Format-generic invariants: the fake layout equals the real quantize, flatten round-trips,
TensorProto matches, dequantize error bounds, and bad shapes/dtypes raise clear errors."""
import pytest
import torch
from format_cases import FORMAT_CASES
from hypothesis import given
from hypothesis import strategies as st
from inputs import seeded_input

from transformer_engine_proto.tensor import QuantizedTensor, TensorProto, to_tensor_proto

USAGES = [(True, False), (False, True), (True, True)]


def _lcm(a, b):
    import math

    return a * b // math.gcd(a, b)


@st.composite
def valid_shapes(draw, case, rowwise, columnwise):
    k_mult = 1
    if rowwise:
        k_mult = _lcm(k_mult, case.k_multiple)
    if columnwise:
        k_mult = _lcm(k_mult, case.k_multiple_columnwise)
    m_mult = case.m_multiple if columnwise else 1
    k = k_mult * draw(st.integers(1, max(1, 96 // k_mult)))
    ndim = draw(st.integers(1, 3)) if m_mult == 1 else draw(st.integers(2, 3))
    if ndim == 1:
        return (k,)
    m = m_mult * draw(st.integers(1, max(1, 64 // m_mult)))
    if ndim == 3 and m % 2 == 0 and draw(st.booleans()):
        return (2, m // 2, k)
    return (1, m, k) if ndim == 3 else (m, k)


def _specs(bufs):
    return {k: (tuple(v.shape), tuple(v.stride()), v.dtype) for k, v in bufs.items()}


@st.composite
def cases_and_shapes(draw):
    case = draw(st.sampled_from(FORMAT_CASES))
    rowwise, columnwise = draw(st.sampled_from(USAGES))
    shape = draw(valid_shapes(case, rowwise, columnwise))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    kind = draw(st.sampled_from(["normal", "large", "zeros", "denormal", "mixed"]))
    return case, rowwise, columnwise, shape, dtype, kind


@given(cases_and_shapes(), st.integers(0, 2**16))
def test_fake_layout_matches_real_quantize(args, seed):
    case, rowwise, columnwise, shape, dtype, kind = args
    q = case.make(rowwise, columnwise)
    x = seeded_input(shape, kind, seed, dtype, large=1e4)
    real = q.quantize(x)
    assert isinstance(real, QuantizedTensor)
    assert real.shape == x.shape and real.dtype == x.dtype
    fake = q.alloc_tensors(shape, dtype, "cpu")
    assert _specs(fake) == _specs(real.get_buffers())
    assert list(fake) == [a for a, _ in type(real)._FLATTEN_TENSOR_BUFFERS if a in fake]

    proto = TensorProto(shape, dtype, q)
    made = proto.create_tensor()
    assert type(made) is type(real)
    assert made.shape == real.shape and made.dtype == real.dtype
    assert _specs(made.get_buffers()) == _specs(real.get_buffers())
    assert proto.inner_names() == tuple(real.get_buffers())
    assert proto.create_metadata()[1] == made.get_metadata()
    assert to_tensor_proto(real).inner_names() == proto.inner_names()

    # flatten -> unflatten round-trips by value
    names, ctx = real.__tensor_flatten__()
    assert names == list(real.get_buffers())
    back = type(real).__tensor_unflatten__({n: getattr(real, n) for n in names}, ctx, real.shape, real.stride())
    assert type(back) is type(real)
    for n in names:
        got, want = (getattr(t, n).reshape(-1).view(torch.uint8) for t in (back, real))
        assert torch.equal(got, want), n
    torch.testing.assert_close(back.dequantize(), real.dequantize(), equal_nan=True, rtol=0, atol=0)


@given(cases_and_shapes(), st.integers(0, 2**16))
def test_dequantize_error_bound(args, seed):
    case, rowwise, columnwise, shape, dtype, kind = args
    q = case.make(rowwise, columnwise)
    x = seeded_input(shape, kind, seed, dtype, large=1e4).float()
    y = q.quantize(x).dequantize()
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.isfinite(y).all()
    amax = x.abs().max().item()
    err = (y - x).abs().max().item()
    assert err <= case.max_abs_rel_err * amax + 1e-30, f"{case.name}: err {err} vs amax {amax}"
    if kind == "zeros":
        assert torch.equal(y, x)


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_both_usages_dequantize_alike(case):
    x = torch.randn(128, 256)
    row = case.make(True, False).quantize(x).dequantize()
    col = case.make(False, True).quantize(x).dequantize()
    assert row.shape == col.shape == x.shape
    # Formats with different rowwise/columnwise blocks differ a little; both are close to x.
    for y in (row, col):
        assert (y - x).abs().max() <= case.max_abs_rel_err * x.abs().max()


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.float64, torch.float8_e4m3fn])
def test_rejects_unsupported_dtypes(case, dtype):
    x = torch.ones(128, 128).to(dtype)
    with pytest.raises(TypeError, match="dtype"):
        case.make(True, True).quantize(x)


@pytest.mark.parametrize("case", [c for c in FORMAT_CASES if c.k_multiple > 1 or c.m_multiple > 1], ids=repr)
def test_rejects_shapes_blocks_do_not_divide(case):
    if case.k_multiple > 1:
        bad = (case.m_multiple * 2, case.k_multiple + 1)
        with pytest.raises(ValueError, match=r"\b%d\b" % bad[-1]):
            case.make(True, False).quantize(torch.randn(bad))
        with pytest.raises(ValueError, match=r"\b%d\b" % bad[-1]):
            case.make(True, False).alloc_tensors(bad, torch.float32)
    if case.m_multiple > 1:
        bad = (case.m_multiple + 1, max(case.k_multiple, case.k_multiple_columnwise) * 2)
        with pytest.raises(ValueError, match=r"\b%d\b" % bad[0]):
            case.make(False, True).quantize(torch.randn(bad))
        with pytest.raises(ValueError, match=r"\b%d\b" % bad[0]):
            TensorProto(bad, torch.float32, case.make(False, True)).create_tensor()


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_rejects_zero_dim_and_no_usage(case):
    with pytest.raises(ValueError, match="0-dim"):
        case.make(True, True).quantize(torch.tensor(1.0))
    with pytest.raises(ValueError, match="usage"):
        case.make(False, False).quantize(torch.randn(128, 128))


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_nan_and_inf_inputs_documented_behaviour(case):
    """NaN propagates to the dequantized output where it was; inf stays non-finite (never a silent
    finite value): +-inf where the format has it (E5M2, MXFP8), NaN where it has none (E4M3) or
    for its whole block (NVFP4). The other blocks keep the precision of their finite values (no
    exception: checking would need a host sync)."""
    x = torch.randn(128, 128)
    x[3, 5] = float("nan")
    y = case.make(True, False).quantize(x).dequantize()
    assert torch.isnan(y[3, 5])
    x = torch.randn(128, 128)
    x[7, 9] = float("inf")
    x[8, 1] = float("-inf")
    y = case.make(True, False).quantize(x).dequantize()
    assert torch.isnan(y[7, 9]) or y[7, 9] == float("inf")
    assert torch.isnan(y[8, 1]) or y[8, 1] == float("-inf")
    assert y[16:].isfinite().all()  # rows in other blocks (NVFP4 2D blocks are 16 x 16)
    # within the coarsest grid step here (FP4 with stochastic rounding: a third of the block max)
    assert (y[16:] - x[16:]).abs().max() <= 0.34 * x[16:].abs().max()


@pytest.mark.parametrize("case", FORMAT_CASES, ids=lambda c: c.name)
def test_internal_quantize_is_a_bare_storage_with_the_same_buffers(case):
    """`quantize(internal=True)` (what the Linear ops use) gives the format's storage class, no
    tensor subclass, with the tensor's buffers bit for bit; `only_usage` keeps one usage's buffers
    and leaves the original whole; gemm reads a storage as it reads the tensor."""
    from transformer_engine_proto.gemm import gemm

    shape = (_lcm(case.m_multiple, 32), _lcm(_lcm(case.k_multiple, case.k_multiple_columnwise), 64))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)  # the same draws for stochastic rounding
    tensor = case.make(True, True).quantize(x)
    torch.manual_seed(1)
    bare = case.make(True, True).quantize(x, internal=True)
    assert not isinstance(bare, torch.Tensor) and isinstance(tensor, type(bare))
    assert type(bare) is type(tensor).storage_class
    a, b = tensor.get_buffers(), bare.get_buffers()
    bits = lambda t: t.contiguous().flatten().view(torch.uint8)  # noqa: E731  (fp8/fp4 buffers: compare bytes)
    assert list(a) == list(b) and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)
    for rowwise in (True, False):
        view = bare.only_usage(rowwise)
        assert (view.has_rowwise(), view.has_columnwise()) == (rowwise, not rowwise)
        assert bare.has_rowwise() and bare.has_columnwise()  # the original keeps both
        assert all(view.get_buffers()[k] is b[k] for k in view.get_buffers())
    w = case.make(True, False).quantize(torch.randn(48, shape[1]), internal=True)
    ref = gemm(tensor.update_usage(rowwise_usage=True, columnwise_usage=False),
               case.make(True, False).quantize(w.dequantize()), trans_b=True, out_dtype=torch.float32)
    out = gemm(bare.only_usage(True), w.only_usage(True), trans_b=True, out_dtype=torch.float32)
    assert out.shape == (shape[0], 48) and torch.allclose(out, ref, rtol=0.1, atol=0.1 * ref.abs().max().item())
    with pytest.raises(TypeError, match="bare storage"):
        tensor.only_usage(True)
    with pytest.raises(ValueError, match="no columnwise buffers"):
        w.only_usage(False)  # never an empty storage


def test_a_bare_storage_refuses_unknown_buffers_and_metadata():
    """`_bare` (the internal quantize's constructor) names what does not belong, and leaves the
    buffers it was not given as None."""
    from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer

    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    t = q.quantize(torch.randn(4, 8), internal=True)
    cls, buffers = type(t), t.get_buffers()
    with pytest.raises(KeyError, match="_bogus"):
        cls._bare({**buffers, "_bogus": buffers["_data"]}, (4, 8), torch.float32, q, q.metadata())
    with pytest.raises(TypeError, match="fp8_dtype"):
        cls._bare(buffers, (4, 8), torch.float32, q, {})
    only_rowwise = cls._bare({"_data": buffers["_data"], "_scale_inv": buffers["_scale_inv"]}, (4, 8),
                             torch.float32, q, q.metadata())
    assert only_rowwise._transpose is None and only_rowwise.has_rowwise() and not only_rowwise.has_columnwise()


@pytest.mark.parametrize("compute_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                                     (torch.float32, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("case", [c for c in FORMAT_CASES if c.name in ("mxfp8_e4m3", "nvfp4_1d")],
                         ids=lambda c: c.name)
def test_emulated_gemm_casts_once_and_equals_the_float32_round_trip(case, compute_dtype, out_dtype):
    """The emulated GEMM (MXFP8/NVFP4 on Hopper, everything on CPU) casts its product straight to
    `out_dtype`; that must equal the former product -> float32 -> out_dtype bit for bit."""
    from transformer_engine_proto.gemm import _values, emulated_gemm

    g = torch.Generator().manual_seed(3)
    a = case.make(True, False).quantize(torch.randn(64, 128, generator=g), internal=True)
    b = case.make(True, False).quantize(torch.randn(32, 128, generator=g), internal=True)
    got = emulated_gemm(a, b, out_dtype=out_dtype, trans_b=True, compute_dtype=compute_dtype)
    want = (_values(a, False, compute_dtype) @ _values(b, True, compute_dtype)).float().to(out_dtype)
    assert got.dtype == out_dtype and torch.equal(got, want)
