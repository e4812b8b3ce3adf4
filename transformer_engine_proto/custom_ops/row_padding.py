"""Zero-padding of a GEMM's tokens to the recipe's row block: the one place it is decided.

MXFP8 (32) and NVFP4 (16) quantize the wgrad operands (the input and grad_output, columnwise) in
blocks that run along the tokens, so a token count that is not a multiple of the block cannot be
quantized as it is. The Linear op (and the fused norm + quantize that feeds it) appends zero rows
to both operands up to the block: zeros change no block's amax and add nothing to
wgrad = dy^T x, and the output / dgrad rows they produce are sliced off. The padded row count is
part of the buffers `LinearPlan` describes, so the fake impls agree with the real ones. Sizes
stay symbolic under torch.compile (a dynamic batch pads by an expression, never by an int()).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .recipe_key import RecipeKey

__all__ = ["gemm_rows", "pad_rows", "unpad_rows"]


@functools.lru_cache(maxsize=None)
def _wgrad_row_block(key: str) -> int:
    q = RecipeKey.quantizers(key)
    if not q.enabled:
        return 1
    return max(getattr(q, role).with_usage(rowwise=False, columnwise=True).row_block()
               for role in ("input", "grad_output"))


def gemm_rows(m, key: str, wgrad: bool):
    """The rows a GEMM's input and grad_output are quantized with: `m` (an int or SymInt) rounded
    up to the recipe's row block when wgrad runs (their columnwise copies block along the rows)."""
    b = _wgrad_row_block(key) if wgrad else 1
    return m if b == 1 else (m + b - 1) // b * b


def pad_rows(x2d: torch.Tensor, rows) -> torch.Tensor:
    """x2d (m, K) with zero rows appended up to `rows` rows."""
    if statically_known_true(x2d.shape[0] == rows):
        return x2d
    return F.pad(x2d, (0, 0, 0, rows - x2d.shape[0]))


def unpad_rows(x2d: torch.Tensor, m) -> torch.Tensor:
    """The first `m` rows of x2d (a view)."""
    if statically_known_true(x2d.shape[0] == m):
        return x2d
    return x2d[:m]
