"""Errors that reach the user as themselves under torch.compile.

In a frame dynamo traces with `fullgraph=True`, a plain `raise ValueError(msg)` becomes dynamo's
`Unsupported: Observed exception` (torch 2.13): 16+ lines with our message buried in the
developer context, and `except ValueError` no longer catches it. An error raised while dynamo
runs an op's fake impl becomes a `TorchRuntimeError` the same way.

`raise_error` keeps the type and the message. It raises from a function dynamo calls instead of
tracing (`assume_constant_result`); while dynamo traces (that call, or an op's fake impl), the
exception's class derives from both the requested type and dynamo's `Unsupported`, which dynamo
and `torch.compile` re-raise unchanged (appending the user stack after our first line). Without
`fullgraph`, dynamo breaks the graph there and makes the call eagerly, which, like eager code,
raises the plain type.
"""
from __future__ import annotations

import functools

import torch
from torch._dynamo.exc import Unsupported

__all__ = ["raise_error", "shape_str"]

_TYPES = {t.__name__: t for t in (ValueError, TypeError, RuntimeError, NotImplementedError)}


@functools.lru_cache(maxsize=None)
def _traced_type(name: str) -> type:
    """`name`'s exception type, also an `Unsupported` (which dynamo passes through)."""
    base = _TYPES[name]

    def __init__(self, message: str):
        Unsupported.__init__(self, message)

    # Unsupported is itself a RuntimeError: (RuntimeError, Unsupported) has no consistent MRO
    bases = (Unsupported,) if issubclass(Unsupported, base) else (base, Unsupported)
    return type(name, bases, {"__init__": __init__, "__module__": __name__})


def raise_error(exc_type: type, message: str):
    """Raise `exc_type(message)` (ValueError, TypeError, RuntimeError or NotImplementedError) so
    that under torch.compile(fullgraph=True) too the user gets that type with `message` first.
    `message` must be a constant str under dynamo: format a shape with `shape_str(t)`."""
    _raise(exc_type.__name__, message)


@torch._dynamo.assume_constant_result  # dynamo calls it instead of tracing it
def _raise(name: str, message: str):
    # while dynamo traces (this call, or a fake impl): the type dynamo passes through; in eager
    # (also where dynamo resumes after a graph break) the plain type
    tracing = torch._guards.TracingContext.try_get() is not None
    raise (_traced_type(name) if tracing else _TYPES[name])(message) from None


def shape_str(t: torch.Tensor) -> str:
    """t's shape as `str(tuple(t.shape))` would print it, also with symbolic sizes under dynamo
    (formatting one size gives a constant, a tuple of them does not; this specializes the sizes,
    so only call it on the way to `raise_error`)."""
    dims = [f"{d}" for d in t.shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
