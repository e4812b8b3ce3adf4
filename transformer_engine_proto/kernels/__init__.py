"""Kernel dispatcher: one name per kernel, a pure-torch reference (the spec, any device) and
optional fast backends (Triton on CUDA) registered under the same name.

Quantizers call `kernel("name")(...)` with plain tensors; the dispatcher picks the backend by the
input's device. `TE_PROTO_KERNELS` selects: `triton` (the default: Triton on CUDA tensors when
triton imports, the reference elsewhere; the Triton quantize kernels are bitwise equal to the
reference, checked on an H100 by tests/test_triton_kernels.py; the norm kernels agree to about one
ulp, tests/test_triton_norm.py) or `reference` (the pure-torch spec everywhere). The variable is
read once, at the first dispatch; `set_backend("reference" | "triton")` switches in Python and
`set_backend(None)` goes back to the variable (read again at the next dispatch).

While inductor traces a library op's body (`custom_ops/inductor_lowering.py`), the kernels named
in `INDUCTOR_FUSIBLE` dispatch to the reference instead: written in aten ops, the per-tensor FP8
amax and cast become part of inductor's graph, which fuses them into the kernels that produce and
consume the tensor (a norm, an activation, a residual add), where a Triton kernel is a separate
pass over memory. Both are bitwise equal, so compiled still equals eager.
`TE_PROTO_FUSIBLE_QUANTIZE=0` (or `set_fusible_quantize(False)`) keeps the Triton kernels there.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["register_kernel", "kernel", "available_backends", "set_backend", "get_backend", "set_fusible_quantize",
           "fusible_quantize_enabled", "tracing_for_inductor", "INDUCTOR_FUSIBLE"]

_KERNELS: Dict[Tuple[str, str], Callable] = {}
# Backends tried first on each device type when TE_PROTO_KERNELS=triton; "reference" is the fallback.
_PREFERENCE = {"cuda": ("triton",)}
DEFAULT_BACKEND = "triton"
BACKENDS = ("reference", "triton")
_backend: Optional[str] = None  # None: not chosen yet, take TE_PROTO_KERNELS at the next dispatch
INDUCTOR_FUSIBLE = frozenset({"amax", "fp8_quantize_delayed", "fp8_quantize_current"})
_fusible = os.environ.get("TE_PROTO_FUSIBLE_QUANTIZE", "1") != "0"
_inductor_depth = 0  # > 0 while inductor traces a library op's body
ON_FUSIBLE_CHANGE = []  # callbacks: the compile cache key names the setting


def set_backend(name: Optional[str]) -> None:
    """Kernel backend for this process: "triton" (Triton on CUDA tensors, the reference elsewhere)
    or "reference" (the pure-torch spec everywhere); None follows `TE_PROTO_KERNELS` again."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be 'reference' or 'triton', got {name!r}")
    _backend = name


def get_backend() -> str:
    """The backend `kernel()` dispatches to ("reference" or "triton")."""
    global _backend
    if _backend is None:
        mode = os.environ.get("TE_PROTO_KERNELS", DEFAULT_BACKEND)
        if mode not in BACKENDS:
            raise ValueError(f"TE_PROTO_KERNELS must be 'reference' or 'triton', got {mode!r}")
        _backend = mode
    return _backend


def set_fusible_quantize(enabled: bool) -> None:
    """Whether inductor traces the reference (fusible) or the Triton kernels of `INDUCTOR_FUSIBLE`
    (compiles after the call see it)."""
    global _fusible
    _fusible = bool(enabled)
    for callback in ON_FUSIBLE_CHANGE:
        callback()


def fusible_quantize_enabled() -> bool:
    return _fusible


@contextlib.contextmanager
def tracing_for_inductor():
    """The scope in which inductor traces a library op's body."""
    global _inductor_depth
    _inductor_depth += 1
    try:
        yield
    finally:
        _inductor_depth -= 1


def register_kernel(name: str, backend: str = "reference"):
    def decorate(fn):
        _KERNELS[(name, backend)] = fn
        return fn

    return decorate


def available_backends(name: str):
    return sorted(b for (n, b) in _KERNELS if n == name)


def kernel(name: str, device=None, reference: bool = False) -> Callable:
    """The implementation of `name` for tensors on `device`; `reference=True`: the pure-torch
    reference whatever the backend, for a caller whose settings only the reference implements
    (NVFP4's row scaling and 4over6), so no fast kernel runs without them."""
    if not _loaded:
        _load_reference()
    mode = _backend if _backend is not None else get_backend()
    if mode == "triton" and device is not None and not reference and not (
            _inductor_depth and _fusible and name in INDUCTOR_FUSIBLE):
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        for backend in _PREFERENCE.get(device_type, ()):
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
