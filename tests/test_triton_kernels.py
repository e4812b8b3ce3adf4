"""Triton quantize kernels (the CUDA fast path) against the pure-torch reference, BITWISE.

Every output buffer must equal the reference's: same shape, strides and dtype, and the same
bits (fp8 / e8m0 bytes compared as uint8; fp32 scales compared as int32 bits, where two NaNs
count as equal). Run on the GPU machine (qa/L1_gpu.sh); marked `cuda`, skipped without a GPU.
The interpreter (CPU) counterpart is tests/test_triton_interpret.py.
"""
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from transformer_engine_proto.kernels import kernel, set_backend  # noqa: E402
from transformer_engine_proto.kernels.reference import blockwise as ref_bw  # noqa: E402
from transformer_engine_proto.kernels.reference import float8 as ref_f8  # noqa: E402
from transformer_engine_proto.kernels.reference import mxfp8 as ref_mx  # noqa: E402
from transformer_engine_proto.kernels.triton import blockwise as tri_bw  # noqa: E402
from transformer_engine_proto.kernels.triton import float8 as tri_f8  # noqa: E402
from transformer_engine_proto.kernels.triton import mxfp8 as tri_mx  # noqa: E402
from transformer_engine_proto.kernels.triton._common import scale_from_amax, scale_reciprocal, set_soft_cast  # noqa: E402

pytestmark = pytest.mark.cuda

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
E4M3 = torch.float8_e4m3fn
USAGES = [(True, True), (True, False), (False, True)]
KINDS = ["normal", "zero_rows", "huge", "tiny", "denormal", "nan", "inf", "all_zero", "mixed"]
SHAPES = [(1, 16), (17, 48), (128, 128), (130, 300), (3, 5, 96), (4096, 4096)]
MX_SHAPES = [(32, 32), (64, 96), (96, 160), (2, 48, 64), (4096, 4096)]
BIG_KINDS = ("normal", "nan", "mixed")  # the large shape checks tiling at scale; the kinds, the small ones


def cases(shapes):
    """(shape, kind) pairs: every kind on the small shapes, BIG_KINDS on 4096x4096."""
    return [(s, k) for s in shapes for k in KINDS if s != (4096, 4096) or k in BIG_KINDS]


