"""TE's two NVFP4 encoding options: row scaling (`row_scaled_nvfp4` / recipe `row_scaled_activation`)
and "4 over 6" (`nvfp4_use_4over6` / recipe `nvfp4_4over6`, with `nvfp4_4over6_err_mode` and the
256 bound `nvfp4_e4m3_max`).

Hand-computed bytes on blocks where the option changes the result, error against plain NVFP4 on
random data, the layout / debug / gather capabilities with the options, the dispatcher routing the
options to the reference kernels, and a Linear trained under the recipe: compiled == eager bitwise.
"""
import copy
import dataclasses
import io

import pytest
import torch
from linear_cases import fresh_dynamo, graph_breaks

import transformer_engine_proto as te
from transformer_engine_proto import kernels
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
from transformer_engine_proto.debug import quant_view
from transformer_engine_proto.kernels.reference import nvfp4 as ref
from transformer_engine_proto.quantization import NVFP4BlockScalingRecipeState
from transformer_engine_proto.tensor import NVFP4Quantizer
from transformer_engine_proto.tensor.recipe_quantizers import quantizers_for_recipe

# E4M3 bytes of the block scales used below: 1.0 * 2**8, 1.5 * 2**8, 1.75 * 2**8
E4M3_256, E4M3_384, E4M3_448 = 0x78, 0x7C, 0x7E


def _rowwise(x, **settings):
    """(packed bytes, scale bytes, amax, dequantized) of x's rowwise quantize."""
    t = NVFP4Quantizer(columnwise_usage=False, **settings).quantize(x)
    return (t._rowwise_data.flatten().tolist(), t._rowwise_scale_inv.view(torch.uint8).flatten().tolist(),
            t._amax_rowwise, t.dequantize())


def _packed(codes):
    """Bytes of E2M1 codes, element 2i in the low nibble."""
    return [lo | (hi << 4) for lo, hi in zip(codes[0::2], codes[1::2])]


def _bits(t):
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


# ---- 4over6: which candidate scale is picked, and why -------------------------------------------------
FOUR_OVER_SIX = dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=256)


def test_4over6_picks_map_to_4_where_it_is_exact():
    """x = [6, 4.5 x 15], amax 6, bound 256: S_enc = 256 * 6 / 6 = 256.
    map-to-6: scale e4m3(6 / 6 * 256) = 256, x * 256/256 = x; 4.5 rounds to E2M1 4 (below the 5
    midpoint): |error| 0.5 on 15 values. map-to-4: scale e4m3(256 * 1.5) = 384, x * 256/384: 6 -> 4
    and 4.5 -> 3, both on the E2M1 grid, dequantized 4 * 384/256 = 6 and 3 * 384/256 = 4.5:
    error 0. So 4over6 stores scale 384 and codes 4 (code 6) / 3 (code 5), exact."""
    x = torch.tensor([[6.0] + [4.5] * 15])
    data, scale, amax, y = _rowwise(x, **FOUR_OVER_SIX)
    assert data == _packed([6] + [5] * 15) == [0x56] + [0x55] * 7
    assert scale == [E4M3_384] and amax.tolist() == [6.0]
    assert torch.equal(y, x)
    # plain NVFP4 (S_enc 448 * 6 / 6, block scale 448): codes 6 (code 7) and 4 (code 6), error 0.5
    data, scale, _, y = _rowwise(x)
    assert data == _packed([7] + [6] * 15) and scale == [E4M3_448]
    assert torch.equal(y, torch.tensor([[6.0] + [4.0] * 15]))


def test_4over6_with_the_448_bound_cannot_expand_the_largest_block():
    """Why TE's 4over6 bounds S_enc by 256: with 448, the block holding the global amax has the
    scale 448, and 1.5 * 448 saturates back to 448, so both candidates are the plain encoding."""
    x = torch.tensor([[6.0] + [4.5] * 15])
    assert _rowwise(x, nvfp4_use_4over6=True)[:2] == _rowwise(x)[:2]


