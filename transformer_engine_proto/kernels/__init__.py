"""Kernel dispatcher: one name per kernel, a pure-torch reference (the spec, any device) and
optional fast backends (Triton on CUDA) registered under the same name.

Quantizers call `kernel("name")(...)` with plain tensors; the dispatcher picks the backend by the
input's device. Set `TE_PROTO_KERNELS=reference` to force the reference everywhere.
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Tuple

import torch

__all__ = ["register_kernel", "kernel", "available_backends"]

_KERNELS: Dict[Tuple[str, str], Callable] = {}
# Backends tried first on each device type, best first; "reference" is always the fallback.
_PREFERENCE = {"cuda": ("triton",)}


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
    if os.environ.get("TE_PROTO_KERNELS", "") != "reference" and device is not None:
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
        from .reference import blockwise, float8, mxfp8, nvfp4  # noqa: F401  (registers kernels)
