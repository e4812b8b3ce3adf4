"""Non-finite inputs under every recipe. A current scale comes from the amax of the finite values,
so one inf or NaN leaves the other values their FP8 precision; inf / NaN stay non-finite through
the quantize (E4M3 has no inf: NaN; E5M2 keeps +-inf) and so reach the GEMM outputs and gradients
where bf16 / fp32 has them, where overflow checks and loss scalers can see them."""
import math

import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.kernels import kernel
from transformer_engine_proto.tensor import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
INF, NAN = float("inf"), float("nan")
# bytes of +inf, -inf, +NaN, -NaN
NONFINITE_BYTES = {E4M3: [0x7F, 0xFF, 0x7F, 0xFF], E5M2: [0x7C, 0xFC, 0x7F, 0xFF]}
MAX_BYTE = {E4M3: 0x7E, E5M2: 0x7B}


def _rel_err(y, ref):
    return ((y.float() - ref.float()).norm() / ref.float().norm()).item()


def _nonfinite_row(n):
    """[+inf, -inf, +NaN, -NaN] then n - 4 finite values."""
    x = torch.randn(1, n)
    x[0, :4] = torch.tensor([INF, -INF, NAN, NAN])
    x[0, 3] = torch.copysign(x[0, 3], torch.tensor(-1.0))  # -NaN
    return x


def _forward_with_inf_in_row_3(model, x, recipe):
    """x[3, 5] = inf through a bias-free Linear under `recipe`: the output is non-finite exactly
    where the fp32 reference's is (row 3). Returns the other rows' relative error."""
    x[3, 5] = INF
    with te.autocast(recipe=recipe):
        y = model(x)
    ref = x.float() @ model.weight.detach().float().T
    assert torch.equal(torch.isfinite(y), torch.isfinite(ref)) and not torch.isfinite(y[3]).any()
    clean = torch.arange(x.shape[0], device=x.device) != 3
    return _rel_err(y[clean], ref[clean])


def _backward_with_inf_in_grad(model, x, recipe):
    """A grad output with an inf at [2, 7] back through a bias-free Linear under `recipe`: dgrad and
    wgrad are non-finite exactly where the fp32 reference's are. Returns the reference's input and
    weight (their .grad set)."""
    with te.autocast(recipe=recipe):
        y = model(x)
    g = torch.randn_like(y)
    g[2, 7] = INF
    y.backward(g)
    xr = x.detach().float().requires_grad_()
    wr = model.weight.detach().float().requires_grad_()
    (xr @ wr.T).backward(g.float())
    assert torch.equal(torch.isfinite(x.grad), torch.isfinite(xr.grad))
    assert torch.equal(torch.isfinite(model.weight.grad), torch.isfinite(wr.grad))
    return xr, wr


# ---- te.Linear ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_current_scaling_inf_in_one_row_keeps_the_other_rows_precision(dtype):
    torch.manual_seed(0)
    model = te.Linear(64, 32, bias=False, params_dtype=dtype)
    x = (torch.randn(16, 64) * 1e-2).to(dtype)
    assert _forward_with_inf_in_row_3(model, x, R.Float8CurrentScaling()) < 0.1  # scale 1 (an inf amax) gave 0.68


@pytest.mark.parametrize("recipe", [R.DelayedScaling(), R.Float8CurrentScaling()], ids=["delayed", "current"])
def test_inf_in_grad_output_reaches_dgrad_and_wgrad(recipe):
    torch.manual_seed(0)
    model = te.Linear(64, 32, bias=False)
    x = torch.randn(16, 64, requires_grad=True)
    xr, wr = _backward_with_inf_in_grad(model, x, recipe)  # the bf16 path: 64 non-finite each
    assert not torch.isfinite(xr.grad[2]).any() and not torch.isfinite(wr.grad[7]).any()
    if isinstance(recipe, R.DelayedScaling):  # the recorded grad amax still shows the inf: counted
        with te.autocast(recipe=recipe):
            model(x)  # folds the pending grad amax into the history
        assert model.gemm.nonfinite_amax_count.tolist() == [0, 0, 1]
        assert torch.isfinite(model.gemm.grad_amax_history).all()


