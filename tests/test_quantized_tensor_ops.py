"""QuantizedTensor behaviour shared by all formats: native ops, fallback, usages."""
import warnings

import pytest
import torch
from format_cases import FORMAT_CASES

from transformer_engine_proto.tensor import QuantizedTensor
from transformer_engine_proto.tensor import quantized_tensor as qt_module


def _same_bits(a, b) -> bool:
    """Bitwise equality of two buffers of any dtype (fp8 / e8m0 / packed fp4 included)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def _q(case, x=None, rowwise=True, columnwise=True):
    x = torch.randn(128, 256) if x is None else x
    return case.make(rowwise, columnwise).quantize(x), x


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_detach_clone_empty_like_keep_format(case):
    t, _ = _q(case)
    for out in (t.detach(), t.clone(), torch.empty_like(t)):
        assert type(out) is type(t) and out.shape == t.shape and out.dtype == t.dtype
        assert out.get_buffers().keys() == t.get_buffers().keys()
    clone = t.clone()
    for name, buf in clone.get_buffers().items():
        assert buf.data_ptr() != getattr(t, name).data_ptr()
    torch.testing.assert_close(clone.dequantize(), t.dequantize(), rtol=0, atol=0)
    det = t.detach()
    for name, buf in det.get_buffers().items():
        assert buf.data_ptr() == getattr(t, name).data_ptr()


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_view_keeping_last_dim_is_native(case):
    t, x = _q(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn
        v = t.view(4, 32, 256)
    assert isinstance(v, QuantizedTensor) and v.shape == (4, 32, 256)
    torch.testing.assert_close(v.dequantize(), t.dequantize().view(4, 32, 256), rtol=0, atol=0)
    r = v.reshape(128, 256)
    torch.testing.assert_close(r.dequantize(), t.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_copy_requantizes_into_existing_buffers(case):
    t, _ = _q(case)
    ptrs = {k: v.data_ptr() for k, v in t.get_buffers().items()}
    y = torch.randn(128, 256) * 3
    t.copy_(y)
    assert {k: v.data_ptr() for k, v in t.get_buffers().items()} == ptrs
    if getattr(case.make(True, True), "stochastic_rounding", False):
        assert (t.dequantize() - y).abs().max() <= case.max_abs_rel_err * y.abs().max()
        return
    fresh = case.make(True, True).quantize(y)
    torch.testing.assert_close(t.dequantize(), fresh.dequantize(), rtol=0, atol=0)
    # copy_ between quantized tensors of the same format copies the buffers
    t2, _ = _q(case)
    t2.copy_(t)
    torch.testing.assert_close(t2.dequantize(), t.dequantize(), rtol=0, atol=0)
    # and into a plain tensor it dequantizes
    plain = torch.empty(128, 256)
    plain.copy_(t)
    torch.testing.assert_close(plain, t.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_copy_from_a_tensor_with_more_usages_keeps_its_values(case):
    """copy_ into a rowwise-only tensor from one of the same format holding both usages (with
    other scales: 3x the data): the source's values exactly, not re-rounded on new scales."""
    dst, _ = _q(case, columnwise=False)
    src, _ = _q(case, torch.randn(128, 256) * 3)
    assert set(dst.get_buffers()) < set(src.get_buffers())
    dst.copy_(src)
    torch.testing.assert_close(dst.dequantize(), src.dequantize(), rtol=0, atol=0)


def test_fallback_runs_on_dequantized_and_warns_once():
    case = FORMAT_CASES[1]
    t, _ = _q(case)
    qt_module._WARNED_OPS.discard(torch.ops.aten.mul.Tensor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out1 = t * 2
        out2 = t * 3
    msgs = [w for w in caught if "no quantized implementation" in str(w.message)]
    assert len(msgs) == 1 and "aten.mul.Tensor" in str(msgs[0].message)
    assert type(out1) is torch.Tensor
    torch.testing.assert_close(out1, t.dequantize() * 2)
    torch.testing.assert_close(out2, t.dequantize() * 3)


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_update_usage_drops_and_keeps(case):
    t, _ = _q(case)
    ref = t.dequantize()
    t.update_usage(rowwise_usage=True, columnwise_usage=False)
    assert t.has_rowwise() and not t.has_columnwise()
    assert not t._quantizer.columnwise_usage
    assert set(t.get_buffers()) == set(t._quantizer.alloc_tensors(t.shape, t.dtype))
    torch.testing.assert_close(t.dequantize(), ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="at least one"):
        t.update_usage(rowwise_usage=False, columnwise_usage=False)


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_columnwise_only_dequantizes(case):
    t, x = _q(case, rowwise=False, columnwise=True)
    assert not t.has_rowwise() and t.has_columnwise()
    assert (t.dequantize() - x).abs().max() <= case.max_abs_rel_err * x.abs().max()


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_deriving_a_missing_usage_is_exact_or_a_clear_error(case):
    t, _ = _q(case, rowwise=True, columnwise=False)
    ref = t.dequantize()
    try:
        t.update_usage(columnwise_usage=True)
    except RuntimeError as e:
        assert "columnwise" in str(e)
        return
    assert t.has_columnwise()
    t.update_usage(rowwise_usage=False)
    torch.testing.assert_close(t.dequantize(), ref, rtol=0, atol=0)


def test_storage_registry_resolves_every_tensor_class():
    from transformer_engine_proto.tensor import storage_class_by_qualname

    for case in FORMAT_CASES:
        t, _ = _q(case)
        names, ctx = t.__tensor_flatten__()
        assert storage_class_by_qualname(ctx[0]) is type(t)
    with pytest.raises(KeyError, match="no quantized storage class"):
        storage_class_by_qualname("nope.Nope")


@pytest.mark.parametrize("noop", [0.0, 1.0])
@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_update_quantized_honors_noop_flag(case, noop):
    """TE's `update_quantized(src, dst, noop_flag=)`: a nonzero flag leaves every buffer of `dst`
    bit for bit; zero writes the new quantize, as without a flag."""
    t, _ = _q(case)
    before = {n: b.clone() for n, b in t.get_buffers().items()}
    old_values = t.dequantize()
    src = torch.randn(128, 256)
    t._quantizer.update_quantized(src, t, noop_flag=torch.tensor([noop]))
    if not noop and "_sr" in repr(case):  # stochastic rounding: no two quantizes agree; dst now holds src
        assert (t.dequantize() - src).abs().mean() < 0.5 * (old_values - src).abs().mean()
        return
    want = before if noop else case.make(True, True).quantize(src).get_buffers()
    for name, buf in t.get_buffers().items():
        assert _same_bits(buf, want[name]), name


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_prepare_for_saving_and_restore_round_trip(case):
    """TE's save protocol: the buffers out (the object emptied), back in bit for bit, nothing left."""
    for t in (_q(case)[0], case.make(True, True).quantize(torch.randn(128, 256), internal=True)):
        want = {n: b.clone() for n, b in t.get_buffers().items()}
        tensors, obj = t.prepare_for_saving()
        assert obj is t and not t.get_buffers() and len(tensors) == len(type(t)._FLATTEN_TENSOR_BUFFERS)
        assert obj.restore_from_saved(tensors + ["next"]) == ["next"]
        assert t.get_buffers().keys() == want.keys()
        for name, buf in t.get_buffers().items():
            assert _same_bits(buf, want[name]), name
