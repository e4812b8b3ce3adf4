"""The kernel dispatcher: Triton on CUDA by default, the reference elsewhere or when asked, bad
values named."""
import pytest

from transformer_engine_proto.kernels import _KERNELS, kernel, register_kernel
from transformer_engine_proto.kernels.reference import float8 as ref_f8


def test_reference_is_the_default_on_cpu(monkeypatch):
    monkeypatch.delenv("TE_PROTO_KERNELS", raising=False)
    assert kernel("fp8_quantize_current", "cpu") is ref_f8.fp8_quantize_current


def test_triton_backend_is_the_cuda_default_and_cuda_only(monkeypatch):
    def fake_triton(*args):
        return "triton"

    register_kernel("__probe", "reference")(lambda *a: "reference")
    register_kernel("__probe", "triton")(fake_triton)
    try:
        monkeypatch.delenv("TE_PROTO_KERNELS", raising=False)
        assert kernel("__probe", "cuda") is fake_triton
        monkeypatch.setenv("TE_PROTO_KERNELS", "triton")
        assert kernel("__probe", "cuda") is fake_triton
        assert kernel("__probe", "cpu")() == "reference"
        monkeypatch.setenv("TE_PROTO_KERNELS", "reference")
        assert kernel("__probe", "cuda")() == "reference"
    finally:
        _KERNELS.pop(("__probe", "reference"))
        _KERNELS.pop(("__probe", "triton"))


def test_bad_backend_and_unknown_kernel_are_named(monkeypatch):
    monkeypatch.setenv("TE_PROTO_KERNELS", "cutlass")
    with pytest.raises(ValueError, match="cutlass"):
        kernel("amax", "cpu")
    monkeypatch.delenv("TE_PROTO_KERNELS")
    with pytest.raises(KeyError, match="no_such_kernel"):
        kernel("no_such_kernel", "cpu")