# ---- per-tensor quantizers: the bytes -------------------------------------------------------------
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_current_scaling_keeps_nonfinite_bytes_and_scales_from_finite_amax(fp8_dtype):
    x = _nonfinite_row(64)
    x[0, 10] = 3.0 * x[0, 4:].abs().max()  # the finite amax
    t = Float8CurrentScalingQuantizer(fp8_dtype)(x)
    assert t._data.view(torch.uint8)[0, :4].tolist() == NONFINITE_BYTES[fp8_dtype]
    assert t._transpose.view(torch.uint8)[:4, 0].tolist() == NONFINITE_BYTES[fp8_dtype]
    fmax = torch.finfo(fp8_dtype).max
    assert t._scale_inv.item() == pytest.approx(x[0, 10].item() / fmax, rel=1e-6)
    assert t._data.view(torch.uint8)[0, 10].item() == MAX_BYTE[fp8_dtype]
    assert _rel_err(t.dequantize()[0, 4:], x[0, 4:]) < 0.1


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_delayed_scaling_keeps_nonfinite_bytes_saturates_finite_and_records_the_inf(fp8_dtype):
    x = _nonfinite_row(8)
    x[0, 4:6] = torch.tensor([3e38, -1e30])  # finite beyond the max (3e38 * 2 overflows fp32)
    amax = torch.zeros(1)
    t = Float8Quantizer(torch.tensor([2.0]), amax, fp8_dtype)(x)
    data = t._data.view(torch.uint8)[0]
    assert data[:4].tolist() == NONFINITE_BYTES[fp8_dtype]
    assert data[4:6].tolist() == [MAX_BYTE[fp8_dtype], MAX_BYTE[fp8_dtype] | 0x80]
    assert t._transpose.view(torch.uint8)[:, 0].tolist() == data.tolist()
    assert not torch.isfinite(amax).any()  # the module's history skips and counts it


# ---- every format -------------------------------------------------------------------------------------
def _formats():
    return {
        "current_e4m3": Float8CurrentScalingQuantizer(E4M3),
        "current_e5m2": Float8CurrentScalingQuantizer(E5M2),
        "delayed": Float8Quantizer(torch.tensor([2.0 ** 12]), torch.zeros(1), E4M3),
        "blockwise_1x128": Float8BlockQuantizer(E4M3, 1),
        "blockwise_128x128": Float8BlockQuantizer(E4M3, 2),
        "mxfp8": MXFP8Quantizer(E4M3),
        "nvfp4": NVFP4Quantizer(),
        "nvfp4_2d": NVFP4Quantizer(with_2d_quantization=True),
        "nvfp4_rht": NVFP4Quantizer(with_rht=True),
    }


def test_no_format_quantizes_inf_or_nan_to_finite_values():
    """Each format and usage: the non-finite element dequantizes non-finite, and a block far from
    it keeps its precision (small inputs: scale 1 from an inf / NaN amax would flush them)."""
    failures = []
    for name, q in _formats().items():
        for bad in (INF, -INF, NAN):
            for rowwise in (True, False):
                torch.manual_seed(0)
                x = torch.randn(256, 256) * 1e-3
                x[5, 10] = bad
                t = q.with_usage(rowwise=rowwise, columnwise=not rowwise)(x)
                y = t.dequantize(dtype=torch.float32)
                err = _rel_err(y[128:, 128:], x[128:, 128:])
                bound = 0.2 if name.startswith("nvfp4") else 0.1
                if math.isfinite(y[5, 10].item()) or not err < bound:
                    failures.append(f"{name} {bad} rowwise={rowwise}: y={y[5, 10].item()}, clean block error {err:.3f}")
    assert not failures, "\n".join(failures)


def test_compiled_current_scaling_keeps_nonfinite_bytes():
    """The reference kernels under inductor: the same bytes as eager."""
    quantizers = [Float8CurrentScalingQuantizer(d) for d in (E4M3, E5M2)]

    def quantize(x):
        return [q(x)._data.view(torch.uint8) for q in quantizers]

    x = _nonfinite_row(64).repeat(8, 1)
    compiled = torch.compile(quantize, backend="inductor", fullgraph=True)(x)
    for got, want, d in zip(compiled, quantize(x), (E4M3, E5M2)):
        assert torch.equal(got, want)
        assert got[:, :4].tolist() == [NONFINITE_BYTES[d]] * 8


def test_amax_kernel_and_fused_norm_take_finite_values():
    x = torch.tensor([[1.0, -2.5, INF, NAN]])
    assert kernel("amax", x.device)(x).tolist() == [2.5]
    inp = torch.tensor([[1.0, -2.5, INF, 0.5], [0.0, 1.0, 2.0, 3.0]])  # row 0 normalizes to a NaN
    y, _, _, data, _, scale_inv, amax = kernel("norm_fp8_current_quantize", inp.device)(
        inp, torch.ones(4), None, 1e-5, "RMSNorm", False, E4M3, True, False)
    finite = torch.isfinite(y)
    assert not finite.all() and amax.item() == y[finite].abs().max().item()
    assert torch.equal(torch.isnan(data.float()), ~finite)


