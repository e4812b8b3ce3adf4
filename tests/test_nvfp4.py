"""NVFP4 numerics against an independent per-element numpy float32 reference, the edge rules of the
spec, and NVFP4Tensor's usage / view / transpose behaviour."""
import dataclasses
import functools
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from inputs import seeded_input

from transformer_engine_proto.kernels import kernel
from transformer_engine_proto.kernels.reference.nvfp4 import pack_fp4, rht_matrix, unpack_fp4
from transformer_engine_proto.tensor import NVFP4Quantizer, NVFP4Tensor, QuantizedTensor

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---- independent reference (explicit loops, float32 scalars, brute-force nearest) ------------
def _e4m3_value(b):
    e, m = (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return math.nan
    return (m / 8) * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)


E4M3 = [_e4m3_value(b) for b in range(127)]  # non-negative finite codes 0x00..0x7E


def ref_e4m3_byte(v):
    """Saturating round-to-nearest-even of a non-negative float to an E4M3 byte."""
    if math.isnan(v):
        return 0x7F
    v = min(float(v), 448.0)
    return min(range(127), key=lambda b: (abs(E4M3[b] - v), b % 2))


def ref_e2m1_code(v, r=None):
    v = F32(v)
    if np.isnan(v):
        return 0
    sign = 8 if np.signbit(v) else 0
    a = min(float(abs(v)), 6.0)
    if r is None:  # nearest, ties to the even code
        return sign | min(range(8), key=lambda c: (abs(E2M1[c] - a), c % 2))
    lo = max(c for c in range(8) if E2M1[c] <= a)
    if lo == 7:
        return sign | 7
    p = (F32(a) - F32(E2M1[lo])) / (F32(E2M1[lo + 1]) - F32(E2M1[lo]))
    return sign | (lo + 1 if F32(r) < p else lo)


def ref_s_enc(amax):
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        s = F32(448 * 6) / F32(amax)
    if amax == 0 or not np.isfinite(amax):
        return F32(1)
    return FLT_MAX if np.isinf(s) else s


