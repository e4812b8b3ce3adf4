"""`kernels/triton/launch.py`: when the fast launch path may be taken (CPU), and that the GPU
kernels give the reference's bits through it (cuda)."""
import pytest
import torch

triton = pytest.importorskip("triton")

from transformer_engine_proto.kernels.triton import launch  # noqa: E402


class _Recorder:
    """Stands in for a jitted kernel: records Triton-path launches."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **k: self.calls.append((grid, a, k))


def test_hook_chains_count_as_installed_only_with_calls(monkeypatch):
    """Triton 3.6 keeps its launch hooks as HookChain objects that are never None: an empty chain
    is no hook (the first version of fast_launch tested `is None` and never left Triton's path)."""
    from triton import knobs

    assert not launch.hooks_installed()
    hook = lambda *a: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert launch.hooks_installed()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not launch.hooks_installed()


@pytest.mark.parametrize("env", ["0", "1", None])
def test_takes_tritons_path_when_disabled_or_off_gpu(monkeypatch, env):
    if env is None:
        monkeypatch.delenv("TE_PROTO_FAST_LAUNCH", raising=False)
        launch.set_fast_launch(None)  # read the variable (and the version) again
        # on by default with the Triton it was verified on, off with any other
        assert launch.enabled() == triton.__version__.startswith(launch.VERIFIED_TRITON)
        monkeypatch.setattr(triton, "__version__", "3.6.0")
        launch.set_fast_launch(None)
        assert launch.enabled()
        monkeypatch.setattr(triton, "__version__", "3.9.0")
        launch.set_fast_launch(None)
        assert not launch.enabled()
        monkeypatch.setenv("TE_PROTO_FAST_LAUNCH", "1")  # read once: no effect until reset
        assert not launch.enabled()
        launch.set_fast_launch(None)
        assert launch.enabled()
    else:
        monkeypatch.setenv("TE_PROTO_FAST_LAUNCH", env)
        launch.set_fast_launch(None)
        assert launch.enabled() == (env == "1")
        launch.set_fast_launch(env != "1")  # the Python switch wins over the variable
        assert launch.enabled() == (env != "1")
        launch.set_fast_launch(env == "1")
    monkeypatch.setattr(launch, "_INTERPRETING", env != "0")  # enabled, but interpreting
    fn = _Recorder()
    launch.fast_launch(fn)[(3,)](torch.zeros(4), 4, BLOCK=16)
    assert len(fn.calls) == 1 and fn.calls[0][0] == (3,)


def test_specialization_classes():
    """Calls Triton would compile differently never share a class."""
    c = launch._arg_class
    base = torch.zeros(64, dtype=torch.float32)
    assert c(base) != c(base[1:])  # 16-byte alignment
    assert c(base) != c(base.view(torch.int32))  # dtype
    assert len({c(1), c(16), c(17), c(2**31), c(2**63)}) == 5  # ==1, %16, width
    assert c(True) != c(1) and c(0.5) != c(1)
    with pytest.raises(TypeError):
        c("a string")


@pytest.mark.cuda
def test_kernels_through_the_fast_path_match_the_reference(monkeypatch):
    """With the fast launch on: repeated launches (the fast path from the second on) with an
    aligned, a misaligned, an odd-length and a length-1 input give the reference's bits."""
    from test_triton_kernels import FP8, assert_bitwise, make_input

    from transformer_engine_proto.kernels.reference import float8 as ref_f8
    from transformer_engine_proto.kernels.triton import float8 as tri_f8

    launch.set_fast_launch(True)
    base = make_input((4096 + 3,), "normal").reshape(-1)
    for x in (base[:4096], base[:4096], base[1:4097], base[3:4096 + 2], base[5:6], base[:4096]):
        assert_bitwise(tri_f8.amax(x), ref_f8.amax(x), f"amax offset {x.storage_offset()} n {x.numel()}")
        x2 = x.reshape(1, -1)
        for fp8_dtype in FP8:
            assert_bitwise(tri_f8.fp8_quantize_current(x2, fp8_dtype, True, True),
                           ref_f8.fp8_quantize_current(x2, fp8_dtype, True, True), "current")
    assert any(k for k in tri_f8._amax_kernel._compiled.values()), "the fast path was never armed"


def test_traced_tells_fake_from_real_tensors():
    """The launch's tracing check: plain, functional-wrapped and subclass tensors of real data are
    real; fake ones (and functional wrappers of fake ones) take the `wrap_triton` path."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    from transformer_engine_proto.kernels.triton._common import traced

    real = torch.zeros(4)
    assert not traced(real) and not traced(torch.nn.Parameter(real)) and not launch._traced_call((3, real))
    assert not traced(torch._to_functional_tensor(real))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        assert traced(fake) and launch._traced_call((3, fake, real))
        with FunctionalTensorMode():
            assert traced(torch.ops.aten.add(fake, 1))
    assert not launch._traced_call((1, 2.0, None))


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(256, 512), (3, 5, 96), (130, 300)], ids=str)
def test_replayed_plans_give_the_full_paths_bits(shape, monkeypatch):
    """An entry point's second call of a signature replays the launches of its first (no entry
    point Python); each call gives the reference's bits, whichever path served it. The shapes take
    the packed transpose (M % 4 == 0), the byte transpose and a ragged tile."""
    from test_triton_kernels import FP8, USAGES, assert_bitwise, make_input

    from transformer_engine_proto.kernels.reference import float8 as ref_f8
    from transformer_engine_proto.kernels.triton import float8 as tri_f8

    full = {"current": 0, "delayed": 0}
    for name in full:
        original = getattr(tri_f8, f"_fp8_quantize_{name}")

        def counted(*args, _original=original, _name=name):
            full[_name] += 1
            return _original(*args)

        monkeypatch.setattr(tri_f8, f"_fp8_quantize_{name}", counted)
    launch.set_fast_launch(True)
    signatures = 0
    for fp8_dtype in FP8:
        for usage in USAGES:
            signatures += 1
            for seed, kind in enumerate(("normal", "mixed", "nan")):
                x = make_input(shape, kind, seed=seed)
                assert_bitwise(tri_f8.fp8_quantize_current(x, fp8_dtype, *usage),
                               ref_f8.fp8_quantize_current(x, fp8_dtype, *usage), f"current {usage} {kind}")
                for slot in (0, 1):  # a module's state: a slot of a longer buffer (slot 1 is misaligned)
                    scale = torch.tensor([0.37 + seed, 0.61 + seed], device="cuda")[slot:slot + 1]
                    amax_ref = torch.tensor([1.5 * seed, 2.5 * seed], device="cuda")
                    amax_tri = amax_ref.clone()
                    assert_bitwise(tri_f8.fp8_quantize_delayed(x, scale, amax_tri[slot:slot + 1], fp8_dtype, *usage),
                                   ref_f8.fp8_quantize_delayed(x, scale, amax_ref[slot:slot + 1], fp8_dtype, *usage),
                                   f"delayed {usage} {kind} slot {slot}")
                    assert_bitwise((amax_tri,), (amax_ref,), f"delayed amax {usage} {kind} slot {slot}")
    assert full == {"current": signatures, "delayed": 2 * signatures}, "a recorded plan was not replayed"


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(64, 128), (96, 160), (2, 48, 64)], ids=str)
def test_replayed_mxfp8_plans_give_the_full_paths_bits(shape, monkeypatch):
    """As above for the MXFP8 quantize: both kernels (the quarters kernel serves usages with a
    columnwise part, the row-block kernel rowwise alone)."""
    from test_triton_kernels import FP8, USAGES, assert_bitwise, make_input

    from transformer_engine_proto.kernels.reference import mxfp8 as ref_mx
    from transformer_engine_proto.kernels.triton import dequant as tri_dq
    from transformer_engine_proto.kernels.triton import mxfp8 as tri_mx

    full, full_dequantize = [], []
    original, original_dequantize = tri_mx._mxfp8_quantize, tri_dq._mxfp8_dequantize
    monkeypatch.setattr(tri_mx, "_mxfp8_quantize", lambda *a: full.append(1) or original(*a))
    monkeypatch.setattr(tri_dq, "_mxfp8_dequantize", lambda *a: full_dequantize.append(1) or original_dequantize(*a))
    launch.set_fast_launch(True)
    for fp8_dtype in FP8:
        for usage in USAGES:
            for seed, kind in enumerate(("normal", "mixed", "nan")):
                x = make_input(shape, kind, seed=seed)
                out = tri_mx.mxfp8_quantize(x, fp8_dtype, *usage)
                assert_bitwise(out, ref_mx.mxfp8_quantize(x, fp8_dtype, *usage), f"mxfp8 {usage} {kind}")
                for columnwise, (data, scale) in ((False, out[:2]), (True, out[2:])):
                    if data is not None:
                        assert_bitwise((tri_dq.mxfp8_dequantize(data, scale, columnwise, torch.float32),),
                                       (ref_mx.mxfp8_dequantize(data, scale, columnwise, torch.float32),),
                                       f"dequantize {columnwise} {kind}")
    assert len(full) == len(FP8) * len(USAGES), "a recorded plan was not replayed"
    assert len(full_dequantize) == 2 * len(FP8), "a recorded dequantize plan was not replayed"


@pytest.mark.cuda
def test_plans_step_aside_for_hooks_settings_and_unusual_inputs(monkeypatch):
    """A launch hook (a profiler), a soft-cast switch, a misaligned or non-contiguous input: the
    full entry point runs, and what it gives is still the reference's."""
    from test_triton_kernels import assert_bitwise, make_input
    from triton import knobs

    from transformer_engine_proto.kernels.reference import float8 as ref_f8
    from transformer_engine_proto.kernels.triton import float8 as tri_f8
    from transformer_engine_proto.kernels.triton._common import set_soft_cast

    calls = []
    original = tri_f8._fp8_quantize_current
    monkeypatch.setattr(tri_f8, "_fp8_quantize_current", lambda *a: calls.append(1) or original(*a))
    launch.set_fast_launch(True)
    x = make_input((64, 128), "mixed")
    e4m3 = torch.float8_e4m3fn

    def quantize(t):
        assert_bitwise(tri_f8.fp8_quantize_current(t, e4m3, True, True),  # a contiguous result
                       ref_f8.fp8_quantize_current(t.contiguous(), e4m3, True, True))
        return len(calls)

    assert quantize(x) == 1 and quantize(x) == 1  # recorded, then replayed
    seen = []
    hook = lambda *a: seen.append(1)  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert quantize(x) == 2 and seen, "a hook must see every launch"
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert quantize(x) == 2
    set_soft_cast(True)  # another kernel binary: recorded anew, then replayed
    assert quantize(x) == 3 and quantize(x) == 3
    set_soft_cast(None)
    assert quantize(x) == 3  # the hardware cast's plan again
    base = make_input((64 * 128 + 8,), "mixed").reshape(-1)
    misaligned = base[2:2 + 64 * 128].view(64, 128)
    assert quantize(misaligned) == 4 and quantize(misaligned) == 5
    assert quantize(x.t()) == 6 and quantize(x.t()) == 7
    launch.set_fast_launch(False)
    assert quantize(x) == 8 and quantize(x) == 9


