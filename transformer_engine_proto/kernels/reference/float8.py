"""Per-tensor FP8 (delayed and current scaling): cast with one scale, optional 2D transpose.

Non-finite inputs (`common`): current scaling takes its scale from the amax of the finite values;
the cast keeps inf / NaN non-finite. Delayed scaling records the amax of every value, so an inf or
NaN shows in the amax it hands back (the module skips and counts it in its history)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import register_kernel
from .common import abs_max, fp8_max, scale_from_amax, scaled_cast, transpose_2d, true_div


def _cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool):
    data = scaled_cast(x, scale, fp8_dtype)
    x2d = data.reshape(-1, x.shape[-1])
    transpose = transpose_2d(x2d) if columnwise else None
    return (data if rowwise else None), transpose


@register_kernel("amax")
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite values of x, as a float32 tensor of shape (1,) (0 if x is empty or
    has no finite value): the amax a current scale is computed from."""
    return abs_max(x, finite=True)


@register_kernel("fp8_quantize_delayed")
def fp8_quantize_delayed(x, scale, amax_out, fp8_dtype, rowwise, columnwise, slot=0
                         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Cast with scale[slot]; max-accumulate max |x| of every value (inf / NaN included) into
    amax_out[slot] in place (amax_out None: no amax taken). A GEMM's quantizes read its scales
    (slots 0 input, 1 weight, 2 gradient) and its forward records into one (2,) amax buffer, slots
    0 and 1; a one-element buffer is its own element for any slot (backward's (1,) gradient amax)."""
    check_slot(scale, amax_out, slot)
    if amax_out is not None:
        amax = _element(amax_out, slot)
        amax.copy_(torch.maximum(amax, abs_max(x).reshape(amax.shape)))
    scale = _element(scale, slot)
    data, transpose = _cast(x, scale, fp8_dtype, rowwise, columnwise)
    return data, transpose, true_div(1.0, scale.float()).reshape(1)


def check_slot(scale: torch.Tensor, amax_out: Optional[torch.Tensor], slot: int) -> None:
    """`slot` must index both buffers (a longer one 1-D; a one-element one is its own slot)."""
    for name, t in (("scale", scale), ("amax_out", amax_out)):
        if t is not None and not (slot >= 0 and t.numel() == 1 or t.dim() == 1 and 0 <= slot < t.numel()):
            raise ValueError(f"fp8_quantize_delayed: slot {slot} is not an element of {name} (shape "
                             f"{tuple(t.shape)}): expected a one-element tensor or a 1-D buffer")


def _element(t: torch.Tensor, slot: int) -> torch.Tensor:
    """t[slot] as a view (written in place through it)."""
    return t if t.numel() == 1 else t[slot:slot + 1]


@register_kernel("fp8_quantize_current")
def fp8_quantize_current(x, fp8_dtype, rowwise, columnwise, margin=0, power_2=False, epsilon=0.0,
                         existing_amax=None):
    """Scale from this tensor's own amax (of its finite values): returns (data, transpose,
    scale_inv, amax). `existing_amax`: that amax, taken already (TE's use_existing_amax): no
    pass to take it again."""
    a = amax(x) if existing_amax is None else existing_amax
    scale = scale_from_amax(a, fp8_max(fp8_dtype), margin, power_2, epsilon)
    data, transpose = _cast(x, scale, fp8_dtype, rowwise, columnwise)
    return data, transpose, true_div(1.0, scale), a