# ---- helpers ---------------------------------------------------------------------------------
def make_input(shape, kind, dtype=torch.bfloat16, seed=0, device="cuda"):
    # drawn on the target device: generating 4096x4096 inputs on the host dominated the GPU run
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
    x2 = x.reshape(-1, shape[-1])
    if kind == "zero_rows":
        x2[::3] = 0
    elif kind == "huge":
        x2.mul_(3e37)
    elif kind == "tiny":
        x2.mul_(1e-30)
    elif kind == "denormal":
        x2.mul_(1e-39)
    elif kind == "nan":
        x2.view(-1)[:: max(1, x2.numel() // 7)] = float("nan")
        x2.view(-1)[1] = -float("nan")
    elif kind == "inf":
        x2.view(-1)[:: max(1, x2.numel() // 5)] = float("inf")
        x2.view(-1)[-1] = -float("inf")
    elif kind == "all_zero":
        x2.zero_()
    elif kind == "mixed":  # magnitudes spread over many binades, exact powers of two, -0
        e = torch.randint(-40, 40, x2.shape, generator=g, device=device).float()
        x2.mul_(torch.exp2(e))
        x2.view(-1)[::11] = torch.exp2(
            torch.randint(-20, 20, x2.view(-1)[::11].shape, generator=g, device=device).float())
        x2.view(-1)[::13] = -0.0
    return x.to(dtype)


def _bits(t):
    if t.dtype.itemsize == 1:
        return t.view(torch.uint8)
    assert t.dtype == torch.float32, t.dtype
    b = t.view(torch.int32)
    return torch.where(torch.isnan(t), torch.full_like(b, 0x7FC00000), b)


def assert_bitwise(out, ref, name=""):
    assert len(out) == len(ref), name
    for i, (o, r) in enumerate(zip(out, ref)):
        what = f"{name}[{i}]"
        if r is None:
            assert o is None, what
            continue
        assert o is not None, what
        assert o.shape == r.shape, (what, o.shape, r.shape)
        assert o.dtype == r.dtype, (what, o.dtype, r.dtype)
        assert o.stride() == r.stride(), (what, o.stride(), r.stride())
        assert o.device == r.device, what
        ob, rb = _bits(o), _bits(r)
        bad = ob != rb
        if bad.any():
            idx = bad.nonzero()[:5].tolist()
            raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ, e.g. at {idx}: "
                                 f"{ob[bad][:5].tolist()} vs reference {rb[bad][:5].tolist()}")


def poison_like(ref):
    """Fill freed allocator blocks of the reference outputs' sizes with a poison byte, so that an
    element the kernel does not write shows up (the caching allocator reuses those blocks)."""
    blocks = [torch.full((r.untyped_storage().nbytes(),), 0xA5, dtype=torch.uint8, device="cuda")
              for r in ref if r is not None]
    del blocks


# ---- dispatcher --------------------------------------------------------------------------------
def test_dispatcher_picks_triton_on_cuda():
    assert kernel("amax", "cuda") is tri_f8.amax
    assert kernel("fp8_quantize_current", "cuda") is tri_f8.fp8_quantize_current
    assert kernel("fp8_quantize_delayed", "cuda") is tri_f8.fp8_quantize_delayed
    assert kernel("fp8_blockwise_quantize", "cuda") is tri_bw.fp8_blockwise_quantize
    assert kernel("mxfp8_quantize", "cuda") is tri_mx.mxfp8_quantize
    assert kernel("amax", "cpu") is ref_f8.amax


# ---- per-tensor FP8 ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,kind", cases(SHAPES), ids=str)
def test_amax(shape, kind):
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        x = make_input(shape, kind, dtype)
        assert_bitwise((tri_f8.amax(x),), (ref_f8.amax(x),), f"amax {dtype}")


@pytest.mark.parametrize("shape,kind", cases(SHAPES), ids=str)
def test_current_scaling(shape, kind):
    x = make_input(shape, kind)
    for fp8_dtype in FP8:
        for usage in USAGES:
            ref = ref_f8.fp8_quantize_current(x, fp8_dtype, *usage)
            poison_like(ref)
            assert_bitwise(tri_f8.fp8_quantize_current(x, fp8_dtype, *usage), ref,
                           f"current {fp8_dtype} {usage}")


@pytest.mark.parametrize("kind", ["normal", "tiny", "denormal", "huge", "nan", "mixed"])
@pytest.mark.parametrize("margin,power_2,epsilon", [(0, True, 0.0), (2, False, 0.0), (1, True, 1e-3),
                                                    (0, False, 1e-12), (-1, False, 0.0)])
@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_current_scaling_options(kind, margin, power_2, epsilon, fp8_dtype, dtype):
    x = make_input((67, 200), kind, dtype, seed=1)
    ref = ref_f8.fp8_quantize_current(x, fp8_dtype, True, True, margin, power_2, epsilon)
    out = tri_f8.fp8_quantize_current(x, fp8_dtype, True, True, margin, power_2, epsilon)
    assert_bitwise(out, ref, "current")


@pytest.mark.parametrize("options", [(0, False, 0.0), (1, True, 1e-3)], ids=str)
def test_current_scaling_existing_amax(options):
    check_existing_amax("cuda", [(256, 512), (130, 300), (3, 5, 96)], ["normal", "mixed", "nan"], options)


DELAYED_STATES = [(1.0, 0.0), (3.7, 0.5), (2.0**100, 1e30), (1e-30, 0.0),
                  (float(torch.finfo(torch.float32).max), 0.0)]


@pytest.mark.parametrize("shape,kind", cases(SHAPES), ids=str)
def test_delayed_scaling(shape, kind):
    x = make_input(shape, kind)
    for fp8_dtype in FP8:
        for usage in USAGES + [(False, False)]:
            for scale_value, amax_init in DELAYED_STATES:
                what = f"delayed {fp8_dtype} {usage} scale={scale_value} amax={amax_init}"
                scale = torch.tensor([scale_value], device="cuda")
                amax_ref = torch.tensor([amax_init], device="cuda")
                amax_tri = amax_ref.clone()
                ref = ref_f8.fp8_quantize_delayed(x, scale, amax_ref, fp8_dtype, *usage)
                poison_like(ref)
                out = tri_f8.fp8_quantize_delayed(x, scale, amax_tri, fp8_dtype, *usage)
                assert_bitwise(out, ref, what)
                assert_bitwise((amax_tri,), (amax_ref,), what + " amax_out")


def check_existing_amax(device, shapes, kinds, options=(0, False, 0.0)):
    """Current scaling given the tensor's amax, taken already (`existing_amax`): the bytes of a
    fresh pass, the same amax handed back, and the given buffer left as it was; a different amax
    gives a different scale (the one given is the one used)."""
    for shape, kind in zip(shapes, kinds):
        x = make_input(shape, kind, device=device)
        for fp8_dtype in FP8:
            for usage in USAGES:
                fresh = ref_f8.fp8_quantize_current(x, fp8_dtype, *usage, *options)
                given = fresh[3].clone()
                for call in ("first", "replayed"):  # on CUDA the second call replays the first's launch
                    out = tri_f8.fp8_quantize_current(x, fp8_dtype, *usage, *options, existing_amax=given)
                    assert_bitwise(out, fresh, f"existing amax {shape} {kind} {fp8_dtype} {usage} {call}")
                    assert torch.equal(given, fresh[3])
        if kind in ("normal", "mixed"):
            other = tri_f8.fp8_quantize_current(x, E4M3, True, False, *options, existing_amax=given * 4)
            assert not torch.equal(other[2], fresh[2])


def check_delayed_slots(device, shapes, kinds):
    """A slot of a (2,) scale / amax buffer (a GEMM's input and weight share one of each) quantizes
    as a one-element buffer holding that value does, bitwise, and the other element is left as it
    was; amax None takes no amax and gives the same bytes."""
    for shape, kind in zip(shapes, kinds):
        x = make_input(shape, kind, device=device)
        for usage in USAGES:
            for slot in (0, 1):
                scales = torch.tensor([0.37, 3.7], device=device)
                amaxes = torch.tensor([0.5, 2.0], device=device)
                one_amax = amaxes[slot:slot + 1].clone()
                ref = ref_f8.fp8_quantize_delayed(x, scales[slot:slot + 1].clone(), one_amax, E4M3, *usage)
                out = tri_f8.fp8_quantize_delayed(x, scales, amaxes, E4M3, *usage, slot)
                what = f"{shape} {kind} {usage} slot {slot}"
                assert_bitwise(out, ref, what)
                assert_bitwise((amaxes[slot:slot + 1],), (one_amax,), what + " amax")
                assert amaxes[1 - slot].item() == (0.5, 2.0)[1 - slot], what + ": the other slot was written"
                assert_bitwise(tri_f8.fp8_quantize_delayed(x, scales, None, E4M3, *usage, slot), ref, what + " no amax")
                assert_bitwise(ref_f8.fp8_quantize_delayed(x, scales, None, E4M3, *usage, slot), ref, what + " ref")


def test_delayed_scaling_slots():
    # M % 4 == 0: the packed kernel with its tile amax; M % 4 != 0: the amax pass, then the cast
    check_delayed_slots("cuda", [(128, 256), (130, 300), (4096, 4096)], ["mixed", "nan", "normal"])


@pytest.mark.parametrize("fp8_dtype", FP8)
@pytest.mark.parametrize("scale_value", [1.0, 0.7, 3.0, 2.0**-100, 1e30])
@pytest.mark.parametrize("soft", [False, True])
def test_every_bf16_value(fp8_dtype, scale_value, soft, monkeypatch):
    """All 65536 bf16 bit patterns (NaNs of both signs, +-Inf, subnormals) through the cast,
    with the hardware cvt and with the software rounding used under the interpreter."""
    if soft:
        set_soft_cast(True)  # conftest puts it back after the test
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(256, 256).cuda()
    scale = torch.tensor([scale_value], device="cuda")
    a_ref, a_tri = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    ref = ref_f8.fp8_quantize_delayed(x, scale, a_ref, fp8_dtype, True, True)
    assert_bitwise(tri_f8.fp8_quantize_delayed(x, scale, a_tri, fp8_dtype, True, True), ref, "all-bf16")
    assert_bitwise((a_tri,), (a_ref,), "amax_out")


def test_non_contiguous_input():
    """Outputs are contiguous whatever x's strides (quantizers pass x.contiguous() anyway; the
    reference's rowwise data would keep x's strides)."""
    x = make_input((96, 160), "normal").t()
    for fp8_dtype in FP8:
        out = tri_f8.fp8_quantize_current(x, fp8_dtype, True, True)
        assert out[0].is_contiguous()
        assert_bitwise(out, ref_f8.fp8_quantize_current(x.contiguous(), fp8_dtype, True, True), "current-nc")
        out = tri_bw.fp8_blockwise_quantize(x, fp8_dtype, 1, True, True)
        assert_bitwise(out, ref_bw.fp8_blockwise_quantize(x.contiguous(), fp8_dtype, 1, True, True), "bw-nc")
        out = tri_mx.mxfp8_quantize(x, fp8_dtype, True, True)
        assert_bitwise(out, ref_mx.mxfp8_quantize(x.contiguous(), fp8_dtype, True, True), "mx-nc")


# Launch configs other than the defaults (what benchmarks/bench_quantize.py --sweep may pick).
ALT_CONFIGS = [
    (tri_f8.CONFIG, "cast", [dict(BM=64, BK=64, num_warps=4), dict(BM=32, BK=128, num_warps=4),
                             dict(BM=256, BK=64, num_warps=8)]),
    (tri_f8.CONFIG, "cast_rowwise", [dict(BM=8, BK=1024, num_warps=8), dict(BM=64, BK=128, num_warps=4)]),
    (tri_f8.CONFIG, "cast_packed", [dict(BM=64, BK=64, num_warps=4), dict(BM=256, BK=64, num_warps=8),
                                    dict(BM=16, BK=128, num_warps=4)]),
    (tri_f8.CONFIG, "pack_transpose", [False]),  # the byte transpose for every M
    (tri_f8.CONFIG, "amax", [dict(BLOCK=1024, num_warps=4), dict(BLOCK=32768, num_warps=16)]),
    (tri_bw.CONFIG, (1, True, True), [dict(BM=128, BK=128, CH=128, num_warps=8),
                                      dict(BM=128, BK=128, CH=64, num_warps=4)]),
    (tri_bw.CONFIG, (1, True, False), [dict(BM=128, BK=128, CH=128, num_warps=8),
                                       dict(BM=64, BK=128, CH=16, num_warps=4)]),
    (tri_bw.CONFIG, (1, False, True), [dict(BM=128, BK=128, CH=128, num_warps=8),
                                       dict(BM=128, BK=32, CH=64, num_warps=4)]),
    (tri_bw.CONFIG, (2, True, True), [dict(BM=128, BK=128, CH=128, num_warps=8),
                                      dict(BM=128, BK=128, CH=16, num_warps=4),
                                      dict(BM=128, BK=128, CH=32, num_warps=4)]),
    (tri_mx.CONFIG, (True, True), [dict(MB=1, NB=1, num_warps=4), dict(MB=4, NB=8, num_warps=8),
                                   dict(MB=2, NB=4, num_warps=8)]),
    (tri_mx.CONFIG, (True, False), [dict(MB=1, NB=8, num_warps=4)]),
    (tri_mx.CONFIG, "quarters", [False, dict(NB=1, num_warps=4), dict(NB=2, num_warps=1),
                                 dict(NB=8, num_warps=8)]),
    (tri_mx.CONFIG, (False, True), [dict(MB=4, NB=2, num_warps=4)]),
]


def run_alt_config(table, key, cfg, device, monkeypatch):
    monkeypatch.setitem(table, key, cfg)
    if table is tri_mx.CONFIG and isinstance(key, tuple):
        monkeypatch.setitem(table, "quarters", False)  # the (MB, NB) configs are `_mxfp8_kernel`'s
    for shape, kind in (((96, 288), "mixed"), ((33, 130), "nan"), ((256, 160), "zero_rows")):
        x = make_input(shape, kind, device=device)
        for fp8_dtype in FP8:
            if table is tri_f8.CONFIG:
                for usage in USAGES:
                    assert_bitwise(tri_f8.fp8_quantize_current(x, fp8_dtype, *usage),
                                   ref_f8.fp8_quantize_current(x, fp8_dtype, *usage), f"current {cfg}")
                    scale, amax_ref = torch.tensor([3.7], device=device), torch.zeros(1, device=device)
                    amax_tri = amax_ref.clone()
                    ref = ref_f8.fp8_quantize_delayed(x, scale, amax_ref, fp8_dtype, *usage)
                    assert_bitwise(tri_f8.fp8_quantize_delayed(x, scale, amax_tri, fp8_dtype, *usage), ref,
                                   f"delayed {cfg}")
                    assert_bitwise((amax_tri,), (amax_ref,), f"delayed amax {cfg}")
            elif table is tri_bw.CONFIG:
                dim, usage = key[0], key[1:]
                assert_bitwise(tri_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage),
                               ref_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage), f"bw {key} {cfg}")
            elif shape[0] % 32 == 0 and shape[1] % 32 == 0:
                # the "quarters" entry serves both usages with a columnwise part
                for usage in [key] if isinstance(key, tuple) else [(True, True), (False, True)]:
                    assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, *usage),
                                   ref_mx.mxfp8_quantize(x, fp8_dtype, *usage), f"mx {key} {cfg}")


