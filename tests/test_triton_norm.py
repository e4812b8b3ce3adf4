"""LayerNorm / RMSNorm kernels: Triton against the pure-torch reference (the spec).

The Triton kernels reduce the row sums in another order than torch, so they are not bitwise the
reference. The bar: |out - ref| <= TOL * eps(dtype) * scale, where `scale` is the magnitude of the
terms the output is computed from (e.g. (|x| + mean|x|) * rsigma * |gamma| + |beta| for y; it is
>= |ref|, and is what a one-ulp change of mu or rsigma moves the output by). TOL is 1 for bf16 /
fp16 (at most one ulp of the output dtype) and a few for fp32 outputs (where the statistics' own
one- or two-ulp differences show). The amax of the fused forward, and the fused current-scaling
buffers, are compared BITWISE with the amax / quantize of the kernel's own y.

Three parts:
- CPU (always): argument checks, and the current-scaling helper of custom_ops/norm.py equal to
  `quantizer.quantize(y)` buffer for buffer;
- `interp`: the Triton kernels under Triton's CPU interpreter on small shapes, skipped unless
  TRITON_INTERPRET=1 is set for the whole pytest process, e.g.
  TRITON_INTERPRET=1 python -m pytest tests/test_triton_norm.py
- `cuda`: the same checks at transformer shapes on the GPU (qa/L1_gpu.sh).
"""
import os

import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import kernels as K
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import norm as ops_norm
from transformer_engine_proto.kernels import kernel
from transformer_engine_proto.kernels.reference import float8 as ref_f8
from transformer_engine_proto.kernels.reference import norm as ref
from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interp = pytest.mark.skipif(not INTERPRETING, reason="set TRITON_INTERPRET=1 to run Triton on CPU")
cuda = pytest.mark.cuda
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/Inf lanes

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
USAGES = [(True, True), (True, False), (False, True)]
TOL = {torch.float32: 4.0, torch.bfloat16: 1.0, torch.float16: 1.0}  # y, dx
TOL_SUM = {torch.float32: 8.0, torch.bfloat16: 1.0, torch.float16: 1.0}  # dgamma, dbeta: sums over M
# (kind, with bias): LayerNorm with and without beta, RMSNorm
VARIANTS = [("LayerNorm", True), ("LayerNorm", False), ("RMSNorm", False)]


def tri():
    from transformer_engine_proto.kernels.triton import norm as tri_norm
    return tri_norm


# ---- helpers ---------------------------------------------------------------------------------
def make_case(shape, dtype, kind, with_bias, zero_centered, seed=0, device="cpu", w_dtype=None,
              offset=0.5):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = torch.randn(shape, generator=g) * 3 + offset
    w = torch.randn(k, generator=g) * (0.1 if zero_centered else 1.0)
    b = torch.randn(k, generator=g) if with_bias else None
    dy = torch.randn(shape, generator=g)
    w_dtype = w_dtype or dtype
    return (x.to(device, dtype), w.to(device, w_dtype), None if b is None else b.to(device, w_dtype),
            dy.to(device, dtype))


def _bits(t):
    ib = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize]
    b = t.view(ib)
    return torch.where(torch.isnan(t), torch.full_like(b, -1), b) if t.is_floating_point() else b


def assert_bitwise(out, want, what=""):
    for i, (o, r) in enumerate(zip(out, want)):
        if r is None:
            assert o is None, (what, i)
            continue
        assert (o.shape, o.dtype, o.stride()) == (r.shape, r.dtype, r.stride()), (what, i)
        bad = _bits(o.cpu()) != _bits(r.cpu())
        assert not bad.any(), f"{what}[{i}]: {int(bad.sum())} of {bad.numel()} differ"


def err_ratio(out, want, scale):
    """max |out - want| / (eps(out.dtype) * scale); NaN / Inf positions must agree."""
    o, w = out.double().cpu(), want.double().cpu()
    assert torch.equal(o.isnan(), w.isnan()) and torch.equal(o.isinf(), w.isinf())
    ok = torch.isfinite(w)
    eps = torch.finfo(out.dtype).eps
    return ((o - w).abs()[ok] / (eps * scale.cpu()[ok])).max().item() if ok.any() else 0.0