# ---- the GPU: Triton kernels bitwise the reference, GEMMs through torch._scaled_mm ----------------------
def _poisoned(shape, dtype, seed=0, device="cuda"):
    """Small values (1e-2) with +-inf, +-NaN and a finite 3e38 scattered over them."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device) * 1e-2
    flat = x.view(-1)
    n = flat.numel()
    for i, v in enumerate((INF, -INF, NAN, -NAN, 3e38, INF)):
        flat[(i * 7919 + 5) % n] = v
    flat[n // 2] = torch.copysign(torch.tensor(NAN, device=device), torch.tensor(-1.0, device=device))
    return x.to(dtype)


def _same_bits(out, ref, what):
    assert len(out) == len(ref), what
    for i, (o, r) in enumerate(zip(out, ref)):
        if r is None:
            assert o is None, (what, i)
            continue
        assert (o.shape, o.dtype, o.stride()) == (r.shape, r.dtype, r.stride()), (what, i)
        if o.dtype.itemsize == 1:
            ob, rb = o.view(torch.uint8), r.view(torch.uint8)
        else:  # fp32 scales / amaxes: every NaN alike
            ob, rb = (torch.where(torch.isnan(t), torch.full_like(t.view(torch.int32), -1), t.view(torch.int32))
                      for t in (o, r))
        bad = ob != rb
        assert not bad.any(), (f"{what}[{i}]: {int(bad.sum())} differ, "
                               f"e.g. {ob[bad][:4].tolist()} vs {rb[bad][:4].tolist()}")


@pytest.mark.cuda
def test_cuda_triton_quantize_equals_reference_on_nonfinite_inputs():
    from transformer_engine_proto.kernels.reference import blockwise as ref_bw
    from transformer_engine_proto.kernels.reference import float8 as ref_f8
    from transformer_engine_proto.kernels.reference import nvfp4 as ref_fp4
    from transformer_engine_proto.kernels.triton import blockwise as tri_bw
    from transformer_engine_proto.kernels.triton import float8 as tri_f8
    from transformer_engine_proto.kernels.triton import nvfp4 as tri_fp4

    usages = ((True, True), (True, False), (False, True))
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((132, 256), (130, 200), (3, 5, 96)):  # packed transpose (M % 4 == 0), byte transpose
            x = _poisoned(shape, dtype)
            _same_bits((tri_f8.amax(x),), (ref_f8.amax(x),), "amax")
            assert torch.isfinite(tri_f8.amax(x)).all()
            for fp8_dtype in (E4M3, E5M2):
                for usage in usages:
                    _same_bits(tri_f8.fp8_quantize_current(x, fp8_dtype, *usage),
                               ref_f8.fp8_quantize_current(x, fp8_dtype, *usage), f"current {shape} {fp8_dtype}")
                    scale = torch.tensor([2.0 ** 10], device="cuda")  # 3e38 * 2**10 overflows fp32
                    a_tri, a_ref = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
                    _same_bits(tri_f8.fp8_quantize_delayed(x, scale, a_tri, fp8_dtype, *usage) + (a_tri,),
                               ref_f8.fp8_quantize_delayed(x, scale, a_ref, fp8_dtype, *usage) + (a_ref,),
                               f"delayed {shape} {fp8_dtype}")
                    assert torch.isnan(a_tri).all()  # every value's amax: the NaN shows
                data = tri_f8.fp8_quantize_current(x, fp8_dtype, True, False)[0].view(torch.uint8).reshape(-1)
                flat = x.float().reshape(-1)
                for v, byte in zip((INF, -INF), NONFINITE_BYTES[fp8_dtype][:2]):
                    assert (data[flat == v] == byte).all()
                assert ((data[torch.isnan(flat)] & 0x7F) == 0x7F).all()
                for dim in (1, 2):
                    for usage in usages:
                        for power_2 in (True, False):
                            _same_bits(tri_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage, power_2),
                                       ref_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage, power_2),
                                       f"blockwise {dim} {shape} {fp8_dtype}")
        x = _poisoned((144, 256), dtype)
        for mode in (dict(), dict(two_d=True), dict(rht=True, rht_seed=3)):
            out = tri_fp4.nvfp4_quantize(x, True, True, **mode)
            _same_bits(out, ref_fp4.nvfp4_quantize(x, True, True, **mode), f"nvfp4 {mode}")
            assert torch.isfinite(out[4]).all() and torch.isnan(out[1].float()).any()


@pytest.mark.cuda
def test_cuda_fused_norm_quantize_takes_the_finite_amax():
    from transformer_engine_proto.kernels.reference import float8 as ref_f8
    from transformer_engine_proto.kernels.triton import norm as tri_norm

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    x[5, 9] = INF  # its row normalizes to NaN
    w = torch.rand(256, device="cuda", dtype=torch.bfloat16) + 0.5
    out = tri_norm.norm_fp8_current_quantize(x, w, None, 1e-5, "RMSNorm", False, E4M3, True, True)
    y = out[0]
    assert torch.isnan(y[5]).any() and torch.isfinite(out[6]).all()
    _same_bits(out[3:], ref_f8.fp8_quantize_current(y, E4M3, True, True), "norm + current")


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [R.DelayedScaling(), R.Float8CurrentScaling(), R.Float8BlockScaling(),
                                    R.NVFP4BlockScaling()], ids=lambda r: type(r).__name__)
def test_cuda_linear_keeps_nonfinite_outputs_and_clean_rows(recipe):
    torch.manual_seed(0)
    model = te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda")
    x = (torch.randn(256, 256, device="cuda") * 1e-2).to(torch.bfloat16)
    err = _forward_with_inf_in_row_3(model, x, recipe)
    if not isinstance(recipe, R.DelayedScaling):  # a delayed scale does not come from this tensor
        assert err < (0.25 if isinstance(recipe, R.NVFP4BlockScaling) else 0.1)
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _backward_with_inf_in_grad(model, x, recipe)