@pytest.mark.parametrize("table,key,cfg", [(t, k, c) for t, k, cs in ALT_CONFIGS for c in cs],
                         ids=[f"{k}-{c}" for _, k, cs in ALT_CONFIGS for c in cs])
def test_alternative_configs(table, key, cfg, monkeypatch):
    run_alt_config(table, key, cfg, "cuda", monkeypatch)


def test_current_scaling_under_cuda_graph():
    """No host sync: the quantize captures into a CUDA graph and replays with new data."""
    x = make_input((256, 512), "normal")
    fp8_dtype = torch.float8_e4m3fn
    tri_f8.fp8_quantize_current(x, fp8_dtype, True, True)  # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        tri_f8.fp8_quantize_current(x, fp8_dtype, True, True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = tri_f8.fp8_quantize_current(x, fp8_dtype, True, True)
    x.copy_(make_input((256, 512), "mixed", seed=5))
    g.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, ref_f8.fp8_quantize_current(x, fp8_dtype, True, True), "graph")


# ---- FP8 blockwise -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES + [(256, 384), (129, 257)], ids=str)
@pytest.mark.parametrize("dim", [1, 2])
def test_blockwise(shape, kind, dim):
    x = make_input(shape, kind)
    for fp8_dtype in FP8:
        for usage in USAGES:
            ref = ref_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage)
            poison_like(ref)
            assert_bitwise(tri_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage), ref,
                           f"blockwise{dim} {fp8_dtype} {usage}")