def scales(x, w, b, zero_centered, mu, rsigma, dy):
    """Term magnitudes of y, dx, dgamma, dbeta (float64, on the CPU)."""
    x, w, dy = x.double().cpu(), w.double().cpu(), dy.double().cpu()
    mu, rs = mu.double().cpu()[..., None], rsigma.double().cpu()[..., None]
    g = (w + 1 if zero_centered else w).abs()
    # magnitude of the terms of xhat: mu's rounding error scales with the mean of |x|, not with |mu|
    xs = (x.abs() + x.abs().mean(-1, keepdim=True)) * rs
    sy = xs * g + (b.double().cpu().abs() if b is not None else 0)
    dxhat = dy.abs() * g
    sdx = (dxhat + dxhat.mean(-1, keepdim=True) + xs * (dxhat * xs).mean(-1, keepdim=True)) * rs
    dims = tuple(range(x.dim() - 1))
    return sy, sdx, (dy.abs() * xs).sum(dims), dy.abs().sum(dims)


def check_norm(x, w, b, dy, kind, zc, eps=1e-5):
    """Triton fwd (with amax) and bwd against the CPU reference; returns the worst error ratios."""
    t = tri()
    y, mu, rs, amax = t.norm_fwd_amax(x, w, b, eps, kind, zc)
    xc, wc, bc = x.cpu(), w.cpu(), None if b is None else b.cpu()
    y_r, mu_r, rs_r = ref.norm_fwd(xc, wc, bc, eps, kind, zc)
    assert (y.shape, y.dtype, mu.shape, mu.dtype, rs.dtype) == (y_r.shape, y_r.dtype, mu_r.shape, mu_r.dtype,
                                                                 rs_r.dtype)
    assert_bitwise((amax,), (ref_f8.amax(y),), "amax of the kernel's own y")
    assert_bitwise(t.norm_fwd(x, w, b, eps, kind, zc), (y, mu, rs), "norm_fwd == norm_fwd_amax[:3]")
    sy, sdx, sdw, sdb = scales(xc, wc, bc, zc, mu_r, rs_r, dy)
    worst = {"y": err_ratio(y, y_r, sy), "mu": err_ratio(mu, mu_r, xc.double().abs().mean(-1)),
             "rsigma": err_ratio(rs, rs_r, rs_r.double())}
    # backward from the reference's statistics, so only the kernel's own sums differ
    grads = t.norm_bwd(dy, x, mu_r.to(x.device), rs_r.to(x.device), w, kind, zc, b is not None)
    grads_r = ref.norm_bwd(dy.cpu(), xc, mu_r, rs_r, wc, kind, zc, b is not None)
    assert len(grads) == len(grads_r)
    for name, o, r, s in zip(("dx", "dgamma", "dbeta"), grads, grads_r, (sdx, sdw, sdb)):
        assert (o.shape, o.dtype) == (r.shape, r.dtype), name
        worst[name] = err_ratio(o, r, s)
    for name, v in worst.items():
        if name in ("mu", "rsigma"):
            tol = TOL[torch.float32]
        elif name in ("dgamma", "dbeta"):
            tol = TOL_SUM[w.dtype]
        else:
            tol = TOL[x.dtype]
        assert v <= tol, f"{name}: error {v:.3f} x eps * scale > {tol} ({x.dtype}, {kind}, zc={zc})"
    return worst


