"""Triton NVFP4 quantize / dequantize and MXFP8 dequantize against the reference, BITWISE.

Every output must equal the reference's: shapes, strides, dtypes and bits (1-byte buffers as
uint8; fp32 / bf16 / fp16 as their integer bits, any NaN equal to any NaN). Two halves:
- `cuda`-marked tests run the kernels on the GPU (qa/L1_gpu.sh); skipped without one;
- `interp` tests run the same checks on small shapes under Triton's CPU interpreter, skipped
  unless TRITON_INTERPRET=1 is set for the whole pytest process, e.g.
  TRITON_INTERPRET=1 python -m pytest tests/test_triton_nvfp4.py
  (there the kernels use the exact software fp8 cast / decode and bf16 rounding, SOFT).
"""
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from test_triton_kernels import make_input  # noqa: E402

from transformer_engine_proto.kernels import kernel, set_backend  # noqa: E402
from transformer_engine_proto.kernels.reference import mxfp8 as ref_mx  # noqa: E402
from transformer_engine_proto.kernels.reference import nvfp4 as ref_fp4  # noqa: E402
from transformer_engine_proto.kernels.reference import nvfp4_to as ref_fp4_to  # noqa: E402
from transformer_engine_proto.kernels.triton import dequant as tri_dq  # noqa: E402
from transformer_engine_proto.kernels.triton import nvfp4 as tri_fp4  # noqa: E402
from transformer_engine_proto.kernels.triton._common import set_soft_cast  # noqa: E402

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
interp = pytest.mark.skipif(not INTERPRETING, reason="set TRITON_INTERPRET=1 to run Triton on CPU")
cuda = pytest.mark.cuda
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/Inf lanes

KINDS = ["normal", "zero_rows", "huge", "tiny", "denormal", "nan", "inf", "all_zero", "mixed"]
USAGES = [(True, True), (True, False), (False, True)]
MODES = {"1d": dict(), "2d": dict(two_d=True), "rht": dict(rht=True, rht_seed=7)}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SEEDS_RHT = [0, 7, 12345]


# ---- helpers ---------------------------------------------------------------------------------
def _bits(t):
    if t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    ib = {8: torch.int64, 4: torch.int32, 2: torch.int16}[t.dtype.itemsize]
    b = t.view(ib)
    return torch.where(torch.isnan(t), torch.full_like(b, -1), b)


def assert_same(out, ref, what=""):
    """Tuples (or single tensors) equal in layout and bits."""
    if isinstance(ref, torch.Tensor) or ref is None:
        out, ref = (out,), (ref,)
    assert len(out) == len(ref), what
    for i, (o, r) in enumerate(zip(out, ref)):
        w = f"{what}[{i}]"
        if r is None:
            assert o is None, w
            continue
        assert o is not None, w
        assert (o.shape, o.dtype, o.stride(), o.device) == (r.shape, r.dtype, r.stride(), r.device), (
            w, (o.shape, o.dtype, o.stride()), (r.shape, r.dtype, r.stride()))
        bad = _bits(o) != _bits(r)
        if bad.any():
            raise AssertionError(f"{w}: {int(bad.sum())} of {bad.numel()} differ, e.g. at "
                                 f"{bad.nonzero()[:5].tolist()}: {o[bad][:5].tolist()} vs {r[bad][:5].tolist()}")


def _row_bufs(q):
    return q[0], q[1], q[4], None, None, None


def _col_bufs(q):
    return None, None, None, q[2], q[3], q[5]


def check_nvfp4(x, usage, mode, out_dtypes=(torch.float32, torch.bfloat16), **extra):
    """Quantize with both backends; then dequantize the reference's buffers with both."""
    opts = dict(MODES[mode], **extra)
    ref = ref_fp4.nvfp4_quantize(x, *usage, **opts)
    assert_same(tri_fp4.nvfp4_quantize(x, *usage, **opts), ref, f"quantize {mode} {usage}")
    rht, seed = opts.get("rht", False), opts.get("rht_seed", 0)
    for bufs, which in ((_row_bufs(ref), usage[0]), (_col_bufs(ref), usage[1])):
        if not which:
            continue
        want = ref_fp4.nvfp4_dequantize(*bufs, rht, seed)
        assert_same(tri_fp4.nvfp4_dequantize(*bufs, rht, seed), want, f"dequantize {mode}")
        for dt in out_dtypes:
            assert_same(tri_fp4.nvfp4_dequantize_to(*bufs, rht, seed, dt), want.to(dt), f"dequantize_to {dt}")
    return ref