@pytest.mark.parametrize("mode,codes,scale", [
    # MAE: map-to-6 |5 - 4| = 1  vs  map-to-4 |5 - 4.5| + 3 * |1 - 0.75| = 1.25   -> map-to-6
    ("MAE", [7, 6, 2, 2, 2] + [0] * 11, E4M3_256),
    # MSE: map-to-6 1^2 = 1     vs  map-to-4 0.5^2 + 3 * 0.25^2 = 0.4375         -> map-to-4
    ("MSE", [6, 5, 1, 1, 1] + [0] * 11, E4M3_384),
])
def test_4over6_error_mode_decides(mode, codes, scale):
    """x = [6, 5, 1, 1, 1, 0...] (S_enc 256 as above). map-to-6 (scale 256): 5 is the 4..6
    midpoint, ties to the even code (4), error 1; 1 exact. map-to-4 (scale 384, factor 2/3): 5 ->
    3.33 -> 3, dequantized 4.5 (error 0.5); 1 -> 0.67 -> 0.5, dequantized 0.75 (error 0.25)."""
    x = torch.tensor([[6.0, 5.0, 1.0, 1.0, 1.0] + [0.0] * 11])
    data, s, _, y = _rowwise(x, **FOUR_OVER_SIX, nvfp4_4over6_err_mode=mode)
    assert data == _packed(codes) and s == [scale]
    expected = [6.0, 4.0, 1.0, 1.0, 1.0] if mode == "MAE" else [6.0, 4.5, 0.75, 0.75, 0.75]
    assert y[0, :5].tolist() == expected and not y[0, 5:].any()


def test_4over6_tie_keeps_map_to_6():
    """[6, 3, 0...]: exact under both scales (3 * 2/3 = 2 dequantizes to 2 * 1.5 = 3), errors tie."""
    x = torch.tensor([[6.0, 3.0] + [0.0] * 14])
    data, scale, _, y = _rowwise(x, **FOUR_OVER_SIX)
    assert data == _packed([7, 5] + [0] * 14) and scale == [E4M3_256] and torch.equal(y, x)


def test_4over6_2d_decides_per_16x16_tile():
    """With 2D blocks the errors of the tile's 16 rows are summed: row 0 = [6, 4.5 x 15] alone
    would take map-to-4 (error 0 vs 7.5), but rows 1..15 of ones (exact at map-to-6, 16 * 0.25 each
    at map-to-4) outweigh it, so the whole tile keeps map-to-6; the columnwise copy is its transpose."""
    x = torch.ones(16, 16)
    x[0] = torch.tensor([6.0] + [4.5] * 15)
    t = NVFP4Quantizer(with_2d_quantization=True, **FOUR_OVER_SIX).quantize(x)
    assert t._rowwise_scale_inv.view(torch.uint8).flatten().tolist() == [E4M3_256] * 16
    assert t._rowwise_data[0].tolist() == _packed([7] + [6] * 15)
    assert t._rowwise_data[1].tolist() == _packed([2] * 16)
    col, col_s = ref.transpose_2d_blocks(t._rowwise_data, t._rowwise_scale_inv)
    assert torch.equal(t._columnwise_data, col) and torch.equal(_bits(t._columnwise_scale_inv), _bits(col_s))
    # 1D blocks decide row by row: row 0 takes map-to-4
    assert _rowwise(x[:1], **FOUR_OVER_SIX)[1] == [E4M3_384]


def test_4over6_non_finite_and_zero_blocks_stay_plain():
    x = torch.zeros(3, 16)
    x[0, 3], x[1, 0] = float("inf"), float("nan")
    x[2] = torch.linspace(-2, 3, 16)
    y = NVFP4Quantizer(columnwise_usage=False, **FOUR_OVER_SIX).quantize(x).dequantize()
    assert y[0].isnan().all() and y[1].isnan().all() and torch.isfinite(y[2]).all()
    assert not NVFP4Quantizer(**FOUR_OVER_SIX).quantize(torch.zeros(16, 32)).dequantize().any()