@pytest.mark.parametrize("power_2,epsilon", [(False, 0.0), (True, 1e-6), (False, 1e-3)])
@pytest.mark.parametrize("kind", ["normal", "tiny", "denormal", "huge", "mixed", "zero_rows"])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blockwise_options(power_2, epsilon, kind, dim, dtype):
    x = make_input((200, 300), kind, dtype, seed=2)
    for fp8_dtype in FP8:
        ref = ref_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, True, True, power_2, epsilon)
        out = tri_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, True, True, power_2, epsilon)
        assert_bitwise(out, ref, f"blockwise{dim}")


# ---- MXFP8 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,kind", cases(MX_SHAPES), ids=str)
def test_mxfp8(shape, kind):
    for dtype in (torch.bfloat16, torch.float32):
        x = make_input(shape, kind, dtype)
        for fp8_dtype in FP8:
            for usage in USAGES:
                ref = ref_mx.mxfp8_quantize(x, fp8_dtype, *usage)
                poison_like(ref)
                assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, *usage), ref,
                               f"mxfp8 {dtype} {fp8_dtype} {usage}")


@pytest.mark.parametrize("shape,usage", [((17, 64), (True, False)), ((64, 48), (False, True)),
                                         ((1, 32), (True, False))], ids=str)
def test_mxfp8_one_usage_odd_other_dim(shape, usage):
    """Rowwise needs only K % 32 == 0 and columnwise only M % 32 == 0."""
    x = make_input(shape, "mixed")
    for fp8_dtype in FP8:
        assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, *usage),
                       ref_mx.mxfp8_quantize(x, fp8_dtype, *usage), "mxfp8")