def check_mxfp8_dequant(x, fp8_dtype, out_dtypes=OUT_DTYPES):
    m = x.numel() // x.shape[-1]
    rowwise, columnwise = x.shape[-1] % 32 == 0, m % 32 == 0
    q = ref_mx.mxfp8_quantize(x, fp8_dtype, rowwise, columnwise)
    for data, scale, col in ((q[0], q[1], False), (q[2], q[3], True)):
        if data is None:
            continue
        for dt in out_dtypes:
            assert_same(tri_dq.mxfp8_dequantize(data, scale, col, dt),
                        ref_mx.mxfp8_dequantize(data, scale, col, dt), f"mxfp8 {fp8_dtype} col={col} {dt}")


def every_code_buffers(device, amax_value):
    """Packed data holding every byte under every e4m3 scale byte (NaN and negative included)."""
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1)  # (256, 256): C = 512
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 32)
    amax = torch.tensor([amax_value], dtype=torch.float32)
    return data.to(device), scale.view(torch.float8_e4m3fn).to(device), amax.to(device)


# 8.09e-33: S_enc ~ 2**118, where S_dec / S_enc crosses 2**-125 (per-block fast / exact dequantize)
AMAXES = [0.0, 1.0, 2688.0, 1e-30, 8.09e-33, 3e-41, 3.4e38, float("inf"), float("nan"), 123.456]


def check_every_code(device, amax_value, out_dtypes):
    data, scale, amax = every_code_buffers(device, amax_value)
    for bufs in ((data, scale, amax, None, None, None), (None, None, None, data, scale, amax)):
        for rht in ((False, True) if bufs[0] is None else (False,)):
            want = ref_fp4.nvfp4_dequantize(*bufs, rht, 3)
            assert_same(tri_fp4.nvfp4_dequantize(*bufs, rht, 3), want, f"every code amax={amax_value}")
            for dt in out_dtypes:
                assert_same(tri_fp4.nvfp4_dequantize_to(*bufs, rht, 3, dt), want.to(dt), f"every code {dt}")


