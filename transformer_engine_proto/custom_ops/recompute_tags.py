"""Tagging what inductor's partitioner must recompute in backward instead of saving.

While inductor traces an op body (its decomposition runs with node metadata preserved), the
nodes made inside `recomputed_in_backward()` are tagged `MUST_RECOMPUTE`: AOT's partitioner then
never saves their outputs for backward and runs them again there. The Linear op uses it to keep
backward's weight quantize in backward; `set_recompute_saved_input(True)` also tags the forward's
input quantize and the norms, so a Linear's saved FP8 input is rebuilt in backward from tensors
kept anyway (the norm's input) instead of being saved: less memory, one more cast (and the input's
producer) per Linear in backward (read once from `TE_PROTO_RECOMPUTE_INPUT`, default off).
"""
from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch.fx.traceback as fx_traceback
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["recomputed_in_backward", "tagged", "set_recompute_saved_input", "recompute_saved_input",
           "traced_for_inductor", "recomputable_read"]

_MISSING = object()
_recompute_input: Optional[bool] = None
ON_CHANGE = []  # callbacks when the setting changes (inductor_lowering re-tags its cache key)


def set_recompute_saved_input(on: Optional[bool]) -> None:
    """Recompute (True) or save (False) the Linear's quantized input for backward under inductor;
    None goes back to `TE_PROTO_RECOMPUTE_INPUT`. Changes what is compiled next."""
    global _recompute_input
    _recompute_input = on
    for fn in ON_CHANGE:
        fn()


def recompute_saved_input() -> bool:
    global _recompute_input
    if _recompute_input is None:
        _recompute_input = os.environ.get("TE_PROTO_RECOMPUTE_INPUT", "0") == "1"
    return _recompute_input


def traced_for_inductor() -> bool:
    """Whether an op body is being traced with node metadata kept (inductor's inlining), where tags
    take effect; an eager run or an opaque op's body is not."""
    return fx_traceback.has_preserved_node_meta()


def recomputable_read(x):
    """`x` through a fusible op (`x * 1`, exact), for a tagged kernel that reads `x` only in backward.
    AOT's partitioner never recomputes a tensor that a non-fusible op of backward reads (a Triton
    kernel: `ban_if_materialized_backward`), so it would save `x` in high precision; read through
    this op (tagged too, so rebuilt in backward), `x`'s producer (a norm, SwiGLU) is recomputed into
    the same generated kernel instead."""
    return x * 1


def recomputed_in_backward(active: bool = True):
    """Tag the nodes traced inside MUST_RECOMPUTE (a no-op outside inductor's tracing)."""
    return tagged(CheckpointPolicy.MUST_RECOMPUTE, active)


@contextlib.contextmanager
def tagged(policy: CheckpointPolicy, active: bool = True):
    """Tag the nodes traced inside with `policy` (a no-op outside inductor's tracing)."""
    if not active or not traced_for_inductor():
        yield
        return
    meta = fx_traceback.get_current_meta()
    before = meta.get("recompute", _MISSING)
    meta["recompute"] = policy
    try:
        yield
    finally:
        if before is _MISSING:
            meta.pop("recompute", None)
        else:
            meta["recompute"] = before