# ---- row scaling ---------------------------------------------------------------------------------------
def test_row_scaled_gives_each_row_its_own_global_scale():
    """Rows of amax 1024 and 2**-10, values amax * v / 6 for v on the E2M1 grid: per row S_enc =
    448 * 6 / amax, so each row's block scale is e4m3(amax / 6 * S_enc) = 448 and its codes are v's.
    One S_enc for both rows (plain NVFP4) gives the small row a block scale below E4M3's least
    subnormal: it quantizes to zeros."""
    v = torch.tensor([6.0, 4, 3, 2, 1.5, 1, 0.5, 0, -6, -4, -3, -2, -1.5, -1, -0.5, -0.0])
    amaxes = torch.tensor([1024.0, 2.0 ** -10])
    x = amaxes[:, None] * v / 6
    data, scale, amax, y = _rowwise(x, row_scaled_nvfp4=True)
    codes = [7, 6, 5, 4, 3, 2, 1, 0, 15, 14, 13, 12, 11, 10, 9, 8]
    assert data == _packed(codes) * 2 and scale == [E4M3_448] * 2 and torch.equal(amax, amaxes)
    torch.testing.assert_close(y, x, rtol=1e-6, atol=0)
    plain = _rowwise(x)
    assert plain[1][1] == 0 and not plain[3][1].any()


def test_row_scaled_columnwise_amax_is_per_column():
    x = torch.randn(32, 48, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 48)
    t = NVFP4Quantizer(row_scaled_nvfp4=True).quantize(x)
    assert torch.equal(t._amax_rowwise, x.abs().amax(1)) and torch.equal(t._amax_columnwise, x.abs().amax(0))
    # each column's values come back with that column's precision (plain: small columns vanish)
    col = NVFP4Quantizer(row_scaled_nvfp4=True, rowwise_usage=False).quantize(x)
    assert ((col.dequantize() - x).abs().amax(0) / x.abs().amax(0)).max() < 0.2
    plain = NVFP4Quantizer(rowwise_usage=False).quantize(x)
    assert ((plain.dequantize() - x).abs().amax(0) / x.abs().amax(0)).max() > 0.5


def test_row_scaled_and_4over6_combine():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-2, 2, 32)[:, None]
    both = NVFP4Quantizer(row_scaled_nvfp4=True, **FOUR_OVER_SIX).quantize(x)
    for r in (0, 31):  # a row quantized alone gives the same bytes: nothing crosses rows
        alone = NVFP4Quantizer(columnwise_usage=False, **FOUR_OVER_SIX).quantize(x[r:r + 1])
        assert torch.equal(both._rowwise_data[r], alone._rowwise_data[0])
        assert torch.equal(_bits(both._rowwise_scale_inv[r]), _bits(alone._rowwise_scale_inv[0]))


# ---- dequantize error: no worse than plain NVFP4 -----------------------------------------------------
def _inputs():
    g = torch.Generator().manual_seed(0)
    return {"randn": torch.randn(128, 256, generator=g),
            "cubed": torch.randn(128, 256, generator=g) ** 3,
            "rows_of_scales": torch.randn(128, 256, generator=g) * torch.logspace(-4, 4, 128)[:, None]}


