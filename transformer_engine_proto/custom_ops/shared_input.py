"""One quantized copy of an input that several Linears read.

A Hugging Face Llama's q/k/v (and gate/up) projections are separate Linears reading one tensor.
bf16 saves that tensor once for backward; without sharing each Linear op quantizes it again and
saves its own columnwise copy. Here the Linear op's body asks `lookup` for the quantized input of
(this source tensor, quantizer, rows) and `store`s the one it makes, so later calls on the same
tensor reuse the buffers: one quantize and one saved copy per format and usage. Under delayed
scaling the copy is scaled by the first reader's input scale and each reader records its amax, as
TE's fused QKV projection has one input scale: Linears fed the same tensors keep equal histories,
so their own scales would be the same (they differ only if their histories were made to differ,
as by loading other checkpoints into them).

Sharing happens only inside a `scope`, which the two callers of the body open:
- the eager path (`custom_ops/eager_path.py`): the source is the tensor the op was called with; entries
  are the buffers themselves;
- inductor's inlining (`custom_ops/inductor_lowering.py`): the body traces on functional wrappers of the
  decomposition's arguments; the source is the traced tensor the wrapper came from, the entries
  are traced tensors of the same trace (keyed by the tracing mode too), so the second Linear's
  graph reads the first one's quantize: one node, one saved tensor, on every backend's kernels
  (AOT's CSE cannot merge two Triton quantize launches: their outputs are fresh `empty`s).
Everywhere else (the opaque op under aot_eager, opcheck, fake tensors) the body quantizes as before.

An entry lives while its source tensor does (a weakref callback drops it), is checked against
the source's version counter (an in-place write invalidates it), and `clear()` (autocast exit)
drops them all, so the quantized rowwise copy never outlives the forward that made it.
Inference tensors (made under `torch.inference_mode`) have no version counter, so an in-place
write to one could not be detected: they are never shared.

Nothing is shared while a CUDA graph is being captured (`make_graphed_callables`, a user's
`torch.cuda.graph`): a hit would leave the quantize out of the graph, so every replay would read
the buffers of the call before the capture (and memory outside the graph's pool).
"""
from __future__ import annotations

import threading
import weakref
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["scope", "lookup", "store", "clear", "stats"]

stats = {"hits": 0, "stores": 0}  # counts, for tests and tools


class _ThreadLocal(threading.local):
    """Scopes and entries are per thread, as autocast's state: one thread's forward (or trace)
    never reads or clears another's."""

    def __init__(self):
        self.scopes: List["_Scope"] = []
        self.entries: Dict[tuple, tuple] = {}


_local = _ThreadLocal()


class _Scope:
    """The context manager `scope` returns (a class, not a generator: the eager path opens one
    per Linear call)."""

    def __init__(self, sources, owner, wrap, unwrap, commit):
        self.sources = sources  # id(tensor the body sees) -> the source tensor, or None: itself
        self.owner = owner  # the tracing mode (None in eager): entries never cross traces
        self.wrap, self.unwrap = wrap, unwrap
        self.auto_commit = commit
        self.pending = []

    def __enter__(self) -> "_Scope":
        _local.scopes.append(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _local.scopes.pop()
        if self.auto_commit and exc_type is None:
            self.commit()

    def commit(self) -> None:
        """Store the entries made in this scope (`unwrap` applied)."""
        for src, key, buffers in self.pending:
            _put(src, self.owner, key, [self.unwrap(b) for b in buffers] if self.unwrap else buffers)
            stats["stores"] += 1
        self.pending = []

    def source(self, t):
        """The tensor identifying `t`, or None when `t` cannot be shared (untracked, or an
        inference tensor: no version counter)."""
        src = t if self.sources is None else self.sources.get(id(t))
        return None if src is None or src.is_inference() else src


def scope(sources: Optional[dict] = None, owner=None, wrap: Optional[Callable] = None,
          unwrap: Optional[Callable] = None, commit: bool = True) -> _Scope:
    """A context manager letting the body share quantized inputs. `sources`: id(argument as the
    body sees it) -> the tensor identifying it (tracing); `wrap` / `unwrap` move stored buffers
    into / out of the body's tensors. Entries made inside are stored when the scope exits
    without an exception, or (commit=False) by the caller's `commit()`."""
    return _Scope(sources, owner, wrap, unwrap, commit)


def _key(src, owner, key):
    return (id(src), id(owner), key)


def _put(src, owner, key, buffers) -> None:
    k, entries = _key(src, owner, key), _local.entries
    ref = weakref.ref(src, lambda _r, k=k, entries=entries: entries.pop(k, None))
    entries[k] = (ref, src._version, buffers)


def _capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def lookup(inp: torch.Tensor, key) -> Optional[list]:
    """The buffers stored for `inp` (as the body sees it) under `key`, or None."""
    scopes = _local.scopes
    if not scopes or _capturing():
        return None
    s = scopes[-1]
    src = s.source(inp)
    if src is None:
        return None
    hit = _local.entries.get(_key(src, s.owner, key))
    if hit is None or hit[0]() is not src or hit[1] != src._version:
        return None
    stats["hits"] += 1
    return [s.wrap(b) for b in hit[2]] if s.wrap else list(hit[2])


def store(inp: torch.Tensor, key, buffers) -> None:
    """Offer `buffers` (the quantized `inp` under `key`) to later calls in this scope's owner."""
    scopes = _local.scopes
    if not scopes or _capturing():
        return
    s = scopes[-1]
    src = s.source(inp)
    if src is not None:
        s.pending.append((src, key, list(buffers)))


def clear() -> None:
    """Forget this thread's entries (autocast exit)."""
    _local.entries.clear()
