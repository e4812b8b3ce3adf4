"""MXFP8 numerics against an independent float64 implementation written here (loops over blocks,
fp8 rounding from the format's bit definition), plus the edge rules and tensor behaviour."""
import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from inputs import KINDS, seeded_input

from transformer_engine_proto.tensor import MXFP8Quantizer, MXFP8Tensor, QuantizedTensor, TensorProto

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT_MAX = {E4M3: 448.0, E5M2: 57344.0}
BLOCK = 32


# ---- independent reference ---------------------------------------------------------------------
def _fp8_table(fp8_dtype):
    """Non-negative finite fp8 values by code, decoded from the bit layout (sign-exp-mantissa)."""
    ebits, mbits, bias = (4, 3, 7) if fp8_dtype == E4M3 else (5, 2, 15)
    vals = []
    for code in range(128):
        exp, man = code >> mbits, code & ((1 << mbits) - 1)
        if exp == 0:
            v = man / 2**mbits * 2.0 ** (1 - bias)
        else:
            v = (1 + man / 2**mbits) * 2.0 ** (exp - bias)
        vals.append(v)
    n_finite = 127 if fp8_dtype == E4M3 else 124  # e4m3fn: 0x7f NaN; e5m2: 0x7c.. inf/NaN
    table = torch.tensor(vals[:n_finite], dtype=torch.float64)
    assert table[-1].item() == FMT_MAX[fp8_dtype]
    return table


_TABLES = {d: _fp8_table(d) for d in (E4M3, E5M2)}


