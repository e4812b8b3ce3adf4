"""Per-tensor FP8 (delayed and current scaling): cast with one scale, optional 2D transpose."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import register_kernel
from .common import abs_max, fp8_max, saturating_cast, scale_from_amax, transpose_2d


def _cast(x: torch.Tensor, scale: torch.Tensor, fp8_dtype, rowwise: bool, columnwise: bool):
    data = saturating_cast(x.float() * scale.float(), fp8_dtype)
    x2d = data.reshape(-1, x.shape[-1])
    transpose = transpose_2d(x2d) if columnwise else None
    return (data if rowwise else None), transpose


@register_kernel("amax")
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 tensor of shape (1,) (NaN if x has a NaN; 0 if x is empty)."""
    return abs_max(x)


@register_kernel("fp8_quantize_delayed")
def fp8_quantize_delayed(x, scale, amax_out, fp8_dtype, rowwise, columnwise
                         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Cast with a given scale; max-accumulate this tensor's amax into `amax_out` in place."""
    amax_out.copy_(torch.maximum(amax_out, amax(x).reshape(amax_out.shape)))
    data, transpose = _cast(x, scale, fp8_dtype, rowwise, columnwise)
    return data, transpose, scale.float().reciprocal().reshape(1)


@register_kernel("fp8_quantize_current")
def fp8_quantize_current(x, fp8_dtype, rowwise, columnwise, margin=0, power_2=False, epsilon=0.0):
    """Scale from this tensor's own amax: returns (data, transpose, scale_inv, amax)."""
    a = amax(x)
    scale = scale_from_amax(a, fp8_max(fp8_dtype), margin, power_2, epsilon)
    data, transpose = _cast(x, scale, fp8_dtype, rowwise, columnwise)
    return data, transpose, scale.reciprocal(), a