def check_fused_current(x, w, b, kind, zc, fp8_dtype, usage, margin=0, power_2=False, epsilon=0.0):
    """The fused norm + current scaling == the kernel's own y quantized by the reference (and by
    the unfused Triton quantize), bitwise."""
    from transformer_engine_proto.kernels.triton import float8 as tri_f8

    out = tri().norm_fp8_current_quantize(x, w, b, 1e-5, kind, zc, fp8_dtype, *usage, margin, power_2, epsilon)
    y = out[0]
    y_own, _, _ = tri().norm_fwd(x, w, b, 1e-5, kind, zc)
    assert_bitwise((y,), (y_own,), "y")
    y2d = y.reshape(-1, y.shape[-1])
    want = ref_f8.fp8_quantize_current(y2d.cpu(), fp8_dtype, *usage, margin, power_2, epsilon)
    assert_bitwise(out[3:], want, f"fused vs reference quantize {fp8_dtype} {usage}")
    assert_bitwise(out[3:], tri_f8.fp8_quantize_current(y2d, fp8_dtype, *usage, margin, power_2, epsilon),
                   "fused vs triton quantize")


def check_helper_buffers(x, w, b, kind, q):
    """custom_ops/norm.py's fused helper: the buffers `q.quantize(y)` holds, same names and order."""
    y, mu, rs, bufs = ops_norm.norm_fp8_current(x, w, b, 1e-5, kind, False, q)
    want = q.quantize(y.reshape(-1, y.shape[-1])).get_buffers()
    assert len(bufs) == len(want)
    assert_bitwise(bufs, list(want.values()), f"helper {q}")


# ---- CPU: argument checks and the helper on the reference ----------------------------------------
def test_reference_rejects_bad_input():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="normalization"):
        ref.norm_fwd(x, w, None, 1e-5, "BatchNorm", False)
    with pytest.raises(ValueError, match="dtype"):
        ref.norm_fwd(x.double(), w, None, 1e-5, "LayerNorm", False)
    with pytest.raises(ValueError, match="dtype"):
        ref.norm_fwd(x, w.to(torch.int32), None, 1e-5, "LayerNorm", False)
    with pytest.raises(ValueError, match=r"\(8,\)"):
        ref.norm_fwd(x, torch.randn(7), None, 1e-5, "LayerNorm", False)
    with pytest.raises(ValueError, match="RMSNorm has no bias"):
        ref.norm_fwd(x, w, w, 1e-5, "RMSNorm", False)
    with pytest.raises(ValueError, match="normalization"):
        ops_norm.norm_fwd(x, w, None, 1e-5, "Foo", False)


def test_dispatcher_names():
    assert kernel("norm_fwd", "cpu") is ref.norm_fwd
    assert kernel("norm_bwd", "cpu") is ref.norm_bwd
    assert kernel("norm_fwd_amax", "cpu") is ref.norm_fwd_amax
    assert kernel("norm_fp8_current_quantize", "cpu") is ref.norm_fp8_current_quantize
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    for name in ("norm_fwd", "norm_bwd", "norm_fwd_amax", "norm_fp8_current_quantize"):
        assert K.available_backends(name) == ["reference", "triton"], name


@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_helper_buffers_equal_quantize_reference(usage, fp8_dtype):
    x, w, b, _ = make_case((3, 5, 64), torch.bfloat16, "LayerNorm", True, False)
    for opts in (dict(), dict(margin=1, force_pow_2_scales=True, amax_epsilon=1e-3)):
        q = Float8CurrentScalingQuantizer(fp8_dtype=fp8_dtype, rowwise_usage=usage[0],
                                          columnwise_usage=usage[1], **opts)
        check_helper_buffers(x, w, b, "LayerNorm", q)


# ---- Triton under the interpreter --------------------------------------------------------------------
# K a power of two or not, a 3-D input (bf16 only: the layout logic is dtype-independent)
INTERP_SHAPES = [(s, d) for s in [(17, 48), (5, 300)] for d in (torch.bfloat16, torch.float32, torch.float16)]
INTERP_SHAPES += [((3, 5, 96), torch.bfloat16)]