@pytest.mark.parametrize("kind", list(_inputs()))
@pytest.mark.parametrize("settings,metric", [
    (dict(nvfp4_use_4over6=True), "mae"),
    (dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=256), "mae"),
    (dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MSE"), "mse"),
    (dict(row_scaled_nvfp4=True), "mae"),
    (dict(row_scaled_nvfp4=True, nvfp4_use_4over6=True, nvfp4_e4m3_max=256), "mae"),
], ids=["4over6_448", "4over6_256", "4over6_mse", "row_scaled", "row_scaled_4over6"])
@pytest.mark.parametrize("columnwise", [False, True])
def test_error_no_worse_than_plain(kind, settings, metric, columnwise):
    """Mean |error| (mean error^2 for MSE's choice). Row scaling alone, on rows of one magnitude,
    only moves where the E4M3 block scales round: equal up to noise (1% allowed); with rows of
    different magnitudes it is much better."""
    x = _inputs()[kind]
    usage = dict(rowwise_usage=not columnwise, columnwise_usage=columnwise)

    def err(q):
        e = q.quantize(x).dequantize() - x
        return e.abs().mean() if metric == "mae" else (e * e).mean()

    ours, plain = err(NVFP4Quantizer(**settings, **usage)), err(NVFP4Quantizer(**usage))
    if settings.get("nvfp4_use_4over6"):
        assert ours < plain
    else:
        assert ours <= plain * 1.01


def test_row_scaled_error_per_row():
    x = _inputs()["rows_of_scales"]

    def rel(q):  # mean over rows of the row's mean |error| over its mean |x|
        return ((q.quantize(x).dequantize() - x).abs().mean(1) / x.abs().mean(1)).mean()

    assert rel(NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False)) < \
        0.5 * rel(NVFP4Quantizer(columnwise_usage=False))


def test_4over6_448_never_loses_a_block():
    """With the 448 bound the map-to-6 candidate is the plain encoding, so no block's error exceeds
    plain NVFP4's (up to the rounding of the error sums)."""
    x = _inputs()["cubed"]
    err = {}
    for name, q in (("plain", NVFP4Quantizer(columnwise_usage=False)),
                    ("4over6", NVFP4Quantizer(columnwise_usage=False, nvfp4_use_4over6=True))):
        err[name] = (q.quantize(x).dequantize() - x).double().abs().reshape(-1, 16).sum(-1)
    assert (err["4over6"] <= err["plain"] * (1 + 1e-6)).all()
    assert (err["4over6"] < err["plain"]).float().mean() > 0.2  # and wins often


# ---- the quantizer: settings, layout, capabilities --------------------------------------------------
def test_quantizer_settings_are_checked_and_normalized():
    assert NVFP4Quantizer(nvfp4_e4m3_max=256) == NVFP4Quantizer()  # the bound without 4over6: normalized
    unused = NVFP4Quantizer(nvfp4_4over6_err_mode="mse", columnwise_usage=False)
    assert unused.nvfp4_4over6_err_mode == "MSE"  # kept as given, as TE's (its recipe state reports it)
    x = torch.randn(32, 64)
    assert torch.equal(unused.quantize(x).dequantize(), NVFP4Quantizer(columnwise_usage=False).quantize(x).dequantize())
    q = NVFP4Quantizer(nvfp4_use_4over6=True, nvfp4_4over6_err_mode="mse", nvfp4_e4m3_max=256)
    assert q.nvfp4_4over6_err_mode == "MSE" and q.nvfp4_e4m3_max == 256
    assert q != NVFP4Quantizer(nvfp4_use_4over6=True) and hash(q) == hash(dataclasses.replace(q))
    for bad, match in [(dict(nvfp4_use_4over6=True, with_rht=True), "nvfp4_use_4over6 cannot be combined"),
                       (dict(nvfp4_use_4over6=True, stochastic_rounding=True), "nvfp4_use_4over6 cannot be combined"),
                       (dict(row_scaled_nvfp4=True, with_2d_quantization=True), "row_scaled_nvfp4 cannot be combined"),
                       (dict(row_scaled_nvfp4=True, with_rht=True), "row_scaled_nvfp4 cannot be combined"),
                       (dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=300), "nvfp4_e4m3_max must be one of"),
                       (dict(nvfp4_use_4over6=True, nvfp4_4over6_err_mode="L1"), "err_mode must be one of")]:
        with pytest.raises(ValueError, match=match):
            NVFP4Quantizer(**bad)
    # TE's positional order: ..., stochastic_rounding, row_scaled_nvfp4, nvfp4_use_4over6, e4m3_max, err_mode
    te_q = NVFP4Quantizer(te.DType.kFloat4E2M1, True, True, False, None, False, False, False, False,
                          True, True, 256, "MSE")
    assert te_q == NVFP4Quantizer(row_scaled_nvfp4=True, nvfp4_use_4over6=True, nvfp4_e4m3_max=256,
                                  nvfp4_4over6_err_mode="MSE")