def finite_bf16_sweep(device):
    """All bf16 values with |x| in [2**-20, 2**20), both signs: (80, 128), one binade per row."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    a = x.float().abs()
    return x[(a >= 2.0**-20) & (a < 2.0**20)].reshape(-1, 128).to(device)


def fallback_cases(device):
    """(callable, args) pairs the Triton kernels hand to the reference (odd shapes, dtypes)."""
    x = make_input((48, 64), "normal", device=device)
    q = ref_fp4.nvfp4_quantize(x, True, True)
    mq = ref_mx.mxfp8_quantize(make_input((64, 64), "normal", device=device), torch.float8_e4m3fn, True, True)
    return [
        ("nvfp4_quantize", (x.double(), True, True)),
        ("nvfp4_quantize", (x[:, :0], False, True)),
        ("nvfp4_quantize", (x, False, False)),
        ("nvfp4_quantize", (make_input((17, 40), "normal", device=device), False, False, True)),
        ("nvfp4_dequantize", (q[0][:, :4], q[1][:, :1], q[4], None, None, None)),  # C = 8
        ("nvfp4_dequantize", (q[0].t().contiguous().t(), q[1], q[4], None, None, None)),
        ("nvfp4_dequantize_to", (*_row_bufs(q), False, 0, torch.float64)),
        ("mxfp8_dequantize", (mq[0], mq[1], False, torch.float64)),
        ("mxfp8_dequantize", (mq[0][:, :0], mq[1][:, :0], False, torch.bfloat16)),
        ("mxfp8_dequantize", (mq[0].t(), mq[1], False, torch.float32)),
    ]


_REF = {"nvfp4_quantize": ref_fp4.nvfp4_quantize, "nvfp4_dequantize": ref_fp4.nvfp4_dequantize,
        "nvfp4_dequantize_to": ref_fp4_to.nvfp4_dequantize_to, "mxfp8_dequantize": ref_mx.mxfp8_dequantize}
_TRI = {"nvfp4_quantize": tri_fp4.nvfp4_quantize, "nvfp4_dequantize": tri_fp4.nvfp4_dequantize,
        "nvfp4_dequantize_to": tri_fp4.nvfp4_dequantize_to, "mxfp8_dequantize": tri_dq.mxfp8_dequantize}


def check_fallbacks(device):
    for name, args in fallback_cases(device):
        try:
            want = _REF[name](*args)
        except Exception as e:  # the same error from both
            with pytest.raises(type(e)):
                _TRI[name](*args)
            continue
        got = _TRI[name](*args)
        assert_same(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,), name)


ALT_CONFIGS = [
    ("cast", dict(G=1, NB=1, num_warps=1)), ("cast", dict(G=2, NB=8, num_warps=4)),
    ("amax_rht", dict(G=1, BK=16, num_warps=1)), ("amax", dict(BLOCK=256, num_warps=2)),
    ("dequant_rowwise", dict(BR=4, NB=1, num_warps=1)), ("dequant_rowwise", dict(BR=64, NB=4, num_warps=8)),
    ("dequant_columnwise", dict(BR=16, G=1, num_warps=1)), ("dequant_columnwise", dict(BR=32, G=8, num_warps=8)),
]
MX_ALT_CONFIGS = [
    ("mxfp8_rowwise", dict(BM=4, NB=1, num_warps=1)), ("mxfp8_rowwise", dict(BM=64, NB=8, num_warps=8)),
    ("mxfp8_columnwise", dict(MB=2, BK=32, num_warps=4)), ("mxfp8_columnwise", dict(MB=1, BK=256, num_warps=8)),
]


def run_alt_config(key, cfg, device, monkeypatch):
    monkeypatch.setitem(tri_fp4.CONFIG, key, cfg)
    x = make_input((32, 48) if device == "cpu" else (272, 400), "mixed", device=device)
    for mode in MODES:
        check_nvfp4(x, (True, True), mode)


# ---- CPU: the reference variant exists everywhere ---------------------------------------------
def test_dequantize_to_reference_on_cpu():
    x = make_input((32, 48), "mixed", device="cpu")
    q = ref_fp4.nvfp4_quantize(x, True, True, rht=True, rht_seed=5)
    f = kernel("nvfp4_dequantize_to", "cpu")
    assert f is ref_fp4_to.nvfp4_dequantize_to
    for bufs in (_row_bufs(q), _col_bufs(q)):
        assert_same(f(*bufs, True, 5, torch.bfloat16), ref_fp4.nvfp4_dequantize(*bufs, True, 5).to(torch.bfloat16))


# ---- interpreter (CPU) ------------------------------------------------------------------------
@interp
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
def test_interp_nvfp4(kind, mode):
    check_nvfp4(make_input((48, 80), kind, device="cpu"), (True, True), mode)


def valid_for_mode(cases):
    """(mode, *case) pairs, leaving out 2D blocks on a K that 16 does not divide (the quantizer
    rejects those; tests/test_nvfp4.py checks the error)."""
    return [(mode, *c) for mode in MODES for c in cases if not (mode == "2d" and c[0][-1] % 16)]


@interp
@pytest.mark.parametrize("mode,shape,usage,dtype", valid_for_mode([
    ((16, 16), (True, True), torch.float32), ((2, 16, 32), (True, True), torch.float16),
    ((17, 32), (True, False), torch.bfloat16), ((32, 5), (False, True), torch.bfloat16),
    ((1, 16), (True, False), torch.float32), ((64, 48), (False, True), torch.float32),
]), ids=str)
def test_interp_nvfp4_shapes(shape, usage, dtype, mode):
    check_nvfp4(make_input(shape, "mixed", dtype, seed=1, device="cpu"), usage, mode, out_dtypes=OUT_DTYPES)


@interp
@pytest.mark.parametrize("mode", list(MODES))
def test_interp_nvfp4_stochastic(mode):
    x = make_input((32, 48), "mixed", seed=2, device="cpu")
    g = torch.Generator().manual_seed(3)
    rand, rand_c = torch.rand(32, 48, generator=g), torch.rand(48, 32, generator=g).double()
    check_nvfp4(x, (True, True), mode, stochastic=True, rand=rand, rand_columnwise=rand_c)
    torch.manual_seed(11)  # no draws given: both backends draw the same ones from the same state
    ref = ref_fp4.nvfp4_quantize(x, True, True, stochastic=True, **MODES[mode])
    torch.manual_seed(11)
    assert_same(tri_fp4.nvfp4_quantize(x, True, True, stochastic=True, **MODES[mode]), ref, "drawn")


@interp
@pytest.mark.parametrize("mode", ["1d", "2d"])
def test_interp_nvfp4_given_amax(mode):
    x = make_input((48, 64), "mixed", seed=4, device="cpu")
    for amax in (x.float().abs().amax().reshape(1), torch.tensor([3.0e4]), torch.tensor([1e-30])):
        check_nvfp4(x, (True, True), mode, amax=amax)


@interp
@pytest.mark.parametrize("seed", SEEDS_RHT)
def test_interp_rht_seeds(seed):
    check_nvfp4(make_input((32, 16), "normal", seed=seed, device="cpu"), (True, True), "rht", rht_seed=seed)


@interp
def test_interp_every_bf16_value():
    check_nvfp4(finite_bf16_sweep("cpu"), (True, True), "1d", out_dtypes=())


@interp
@pytest.mark.parametrize("amax", AMAXES)
def test_interp_every_code(amax, monkeypatch):
    # few programs per call (the interpreter's cost is per program, not per element), yet tiles
    # small enough that some take the per-block fast path and some not, for amax 8.09e-33
    monkeypatch.setitem(tri_fp4.CONFIG, "dequant_rowwise", dict(BR=64, NB=32, num_warps=4))
    monkeypatch.setitem(tri_fp4.CONFIG, "dequant_columnwise", dict(BR=64, G=32, num_warps=4))
    check_every_code("cpu", amax, (torch.bfloat16,))


@interp
@pytest.mark.parametrize("kind", KINDS)
def test_interp_mxfp8_dequantize(kind):
    for shape in ((64, 96), (2, 32, 64), (17, 32)):
        for fp8_dtype in FP8:
            check_mxfp8_dequant(make_input(shape, kind, torch.float32, device="cpu"), fp8_dtype)


@interp
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_interp_mxfp8_every_byte_and_scale(fp8_dtype):
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1).view(fp8_dtype)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8).view(torch.float8_e8m0fnu)
    for dt in OUT_DTYPES:
        assert_same(tri_dq.mxfp8_dequantize(data, scale, False, dt), ref_mx.mxfp8_dequantize(data, scale, False, dt))
        dt_, st = data.t().contiguous(), scale.view(torch.uint8).t().contiguous().view(torch.float8_e8m0fnu)
        assert_same(tri_dq.mxfp8_dequantize(dt_, st[:8], True, dt), ref_mx.mxfp8_dequantize(dt_, st[:8], True, dt))


@interp
def test_interp_fallbacks():
    check_fallbacks("cpu")


@interp
@pytest.mark.parametrize("key,cfg", ALT_CONFIGS, ids=str)
def test_interp_alternative_configs(key, cfg, monkeypatch):
    run_alt_config(key, cfg, "cpu", monkeypatch)


@interp
@pytest.mark.parametrize("key,cfg", MX_ALT_CONFIGS, ids=str)
def test_interp_mxfp8_alternative_configs(key, cfg, monkeypatch):
    monkeypatch.setitem(tri_dq.CONFIG, key, cfg)
    check_mxfp8_dequant(make_input((64, 96), "mixed", torch.float32, device="cpu"), torch.float8_e4m3fn)


# ---- GPU ----------------------------------------------------------------------------------------
GPU_SHAPES = [(16, 16), (48, 80), (2, 64, 96), (256, 384), (1040, 2064)]
LARGE = [((4096, 4096), "normal"), ((4096, 4096), "mixed"), ((8192, 1024), "nan")]


@cuda
def test_dispatcher_picks_triton_on_cuda(monkeypatch):
    set_backend("triton")
    assert kernel("nvfp4_quantize", "cuda") is tri_fp4.nvfp4_quantize
    assert kernel("nvfp4_dequantize", "cuda") is tri_fp4.nvfp4_dequantize
    assert kernel("nvfp4_dequantize_to", "cuda") is tri_fp4.nvfp4_dequantize_to
    assert kernel("mxfp8_dequantize", "cuda") is tri_dq.mxfp8_dequantize
    assert kernel("nvfp4_quantize", "cpu") is ref_fp4.nvfp4_quantize


@cuda
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
def test_nvfp4(shape, kind, mode):
    x = make_input(shape, kind)
    for usage in USAGES:
        check_nvfp4(x, usage, mode, out_dtypes=OUT_DTYPES)


@cuda
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape,kind", LARGE, ids=str)
def test_nvfp4_large(shape, kind, mode):
    check_nvfp4(make_input(shape, kind), (True, True), mode)


@cuda
@pytest.mark.parametrize("mode,shape,usage", valid_for_mode([
    ((17, 32), (True, False)), ((32, 5), (False, True)), ((1, 16), (True, False)), ((96, 40), (False, True))]),
    ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_nvfp4_one_usage_odd_other_dim(shape, usage, dtype, mode):
    check_nvfp4(make_input(shape, "mixed", dtype), usage, mode)


@cuda
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", [(64, 96), (512, 1024)], ids=str)
def test_nvfp4_stochastic(shape, mode):
    x = make_input(shape, "mixed", seed=2)
    m, k = shape
    check_nvfp4(x, (True, True), mode, stochastic=True, rand=torch.rand(m, k, device="cuda"),
                rand_columnwise=torch.rand(k, m, device="cuda"))
    torch.manual_seed(11)
    ref = ref_fp4.nvfp4_quantize(x, True, True, stochastic=True, **MODES[mode])
    torch.manual_seed(11)
    assert_same(tri_fp4.nvfp4_quantize(x, True, True, stochastic=True, **MODES[mode]), ref, "drawn")


@cuda
@pytest.mark.parametrize("seed", SEEDS_RHT)
def test_rht_seeds(seed):
    check_nvfp4(make_input((256, 128), "normal", seed=seed), (True, True), "rht", rht_seed=seed)


@cuda
@pytest.mark.parametrize("soft", [False, True])
def test_every_bf16_value(soft, monkeypatch):
    if soft:
        set_soft_cast(True)  # conftest puts it back after the test
    x = finite_bf16_sweep("cuda")
    for mode in MODES:
        check_nvfp4(x, (True, True), mode)


@cuda
@pytest.mark.parametrize("mode", ["1d", "2d"])
def test_nvfp4_given_amax(mode):
    x = make_input((1056, 2080), "mixed", seed=4)
    for amax in (x.float().abs().amax().reshape(1), torch.tensor([3.0e4], device="cuda"),
                 torch.tensor([1e-30], device="cuda")):
        check_nvfp4(x, (True, True), mode, amax=amax)


@cuda
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("amax", AMAXES)
def test_every_code(amax, soft, monkeypatch):
    if soft:
        set_soft_cast(True)  # conftest puts it back after the test
    check_every_code("cuda", amax, OUT_DTYPES)


@cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(32, 32), (64, 96), (2, 48, 64), (17, 64), (96, 40), (1056, 2080)], ids=str)
def test_mxfp8_dequantize(shape, kind):
    for dtype in (torch.bfloat16, torch.float32):
        for fp8_dtype in FP8:
            check_mxfp8_dequant(make_input(shape, kind, dtype), fp8_dtype)


@cuda
@pytest.mark.parametrize("shape,kind", LARGE, ids=str)
def test_mxfp8_dequantize_large(shape, kind):
    check_mxfp8_dequant(make_input(shape, kind), torch.float8_e4m3fn)


@cuda
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8)
def test_mxfp8_every_byte_and_scale(fp8_dtype, soft, monkeypatch):
    if soft:
        set_soft_cast(True)  # conftest puts it back after the test
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(256, 1).cuda().view(fp8_dtype)
    scale = torch.arange(256, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8).cuda()
    for dt in OUT_DTYPES:
        s = scale.view(torch.float8_e8m0fnu)
        assert_same(tri_dq.mxfp8_dequantize(data, s, False, dt), ref_mx.mxfp8_dequantize(data, s, False, dt))
        dt_, st = data.t().contiguous(), scale.t().contiguous()[:8].view(torch.float8_e8m0fnu)
        assert_same(tri_dq.mxfp8_dequantize(dt_, st, True, dt), ref_mx.mxfp8_dequantize(dt_, st, True, dt))


@cuda
def test_fallbacks():
    check_fallbacks("cuda")


@cuda
@pytest.mark.parametrize("key,cfg", ALT_CONFIGS, ids=str)
def test_alternative_configs(key, cfg, monkeypatch):
    run_alt_config(key, cfg, "cuda", monkeypatch)


@cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_nvfp4_under_cuda_graph(mode):
    """No host sync: quantize + dequantize capture into a CUDA graph and replay on new data."""
    x = make_input((256, 512), "normal")

    def step():
        q = tri_fp4.nvfp4_quantize(x, True, True, **MODES[mode])
        return q, tri_fp4.nvfp4_dequantize_to(*_col_bufs(q), mode == "rht", 7, torch.bfloat16)

    step()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, v = step()
    x.copy_(make_input((256, 512), "mixed", seed=5))
    g.replay()
    torch.cuda.synchronize()
    ref = ref_fp4.nvfp4_quantize(x, True, True, **MODES[mode])
    assert_same(q, ref, "graph")
    assert_same(v, ref_fp4.nvfp4_dequantize(*_col_bufs(ref), mode == "rht", 7).to(torch.bfloat16), "graph dq")
