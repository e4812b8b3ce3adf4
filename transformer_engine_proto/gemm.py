"""One `gemm` for every format: out = op(a) @ op(b) (+ bias), op = optional transpose.

Operands are plain tensors or quantized tensors holding exactly the usage the product needs (the
ops drop the other usage before calling). This is the emulated path: dequantize each operand and
multiply in float32 -- exact for the quantized values, so it is the numerical reference for the
fast `torch._scaled_mm` paths that slot in here by format and device.
"""
from __future__ import annotations

from typing import Optional

import torch

from .tensor import QuantizedTensor

__all__ = ["gemm"]


def _values(t: torch.Tensor, transpose: bool) -> torch.Tensor:
    v = t.dequantize(dtype=torch.float32) if isinstance(t, QuantizedTensor) else t.float()
    v = v.reshape(-1, v.shape[-1])
    return v.t() if transpose else v


def gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype, trans_a: bool = False,
         trans_b: bool = False, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """op(a) (M,K) @ op(b) (K,N) in float32, + bias, cast to out_dtype."""
    a2, b2 = _values(a, trans_a), _values(b, trans_b)
    if a2.shape[1] != b2.shape[0]:
        raise ValueError(f"gemm: inner dims differ: {tuple(a2.shape)} @ {tuple(b2.shape)}")
    out = a2 @ b2
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
