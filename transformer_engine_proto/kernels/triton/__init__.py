"""Triton kernels: the CUDA fast path of the quantize / dequantize kernels (same names,
signatures and bit-exact results as `kernels/reference`) and of the norms (same names and
signatures; their row sums are reduced in another order, so equal to about one ulp, see norm.py).

Imported by the dispatcher (`kernels._load_reference`) whether or not `triton` imports; each
submodule registers its kernels with backend "triton", which `kernel(name, device)` prefers for
CUDA tensors.
"""
try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except ImportError:  # pragma: no cover - CPU-only installs
    HAVE_TRITON = False
else:
    HAVE_TRITON = True
    from .. import ON_INDUCTOR_TRACE  # noqa: E402
    from . import blockwise, delayed_scaling, dequant, float8, mxfp8, norm, nvfp4  # noqa: F401,E402
    from .direct_swap import install_swap as _install_swap  # noqa: E402
    from .trace_analysis import install as _install_trace_analysis  # noqa: E402
    from .trace_analysis import install_closure as _install_closure  # noqa: E402

    _install_trace_analysis()
    # inductor's modules load only when a compile needs them
    ON_INDUCTOR_TRACE.extend([_install_swap, _install_closure])