@pytest.mark.parametrize("settings", [dict(row_scaled_nvfp4=True), FOUR_OVER_SIX,
                                      dict(with_2d_quantization=True, **FOUR_OVER_SIX)])
@pytest.mark.parametrize("shape", [(16, 32), (2, 8, 48), (48, 16)])
@pytest.mark.parametrize("usage", [(True, True), (True, False), (False, True)])
def test_layout_matches_the_kernel(settings, shape, usage):
    q = NVFP4Quantizer(**settings, rowwise_usage=usage[0], columnwise_usage=usage[1])
    t = q.quantize(torch.randn(shape))
    alloc = q.alloc_tensors(shape, torch.float32)
    bufs = t.get_buffers()
    assert list(bufs) == list(alloc)
    for name, b in bufs.items():
        a = alloc[name]
        assert (b.shape, b.dtype, b.stride()) == (a.shape, a.dtype, a.stride()), name
    assert t.dequantize().shape == shape
    if settings.get("row_scaled_nvfp4"):  # views keep the rows: the per-row amaxes stay valid
        assert torch.equal(t.view(-1, shape[-1]).dequantize(), t.dequantize().view(-1, shape[-1]))


@pytest.mark.parametrize("settings", [dict(row_scaled_nvfp4=True), FOUR_OVER_SIX,
                                      dict(row_scaled_nvfp4=True, **FOUR_OVER_SIX)])
def test_debug_dump_reconstructs_bitwise(settings):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 2, 32)[:, None]
    t = NVFP4Quantizer(**settings).quantize(x)
    d = quant_view.internals(t)
    for usage in ("rowwise", "columnwise"):
        one = NVFP4Quantizer(**settings, rowwise_usage=usage == "rowwise",
                             columnwise_usage=usage == "columnwise").quantize(x)  # that usage's dequantize
        assert torch.equal(quant_view.reconstruct(d, usage), one.dequantize())
        view = t.debug_usage_view(x, usage == "columnwise")  # in the usage's own (transposed) layout
        assert torch.equal(view.dq.t() if usage == "columnwise" else view.dq, one.dequantize())


def test_gemm_with_row_scaled_operands_is_emulated():
    x = torch.randn(32, 64)
    w = torch.randn(16, 64)
    xq = NVFP4Quantizer(row_scaled_nvfp4=True).quantize(x)
    wq = NVFP4Quantizer(**FOUR_OVER_SIX).quantize(w)
    assert xq.gemm_native() is None and xq.gemm_operand(True) is None
    assert wq.gemm_native() == "block_scaled" and wq.gemm_operand(True).global_scale is not None
    decode = wq.gemm_operand(True).global_scale
    assert torch.equal(decode, 1.0 / ref.global_encode_scale(wq._amax_rowwise, 256))  # the 256 bound
    from transformer_engine_proto.gemm import gemm
    out = gemm(xq, wq, out_dtype=torch.float32, trans_b=True)
    assert torch.equal(out, xq.dequantize() @ wq.dequantize().t())


def test_fsdp_shard_of_a_4over6_weight_equals_the_whole_weights_rows():
    """4over6 decides per 16x16 tile, with the whole weight's amax: a shard of whole tiles gives
    the whole weight's bytes for its rows."""
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(4))
    q = NVFP4Quantizer(with_2d_quantization=True, **FOUR_OVER_SIX)
    assert q.fsdp_gather_rule().layout == "nvfp4"
    whole = q.quantize(w)
    (data, scale), (amax,) = q.fsdp_quantize_shard(w[16:48], lambda: w.abs().amax().reshape(1), None)
    assert torch.equal(data, whole._rowwise_data[16:48])
    assert torch.equal(scale, _bits(whole._rowwise_scale_inv[16:48]))
    # 1D blocks (all a row-scaled tensor has): gathered in high precision
    assert NVFP4Quantizer(row_scaled_nvfp4=True).fsdp_gather_rule().layout is None