@interp
@pytest.mark.parametrize("zc", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("kind,with_bias", VARIANTS, ids=["LN", "LN-nobias", "RMS"])
@pytest.mark.parametrize("shape,dtype", INTERP_SHAPES, ids=str)
def test_interp_norm(shape, dtype, kind, with_bias, zc):
    check_norm(*make_case(shape, dtype, kind, with_bias, zc), kind, zc)


@interp
@pytest.mark.parametrize("kind,with_bias", [("LayerNorm", True), ("RMSNorm", False)], ids=["LN", "RMS"])
def test_interp_k_larger_than_a_block(kind, with_bias):
    """K = 10000 > MAX_BLOCK (8192): the chunked loops, with the default configuration."""
    check_norm(*make_case((2, 10000), torch.bfloat16, kind, with_bias, False, offset=40.0), kind, False)


# chunked with 2 rows per tile; chunked with 1 row and several tiles per bwd program; several tiles
W = dict(WARP_ELEMS=1024)
ALT = [dict(fwd=dict(MAX_BLOCK=64, TILE=128, **W), bwd=dict(MAX_BLOCK=64, TILE=128, MAX_PROGRAMS=512, **W)),
       dict(fwd=dict(MAX_BLOCK=32, TILE=32, **W), bwd=dict(MAX_BLOCK=32, TILE=32, MAX_PROGRAMS=3, **W)),
       dict(fwd=dict(MAX_BLOCK=512, TILE=64, **W), bwd=dict(MAX_BLOCK=512, TILE=64, MAX_PROGRAMS=2, **W))]


@interp
@pytest.mark.parametrize("cfg", ALT, ids=["chunks-2rows", "chunks-1row-iters", "iters"])
def test_interp_alternative_configs(cfg, monkeypatch):
    for key, value in cfg.items():
        monkeypatch.setitem(tri().CONFIG, key, value)
    check_norm(*make_case((6, 100), torch.bfloat16, "LayerNorm", True, True, seed=1), "LayerNorm", True)
    check_norm(*make_case((3, 70), torch.float32, "RMSNorm", False, False, seed=2), "RMSNorm", False)


@interp
def test_interp_mixed_dtypes_and_special_rows():
    """fp32 params with a bf16 input; a constant row (var = 0) and a NaN row (NaN amax)."""
    x, w, b, dy = make_case((6, 96), torch.bfloat16, "LayerNorm", True, False, w_dtype=torch.float32)
    x[1] = 2.5
    check_norm(x, w, b, dy, "LayerNorm", False)
    x[4, 7] = float("nan")
    y, _, _, amax = tri().norm_fwd_amax(x, w, b, 1e-5, "LayerNorm", False)
    assert y[4].isnan().all() and not y[torch.arange(6) != 4].isnan().any()
    assert amax.item() == y[torch.arange(6) != 4].float().abs().max().item()  # the finite rows' amax
    with pytest.raises(ValueError, match="normalization"):
        tri().norm_fwd(x, w, b, 1e-5, "GroupNorm", False)
    with pytest.raises(ValueError, match="dtype"):
        tri().norm_bwd(dy, x.double(), x[:, 0].float(), x[:, 0].float(), w, "LayerNorm", False, True)


@interp
@pytest.mark.parametrize("usage", USAGES)
def test_interp_fused_current_scaling(usage):
    x, w, b, _ = make_case((33, 96), torch.bfloat16, "LayerNorm", True, False)
    for fp8_dtype in FP8:
        check_fused_current(x, w, b, "LayerNorm", False, fp8_dtype, usage)
    x, w, _, _ = make_case((2, 3, 80), torch.float32, "RMSNorm", False, True)
    check_fused_current(x, w, None, "RMSNorm", True, torch.float8_e4m3fn, usage, 2, True, 1e-3)


@interp
def test_interp_ops_path_is_the_unfused_path(monkeypatch):
    """With Triton as the CPU backend (what CUDA gets): the fused op's buffers equal the
    quantizer's on the Triton norm output, and LayerNormLinear matches LayerNorm -> Linear."""
    monkeypatch.setitem(K._PREFERENCE, "cpu", ("triton",))
    x, w, b, _ = make_case((32, 64), torch.bfloat16, "LayerNorm", True, False)
    q = Float8CurrentScalingQuantizer(rowwise_usage=True, columnwise_usage=True)
    check_helper_buffers(x, w, b, "LayerNorm", q)
    torch.manual_seed(0)
    fused = te.LayerNormLinear(64, 32, params_dtype=torch.bfloat16)
    norm, lin = te.LayerNorm(64, params_dtype=torch.bfloat16), te.Linear(64, 32, params_dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(fused.weight)
        lin.bias.copy_(fused.bias)
    with te.autocast(recipe=R.Float8CurrentScaling()):
        assert torch.equal(fused(x), lin(norm(x)))


# ---- GPU ----------------------------------------------------------------------------------------
# (shape, dtype, kind, with_bias, zero_centered): every variant on the smaller shapes, two at 4096^2
GPU_CASES = ([(shape, dtype, kind, with_bias, zc)
              for shape, dtype in [((2048, 1024), torch.bfloat16), ((64, 16384), torch.bfloat16),
                                   ((4, 3, 1000), torch.float32), ((512, 768), torch.float16)]
              for kind, with_bias in VARIANTS for zc in (False, True)]
             + [((4096, 4096), torch.bfloat16, "LayerNorm", True, False),
                ((4096, 4096), torch.bfloat16, "RMSNorm", False, True)])


@cuda
def test_cuda_dispatcher_picks_triton():
    for name in ("norm_fwd", "norm_bwd", "norm_fwd_amax", "norm_fp8_current_quantize"):
        assert kernel(name, "cuda") is getattr(tri(), name)


@cuda
@pytest.mark.parametrize("shape,dtype,kind,with_bias,zc", GPU_CASES, ids=str)
def test_cuda_norm(shape, dtype, kind, with_bias, zc):
    check_norm(*make_case(shape, dtype, kind, with_bias, zc, device="cuda"), kind, zc)


@cuda
@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("shape", [(2048, 1024), (4096, 4096), (3, 5, 96)], ids=str)
def test_cuda_fused_current_scaling(shape, usage):
    x, w, b, _ = make_case(shape, torch.bfloat16, "LayerNorm", True, False, device="cuda")
    for fp8_dtype in FP8:
        check_fused_current(x, w, b, "LayerNorm", False, fp8_dtype, usage)
    x, w, _, _ = make_case(shape, torch.bfloat16, "RMSNorm", False, True, device="cuda")
    check_fused_current(x, w, None, "RMSNorm", True, torch.float8_e4m3fn, usage, 1, True, 1e-6)
    q = Float8CurrentScalingQuantizer(rowwise_usage=usage[0], columnwise_usage=usage[1])
    check_helper_buffers(x, w, None, "RMSNorm", q)


@cuda
def test_cuda_layernorm_linear_fused_equals_unfused():
    torch.manual_seed(0)
    fused = te.LayerNormLinear(1024, 512, params_dtype=torch.bfloat16, device="cuda")
    norm = te.LayerNorm(1024, params_dtype=torch.bfloat16, device="cuda")
    lin = te.Linear(1024, 512, params_dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        lin.weight.copy_(fused.weight)
        lin.bias.copy_(fused.bias)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    with te.autocast(recipe=R.Float8CurrentScaling()):
        y, y2 = fused(x), lin(norm(x2))
    assert torch.equal(y, y2)
    y.float().square().sum().backward()
    y2.float().square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(fused.layer_norm_weight.grad, norm.weight.grad)


@cuda
def test_cuda_fused_under_cuda_graph():
    """No host sync: the fused norm + quantize captures into a CUDA graph and replays."""
    x, w, b, _ = make_case((256, 512), torch.bfloat16, "LayerNorm", True, False, device="cuda")
    args = (w, b, 1e-5, "LayerNorm", False, torch.float8_e4m3fn, True, True)
    tri().norm_fp8_current_quantize(x, *args)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = tri().norm_fp8_current_quantize(x, *args)
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(make_case((256, 512), torch.bfloat16, "LayerNorm", True, False, seed=5, device="cuda")[0] * 7)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, tri().norm_fp8_current_quantize(x, *args), "graph replay")
