"""Quantize and dequantize are differentiable, the gradient passing straight through, as in TE.

`quantizer(x)` of a tensor that requires grad gives a quantized tensor that requires grad, and
`t.dequantize()` of one gives a high-precision tensor in the same graph: user code that quantizes
in its forward (fake quantization, a weight quantized each step) trains as it would in TE. Without
this the result would silently leave autograd's graph and its inputs would get no gradient.

Only calls above autograd record a node: not those inside an op body or a `__torch_dispatch__`
(autograd has already run there, on the op itself), nor bare storages, which are no tensors.
"""
from __future__ import annotations

import torch

__all__ = ["tracks_grad", "QuantizeStraightThrough", "DequantizeStraightThrough"]

_AUTOGRAD = torch._C.DispatchKey.AutogradFunctionality


def tracks_grad(t: torch.Tensor) -> bool:
    """Whether autograd should record an op on `t` called from here: `t` requires grad, grad mode
    is on and the call runs above autograd (dynamo traces user code, which is above it)."""
    if not (t.requires_grad and torch.is_grad_enabled()):
        return False
    return torch.compiler.is_dynamo_compiling() or not torch._C._dispatch_tls_is_dispatch_key_excluded(_AUTOGRAD)


class QuantizeStraightThrough(torch.autograd.Function):
    """`quantize(x)`: the quantized tensor's gradient is x's."""

    @staticmethod
    def forward(ctx, x, quantize):
        return quantize(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class DequantizeStraightThrough(torch.autograd.Function):
    """`t.dequantize(dtype)`: the result's gradient is t's, in t's nominal dtype."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = t.dtype
        return t._dequantize(dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None
