"""Native block-scaled GEMMs (`block_scaled_gemm.py`), checked on CPU.

No GPU here has block-scaled MMA (Hopper emulates MXFP8/NVFP4), so `F.scaled_mm` is replaced by a
stand-in that implements what cuBLAS documents: block scales in 128x4 tiles, the scale of
(row r, col c) of a tile at byte (r % 32) * 16 + (r // 32) * 4 + c, tiles row-major; values =
data * block scale (* the NVFP4 per-tensor decode scale). The product must equal the emulated
GEMM of the same quantized operands for fprop, dgrad and wgrad, which checks that the native path
feeds the right buffers, views and scales, with no transpose copy of the data.
"""
import pytest
import torch
import torch.nn.functional as F

from transformer_engine_proto import block_scaled_gemm as BSG
from transformer_engine_proto.gemm import emulated_gemm
from transformer_engine_proto.kernels.reference.nvfp4 import unpack_fp4
from transformer_engine_proto.tensor import MXFP8Quantizer, NVFP4Quantizer

M, K, N = 128, 64, 96  # tokens, in features, out features


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) scales read back from cuBLAS's tile layout, by its documented offsets."""
    tiles_per_row = -(-cols // 4)
    r = torch.arange(rows)[:, None]
    c = torch.arange(cols)[None, :]
    tile = (r // 128) * tiles_per_row + c // 4
    offset = tile * 512 + (r % 128 % 32) * 16 + (r % 128 // 32) * 4 + c % 4
    return flat.view(torch.uint8)[offset].view(flat.dtype)


@pytest.mark.parametrize("rows,cols", [(128, 4), (200, 7), (1, 1), (256, 12), (384, 2)])
def test_swizzle_places_every_scale_where_cublas_reads_it(rows, cols):
    gen = torch.Generator().manual_seed(rows * cols)
    s = torch.randint(1, 255, (rows, cols), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    flat = BSG.swizzle_block_scales(s)
    assert flat.dtype == s.dtype and flat.dim() == 1
    assert flat.numel() == 512 * -(-rows // 128) * -(-cols // 4)
    assert torch.equal(_unswizzle(flat, rows, cols).view(torch.uint8), s.view(torch.uint8))
    assert int((flat.view(torch.uint8) != 0).sum()) == rows * cols  # the padding is zeros


def test_swizzle_rejects_a_flat_scale():
    with pytest.raises(ValueError, match=r"2D \(rows, K/block\).*\(512,\)"):
        BSG.swizzle_block_scales(torch.zeros(512, dtype=torch.uint8))


def _dequantize_operand(mat, scale, recipe):
    """(outer, K) fp32 values of a scaled_mm operand given as (outer, K-ish) rows."""
    st = F.ScalingType
    if recipe == st.BlockWise1x32:
        values, block, extra = mat.float(), 32, 1.0
    else:
        assert recipe == [st.BlockWise1x16, st.TensorWise]
        values, block, extra = unpack_fp4(mat.contiguous().view(torch.uint8)), 16, scale[1].float()
        scale = scale[0]
    rows, k = values.shape
    s = _unswizzle(scale, rows, k // block).float().repeat_interleave(block, 1)
    return values * s * extra


def _cublas_stand_in(calls):
    def scaled_mm(mat_a, mat_b, scale_a, rec_a, scale_b, rec_b, swizzle_a=None, swizzle_b=None,
                  output_dtype=torch.bfloat16):
        st, sw = F.ScalingType, F.SwizzleType
        assert swizzle_a == swizzle_b == (sw.SWIZZLE_32_4_4 if rec_a == st.BlockWise1x32
                                          else [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE])
        calls.append({"a_k_major": mat_a.stride(1) == 1, "b_k_major": mat_b.stride(0) == 1,
                      "output_dtype": output_dtype,
                      "a_shares_storage": mat_a.untyped_storage().data_ptr(),
                      "b_shares_storage": mat_b.untyped_storage().data_ptr()})
        a = _dequantize_operand(mat_a, scale_a, rec_a)
        b = _dequantize_operand(mat_b.t(), scale_b, rec_b).t()
        return (a @ b).to(output_dtype)
    return scaled_mm


def _operands(fmt):
    gen = torch.Generator().manual_seed(7)
    x, w, dy = (torch.randn(*s, generator=gen) * f for s, f in (((M, K), 2.0), ((N, K), 0.05), ((M, N), 1e-3)))
    if fmt == "mxfp8":
        q = MXFP8Quantizer(rowwise_usage=True, columnwise_usage=True)
        qx = qw = qdy = q
    else:
        qx = NVFP4Quantizer(rowwise_usage=True, columnwise_usage=True, with_rht=True, rht_seed=11)
        qdy = NVFP4Quantizer(rowwise_usage=True, columnwise_usage=True, with_rht=True, rht_seed=11)
        qw = NVFP4Quantizer(rowwise_usage=True, columnwise_usage=True, with_2d_quantization=True)
    return tuple(q.quantize(t, internal=True) for q, t in ((qx, x), (qw, w), (qdy, dy)))


def _gemms(x, w, dy):
    """(name, a, b, trans_a, trans_b) of a Linear's three GEMMs, each with the one usage it reads."""
    return [("fprop", x.only_usage(True), w.only_usage(True), False, True),
            ("dgrad", dy.only_usage(True), w.only_usage(False), False, False),
            ("wgrad", dy.only_usage(False), x.only_usage(False), True, False)]


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_native_gemms_equal_the_emulated_ones(fmt):
    x, w, dy = _operands(fmt)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(3))
    for name, a, b, ta, tb in _gemms(x, w, dy):
        calls = []
        use_bias = bias if name == "fprop" else None
        got = BSG.block_scaled_mm(a, b, ta, tb, torch.float32, use_bias, "all", scaled_mm=_cublas_stand_in(calls))
        want = emulated_gemm(a, b, out_dtype=torch.float32, trans_a=ta, trans_b=tb, bias=use_bias)
        assert got is not None and len(calls) == 1, name
        assert got.dtype == torch.float32 and calls[0]["output_dtype"] == torch.bfloat16, name
        # the native product comes out in bf16 (one rounding, 2**-9 relative), the emulated one in fp32
        torch.testing.assert_close(got, want, rtol=2.0**-8, atol=2.0**-8 * want.abs().max().item(), msg=name)
        # the data goes in as stored: views of the storage's own buffers, no copy
        stored = {p.untyped_storage().data_ptr() for t in (a, b) for p in t.get_buffers().values() if p is not None}
        assert calls[0]["a_shares_storage"] in stored and calls[0]["b_shares_storage"] in stored, name


def test_layouts_per_format_and_gemm():
    """NVFP4 operands are all K-major (its columnwise copy is stored transposed); MXFP8's
    untransposed columnwise copy makes dgrad "NN" and wgrad "TT", which 12.x runs emulated."""
    for fmt, k_major in (("mxfp8", {"fprop": (True, True), "dgrad": (True, False), "wgrad": (False, False)}),
                         ("nvfp4", {"fprop": (True, True), "dgrad": (True, True), "wgrad": (True, True)})):
        for name, a, b, ta, tb in _gemms(*_operands(fmt)):
            calls = []
            assert BSG.block_scaled_mm(a, b, ta, tb, torch.bfloat16, None, "all", _cublas_stand_in(calls)) is not None
            assert (calls[0]["a_k_major"], calls[0]["b_k_major"]) == k_major[name], (fmt, name)
            tn = BSG.block_scaled_mm(a, b, ta, tb, torch.bfloat16, None, "tn", _cublas_stand_in([]))
            assert (tn is not None) == all(k_major[name]), (fmt, name)


def test_falls_back_when_it_cannot_run_natively():
    x, w, dy = _operands("nvfp4")
    never = _cublas_stand_in([])
    # the RHT rotations cancel only when both wgrad operands carry the same one
    other = NVFP4Quantizer(rowwise_usage=True, columnwise_usage=True, with_rht=True, rht_seed=12)
    x_other = other.quantize(torch.randn(M, K), internal=True)
    assert BSG.block_scaled_mm(dy.only_usage(False), x_other.only_usage(False), True, False, torch.float32,
                               None, "all", never) is None
    # a missing usage, mixed formats, or a K that is not whole 32-element blocks
    assert BSG.block_scaled_mm(x.only_usage(False), w.only_usage(True), False, True, torch.float32, None, "all",
                               never) is None
    mx = MXFP8Quantizer().quantize(torch.randn(N, K), internal=True)
    assert BSG.block_scaled_mm(x.only_usage(True), mx, False, True, torch.float32, None, "all", never) is None
    # quantized tensors (not bare storages) take the same path
    calls = []
    a, b = MXFP8Quantizer().quantize(torch.randn(M, K)), MXFP8Quantizer().quantize(torch.randn(N, K))
    assert BSG.block_scaled_mm(a, b, False, True, torch.float32, None, "all", _cublas_stand_in(calls)) is not None
    assert len(calls) == 1
    q16 = NVFP4Quantizer(rowwise_usage=True, columnwise_usage=False)
    a, b = q16.quantize(torch.randn(M, 48), internal=True), q16.quantize(torch.randn(N, 48), internal=True)
    assert BSG.block_scaled_mm(a, b, False, True, torch.float32, None, "all", never) is None


def test_native_layouts_by_compute_capability(monkeypatch):
    cuda0 = torch.device("cuda", 0)
    for cap, want in (((9, 0), None), ((10, 0), "all"), ((10, 3), "all"), ((12, 0), "tn"), ((8, 9), None)):
        monkeypatch.setattr(BSG, "_capability", lambda index, cap=cap: cap)
        assert BSG.native_layouts(cuda0) == want, cap
    assert BSG.native_layouts(torch.device("cpu")) is None
    monkeypatch.setattr(BSG, "_capability", lambda index: (10, 0))
    BSG.set_native_block_gemm(False)
    assert BSG.native_layouts(cuda0) is None
    monkeypatch.setenv("TE_PROTO_NATIVE_BLOCK_GEMM", "0")
    BSG.set_native_block_gemm(None)  # follow the variable again (read at the next GEMM)
    assert BSG.native_layouts(cuda0) is None
    monkeypatch.setenv("TE_PROTO_NATIVE_BLOCK_GEMM", "1")
    assert BSG.native_layouts(cuda0) is None  # read once
    BSG.set_native_block_gemm(None)
    assert BSG.native_layouts(cuda0) == "all"
    monkeypatch.setenv("TE_PROTO_NATIVE_BLOCK_GEMM", "yes")
    BSG.set_native_block_gemm(None)
    with pytest.raises(ValueError, match=r"TE_PROTO_NATIVE_BLOCK_GEMM='yes': expected 0 or 1"):
        BSG.native_layouts(cuda0)
