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