def ref_fp8_bytes(v64: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Round-to-nearest-even with saturation to +-max, as uint8 codes (no NaN in v64)."""
    table = _TABLES[fp8_dtype]
    a = v64.abs().clamp(max=table[-1].item()).flatten()
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    code = code + 128 * torch.signbit(v64.flatten()).long()
    return code.to(torch.uint8).reshape(v64.shape)


def ref_exponent(amax: float, fmt_max: float) -> int:
    """Smallest e in [-127, 127] with amax <= fmt_max * 2**e (exact in float64)."""
    if amax == 0:
        return -127
    if math.isinf(amax):
        return 127
    e = max(-127, math.floor(math.log2(amax) - math.log2(fmt_max)) - 2)
    while e < 127 and amax > fmt_max * 2.0**e:
        e += 1
    return e


def ref_quantize_blocks(x2d: torch.Tensor, fp8_dtype, columnwise: bool):
    """(data bytes (M, K), e8m0 bytes) with blocks of 32 along K (rowwise) or M (columnwise)."""
    x = x2d.double()
    if columnwise:
        data, scale = ref_quantize_blocks(x.t(), fp8_dtype, False)
        return data.t(), scale.t()
    m, k = x.shape
    data = torch.empty(m, k, dtype=torch.uint8)
    scale = torch.empty(m, k // BLOCK, dtype=torch.uint8)
    for i in range(m):
        for j in range(k // BLOCK):
            blk = x[i, j * BLOCK:(j + 1) * BLOCK]
            e = ref_exponent(blk.abs().max().item(), FMT_MAX[fp8_dtype])
            scale[i, j] = e + 127
            data[i, j * BLOCK:(j + 1) * BLOCK] = ref_fp8_bytes(blk * 2.0**-e, fp8_dtype)
    return data, scale


def _bytes(t):
    return t.view(torch.uint8)


def test_reference_rounding_agrees_with_format_definition():
    for d in (E4M3, E5M2):
        table = _TABLES[d]
        assert torch.equal(torch.arange(len(table), dtype=torch.uint8).view(d).double(), table)


# ---- property test vs the reference -----------------------------------------------------------
def _draw_x(shape, kind, seed, dtype):
    # E8M0 block scales span 2**-127 to 2**127: the kinds reach far past FP8's own range
    x = seeded_input(shape, kind, seed, large=3e30, tiny=1e-30, denormal=1e-41, mixed_exp=60)
    if kind == "mixed":
        x[..., : shape[-1] // 2] = 0.0  # whole zero blocks next to busy ones
    return x.to(dtype)


@st.composite
def mx_shapes(draw):
    rowwise, columnwise = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    k = BLOCK * draw(st.integers(1, 3)) if rowwise else draw(st.integers(1, 70))
    m = BLOCK * draw(st.integers(1, 2)) if columnwise else draw(st.integers(1, 40))
    lead = draw(st.sampled_from(["2d", "3d", "1d"]))
    if lead == "1d" and m == 1:
        shape = (k,)
    elif lead == "3d" and m % 2 == 0:
        shape = (2, m // 2, k)
    else:
        shape = (m, k)
    return shape, rowwise, columnwise


@given(mx_shapes(), st.sampled_from(KINDS), st.sampled_from([E4M3, E5M2]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.integers(0, 9999))
def test_quantize_matches_reference_bitwise(shape_usage, kind, fp8_dtype, in_dtype, seed):
    shape, rowwise, columnwise = shape_usage
    x = _draw_x(shape, kind, seed, in_dtype)
    t = MXFP8Quantizer(fp8_dtype, rowwise_usage=rowwise, columnwise_usage=columnwise).quantize(x)
    x2d = x.float().reshape(-1, shape[-1])
    m, k = x2d.shape
    if rowwise:
        data, scale = ref_quantize_blocks(x2d, fp8_dtype, False)
        assert t._rowwise_data.shape == shape and t._rowwise_data.dtype == fp8_dtype
        assert t._rowwise_scale_inv.shape == (m, k // BLOCK)
        assert torch.equal(_bytes(t._rowwise_data).reshape(m, k), data)
        assert torch.equal(_bytes(t._rowwise_scale_inv), scale)
    else:
        assert t._rowwise_data is None and t._rowwise_scale_inv is None
    if columnwise:
        data, scale = ref_quantize_blocks(x2d, fp8_dtype, True)
        assert t._columnwise_data.shape == shape
        assert t._columnwise_scale_inv.shape == (m // BLOCK, k)
        assert torch.equal(_bytes(t._columnwise_data).reshape(m, k), data)
        assert torch.equal(_bytes(t._columnwise_scale_inv), scale)
    else:
        assert t._columnwise_data is None and t._columnwise_scale_inv is None
    # dequantize = fp8 value * 2**e, exactly, from whichever usage is present
    src, sc = (t._rowwise_data, t._rowwise_scale_inv) if rowwise else (t._columnwise_data, t._columnwise_scale_inv)
    vals = _TABLES[fp8_dtype][(_bytes(src).reshape(m, k).long() & 0x7F)]
    vals = torch.where(_bytes(src).reshape(m, k) >= 128, -vals, vals)
    exps = _bytes(sc).double() - 127
    exps = exps.repeat_interleave(BLOCK, dim=1 if rowwise else 0)
    expected = (vals * torch.exp2(exps)).float().reshape(shape)
    assert torch.equal(t.dequantize(dtype=torch.float32), expected)
    assert t.dequantize().dtype == in_dtype


# ---- edge rules -----------------------------------------------------------------------------------
def _one_block(values, fp8_dtype=E4M3):
    """Quantize one rowwise block whose first element(s) are `values` (rest small), return t."""
    x = torch.full((1, BLOCK), 0.5 ** 140, dtype=torch.float32)
    x[0, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return MXFP8Quantizer(fp8_dtype, columnwise_usage=False).quantize(x), x


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("k", [-126, -120, -9, -1, 0, 1, 7, 20, 100, 111])
def test_exponent_rounds_up_exactly_at_boundaries(fp8_dtype, k):
    fmax = FMT_MAX[fp8_dtype]
    at = fmax * 2.0**k
    if at > torch.finfo(torch.float32).max:
        pytest.skip("boundary beyond float32")
    above = float(torch.nextafter(torch.tensor(at), torch.tensor(math.inf)))
    below = float(torch.nextafter(torch.tensor(at), torch.tensor(0.0)))
    for amax, e in ((at, k), (above, k + 1), (below, k)):
        t, _ = _one_block([amax, -amax / 3], fp8_dtype)
        assert _bytes(t._rowwise_scale_inv).item() == e + 127, (amax, e)
        assert _bytes(t._rowwise_data)[0, 0].item() == ref_fp8_bytes(torch.tensor(amax * 2.0**-e), fp8_dtype)
    # exactly at the boundary the block max is fp8_max itself: no overflow, no loss
    t, _ = _one_block([at], fp8_dtype)
    assert t.dequantize()[0, 0].item() == at


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_every_e8m0_byte_matches_reference(fp8_dtype):
    """Blocks with amax = 2**j (and 1.5 * 2**j) for all float32 binades give byte e + 127."""
    js = list(range(-149, 128))
    amaxes = [2.0**j for j in js] + [1.5 * 2.0**j for j in js[:-1]]
    x = torch.zeros(len(amaxes), BLOCK)
    x[:, 3] = torch.tensor(amaxes)
    t = MXFP8Quantizer(fp8_dtype, columnwise_usage=False).quantize(x)
    expected = torch.tensor([ref_exponent(a, FMT_MAX[fp8_dtype]) + 127 for a in amaxes], dtype=torch.uint8)
    got = _bytes(t._rowwise_scale_inv)[:, 0]
    assert torch.equal(got, expected)
    assert got.min().item() == 0  # e = -127 reached for tiny amax
    assert t._rowwise_scale_inv.dtype == torch.float8_e8m0fnu
    # the scale value is the exact power of two
    assert torch.equal(t._rowwise_scale_inv.double().flatten(), torch.exp2(expected.double() - 127))


def test_all_zero_blocks():
    x = torch.randn(64, 96)
    x[:, 32:64] = 0.0
    x[5, 64:96] = -0.0
    for q in (MXFP8Quantizer(E4M3), MXFP8Quantizer(E5M2)):
        t = q.quantize(x)
        row = _bytes(t._rowwise_scale_inv)
        assert (row[:, 1] == 0).all() and row[5, 2] == 0  # e = -127
        assert (row[:, 0] > 0).all()
        assert (_bytes(t._rowwise_data)[:, 32:64] == 0).all()
        assert (_bytes(t._rowwise_data)[5, 64:96] == 0x80).all()  # -0.0 keeps its sign
        assert torch.equal(t.dequantize()[:, 32:64], x[:, 32:64])
    t = MXFP8Quantizer(E4M3).quantize(torch.zeros(32, 32))
    assert (_bytes(t._columnwise_scale_inv) == 0).all() and (_bytes(t._rowwise_scale_inv) == 0).all()
    assert torch.equal(t.dequantize(), torch.zeros(32, 32))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_denormal_inputs(fp8_dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g) * 1e-40  # float32 subnormals
    x[0, 0] = 2.0**-149  # smallest subnormal
    assert (x[x != 0].abs() < torch.finfo(torch.float32).tiny).all()
    t = MXFP8Quantizer(fp8_dtype).quantize(x)
    assert (_bytes(t._rowwise_scale_inv) == 0).all()  # e clamps to -127
    data, scale = ref_quantize_blocks(x, fp8_dtype, False)
    assert torch.equal(_bytes(t._rowwise_data), data)
    data, scale = ref_quantize_blocks(x, fp8_dtype, True)
    assert torch.equal(_bytes(t._columnwise_data), data) and torch.equal(_bytes(t._columnwise_scale_inv), scale)
    # x * 2**127 is exact and within the fp8 range: error is only the fp8 rounding
    y = t.dequantize()
    assert ((y - x).abs() <= x.abs() * (2.0**-4 if fp8_dtype == E4M3 else 2.0**-3) + 2.0**-136).all()


def test_columnwise_scale_is_per_32_rows_of_each_column():
    m, k = 96, 5
    x = torch.ones(m, k)
    for g in range(m // BLOCK):
        for c in range(k):
            x[g * BLOCK + (7 * c + g) % BLOCK, c] = 448.0 * 2.0 ** (g * k + c - 4)  # distinct amax per block
    t = MXFP8Quantizer(E4M3, rowwise_usage=False).quantize(x)
    assert t._columnwise_scale_inv.shape == (m // BLOCK, k)
    assert t._columnwise_data.shape == (m, k)  # logical layout, not transposed
    for g in range(m // BLOCK):
        for c in range(k):
            e = g * k + c - 4  # the big entry is the block amax, exactly fp8_max * 2**e
            assert _bytes(t._columnwise_scale_inv)[g, c].item() == e + 127
    big = x > 1
    assert big.sum() == k * m // BLOCK and torch.equal(t.dequantize()[big], x[big])


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [True, False])
def test_nan_is_ignored_by_the_block_scale_and_stays_nan(fp8_dtype, rowwise):
    """Documented: NaN takes no part in the block amax; it alone dequantizes to NaN."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 64, generator=g)
    x[3, 5] = float("nan")
    clean = x.clone()
    clean[3, 5] = 0.0
    q = MXFP8Quantizer(fp8_dtype, rowwise_usage=rowwise, columnwise_usage=not rowwise)
    y, y_clean = q.quantize(x).dequantize(), q.quantize(clean).dequantize()
    assert torch.isnan(y[3, 5]) and torch.isnan(y).sum() == 1
    y[3, 5] = 0.0
    assert torch.equal(y, y_clean)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_inf_clamps_exponent_and_saturates(fp8_dtype):
    x = torch.randn(32, 64)
    x[2, 3] = float("inf")
    x[2, 40] = float("-inf")
    t = MXFP8Quantizer(fp8_dtype).quantize(x)
    fmax = FMT_MAX[fp8_dtype]
    row = _bytes(t._rowwise_scale_inv)
    assert row[2, 0] == 254 and row[2, 1] == 254  # e = 127
    assert t._rowwise_data[2, 3].float() == fmax and t._rowwise_data[2, 40].float() == -fmax
    assert (t._rowwise_data[2, 4:32].float() == 0).all()  # the rest of the block underflows
    col = _bytes(t._columnwise_scale_inv)
    assert col[0, 3] == 254 and col[0, 40] == 254 and col[0, 0] < 254
    y = t.dequantize()
    assert y[2, 3] == math.inf and y[2, 40] == -math.inf  # fmax * 2**127 overflows float32


# ---- shapes, usages, tensor behaviour --------------------------------------------------------------
def test_check_shape_errors_name_shape_and_block():
    with pytest.raises(ValueError, match=r"\(48, 33\).*block of 32"):
        MXFP8Quantizer(columnwise_usage=False).quantize(torch.randn(48, 33))
    with pytest.raises(ValueError, match=r"\(33, 64\).*block of 32"):
        MXFP8Quantizer(rowwise_usage=False).quantize(torch.randn(33, 64))
    with pytest.raises(ValueError, match=r"\(2, 3, 64\).*block of 32"):
        TensorProto((2, 3, 64), torch.float32, MXFP8Quantizer()).create_tensor()
    # each usage checks only its own dim
    MXFP8Quantizer(columnwise_usage=False).quantize(torch.randn(3, 64))
    MXFP8Quantizer(rowwise_usage=False).quantize(torch.randn(2, 16, 7))


def test_quantizer_settings():
    q = MXFP8Quantizer()
    assert q.fp8_dtype == E4M3 and q.rowwise_usage and q.columnwise_usage
    assert q == MXFP8Quantizer(E4M3) and hash(q) == hash(MXFP8Quantizer(E4M3))
    assert q != MXFP8Quantizer(E5M2) and MXFP8Quantizer(E5M2).fp8_max == 57344.0
    with pytest.raises(TypeError, match="fp8_dtype"):
        MXFP8Quantizer(torch.bfloat16)
    layout = MXFP8Quantizer().buffer_layout((2, 32, 64))
    assert list(layout) == ["_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"]
    assert layout["_rowwise_scale_inv"].shape == (64, 2) and layout["_columnwise_scale_inv"].shape == (2, 64)
    assert layout["_columnwise_data"].shape == (2, 32, 64)


def test_both_usages_and_update_usage():
    x = torch.randn(64, 128)
    t = MXFP8Quantizer().quantize(x)
    assert isinstance(t, MXFP8Tensor) and t.has_rowwise() and t.has_columnwise()
    row_only = MXFP8Quantizer(columnwise_usage=False).quantize(x).dequantize()
    col_only = MXFP8Quantizer(rowwise_usage=False).quantize(x).dequantize()
    assert torch.equal(t.dequantize(), row_only)  # rowwise is preferred when present
    t.update_usage(rowwise_usage=False)
    assert not t.has_rowwise() and t._rowwise_scale_inv is None
    assert torch.equal(t.dequantize(), col_only)
    assert not t._quantizer.rowwise_usage
    with pytest.raises(RuntimeError, match="rowwise"):
        t.update_usage(rowwise_usage=True)
    r = MXFP8Quantizer(columnwise_usage=False).quantize(x)
    with pytest.raises(RuntimeError, match="columnwise"):
        r.update_usage(columnwise_usage=True)


def test_views_share_data_and_keep_scales():
    t = MXFP8Quantizer().quantize(torch.randn(64, 96))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = t.view(2, 32, 96)
    assert isinstance(v, MXFP8Tensor) and v.shape == (2, 32, 96)
    assert v._rowwise_data.shape == (2, 32, 96) and v._columnwise_data.shape == (2, 32, 96)
    assert v._rowwise_data.data_ptr() == t._rowwise_data.data_ptr()
    assert v._rowwise_scale_inv is t._rowwise_scale_inv and v._columnwise_scale_inv is t._columnwise_scale_inv
    assert torch.equal(v.dequantize(), t.dequantize().view(2, 32, 96))
    # a view that changes the last dim, and a transpose, fall back to the dequantized tensor
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = t.view(64 * 3, 32)
        tt = t.t()
    assert type(w) is torch.Tensor and torch.equal(w, t.dequantize().view(192, 32))
    assert type(tt) is torch.Tensor and torch.equal(tt, t.dequantize().t())
    assert t._transpose_buffers() is None


def test_quantizing_a_quantized_tensor_and_copy():
    x = torch.randn(32, 64)
    t = MXFP8Quantizer(E5M2).quantize(x)
    again = MXFP8Quantizer(E5M2).quantize(t)
    assert torch.equal(again.dequantize(), t.dequantize())  # requantizing MX values is exact
    dst = MXFP8Quantizer(E5M2).quantize(torch.zeros(32, 64))
    dst.copy_(x)
    assert torch.equal(dst.dequantize(), t.dequantize())
    assert isinstance(dst, QuantizedTensor)
