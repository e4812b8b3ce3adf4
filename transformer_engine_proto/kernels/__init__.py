"""Kernel dispatcher: one name per kernel, a pure-torch reference (the spec, any device) and
optional fast backends (Triton on CUDA) registered under the same name.

Quantizers call `kernel("name")(...)` with plain tensors; the dispatcher picks the backend by the
input's device. `TE_PROTO_KERNELS` selects: `triton` (the default: Triton on CUDA tensors when
triton imports, the reference elsewhere; the Triton quantize kernels are bitwise equal to the
reference, checked on an H100 by tests/test_triton_kernels.py; the norm kernels agree to about one
ulp, tests/test_triton_norm.py) or `reference` (the pure-torch spec everywhere).
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Tuple

import torch

__all__ = ["register_kernel", "kernel", "available_backends"]

_KERNELS: Dict[Tuple[str, str], Callable] = {}
# Backends tried first on each device type when TE_PROTO_KERNELS=triton; "reference" is the fallback.
_PREFERENCE = {"cuda": ("triton",)}
DEFAULT_BACKEND = "triton"


def register_kernel(name: str, backend: str = "reference"):
    def decorate(fn):
        _KERNELS[(name, backend)] = fn
        return fn

    return decorate


def available_backends(name: str):
    return sorted(b for (n, b) in _KERNELS if n == name)


def kernel(name: str, device=None) -> Callable:
    """The implementation of `name` for tensors on `device`."""
    _load_reference()
    mode = os.environ.get("TE_PROTO_KERNELS", DEFAULT_BACKEND)
    if mode not in ("reference", "triton"):
        raise ValueError(f"TE_PROTO_KERNELS must be 'reference' or 'triton', got {mode!r}")
    if mode == "triton" and device is not None:
        for backend in _PREFERENCE.get(torch.device(device).type, ()):
            fn = _KERNELS.get((name, backend))
            if fn is not None:
                return fn
    try:
        return _KERNELS[(name, "reference")]
    except KeyError:
        raise KeyError(f"no kernel named {name!r}; known: {sorted({n for n, _ in _KERNELS})}") from None


_loaded = False


def _load_reference():
    global _loaded
    if not _loaded:
        _loaded = True
        from .reference import blockwise, float8, mxfp8, norm, nvfp4, nvfp4_to  # noqa: F401  (registers kernels)
        try:
            from . import triton as _triton_backend  # noqa: F401  (registers "triton" kernels)
        except ImportError:
            pass