@pytest.mark.parametrize("settings", [dict(row_scaled_nvfp4=True), FOUR_OVER_SIX,
                                      dict(row_scaled_nvfp4=True, **FOUR_OVER_SIX)])
@pytest.mark.parametrize("columnwise", [True, False])
def test_sp_gather_of_shards_equals_the_whole_quantize(settings, columnwise):
    """Two shards' `sp_quantize_shard` with a simulated all-reduce, gathered along the dims the
    parts name: the buffers of quantizing the whole input, bit for bit."""
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(5)) * torch.logspace(-2, 2, 64)[:, None]
    q = NVFP4Quantizer(**settings, columnwise_usage=columnwise)
    assert q.sp_gather_rule().layout == "nvfp4"
    shards, seen = x.chunk(2), []
    for s in shards:
        q.sp_quantize_shard(s, None, lambda t: seen.append(t.clone()))
    reduced = torch.stack(seen).amax(0)
    outs = [q.sp_quantize_shard(s, None, lambda t: t.copy_(reduced)) for s in shards]
    bufs = dict(outs[0][1])
    for i, (name, _, dim) in enumerate(outs[0][0]):
        bufs[name] = torch.cat([o[0][i][1] for o in outs], dim)
    whole = q.quantize(x)
    assert sorted(bufs) == sorted(whole.get_buffers())
    for name, b in whole.get_buffers().items():
        assert torch.equal(_bits(bufs[name]), _bits(b)), name
    assert torch.equal(outs[0][2], x.abs().amax().reshape(1))


