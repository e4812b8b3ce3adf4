"""FP8 blockwise numerics against an independent float64/numpy reference (loops over tiles,
explicit fp8 rounding), plus the format's edge rules, layouts and tensor-class behaviour."""
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from inputs import seeded_input

from transformer_engine_proto.tensor import Float8BlockQuantizer, Float8BlockwiseQTensor, QuantizedTensor

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
FLT_MAX = float(np.finfo(np.float32).max)


# ---- independent reference -------------------------------------------------------------------
def _fp8_table(fp8):
    """Values of the non-negative finite fp8 codes, decoded from the bit layout by formula."""
    ebits, mbits, bias = (4, 3, 7) if fp8 == E4M3 else (5, 2, 15)
    last = 0x7E if fp8 == E4M3 else 0x7B  # e4m3fn: 0x7F is NaN; e5m2: 0x7C is inf
    vals = []
    for code in range(last + 1):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        if e == 0:
            vals.append(m / 2**mbits * 2.0 ** (1 - bias))
        else:
            vals.append((1 + m / 2**mbits) * 2.0 ** (e - bias))
    return np.array(vals)


_TABLES = {d: _fp8_table(d) for d in (E4M3, E5M2)}


def _encode_fp8(v, fp8):
    """Round-to-nearest-even fp8 codes (uint8) of float32 values, saturating to +-max."""
    v = np.asarray(v, dtype=np.float64)
    table = _TABLES[fp8]
    a = np.minimum(np.abs(v), table[-1])
    hi = np.clip(np.searchsorted(table, a), 0, len(table) - 1)
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - table[lo], table[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = np.where(pick_hi, hi, lo).astype(np.uint8)
    code = np.where(np.signbit(v), code | 0x80, code).astype(np.uint8)
    return np.where(np.isnan(v), np.uint8(0xFF), code).astype(np.uint8)


def _ref_scale(amax, fp8, pow2, eps):
    """TE's rule: amax floored at epsilon (fp32); amax 0/NaN/Inf -> scale 1; fp32 overflow ->
    fp32 max; pow2 -> largest power of two <= scale."""
    if eps > 0 and not math.isnan(amax):
        amax = max(amax, float(np.float32(eps)))
    if not math.isfinite(amax) or amax == 0:
        scale = 1.0
    else:
        # one correctly rounded fp32 division (exact in f64, then rounded once to f32)
        with np.errstate(over="ignore", divide="ignore"):
            scale = float(np.float32(FMAX[fp8] / float(np.float32(amax))))
        if math.isinf(scale):
            scale = FLT_MAX
    if pow2:
        scale = 2.0 ** (math.frexp(scale)[1] - 1)
    return np.float32(scale)


def ref_quantize(x2d, rows, fp8, pow2, eps):
    """(codes (R, C) uint8, scale_inv (ceil(R/rows), ceil(C/128)) float32) with tiles rows x 128."""
    x2d = np.asarray(x2d, dtype=np.float32)
    r, c = x2d.shape
    rt, ct = -(-r // rows), -(-c // 128)
    codes = np.zeros((r, c), dtype=np.uint8)
    sinv = np.zeros((rt, ct), dtype=np.float32)
    for i in range(rt):
        for j in range(ct):
            tile = x2d[i * rows:(i + 1) * rows, j * 128:(j + 1) * 128]
            amax = float(np.max(np.abs(tile.astype(np.float64))))
            s = _ref_scale(amax, fp8, pow2, eps)
            with np.errstate(over="ignore", invalid="ignore"):
                codes[i * rows:(i + 1) * rows, j * 128:(j + 1) * 128] = _encode_fp8(tile * s, fp8)
            sinv[i, j] = np.float32(1.0) / s
    return codes, sinv


def _bits(t):
    return t.contiguous().view(torch.uint8).numpy() if t.element_size() == 1 else t.contiguous().numpy()


def _assert_codes_equal(actual, expected, x, fp8):
    actual = np.asarray(actual)
    nan = np.isnan(x)
    assert np.array_equal(actual[~nan], expected[~nan]), np.argwhere(actual != expected)[:5]
    low = actual[nan] & 0x7F
    assert np.all(low == 0x7F) if fp8 == E4M3 else np.all(low >= 0x7D)  # NaN codes


def _check_against_reference(q, x):
    qt = q.quantize(x)
    xf = x.float().reshape(-1, x.shape[-1]).numpy()
    rows = 1 if q.block_scaling_dim == 1 else 128
    codes, sinv = ref_quantize(xf, rows, q.fp8_dtype, q.force_pow_2_scales, q.amax_epsilon)
    if q.rowwise_usage:
        _assert_codes_equal(_bits(qt._rowwise_data).reshape(xf.shape), codes, xf, q.fp8_dtype)
        assert np.array_equal(_bits(qt._rowwise_scale_inv).view(np.uint32), sinv.view(np.uint32))
    if q.columnwise_usage:
        if rows == 1:
            ccodes, csinv = ref_quantize(xf.T, 1, q.fp8_dtype, q.force_pow_2_scales, q.amax_epsilon)
        else:
            ccodes, csinv = codes.T, sinv.T
        _assert_codes_equal(_bits(qt._columnwise_data), ccodes, xf.T, q.fp8_dtype)
        assert np.array_equal(_bits(qt._columnwise_scale_inv).view(np.uint32),
                              np.ascontiguousarray(csinv).view(np.uint32))
    # The fake layout describes the real buffers exactly, multi-tile shapes included.
    fake = q.alloc_tensors(x.shape, x.dtype)
    real = qt.get_buffers()
    assert list(fake) == list(real)
    for k in fake:
        assert (fake[k].shape, fake[k].stride(), fake[k].dtype) == (real[k].shape, real[k].stride(), real[k].dtype), k
    return qt


def test_fp8_table_matches_torch_decode():
    for fp8, table in _TABLES.items():
        torch_vals = torch.arange(len(table), dtype=torch.uint8).view(fp8).double().numpy()
        assert np.array_equal(table, torch_vals)


# ---- numerics ------------------------------------------------------------------------------------
def _make_input(shape, kind, seed, dtype):
    if kind != "zero_rows":
        return seeded_input(shape, kind, seed, dtype, mixed_exp=30)
    x = seeded_input(shape, "normal", seed)
    x.view(-1, shape[-1])[::3] = 0  # whole zero tiles next to normal ones
    return x.to(dtype)


@st.composite
def _configs(draw):
    m = draw(st.sampled_from([1, 2, 127, 128, 129, 200, 256, 300]))
    k = draw(st.sampled_from([1, 3, 128, 130, 255, 384]))
    shape = (m, k)
    if m % 2 == 0 and draw(st.booleans()):
        shape = (2, m // 2, k)
    elif m == 1 and draw(st.booleans()):
        shape = (k,)
    rowwise, columnwise = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
    q = Float8BlockQuantizer(
        draw(st.sampled_from([E4M3, E5M2])), draw(st.sampled_from([1, 2])), draw(st.booleans()),
        draw(st.sampled_from([0.0, 0.0, 1e-3])), rowwise_usage=rowwise, columnwise_usage=columnwise,
    )
    kind = draw(st.sampled_from(["normal", "large", "zeros", "denormal", "mixed", "zero_rows"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return q, shape, kind, dtype


@given(_configs(), st.integers(0, 2**16))
def test_quantize_matches_reference(cfg, seed):
    q, shape, kind, dtype = cfg
    _check_against_reference(q, _make_input(shape, kind, seed, dtype))


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
def test_partial_tiles_use_only_real_elements(dim, pow2):
    m, k = 200, 130
    x = torch.randn(m, k)
    x[:, 128:] *= 1e-3  # the partial K tile holds only small values
    q = Float8BlockQuantizer(E4M3, dim, pow2)
    qt = _check_against_reference(q, x)
    if dim == 1:
        assert qt._rowwise_scale_inv.shape == (200, 2) and qt._columnwise_scale_inv.shape == (130, 2)
        amax = x[:, 128:].abs().amax(dim=1)
        edge_sinv = qt._rowwise_scale_inv[:, 1]
        col_amax = x[128:, :].abs().amax(dim=0)  # columnwise partial tile: rows 128..199
        col_edge = qt._columnwise_scale_inv[:, 1]
    else:
        assert qt._rowwise_scale_inv.shape == (2, 2) and qt._columnwise_scale_inv.shape == (2, 2)
        amax = x[128:, 128:].abs().amax().reshape(1)
        edge_sinv = qt._rowwise_scale_inv[1, 1:]
        col_amax, col_edge = amax, qt._columnwise_scale_inv[1, 1:]
    for a, s in ((amax, edge_sinv), (col_amax, col_edge)):
        # The edge tile's largest value lands in the top binade of fp8 (not scaled for a
        # larger, padded amax).
        top = a.double() / s.double()
        assert bool(((top <= 448 * (1 + 1e-6)) & (top > (224 if pow2 else 447))).all())


_ADVERSARIAL_AMAX = [float(np.nextafter(np.float32(448 * 2.0**-k), np.float32(np.inf))) for k in range(-12, 30)]


@given(st.lists(st.one_of(st.sampled_from(_ADVERSARIAL_AMAX),
                          st.floats(2.0**-100, 2.0**100, width=32),
                          st.floats(2.0**-148, 2.0**-123, width=32)), min_size=1, max_size=8),
       st.sampled_from([E4M3, E5M2]), st.sampled_from([1, 2]))
def test_pow2_scales_are_exact_powers_of_two_and_never_overflow(amaxes, fp8, dim):
    rows = 1 if dim == 1 else 128
    x = torch.zeros(len(amaxes) * rows, 128)
    for i, a in enumerate(amaxes):
        x[i * rows, 5] = -a  # one tile per amax, max at a negative value
        x[i * rows, 6] = a / 3
    qt = Float8BlockQuantizer(fp8, dim, True)(x)
    sinv = qt._rowwise_scale_inv.reshape(-1).double()
    for a, s in zip(amaxes, sinv.tolist()):
        assert math.frexp(s)[0] == 0.5, s  # exact power of two
        scale = 1 / s
        assert a * scale <= FMAX[fp8]  # no overflow, in exact arithmetic
        if scale < 2.0**127:
            assert a * scale * 2 > FMAX[fp8]  # the largest such power of two
    _check_against_reference(Float8BlockQuantizer(fp8, dim, True), x)


def test_128x128_columnwise_bits_are_transpose_of_rowwise():
    x = torch.randn(300, 200) * torch.exp2(torch.randint(-8, 8, (300, 200)).float())
    qt = Float8BlockQuantizer(E4M3, 2)(x)
    assert torch.equal(qt._columnwise_data.view(torch.uint8), qt._rowwise_data.view(torch.uint8).t())
    assert torch.equal(qt._columnwise_scale_inv, qt._rowwise_scale_inv.t())
    # ... and both usages dequantize to the same values.
    row = Float8BlockQuantizer(E4M3, 2, rowwise_usage=True, columnwise_usage=False)(x).dequantize()
    col = Float8BlockQuantizer(E4M3, 2, rowwise_usage=False, columnwise_usage=True)(x).dequantize()
    assert torch.equal(row, col)


@pytest.mark.parametrize("shape", [(200, 130), (2, 100, 130), (1, 130), (130,), (128, 1)])
def test_scale_layouts_and_strides(shape):
    m, k = math.prod(shape[:-1]), shape[-1]
    mt, kt = -(-m // 128), -(-k // 128)
    x = torch.randn(shape)
    q1 = Float8BlockQuantizer(E4M3, 1)(x)
    assert q1._rowwise_data.shape == shape and q1._rowwise_data.dtype == E4M3
    assert q1._rowwise_scale_inv.shape == (m, kt) and q1._rowwise_scale_inv.stride() == (1, m)
    assert q1._columnwise_data.shape == (k, m) and q1._columnwise_data.is_contiguous()
    assert q1._columnwise_scale_inv.shape == (k, mt) and q1._columnwise_scale_inv.stride() == (1, k)
    q2 = Float8BlockQuantizer(E4M3, 2)(x)
    assert q2._rowwise_scale_inv.shape == (mt, kt) and q2._rowwise_scale_inv.stride() == (kt, 1)
    assert q2._columnwise_scale_inv.shape == (kt, mt) and q2._columnwise_scale_inv.stride() == (mt, 1)
    assert all(b.dtype == torch.float32 for b in (q1._rowwise_scale_inv, q2._columnwise_scale_inv))
    assert [a for a, _ in Float8BlockwiseQTensor._FLATTEN_TENSOR_BUFFERS] == [
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"]
    assert q1.__tensor_flatten__()[1][-1] == (("fp8_dtype", E4M3), ("block_scaling_dim", 1))


def test_scaled_mm_fprop_mapping_shapes_are_accepted():
    """The documented fprop call type-checks against torch's _scaled_mm shape rules (meta)."""
    x, w = torch.randn(200, 384), torch.randn(256, 384)
    xq, wq = Float8BlockQuantizer(E4M3, 1)(x), Float8BlockQuantizer(E4M3, 2)(w)

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    out = torch._scaled_mm(meta(xq._rowwise_data), meta(wq._rowwise_data).t(),
                           scale_a=meta(xq._rowwise_scale_inv), scale_b=meta(wq._rowwise_scale_inv).t(),
                           out_dtype=torch.bfloat16)
    assert out.shape == (200, 256)


def _emulated_gemm(a, sa, a_rows, b_t, sb_t, b_rows):
    """(a * scales) @ (b_t * scales).T in float64, from the buffers of each operand."""
    from transformer_engine_proto.kernels.reference.blockwise import expand_tiles

    da = a.double() * expand_tiles(sa.double(), a_rows, *a.shape)
    db = b_t.double() * expand_tiles(sb_t.double(), b_rows, *b_t.shape)
    return da @ db.t()


@pytest.mark.cuda
@pytest.mark.parametrize("mnk", [(256, 512, 512), (200, 1024, 1024), (256, 512, 496)])
def test_scaled_mm_gemms_on_cuda(mnk):
    """fprop/dgrad/wgrad with torch._scaled_mm straight from the stored buffers (shapes meet
    the alignment rules of the module docstring; K=496 has a partial tile)."""
    m, n, k = mnk
    g = torch.Generator().manual_seed(0)
    x, w, dy = (torch.randn(s, generator=g).cuda() for s in ((m, k), (n, k), (m, n)))
    act, wgt = Float8BlockQuantizer(E4M3, 1), Float8BlockQuantizer(E4M3, 2)
    xq, wq, dyq = act(x), wgt(w), act(dy)

    def check(a, b, sa, sb, ref):
        y = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16).double()
        assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-2

    check(xq._rowwise_data, wq._rowwise_data.t(), xq._rowwise_scale_inv, wq._rowwise_scale_inv.t(),
          _emulated_gemm(xq._rowwise_data, xq._rowwise_scale_inv, 1, wq._rowwise_data, wq._rowwise_scale_inv, 128))
    check(dyq._rowwise_data, wq._columnwise_data.t(), dyq._rowwise_scale_inv, wq._columnwise_scale_inv.t(),
          _emulated_gemm(dyq._rowwise_data, dyq._rowwise_scale_inv, 1,
                         wq._columnwise_data, wq._columnwise_scale_inv, 128))
    if m % 16 == 0:  # wgrad reduces over M
        check(dyq._columnwise_data, xq._columnwise_data.t(), dyq._columnwise_scale_inv, xq._columnwise_scale_inv.t(),
              _emulated_gemm(dyq._columnwise_data, dyq._columnwise_scale_inv, 1,
                             xq._columnwise_data, xq._columnwise_scale_inv, 1))
    # The reference quantize kernels give the same bits on CUDA as on CPU.
    for q, t in ((act, x), (wgt, w), (Float8BlockQuantizer(E5M2, 1, False, 1e-3), dy)):
        for name, buf in q(t).get_buffers().items():
            ref = getattr(q(t.cpu()), name)
            assert buf.stride() == ref.stride()
            assert torch.equal(buf.cpu().view(torch.uint8) if buf.element_size() == 1 else buf.cpu(),
                               ref.view(torch.uint8) if ref.element_size() == 1 else ref)


@pytest.mark.cuda
@pytest.mark.parametrize("in_features", [64, 192])
def test_linear_whose_weight_tiles_are_partial_on_cuda(in_features):
    """A Linear whose in_features is no multiple of 128: dgrad's 128x128-scaled weight has a partial
    tile along N, which cuBLAS's blockwise GEMM rejects; the GEMM is emulated instead, in eager
    and compiled (where torch's shape check failed the compile)."""
    import transformer_engine_proto as te
    from transformer_engine_proto import recipe as R

    torch.manual_seed(0)
    lin = te.Linear(in_features, 256, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(128, in_features, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    grads = []
    for fn in (lin, torch.compile(lin)):
        x.grad = lin.weight.grad = None
        with te.autocast(recipe=R.Float8BlockScaling()):
            y = fn(x)
        y.float().square().sum().backward()
        grads.append((x.grad, lin.weight.grad))
    (dx, dw), (cdx, cdw) = grads
    # the emulated GEMM is a float32 matmul, whose operand layouts inductor may choose otherwise
    torch.testing.assert_close(cdx, dx, rtol=2 ** -6, atol=1e-5)
    torch.testing.assert_close(cdw, dw, rtol=2 ** -6, atol=1e-5)
    ref = x.detach().float().requires_grad_()
    (ref @ lin.weight.float().t()).square().sum().backward()
    assert ((dx.float() - ref.grad).norm() / ref.grad.norm()).item() < 0.1


# ---- edge rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [1, 2])
def test_epsilon_floors_tile_amax(dim):
    x = torch.zeros(256, 256)
    x[0, 0] = 1e-6  # tile (0, 0): amax below epsilon; other tiles all zero
    x[200, 200] = 5.0  # tile (1, 1) for 128x128, row 200 / K-tile 1 for 1x128
    eps = 1e-3
    qt = Float8BlockQuantizer(E4M3, dim, False, eps, columnwise_usage=False)(x)
    sinv = qt._rowwise_scale_inv
    expect_small = np.float32(1) / (np.float32(448) / np.float32(eps))
    assert sinv[0, 0].item() == expect_small  # tiny and all-zero tiles use epsilon, not 1
    assert sinv[1, 0].item() == expect_small
    big = sinv[200, 1] if dim == 1 else sinv[1, 1]
    assert big.item() == np.float32(1) / (np.float32(448) / np.float32(5.0))
    assert torch.equal(qt.dequantize()[x == 0], x[x == 0])
    _check_against_reference(Float8BlockQuantizer(E4M3, dim, True, eps), x)
    no_eps = Float8BlockQuantizer(E4M3, dim, False, columnwise_usage=False)(x)
    assert no_eps._rowwise_scale_inv[1, 0].item() == 1.0  # zero tile without epsilon: scale 1


def test_nan_and_inf_stay_in_their_tile():
    x = torch.randn(4, 256)
    x[0, 3] = float("nan")
    x[1, 200] = float("inf")
    qt = Float8BlockQuantizer(E4M3, 1, columnwise_usage=False)(x)
    y = qt.dequantize()
    # E4M3 has no inf: both come out NaN; the tiles keep the scale of their finite values
    assert torch.isnan(y[0, 3]) and torch.isnan(y[1, 200]) and torch.isnan(y).sum() == 2
    ok = torch.isfinite(x)
    assert ((y - x)[ok].abs() <= 0.07 * x[ok].abs().max()).all()


# ---- tensor class behaviour ---------------------------------------------------------------------
def _q(dim, rowwise=True, columnwise=True):
    return Float8BlockQuantizer(E4M3, dim, rowwise_usage=rowwise, columnwise_usage=columnwise)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("usage", [(True, False), (False, True), (True, True)])
def test_dequantize_from_either_usage(dim, usage):
    x = torch.randn(3, 100, 130)
    qt = _q(dim, *usage)(x)
    assert qt.has_rowwise() == usage[0] and qt.has_columnwise() == usage[1]
    y = qt.dequantize()
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().max() <= 0.07 * x.abs().max()
    rows = 1 if dim == 1 else 128
    xf = x.reshape(-1, 130).numpy()
    codes, sinv = ref_quantize(xf if usage[0] else xf.T, rows, E4M3, True, 0.0)
    vals = np.where(codes & 0x80, -1.0, 1.0) * _TABLES[E4M3][codes & 0x7F]
    full = np.repeat(np.repeat(sinv, rows, 0), 128, 1)[:codes.shape[0], :codes.shape[1]]
    expect = (vals * full).astype(np.float32)
    assert np.array_equal(y.reshape(-1, 130).numpy(), expect if usage[0] else expect.T)
    assert qt.dequantize(dtype=torch.bfloat16).dtype == torch.bfloat16


def test_update_usage_128x128_derives_exactly():
    x = torch.randn(200, 130)
    both = _q(2)(x)
    row = _q(2, True, False)(x).update_usage(columnwise_usage=True)
    col = _q(2, False, True)(x).update_usage(rowwise_usage=True)
    for t in (row, col):
        for name, buf in both.get_buffers().items():
            got = getattr(t, name)
            assert got.shape == buf.shape and got.stride() == buf.stride()
            assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                               buf.view(torch.uint8) if buf.element_size() == 1 else buf)
        assert t.quantizer.rowwise_usage and t.quantizer.columnwise_usage
    row.update_usage(rowwise_usage=False)
    assert row._rowwise_data is None and row._rowwise_scale_inv is None and not row.quantizer.rowwise_usage
    assert torch.equal(row.dequantize(), both.dequantize())


def test_update_usage_1x128_cannot_derive():
    x = torch.randn(64, 256)
    with pytest.raises(RuntimeError, match="cannot be derived"):
        _q(1, True, False)(x).update_usage(columnwise_usage=True)
    with pytest.raises(RuntimeError, match="cannot be derived"):
        _q(1, False, True)(x).update_usage(rowwise_usage=True)
    qt = _q(1)(x).update_usage(columnwise_usage=False)
    assert qt._columnwise_data is None and qt._columnwise_scale_inv is None and qt.has_rowwise()


@pytest.mark.parametrize("dim", [1, 2])
def test_views_keep_last_dim_natively(dim):
    x = torch.randn(200, 130)
    qt = _q(dim)(x)
    v = qt.view(2, 100, 130)
    assert isinstance(v, Float8BlockwiseQTensor) and v.shape == (2, 100, 130)
    assert v._rowwise_data.shape == (2, 100, 130) and v._rowwise_data.data_ptr() == qt._rowwise_data.data_ptr()
    assert v._rowwise_scale_inv is qt._rowwise_scale_inv and v._columnwise_data is qt._columnwise_data
    assert torch.equal(v.dequantize(), qt.dequantize().view(2, 100, 130))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = qt.reshape(-1)  # changes the last dim: falls back to the dequantized tensor
    assert not isinstance(flat, QuantizedTensor) and torch.equal(flat, qt.dequantize().reshape(-1))


def test_transpose_native_for_128x128_with_both_usages():
    x = torch.randn(200, 130)
    qt = _q(2)(x)
    tt = qt.t()
    assert isinstance(tt, Float8BlockwiseQTensor) and tt.shape == (130, 200)
    assert tt._rowwise_data is qt._columnwise_data and tt._columnwise_scale_inv is qt._rowwise_scale_inv
    assert torch.equal(tt.dequantize(), qt.dequantize().t())
    fresh = _q(2)(x.t().contiguous())  # same layout as quantizing the transpose directly
    for name, buf in fresh.get_buffers().items():
        assert getattr(tt, name).shape == buf.shape and getattr(tt, name).stride() == buf.stride()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for other in (_q(1)(x), _q(2, True, False)(x)):  # no exact swap: dequantized fallback
            t = other.t()
            assert not isinstance(t, QuantizedTensor) and torch.equal(t, other.dequantize().t())


# ---- quantizer settings ------------------------------------------------------------------------
def test_quantizer_defaults_and_validation():
    q = Float8BlockQuantizer()
    assert (q.fp8_dtype, q.block_scaling_dim, q.force_pow_2_scales, q.amax_epsilon) == (E4M3, 2, True, 0.0)
    assert q == Float8BlockQuantizer(amax_epsilon=0) and hash(q) == hash(Float8BlockQuantizer())
    assert Float8BlockQuantizer(amax_epsilon=1).amax_epsilon == 1.0
    with pytest.raises(TypeError, match="fp8_dtype"):
        Float8BlockQuantizer(torch.float16)
    for bad in (0, 3, True, "2", 2.0):
        with pytest.raises(ValueError, match="block_scaling_dim"):
            Float8BlockQuantizer(block_scaling_dim=bad)
    with pytest.raises(TypeError, match="force_pow_2_scales"):
        Float8BlockQuantizer(force_pow_2_scales=1)
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="amax_epsilon"):
            Float8BlockQuantizer(amax_epsilon=bad)
    with pytest.raises(TypeError, match="amax_epsilon"):
        Float8BlockQuantizer(amax_epsilon=torch.tensor(1.0))
    with pytest.raises(ValueError, match="0-dim"):
        q.quantize(torch.tensor(1.0))


@pytest.mark.parametrize("rows,kb", [(3, 4), (5, 8), (3, 5), (2, 7), (1, 1)])
def test_128x128_scale_padding_layout(rows, kb):
    """The 128x128 scales cuBLAS reads: (L4, rows) with strides (1, L4), zero padded along the
    reduction blocks; a contiguous scale with kb % 4 == 0 is used as is (no copy)."""
    from transformer_engine_proto.gemm import _pad_128x128

    scale = torch.rand(rows, kb) + 0.5
    out = _pad_128x128(scale)
    l4 = (kb + 3) // 4 * 4
    assert out.shape == (l4, rows) and out.stride() == (1, l4)
    assert torch.equal(out[:kb], scale.t()) and not out[kb:].any()
    assert (out.data_ptr() == scale.data_ptr()) == (kb % 4 == 0)
