"""`saved_state(t)`: a module-state value that backward reads exactly as the forward read it.

The forward reads the delayed-scaling scales from their buffers, and backward needs the same
values (the columnwise copies' scales), but autocast's exit rewrites the input / weight scales in
place in between. AOT's min-cut partitioner may recompute a value in backward from the buffer it
came from (then autograd's version check fails the backward). Routing the value through this op
pins it: under inductor its body is tagged MUST_SAVE, and since the forward uses it the
partitioner saves it; te.checkpoint's compiled policy saves it too. (The gradient scale, read
only by backward, changes at the next autocast entry, after that backward.) Eager and the other
backends see the value itself (no op, no copy).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .inductor_lowering import inline_in_inductor
from .recompute_tags import tagged

__all__ = ["saved_state"]


@torch.library.custom_op("te_proto::saved_state", mutates_args=())
def _saved_state(t: torch.Tensor) -> torch.Tensor:
    # `t * 1.0` is `t` bit for bit; a clone would be deleted (with its tag) by inductor's
    # joint-graph no-op pass before the partitioner sees it
    with tagged(CheckpointPolicy.MUST_SAVE):
        return t * 1.0


@_saved_state.register_fake
def _(t):
    return torch.empty_like(t)


inline_in_inductor(torch.ops.te_proto.saved_state.default, _saved_state._init_fn)


def saved_state(t: torch.Tensor) -> torch.Tensor:
    """`t`, pinned as a value backward must read from forward (a no-op outside torch.compile)."""
    return torch.ops.te_proto.saved_state.default(t) if torch.compiler.is_dynamo_compiling() else t
