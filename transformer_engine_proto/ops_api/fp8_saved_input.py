"""An activation whose input is saved for backward in FP8 (TE's `cache_quantized_input=True`).

Why: the activation's input is the widest tensor of an MLP; keeping it for backward in FP8
(E4M3, current scaling, rowwise) instead of its own precision quarters (float32) or halves
(bf16) that memory. The forward uses the input as given, as TE's; the backward differentiates
the activation at the dequantized copy, so the input gradient carries its quantization error,
as TE's does.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..tensor import Float8CurrentScalingQuantizer

__all__ = ["activation_with_fp8_saved_input"]

_QUANTIZER = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, rowwise_usage=True, columnwise_usage=False)


class _FP8SavedInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: Callable, x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.x_fp8 = _QUANTIZER(x.detach())  # a QuantizedTensor: held on ctx, not in saved_tensors
        return fn(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x = ctx.x_fp8.dequantize()
        ctx.x_fp8 = None
        _, vjp = torch.func.vjp(ctx.fn, x)  # torch.func, not autograd.grad: dynamo traces it
        (dx,) = vjp(dy)
        return None, dx


def activation_with_fp8_saved_input(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x), with x kept in FP8 for the backward of `fn` (which must be differentiable torch code)."""
    return _FP8SavedInput.apply(fn, x)