@pytest.mark.cuda
def test_threads_record_their_own_plans(monkeypatch):
    """Quantizes running in two threads at once: each thread's recording holds only its own
    launches (a launch of the other thread joining a plan would replay the wrong kernel), so every
    result, recorded or replayed, is the reference's."""
    import threading

    from test_triton_kernels import assert_bitwise, make_input

    from transformer_engine_proto.kernels.reference import float8 as ref_f8
    from transformer_engine_proto.kernels.reference import mxfp8 as ref_mx
    from transformer_engine_proto.kernels.triton import float8 as tri_f8
    from transformer_engine_proto.kernels.triton import mxfp8 as tri_mx

    launch.set_fast_launch(True)
    monkeypatch.setattr(launch, "PLAN_LIMIT", 3)  # the limit starts plans over while threads record
    e4m3 = torch.float8_e4m3fn
    errors = []

    def work(shapes, quantize, reference):
        try:
            for i in range(40):
                x = make_input(shapes[i % len(shapes)], "mixed", seed=i)
                assert_bitwise(quantize(x), reference(x), f"{quantize.__name__} {tuple(x.shape)} call {i}")
        except Exception as e:  # reported by the main thread
            errors.append(e)

    def current(x):
        return tri_f8.fp8_quantize_current(x, e4m3, True, True)

    def mxfp8(x):
        return tri_mx.mxfp8_quantize(x, e4m3, True, True)

    threads = [
        threading.Thread(target=work, args=([(64, 128), (32, 96)], current,
                                            lambda x: ref_f8.fp8_quantize_current(x, e4m3, True, True))),
        threading.Thread(target=work, args=([(64, 64), (96, 32)], mxfp8,
                                            lambda x: ref_mx.mxfp8_quantize(x, e4m3, True, True))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors[0]
    assert 0 < len(launch.PLANS) <= 3


@triton.jit
def _add_one(x_ptr, n, BLOCK: triton.language.constexpr):
    i = triton.language.arange(0, BLOCK)
    triton.language.store(x_ptr + i, triton.language.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def test_traced_launches_with_options_share_one_kernel_per_options():
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch.fx.experimental.proxy_tensor import make_fx

    wrapped = launch.fast_launch(_add_one)

    def body(x):
        for _ in range(3):
            wrapped[(1,)](x, 4, BLOCK=4, num_warps=1)
        wrapped[(1,)](x, 4, BLOCK=4, num_warps=2)
        wrapped[(1,)](x, 4, BLOCK=4)
        return x

    graph = make_fx(body, tracing_mode="fake")(torch.zeros(4))
    nodes = [n for n in graph.graph.nodes if n.op == "call_function"]
    kernels = [kernel_side_table.get_kernel(n.kwargs["kernel_idx"]) for n in nodes]
    assert len(nodes) == 5
    assert kernels[0] is kernels[1] is kernels[2] and kernels[3] is not kernels[0]  # one entry per options
    assert [k.configs[0].num_warps for k in kernels[:4]] == [1, 1, 1, 2] and len(kernels[0].configs) == 1
    assert kernels[0].fn is _add_one and kernels[4] is _add_one  # no options: the kernel itself
    for n in nodes:  # the options travel in the kernel's config, not as arguments
        assert "num_warps" not in kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"])
