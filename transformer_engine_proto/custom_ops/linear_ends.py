"""The ends every Linear path shares (the op, the eager programs, the debug tools' GEMM pair): the
scales a backward reads, the order of a backward's outputs and the side effects after it, so the
paths differ only in how they compute their GEMMs."""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..kernels.reference.common import traced
from .delayed_scaling import record_grad_amax
from .linear_call import LinearCall

__all__ = ["scales_for_backward", "backward_tail", "fake_backward_grads", "finish_backward"]


def scales_for_backward(fp8_scale):
    """The delayed-scaling scales backward reads. Eager, a snapshot of slots 0-2 (the update at
    autocast exit rewrites the state in place). Traced, the scales are values already pinned for
    backward (`saved_state`), kept as they are: a snapshot would cost a small generated kernel per
    backward quantize that reads it."""
    if fp8_scale is None or traced(fp8_scale):
        return fp8_scale
    return fp8_scale[:3].clone()


def backward_tail(grads: List[torch.Tensor], dy: torch.Tensor, bias_requires_grad: bool, weight_dtype: torch.dtype,
                  grad_amax: Optional[torch.Tensor]) -> List[torch.Tensor]:
    """`grads` + [dbias (from the high-precision dy)] + [the gradient amax (delayed scaling)]: the
    end of every Linear backward op's output list, in the order `finish_backward` reads."""
    if bias_requires_grad:
        grads.append(dy.float().sum(0).to(weight_dtype))
    if grad_amax is not None:
        grads.append(grad_amax)
    return grads


def fake_backward_grads(grad_out, call: LinearCall, in_shape, weight_shape, weight_dtype, delayed: bool):
    """Empty tensors shaped as a Linear backward op's outputs (`backward_tail`'s order)."""
    grads = []
    if call.computes_dgrad:
        grads.append(grad_out.new_empty(tuple(in_shape)))
    if call.computes_wgrad:
        dtype = torch.float32 if call.fuse_wgrad_accumulation else weight_dtype
        grads.append(grad_out.new_empty(tuple(weight_shape), dtype=dtype))
    if call.bias_requires_grad:
        grads.append(grad_out.new_empty((weight_shape[0],), dtype=weight_dtype))
    if delayed:
        grads.append(grad_out.new_empty((1,), dtype=torch.float32))
    return grads


def finish_backward(call: LinearCall, grads: Sequence[torch.Tensor], grad_amax_state, main_grad):
    """(dgrad, wgrad, dbias) from a Linear backward op's outputs ([dgrad] [wgrad] [dbias] [grad
    amax], by the call's flags): records the gradient amax (delayed scaling) and accumulates wgrad into
    `main_grad` (then returned as None), the two side effects every Linear path shares."""
    grads = iter(grads)
    dgrad = next(grads) if call.computes_dgrad else None
    wgrad = next(grads) if call.computes_wgrad else None
    dbias = next(grads) if call.bias_requires_grad else None
    if grad_amax_state:
        record_grad_amax(grad_amax_state, next(grads))
    if call.fuse_wgrad_accumulation and wgrad is not None:
        main_grad.add_(wgrad)
        wgrad = None
    return dgrad, wgrad, dbias
