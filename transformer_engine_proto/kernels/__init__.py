"""Kernel dispatcher: one name per kernel, a pure-torch reference (the spec, any device) and
optional fast backends (Triton on CUDA) registered under the same name.

Quantizers call `kernel("name")(...)` with plain tensors; the dispatcher picks the backend by the
input's device. `TE_PROTO_KERNELS` selects: `triton` (the default: Triton on CUDA tensors when
triton imports, the reference elsewhere; the Triton quantize kernels are bitwise equal to the
reference, checked on an H100 by tests/test_triton_kernels.py; the norm kernels agree to about one
ulp, tests/test_triton_norm.py) or `reference` (the pure-torch spec everywhere). The variable is
read once, at the first dispatch; `set_backend("reference" | "triton")` switches in Python and
`set_backend(None)` goes back to the variable (read again at the next dispatch).

While inductor traces a library op's body (`custom_ops/inductor_lowering.py`), the kernels of
`INDUCTOR_FUSIBLE` chosen by `set_fusible_quantize` (or `TE_PROTO_FUSIBLE_QUANTIZE`: 1 all, 0 none,
or a comma list of names) dispatch to the reference instead: written in aten ops, the per-tensor
FP8 amax and cast become part of inductor's graph, which may fuse them into the kernels that
produce and consume the tensor (a norm, an activation, a residual add), where a Triton kernel is a
separate pass over memory. Both are bitwise equal, so compiled still equals eager. The default
(none) is the faster on the Llama benchmark (benchmarks/bench_llama.py, `+fuse` variants).
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Dict, Optional, Tuple

import torch

__all__ = ["register_kernel", "kernel", "available_backends", "set_backend", "get_backend", "set_fusible_quantize",
           "fusible_quantize_enabled", "fusing", "fused_into_producer", "tracing_for_inductor", "INDUCTOR_FUSIBLE"]

_KERNELS: Dict[Tuple[str, str], Callable] = {}
# Backends tried first on each device type when TE_PROTO_KERNELS=triton; "reference" is the fallback.
_PREFERENCE = {"cuda": ("triton",)}
DEFAULT_BACKEND = "triton"
BACKENDS = ("reference", "triton")
_backend: Optional[str] = None  # None: not chosen yet, take TE_PROTO_KERNELS at the next dispatch
INDUCTOR_FUSIBLE = frozenset({"amax", "fp8_quantize_delayed", "fp8_quantize_current"})
_inductor_depth = 0  # > 0 while inductor traces a library op's body
_fused_here = frozenset()  # the names `fused_into_producer` makes fusible inside its block
ON_FUSIBLE_CHANGE = []  # callbacks: the compile cache key names the setting
# callbacks when inductor first traces a library op's body: compile-time setup that eager code
# should not pay for (the Triton backend puts its pass in front of inductor's, triton/direct_swap.py)
ON_INDUCTOR_TRACE = []


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


def _fusible_names(setting) -> frozenset:
    """True: every name in `INDUCTOR_FUSIBLE`; False: none; a name or names: those."""
    if isinstance(setting, bool):
        return INDUCTOR_FUSIBLE if setting else frozenset()
    names = frozenset([setting] if isinstance(setting, str) else setting)
    unknown = names - INDUCTOR_FUSIBLE
    if unknown:
        raise ValueError(f"fusible quantize: unknown kernel names {sorted(unknown)}; "
                         f"known: {sorted(INDUCTOR_FUSIBLE)}")
    return names


def _fusible_from_env() -> frozenset:
    env = os.environ.get("TE_PROTO_FUSIBLE_QUANTIZE", "0")
    if env in ("0", "1"):
        return _fusible_names(env == "1")
    return _fusible_names(n.strip() for n in env.split(",") if n.strip())


_fusible = _fusible_from_env()


def set_fusible_quantize(setting) -> None:
    """Which kernels of `INDUCTOR_FUSIBLE` inductor traces as the aten reference (fused with their
    neighbours) instead of our Triton kernel: True (all), False (none), names such as "amax", or
    None (`TE_PROTO_FUSIBLE_QUANTIZE` again). Compiles after the call see it."""
    global _fusible
    _fusible = _fusible_from_env() if setting is None else _fusible_names(setting)
    for callback in ON_FUSIBLE_CHANGE:
        callback()


def fusible_quantize_enabled() -> frozenset:
    """The kernel names inductor traces as the aten reference (empty: none)."""
    return _fusible


def fusing(name: str) -> bool:
    """Whether `kernel(name)` is the fusible reference here (inductor is tracing and `name` is
    chosen, by `set_fusible_quantize` or inside `fused_into_producer`)."""
    return bool(_inductor_depth) and (name in _fusible or name in _fused_here)


@contextlib.contextmanager
def fused_into_producer(*names: str):
    """Inside the block, while inductor traces, `kernel(name)` for `names` (of `INDUCTOR_FUSIBLE`)
    is the aten reference, whatever `set_fusible_quantize` says: for a cast whose input inductor
    computes in a kernel of its own anyway (backward's cast of a recomputed input), where our
    Triton kernel would read that input back from memory."""
    global _fused_here
    unknown = set(names) - INDUCTOR_FUSIBLE
    if unknown:
        raise ValueError(f"fused_into_producer: unknown kernel names {sorted(unknown)}; "
                         f"known: {sorted(INDUCTOR_FUSIBLE)}")
    outer, _fused_here = _fused_here, _fused_here | frozenset(names)
    try:
        yield
    finally:
        _fused_here = outer


@contextlib.contextmanager
def tracing_for_inductor():
    """The scope in which inductor traces a library op's body."""
    global _inductor_depth
    if not _inductor_depth:
        _load_reference()  # the backends register their ON_INDUCTOR_TRACE callbacks when loaded
        for callback in ON_INDUCTOR_TRACE:
            callback()
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
    if mode == "triton" and device is not None and not reference and not fusing(name):
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
        from .reference import blockwise, delayed_scaling, float8, mxfp8, norm, nvfp4, nvfp4_to  # noqa: F401,E501
        try:
            from . import triton as _triton_backend  # noqa: F401  (registers "triton" kernels)
        except ImportError:
            pass