def ref_quantize(x, two_d=False, rand=None):
    """(packed bytes (R, C/2), scale bytes (R, C/16), amax) of float32 array x quantized along C."""
    x = np.asarray(x, dtype=F32)
    r, c = x.shape
    amax = F32(np.max(np.abs(x)))
    s_enc = ref_s_enc(amax)
    data = np.zeros((r, c // 2), np.uint8)
    scales = np.zeros((r, c // 16), np.uint8)
    for i in range(r):
        for jb in range(c // 16):
            rows = range(16 * (i // 16), min(16 * (i // 16) + 16, r)) if two_d else [i]
            amax_b = F32(np.max(np.abs(x[list(rows), 16 * jb:16 * jb + 16])))
            with np.errstate(over="ignore", invalid="ignore"):
                sb = ref_e4m3_byte(F32(amax_b / F32(6)) * s_enc)
                s_dec = F32(_e4m3_value(sb))
                enc = F32(0) if s_dec == 0 else F32(s_enc / s_dec)
            scales[i, jb] = sb
            codes = []
            for j in range(16 * jb, 16 * jb + 16):
                with np.errstate(over="ignore", invalid="ignore"):
                    v = F32(x[i, j] * s_enc) / s_dec if np.isinf(enc) else F32(x[i, j] * enc)
                codes.append(ref_e2m1_code(v, None if rand is None else rand[i, j]))
            for t in range(8):
                data[i, 8 * jb + t] = codes[2 * t] | (codes[2 * t + 1] << 4)
    return data, scales, amax


def sylvester16():
    h = np.array([[1.0]])
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    return h


def ref_rht(seed):
    g = torch.Generator().manual_seed(seed)
    signs = (torch.randint(0, 2, (16,), generator=g) * 2 - 1).double().numpy()
    return sylvester16() @ np.diag(signs) / 4


def _bytes(t):
    return t.view(torch.uint8).numpy()


_inputs = functools.partial(seeded_input, tiny=1e-37)


@st.composite
def shapes(draw, columnwise):
    k = 16 * draw(st.integers(1, 4))
    m = 16 * draw(st.integers(1, 3)) if columnwise else draw(st.sampled_from([1, 2, 5, 16, 33]))
    return m, k


KINDS = st.sampled_from(["normal", "large", "zeros", "denormal", "tiny", "mixed"])


def ref_dequantize(data, scales, amax):
    """fp4 * S_dec_b / S_enc, per element in float32."""
    r = data.shape[0]
    out = np.zeros((r, 2 * data.shape[1]), F32)
    s_enc = ref_s_enc(amax)
    for i in range(r):
        for j in range(out.shape[1]):
            code = (int(data[i, j // 2]) >> (4 * (j % 2))) & 0xF
            v = F32(-E2M1[code & 7] if code & 8 else E2M1[code & 7])
            out[i, j] = F32(v * F32(_e4m3_value(int(scales[i, j // 16])))) / s_enc
    return out


def _check_usage(t, x2d, prefix, two_d=False, rand=None):
    data, scales, amax = ref_quantize(x2d, two_d, rand)
    np.testing.assert_array_equal(_bytes(getattr(t, f"_{prefix}_data")), data)
    np.testing.assert_array_equal(_bytes(getattr(t, f"_{prefix}_scale_inv")), scales)
    assert getattr(t, f"_amax_{prefix}").numpy().tobytes() == np.array([amax], F32).tobytes()
    if prefix == "rowwise":
        y = t.dequantize(dtype=torch.float32).reshape(data.shape[0], -1).numpy()
        np.testing.assert_array_equal(y, ref_dequantize(data, scales, amax))


# ---- bitwise against the reference -----------------------------------------------------------------
@given(shapes(columnwise=True), KINDS, st.integers(0, 2**16))
def test_1d_both_usages_match_reference(shape, kind, seed):
    x = _inputs(shape, kind, seed)
    t = NVFP4Quantizer().quantize(x)
    _check_usage(t, x.numpy(), "rowwise")
    _check_usage(t, x.numpy().T, "columnwise")


@given(shapes(columnwise=False), KINDS, st.integers(0, 2**16), st.sampled_from([False, True]))
def test_rowwise_only_any_rows_matches_reference(shape, kind, seed, two_d):
    x = _inputs(shape, kind, seed)
    t = NVFP4Quantizer(with_2d_quantization=two_d, columnwise_usage=False).quantize(x)
    assert not t.has_columnwise()
    _check_usage(t, x.numpy(), "rowwise", two_d=two_d)


@given(shapes(columnwise=True), KINDS, st.integers(0, 2**16))
def test_2d_matches_reference_and_columnwise_is_transpose(shape, kind, seed):
    x = _inputs(shape, kind, seed)
    t = NVFP4Quantizer(with_2d_quantization=True).quantize(x)
    _check_usage(t, x.numpy(), "rowwise", two_d=True)
    _check_usage(t, x.numpy().T, "columnwise", two_d=True)  # 16x16 tiles are symmetric
    row_vals, col_vals = unpack_fp4(t._rowwise_data), unpack_fp4(t._columnwise_data)
    assert torch.equal(col_vals, row_vals.t())
    # one scale per 16x16 tile, replicated over the tile's rows
    s = t._rowwise_scale_inv.view(torch.uint8)
    assert torch.equal(s, s[::16].repeat_interleave(16, 0))
    assert torch.equal(t._columnwise_scale_inv.view(torch.uint8), s[::16].t().repeat_interleave(16, 0))


@given(shapes(columnwise=True), st.integers(0, 2**16), st.integers(0, 3))
def test_rht_columnwise_matches_reference(shape, seed, rht_seed):
    # small integers: every sum of 16 values * +-1/4 is exact in fp32, so the reference's float64
    # transform and the kernel's fp32 matmul agree bit for bit
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-64, 65, shape, generator=g).float()
    t = NVFP4Quantizer(with_rht=True, rht_seed=rht_seed).quantize(x)
    _check_usage(t, x.numpy(), "rowwise")  # rowwise is untouched by the RHT
    m, k = shape
    h = ref_rht(rht_seed)
    xt = x.double().numpy().T.reshape(k, m // 16, 16) @ h.T  # each run v -> H v
    _check_usage(t, xt.reshape(k, m).astype(F32), "columnwise")


@given(shapes(columnwise=True), st.integers(0, 2**16))
def test_stochastic_rounding_matches_reference_given_rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rand, rand_c = torch.rand(shape, generator=g), torch.rand(shape[::-1], generator=g)
    q = NVFP4Quantizer(stochastic_rounding=True)
    t = q.quantize(x, rand=rand, rand_columnwise=rand_c)
    _check_usage(t, x.numpy(), "rowwise", rand=rand.numpy())
    _check_usage(t, x.numpy().T, "columnwise", rand=rand_c.numpy())
    again = q.quantize(x, rand=rand, rand_columnwise=rand_c)
    for name, buf in t.get_buffers().items():
        assert torch.equal(buf.view(torch.uint8), getattr(again, name).view(torch.uint8)), name


def test_bfloat16_input_quantizes_its_float32_values():
    x = torch.randn(32, 64).bfloat16()
    t = NVFP4Quantizer().quantize(x)
    _check_usage(t, x.float().numpy(), "rowwise")
    assert t.dtype == torch.bfloat16 and t.dequantize().dtype == torch.bfloat16


# ---- explicit edge rules ---------------------------------------------------------------------------
def _unit_block(values):
    """A (1, 16) row whose block amax 6 equals the global amax: S_enc = S_dec_b = 448, so the
    E2M1 codes see the values unscaled."""
    x = torch.zeros(1, 16)
    x[0, : len(values)] = torch.tensor(values)
    x[0, 15] = 6.0
    return x


def _codes(t):
    d = t._rowwise_data.view(torch.uint8).reshape(-1)
    return torch.stack((d & 0xF, d >> 4), -1).reshape(-1).tolist()


def test_packing_order_and_nibble_codes():
    x = torch.tensor([[-0.5, -1, -1.5, -2, -3, -4, -6, -0.0, 0.5, 1, 1.5, 2, 3, 4, 0.0, 6]])
    t = NVFP4Quantizer(columnwise_usage=False).quantize(x)
    assert _codes(t) == [9, 10, 11, 12, 13, 14, 15, 8, 1, 2, 3, 4, 5, 6, 0, 7]
    # element 2i in the low nibble, 2i+1 in the high nibble
    assert t._rowwise_data[0, 0].item() == 9 | (10 << 4)
    assert t._rowwise_data[0, 7].item() == 0 | (7 << 4)
    assert unpack_fp4(t._rowwise_data).tolist() == x.tolist()
    assert torch.equal(pack_fp4(torch.tensor([[3, 12]], dtype=torch.uint8)), torch.tensor([[0xC3]], dtype=torch.uint8))
    # torch's float4_e2m1fn_x2 uses the same convention: it is a bit-view of the same byte
    assert t._rowwise_data.view(torch.float4_e2m1fn_x2).shape == (1, 8)


@pytest.mark.parametrize("value,expected", [
    (0.25, 0.0), (0.26, 0.5), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
    (5.0, 4.0), (5.01, 6.0), (0.7, 0.5), (-2.5, -2.0), (-0.25, -0.0), (1e-30, 0.0),
])
def test_rounding_ties_go_to_even_code(value, expected):
    t = NVFP4Quantizer(columnwise_usage=False).quantize(_unit_block([value]))
    got = t.dequantize()[0, 0].item()
    assert got == expected and math.copysign(1, got) == math.copysign(1, expected)


def test_saturation_inf_and_block_scale():
    x = torch.randn(2, 32)
    x[0, 3], x[1, 20] = float("inf"), float("-inf")
    t = NVFP4Quantizer(columnwise_usage=False).quantize(x)
    assert t._amax_rowwise.item() == x[torch.isfinite(x)].abs().max().item()  # the finite values' amax
    s = t._rowwise_scale_inv.view(torch.uint8)
    assert s[0, 0].item() == 0x7F and s[1, 1].item() == 0x7F  # a block holding inf gets a NaN scale
    y = t.dequantize()
    assert torch.isnan(y[0, :16]).all() and torch.isnan(y[1, 16:]).all()
    assert torch.isfinite(y[0, 16:]).all() and torch.isfinite(y[1, :16]).all()
    # a finite value pushed above 6 by a block scale that rounded down saturates to 6 as well:
    # block amax 4.35 -> 4.35 / 6 * 448 = 324.8 -> E4M3 320, so 4.35 scales to 4.35 * 448 / 320 > 6
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 6.0, 4.35
    t = NVFP4Quantizer(columnwise_usage=False).quantize(x)
    assert t._rowwise_scale_inv.float()[0, 1].item() == 320.0 and _codes(t)[16] == 7
    assert t.dequantize()[0, 16].item() == pytest.approx(6 * 320 / 448)


def test_global_scale_and_block_scale_bytes():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 6.0, 3.0  # global amax 6: S_enc = 448; block amaxes 6 and 3
    t = NVFP4Quantizer(columnwise_usage=False).quantize(x)
    assert t._amax_rowwise.tolist() == [6.0]
    assert t._rowwise_scale_inv.view(torch.uint8)[0].tolist() == [0x7E, 0x76]  # 448, 224
    assert t._rowwise_scale_inv.float()[0].tolist() == [448.0, 224.0]
    assert t.dequantize().tolist() == x.tolist()
    # S_enc = 2688 / amax, so the block holding the amax always gets a scale byte near 448
    for amax in (1e-3, 0.7, 1.0, 123.0, 3e30):
        t = NVFP4Quantizer(columnwise_usage=False).quantize(torch.full((1, 16), amax))
        assert t._rowwise_scale_inv.float().item() == 448.0
        assert t.dequantize()[0, 0].item() == pytest.approx(amax, rel=1e-6)


def test_zeros_quantize_to_zero_with_unit_global_scale():
    t = NVFP4Quantizer().quantize(torch.zeros(16, 32))
    for name, buf in t.get_buffers().items():
        assert not buf.view(torch.uint8).any(), name
    assert torch.equal(t.dequantize(), torch.zeros(16, 32))
    # a zero block beside a non-zero one: scale byte 0, encode factor 0, values 0
    x = torch.zeros(1, 32)
    x[0, 20] = 1.0
    t = NVFP4Quantizer(columnwise_usage=False).quantize(x)
    assert t._rowwise_scale_inv.view(torch.uint8)[0, 0].item() == 0
    assert torch.equal(t.dequantize(), x)


def test_denormal_inputs_keep_their_relative_precision():
    # amax ~1e-39: S_enc overflows and is clamped to float32 max; S_enc / S_dec_b would overflow
    # too, so the kernel scales in two steps and the values stay finite and close.
    x = torch.randn(32, 64) * 1e-39
    t = NVFP4Quantizer().quantize(x)
    y = t.dequantize()
    assert torch.isfinite(y).all()
    assert (y - x).abs().max() <= 0.18 * x.abs().max()
    _check_usage(t, x.numpy(), "rowwise")


def test_nan_poisons_its_block_only():
    x = torch.randn(2, 32)
    x[0, 5] = float("nan")
    t = NVFP4Quantizer(columnwise_usage=False).quantize(x)
    assert t._rowwise_scale_inv.view(torch.uint8)[0, 0].item() == 0x7F
    y = t.dequantize()
    assert torch.isnan(y[0, :16]).all()
    assert torch.isfinite(y[0, 16:]).all() and torch.isfinite(y[1]).all()


# ---- RHT ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 1234])
def test_rht_matrix_is_signed_hadamard_and_orthonormal(seed):
    h = rht_matrix(seed)
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    np.testing.assert_array_equal(h.double().numpy(), ref_rht(seed))
    assert torch.equal(h @ h.t(), torch.eye(16))
    assert torch.equal(rht_matrix(seed), h)  # deterministic


def test_rht_seed_changes_the_signs():
    assert not torch.equal(rht_matrix(0), rht_matrix(1))


def test_rht_round_trip_and_only_columnwise():
    x = torch.randn(64, 48)
    q = NVFP4Quantizer(with_rht=True, rowwise_usage=False, rht_seed=7)
    t = q.quantize(x)
    y = t.dequantize()
    assert (y - x).abs().max() <= 0.25 * x.abs().max()
    # the transform really happened: the columnwise values are not those of x^T
    plain = NVFP4Quantizer(rowwise_usage=False).quantize(x)
    assert not torch.equal(t._columnwise_data, plain._columnwise_data)
    # and the amax is the transformed one
    xt = x.t().reshape(48, 4, 16) @ rht_matrix(7).t()
    assert t._amax_columnwise.item() == pytest.approx(xt.abs().max().item(), rel=1e-6)
    with pytest.raises(ValueError, match="2D"):
        NVFP4Quantizer(with_rht=True, with_2d_quantization=True)


# ---- stochastic rounding -----------------------------------------------------------------------------
def test_stochastic_rounding_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(16, 64, generator=g) * 2 - 1
    x[:, ::16] = torch.tensor([6.0, -3.0, 1.5, -6.0])  # block amaxes with exact E4M3 scales
    n = 1000
    reps = x.repeat(n, 1)
    q = NVFP4Quantizer(stochastic_rounding=True, columnwise_usage=False)
    y = q.quantize(reps, rand=torch.rand(reps.shape, generator=g)).dequantize().reshape(n, 16, 64)
    err = (y - x).mean(0)
    nearest = NVFP4Quantizer(columnwise_usage=False).quantize(x).dequantize() - x
    assert err.abs().max() < 0.15 and abs(err.mean().item()) < 0.01
    assert err.abs().mean() < 0.2 * nearest.abs().mean()  # nearest rounding is biased per element
    # the same draws give the same result, different draws a different one
    a = q.quantize(x, rand=torch.full(x.shape, 0.3))
    b = q.quantize(x, rand=torch.full(x.shape, 0.3))
    c = q.quantize(x, rand=torch.full(x.shape, 0.9))
    assert torch.equal(a._rowwise_data, b._rowwise_data) and not torch.equal(a._rowwise_data, c._rowwise_data)


# ---- shapes, usages, tensor behaviour -------------------------------------------------------------------
def test_check_shape_errors_name_shape_and_block():
    with pytest.raises(ValueError, match=r"\(4, 24\).*\b24\b.*16"):
        NVFP4Quantizer(columnwise_usage=False).quantize(torch.randn(4, 24))
    with pytest.raises(ValueError, match=r"\(8, 32\).*\b8\b.*16"):
        NVFP4Quantizer(rowwise_usage=False).quantize(torch.randn(8, 32))
    with pytest.raises(ValueError, match=r"\b24\b.*16"):
        NVFP4Quantizer(with_2d_quantization=True, rowwise_usage=False).alloc_tensors((16, 24), torch.float32)
    NVFP4Quantizer(rowwise_usage=False).quantize(torch.randn(16, 24))  # columnwise: K is free
    NVFP4Quantizer(columnwise_usage=False).quantize(torch.randn(3, 32))  # rowwise: M is free


def test_buffers_are_2d_and_views_keep_them():
    q = NVFP4Quantizer()
    t = q.quantize(torch.randn(2, 16, 64))
    layout = {k: (v.shape, v.dtype) for k, v in q.buffer_layout((2, 16, 64)).items()}
    assert list(layout) == ["_rowwise_data", "_rowwise_scale_inv", "_columnwise_data",
                            "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise"]
    assert layout["_rowwise_data"] == ((32, 32), torch.uint8)
    assert layout["_columnwise_scale_inv"] == ((64, 2), torch.float8_e4m3fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        v = t.view(32, 64)
    assert all(v.get_buffers()[k] is b for k, b in t.get_buffers().items())
    assert torch.equal(v.dequantize(), t.dequantize().view(32, 64))


@pytest.mark.parametrize("two_d", [False, True])
def test_update_usage_and_derivation(two_d):
    x = torch.randn(32, 64)
    q = NVFP4Quantizer(with_2d_quantization=two_d)
    full = q.quantize(x)
    row = q.with_usage(columnwise=False).quantize(x)
    if not two_d:
        with pytest.raises(RuntimeError, match="columnwise"):
            row.update_usage(columnwise_usage=True)
        col = q.with_usage(rowwise=False).quantize(x)
        with pytest.raises(RuntimeError, match="rowwise"):
            col.update_usage(rowwise_usage=True)
        return
    row.update_usage(columnwise_usage=True)  # 16x16 tiles: exact relayout, no requantization
    for name, buf in full.get_buffers().items():
        assert torch.equal(getattr(row, name).view(torch.uint8), buf.view(torch.uint8)), name
    row.update_usage(rowwise_usage=False)
    assert not row.has_rowwise() and row._amax_rowwise is None
    row.update_usage(rowwise_usage=True)
    assert torch.equal(row._rowwise_data, full._rowwise_data)
    assert torch.equal(row.dequantize(), full.dequantize())


def test_transpose_is_native_for_2d_only():
    x = torch.randn(32, 64)
    t = NVFP4Quantizer(with_2d_quantization=True).quantize(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tt = t.t()
    assert isinstance(tt, NVFP4Tensor) and tt.shape == (64, 32)
    assert tt._rowwise_data is t._columnwise_data
    assert torch.equal(tt.dequantize(), t.dequantize().t())
    # 1D: the usages round differently, so transposing falls back to the dequantized tensor
    t1 = NVFP4Quantizer().quantize(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = t1.t()
    assert not isinstance(out, QuantizedTensor) and torch.equal(out, t1.dequantize().t())


def test_columnwise_only_dequantizes_back_to_logical_shape():
    x = torch.randn(2, 16, 48)
    for q in (NVFP4Quantizer(rowwise_usage=False), NVFP4Quantizer(rowwise_usage=False, with_rht=True)):
        y = q.quantize(x).dequantize()
        assert y.shape == x.shape and (y - x).abs().max() <= 0.25 * x.abs().max()


def test_quantizer_is_a_hashable_setting():
    a, b = NVFP4Quantizer(with_rht=True, rht_seed=3), NVFP4Quantizer(with_rht=True, rht_seed=3)
    assert a == b and hash(a) == hash(b) and a != NVFP4Quantizer(with_rht=True, rht_seed=4)
    with pytest.raises(dataclasses.FrozenInstanceError, match="rht_seed"):
        a.rht_seed = 5
    t = a.quantize(torch.randn(16, 16))
    assert t.get_metadata()["rht_seed"] == 3 and t.with_rht


def test_kernel_is_registered():
    out = kernel("nvfp4_quantize", "cpu")(torch.randn(16, 32), True, True)
    assert len(out) == 6 and all(o is not None for o in out)


# ---- a given amax (FSDP quantizes a weight shard with the whole weight's amax) --------------------
@pytest.mark.parametrize("two_d", [False, True])
def test_given_amax_replaces_the_tensors_own(two_d):
    from transformer_engine_proto.kernels.reference import nvfp4 as ref

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5))
    own = ref.nvfp4_quantize(x, True, True, two_d=two_d)
    same = ref.nvfp4_quantize(x, True, True, two_d=two_d, amax=x.abs().amax().reshape(1))
    for a, b in zip(own, same):
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b)
    whole = torch.tensor([4.0 * x.abs().max().item()])  # a shard of a tensor with a larger amax
    got = ref.nvfp4_quantize(x, True, True, two_d=two_d, amax=whole)
    data, scale = ref.quantize_blocks(x, whole, two_d)
    assert torch.equal(got[0], data) and torch.equal(got[1].view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(got[4], whole) and torch.equal(got[5], whole)
    assert not torch.equal(got[1].view(torch.uint8), own[1].view(torch.uint8))  # the scales did change


def test_given_amax_bad_input():
    from transformer_engine_proto.kernels.reference import nvfp4 as ref

    x = torch.randn(32, 64)
    with pytest.raises(ValueError, match=r"amax must be one float32 value, got torch.float64 of shape \(1,\)"):
        ref.nvfp4_quantize(x, True, False, amax=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"amax must be one float32 value, got torch.float32 of shape \(2,\)"):
        ref.nvfp4_quantize(x, True, False, amax=torch.ones(2))
    with pytest.raises(ValueError, match=r"given amax cannot be combined with the RHT"):
        ref.nvfp4_quantize(x, True, True, rht=True, amax=torch.ones(1))


def test_rht_signs_under_a_default_device_context():
    """The RHT sign vector comes from a CPU generator, also while the user's code runs under
    `with torch.device(...)` (a CUDA context on a GPU; meta here, which fails the same way)."""
    from transformer_engine_proto.kernels.reference import nvfp4 as ref

    seed = 987654
    ref._RHT_CACHE.pop(seed, None)
    with torch.device("meta"):
        values = ref._rht_values(seed)
    ref._RHT_CACHE.pop(seed, None)
    assert values == ref._rht_values(seed)
