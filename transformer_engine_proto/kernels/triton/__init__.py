"""Triton kernels: the CUDA fast path of the quantize kernels (same names, signatures and
bit-exact results as `kernels/reference`).

Imported by the dispatcher (`kernels._load_reference`) only when `triton` imports; each submodule
registers its kernels with backend "triton", which `kernel(name, device)` prefers for CUDA
tensors. NVFP4 stays on the reference path.
"""
try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except ImportError:  # pragma: no cover - CPU-only installs
    HAVE_TRITON = False
else:
    HAVE_TRITON = True
    from . import blockwise, float8, mxfp8  # noqa: F401,E402  (registers kernels)