def test_saved_and_loaded(tmp_path):
    r = R.NVFP4BlockScaling(disable_rht=True, row_scaled_activation=True, nvfp4_4over6="all")
    t = NVFP4Quantizer(row_scaled_nvfp4=True, **FOUR_OVER_SIX).quantize(torch.randn(16, 32))
    buf = io.BytesIO()
    torch.save({"recipe": r, "t": t}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["recipe"] == r
    assert loaded["t"].row_scaled_nvfp4 and loaded["t"].nvfp4_e4m3_max == 256
    assert torch.equal(loaded["t"].dequantize(), t.dequantize())


# ---- the dispatcher sends the options to the reference kernels ----------------------------------------
def test_options_never_reach_a_fast_kernel(monkeypatch):
    """A fast quantize kernel preferred on this device is taken by plain NVFP4 only; the options
    take the reference (kernel(..., reference=True)), on every device."""
    calls = []

    def fast(*args, **kwargs):
        calls.append(kwargs)
        return ref.nvfp4_quantize(*args, **kwargs)

    monkeypatch.setitem(kernels._KERNELS, ("nvfp4_quantize", "triton"), fast)
    monkeypatch.setitem(kernels._PREFERENCE, "cpu", ("triton",))
    kernels.set_backend("triton")
    x = torch.randn(16, 32)
    NVFP4Quantizer().quantize(x)
    assert len(calls) == 1
    for settings in (dict(row_scaled_nvfp4=True), FOUR_OVER_SIX, dict(nvfp4_use_4over6=True)):
        NVFP4Quantizer(**settings).quantize(x)
    assert len(calls) == 1
    assert kernels.kernel("nvfp4_quantize", "cpu") is fast
    assert kernels.kernel("nvfp4_quantize", "cpu", reference=True) is ref.nvfp4_quantize


def test_reference_kernel_refuses_what_te_refuses():
    x = torch.randn(16, 32)
    with pytest.raises(ValueError, match="4over6 cannot be combined with the RHT"):
        ref.nvfp4_quantize(x, True, True, rht=True, four_over_six="MAE")
    with pytest.raises(ValueError, match="row_scaled cannot be combined with 2D"):
        ref.nvfp4_quantize(x, True, True, two_d=True, row_scaled=True)
    with pytest.raises(ValueError, match="given amax cannot be combined with row_scaled"):
        ref.nvfp4_quantize(x, True, True, row_scaled=True, amax=torch.ones(1))
    with pytest.raises(ValueError, match="e4m3_max must be one of"):
        ref.nvfp4_quantize(x, True, True, four_over_six="MAE", e4m3_max=100)


# ---- the recipe -------------------------------------------------------------------------------------
def test_recipe_fields_follow_te():
    r = R.NVFP4BlockScaling()
    assert (r.row_scaled_activation, r.nvfp4_4over6, r.nvfp4_4over6_e4m3_use_256, r.nvfp4_4over6_err_mode) == \
        (False, "none", "all", "MAE")
    q = quantizers_for_recipe(r)
    assert q.input == NVFP4Quantizer(with_rht=True) and not q.weight.nvfp4_use_4over6
    r = R.NVFP4BlockScaling(disable_rht=True, row_scaled_activation=True, nvfp4_4over6="all",
                            nvfp4_4over6_e4m3_use_256="weights", nvfp4_4over6_err_mode="mse")
    q = quantizers_for_recipe(r)
    assert q.input == NVFP4Quantizer(row_scaled_nvfp4=True, nvfp4_use_4over6=True, nvfp4_4over6_err_mode="MSE")
    assert q.weight == NVFP4Quantizer(with_2d_quantization=True, nvfp4_use_4over6=True, nvfp4_e4m3_max=256,
                                      nvfp4_4over6_err_mode="MSE")
    # gradients never use either option (the error mode is reported, unused, as TE's)
    assert q.grad_output == NVFP4Quantizer(stochastic_rounding=True, nvfp4_4over6_err_mode="MSE")
    assert not q.grad_output.nvfp4_use_4over6
    q = quantizers_for_recipe(R.NVFP4BlockScaling(nvfp4_4over6="weights"))  # the RHT stays on the input
    assert q.weight.nvfp4_use_4over6 and q.weight.nvfp4_e4m3_max == 256 and q.input == NVFP4Quantizer(with_rht=True)
    for bad, err, match in [
        (dict(row_scaled_activation=True), ValueError, "row_scaled_activation=True needs disable_rht=True"),
        (dict(nvfp4_4over6="activations"), ValueError, "needs disable_rht=True"),
        (dict(nvfp4_4over6="inputs"), ValueError, "nvfp4_4over6 must be one of"),
        (dict(nvfp4_4over6_e4m3_use_256="yes"), ValueError, "nvfp4_4over6_e4m3_use_256 must be one of"),
        (dict(nvfp4_4over6_err_mode="L2"), ValueError, "err_mode must be one of"),
        (dict(row_scaled_activation=1), TypeError, "must be a bool"),
    ]:
        with pytest.raises(err, match=match):
            R.NVFP4BlockScaling(**bad)


def test_recipe_key_and_repr_round_trip():
    r = R.NVFP4BlockScaling(disable_rht=True, row_scaled_activation=True, nvfp4_4over6="activations",
                            nvfp4_4over6_err_mode="MSE")
    key = RecipeKey.of(r)
    assert key == repr(r) and RecipeKey.recipe(key) == r
    for field in ("row_scaled_activation=True", "nvfp4_4over6='activations'", "nvfp4_4over6_err_mode='MSE'",
                  "nvfp4_4over6_e4m3_use_256='all'"):
        assert field in key
    assert key != RecipeKey.of(R.NVFP4BlockScaling(disable_rht=True))
    rebuilt = R.NVFP4BlockScaling(**{f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.init})
    assert rebuilt == r and repr(rebuilt) == key
    assert RecipeKey.quantizers(key).input.nvfp4_use_4over6 and RecipeKey.quantizers(key).input.row_scaled_nvfp4
    derived = RecipeKey.with_high_precision_gemms(key, ["wgrad"])
    assert RecipeKey.recipe(derived) is RecipeKey.recipe(key)
    assert RecipeKey.quantizers(derived).input == RecipeKey.quantizers(key).input


# ---- a Linear trained under the recipe: compiled == eager, bitwise ---------------------------------------
# stochastic rounding off: its random draws would differ between the two runs
TRAIN_RECIPES = {
    "4over6_all_row_scaled": R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                                 row_scaled_activation=True, nvfp4_4over6="all"),
    "4over6_weights_mse": R.NVFP4BlockScaling(disable_stochastic_rounding=True, nvfp4_4over6="weights",
                                              nvfp4_4over6_err_mode="MSE"),
}