@triton.jit
def _scale_probe_kernel(amax_ptr, scale_ptr, inv_ptr, n, FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr,
                        POW2: tl.constexpr, EPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    s = scale_from_amax(tl.load(amax_ptr + offs, mask=ok, other=1.0), FMAX, MARGIN_MUL, POW2, EPS)
    tl.store(scale_ptr + offs, s, mask=ok)
    tl.store(inv_ptr + offs, scale_reciprocal(s, POW2), mask=ok)


def amax_edge_values():
    """fp32 amaxes: every exponent (subnormals included) with mantissas at, one ulp around and far
    from those of 448 (e4m3) and 57344 (e5m2) (both 1.75 * 2**k), plus 0, Inf, NaN, FLOAT32_MAX."""
    mant = torch.tensor([0, 1, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFF, 0x2AAAAA], dtype=torch.int32)
    expo = torch.arange(0, 255, dtype=torch.int32)
    bits = (expo[:, None] << 23) | mant[None, :]
    special = torch.tensor([0.0, float("inf"), float("nan"), 3.4028234663852886e38, 1e-45, 448.0])
    return torch.cat([bits.reshape(-1).view(torch.float32), special])


def check_scale_helpers(device):
    """`scale_from_amax` and `scale_reciprocal` (the division-free power-of-two path included)
    bitwise against the reference's scale and torch's reciprocal."""
    from transformer_engine_proto.kernels.reference.common import scale_from_amax as ref_scale
    amax = amax_edge_values().to(device)
    n = amax.numel()
    for fmax in (448.0, 57344.0, 6.0):
        for margin, pow2, eps in ((0, True, 0.0), (0, False, 0.0), (1, True, 0.0), (0, True, 1e-12)):
            scale, inv = torch.empty_like(amax), torch.empty_like(amax)
            _scale_probe_kernel[(triton.cdiv(n, 512),)](amax, scale, inv, n, FMAX=fmax,
                                                        MARGIN_MUL=2.0 ** -margin, POW2=pow2,
                                                        EPS=eps, BLOCK=512)
            want = ref_scale(amax, fmax, margin, pow2, eps)
            what = f"fmax={fmax} margin={margin} pow2={pow2} eps={eps}"
            assert_bitwise((scale,), (want,), "scale " + what)
            assert_bitwise((inv,), (torch.reciprocal(want),), "scale_inv " + what)


def test_scale_helpers():
    check_scale_helpers("cuda")


def block_exponent_walk(device="cuda"):
    """(n, 32) fp32 blocks whose amax walks through every binade (and just above/below
    448 * 2**e), the amax itself in column 0."""
    e = torch.arange(-140, 128, dtype=torch.float32)
    amax = torch.cat([torch.exp2(e), torch.exp2(e) * 1.75, torch.exp2(e) * 1.7500001, torch.exp2(e) * 1.9999])
    amax = amax[torch.isfinite(amax)]
    n = amax.numel() // 32 * 32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g).clamp(-1, 1) * amax[:n, None]
    x[:, 0] = amax[:n]
    return x.to(device)


def test_mxfp8_every_block_exponent():
    x = block_exponent_walk()
    for fp8_dtype in FP8:
        for usage in USAGES[:2]:
            assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, *usage),
                           ref_mx.mxfp8_quantize(x, fp8_dtype, *usage), "mxfp8-exp")
        xt = x.t().contiguous()
        assert_bitwise(tri_mx.mxfp8_quantize(xt, fp8_dtype, False, True),
                       ref_mx.mxfp8_quantize(xt, fp8_dtype, False, True), "mxfp8-exp-col")


def test_env_forces_reference(monkeypatch):
    set_backend("reference")
    assert kernel("mxfp8_quantize", "cuda") is ref_mx.mxfp8_quantize
    monkeypatch.setenv("TE_PROTO_KERNELS", "reference")
    set_backend(None)  # the variable, read again
    assert kernel("mxfp8_quantize", "cuda") is ref_mx.mxfp8_quantize
