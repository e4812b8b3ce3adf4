"""The kernel dispatcher: Triton on CUDA by default, the reference elsewhere or when asked, bad
values named."""
import pytest

from transformer_engine_proto.kernels import _KERNELS, get_backend, kernel, register_kernel, set_backend
from transformer_engine_proto.kernels.reference import float8 as ref_f8


def test_reference_is_the_default_on_cpu(monkeypatch):
    monkeypatch.delenv("TE_PROTO_KERNELS", raising=False)
    set_backend(None)
    assert kernel("fp8_quantize_current", "cpu") is ref_f8.fp8_quantize_current


def test_triton_backend_is_the_cuda_default_and_cuda_only(monkeypatch):
    def fake_triton(*args):
        return "triton"

    register_kernel("__probe", "reference")(lambda *a: "reference")
    register_kernel("__probe", "triton")(fake_triton)
    try:
        monkeypatch.delenv("TE_PROTO_KERNELS", raising=False)
        set_backend(None)
        assert kernel("__probe", "cuda") is fake_triton
        set_backend("triton")
        assert kernel("__probe", "cuda") is fake_triton
        assert kernel("__probe", "cpu")() == "reference"
        set_backend("reference")
        assert kernel("__probe", "cuda")() == "reference"
    finally:
        _KERNELS.pop(("__probe", "reference"))
        _KERNELS.pop(("__probe", "triton"))


def test_bad_backend_and_unknown_kernel_are_named(monkeypatch):
    monkeypatch.setenv("TE_PROTO_KERNELS", "cutlass")
    set_backend(None)
    with pytest.raises(ValueError, match="TE_PROTO_KERNELS must be .* got 'cutlass'"):
        kernel("amax", "cpu")
    with pytest.raises(ValueError, match="cutlass"):
        set_backend("cutlass")
    monkeypatch.delenv("TE_PROTO_KERNELS")
    set_backend(None)
    with pytest.raises(KeyError, match="no_such_kernel"):
        kernel("no_such_kernel", "cpu")


def test_the_variable_is_read_once(monkeypatch):
    """TE_PROTO_KERNELS is read at the first dispatch, not at every one; set_backend(None) reads it again."""
    monkeypatch.setenv("TE_PROTO_KERNELS", "reference")
    set_backend(None)
    assert get_backend() == "reference"
    monkeypatch.setenv("TE_PROTO_KERNELS", "triton")
    assert get_backend() == "reference"
    set_backend(None)
    assert get_backend() == "triton"