@pytest.mark.parametrize("name", list(TRAIN_RECIPES))
def test_linear_trains_compiled_as_eager(name):
    recipe = TRAIN_RECIPES[name]
    fresh_dynamo()
    torch.manual_seed(0)
    m = te.Linear(64, 32)
    mc = copy.deepcopy(m)
    cm = torch.compile(mc, fullgraph=True, backend="aot_eager")
    opt, opt_c = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(mc.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(2, 16, 64, generator=g) * torch.logspace(-2, 2, 16)[:, None]
        dy = torch.randn(2, 16, 32, generator=g)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            ye, yc = m(xe), cm(xc)
        assert torch.equal(ye, yc), f"step {step} output"
        ye.backward(dy)
        yc.backward(dy)
        assert torch.equal(xe.grad, xc.grad), f"step {step} input grad"
        for (pname, p), pc in zip(m.named_parameters(), mc.parameters()):
            assert torch.equal(p.grad, pc.grad), f"step {step} {pname} grad"
        opt.step(), opt_c.step()
        opt.zero_grad(), opt_c.zero_grad()
    for p, pc in zip(m.parameters(), mc.parameters()):
        assert torch.equal(p, pc)
    assert graph_breaks() == 0
    # the options did change the numbers: plain NVFP4 (same RHT setting) gives another output
    with te.autocast(recipe=R.NVFP4BlockScaling(disable_rht=recipe.disable_rht, disable_stochastic_rounding=True)):
        plain = m(x)
    with te.autocast(recipe=recipe):
        assert not torch.equal(m(x), plain)


def test_is_quantizable_as_te():
    """TE's `is_quantizable`: whole 16-blocks along both dims, never for a row-scaled quantizer."""
    assert NVFP4Quantizer().is_quantizable(torch.empty(16, 32))
    assert not NVFP4Quantizer().is_quantizable(torch.empty(16, 24))
    assert not NVFP4Quantizer().is_quantizable(torch.empty(8, 32))
    assert not NVFP4Quantizer().is_quantizable(torch.empty(32))
    assert not NVFP4Quantizer(row_scaled_nvfp4=True).is_quantizable(torch.empty(16, 16))
    assert te.MXFP8Quantizer(torch.float8_e4m3fn).is_quantizable(torch.empty(64, 32))
    assert not te.MXFP8Quantizer(torch.float8_e4m3fn).is_quantizable(torch.empty(48, 32))
    assert te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device="cpu").is_quantizable(torch.empty(3, 5))


def test_recipe_state_reports_the_recipes_err_mode_on_every_role():
    recipe = te.recipe.NVFP4BlockScaling(nvfp4_4over6="weights", nvfp4_4over6_err_mode="MSE")
    quantizers = [q for mode in ("forward", "backward") for q in
                  NVFP4BlockScalingRecipeState(recipe, mode=mode, num_quantizers=3 if mode == "forward" else 2)
                  .make_quantizers()]
    assert [q.nvfp4_4over6_err_mode for q in quantizers] == ["MSE"] * 5
    assert [q.nvfp4_use_4over6 for q in quantizers] == [False, True, False, False, False]
