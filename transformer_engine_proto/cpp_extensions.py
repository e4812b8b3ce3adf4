"""TE's `cpp_extensions.general_gemm`, on this package's `gemm`.

TE code (its modules, tests and user code) calls `general_gemm(A, B, out_dtype=..., layout="TN")`
with cuBLAS's column-major naming; in row-major terms the product is

    layout "TN": out = B @ A^T    (a Linear's fprop: A the weight, B the input)
    layout "NN": out = B @ A      (dgrad: A the weight, B the output gradient)
    layout "NT": out = B^T @ A    (wgrad: A the input, B the output gradient)

A quantized operand is read through the usage that product needs (A rowwise for "T", columnwise
for "N"; B columnwise for "T", rowwise for "N"), as TE does. The epilogues TE fuses into cuBLAS
(bias, GELU, its gradient, alpha / beta accumulation, output quantization) are applied after the
product; communication overlap (`ub`) is not ported.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .gemm import gemm
from .tensor.storage import QuantizedTensorStorage

__all__ = ["general_gemm"]

_LAYOUTS = ("TN", "NN", "NT")


def _bare_usage(t, rowwise: bool):
    """A plain tensor as it is; a quantized tensor or storage as a bare storage of one usage."""
    if not isinstance(t, QuantizedTensorStorage):
        return t
    if isinstance(t, torch.Tensor):  # a tensor subclass: its bare storage class over the same buffers
        t = type(t).storage_class._from_buffers(t.get_buffers(), **t.get_metadata())
    return t.only_usage(rowwise)


def general_gemm(A: torch.Tensor, B: torch.Tensor, out_dtype: Optional[torch.dtype] = None,
                 quantization_params=None, gelu: bool = False, gelu_in: Optional[torch.Tensor] = None,
                 alpha: float = 1.0, beta: Optional[float] = None, accumulate: bool = False,
                 layout: str = "TN", out: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
                 use_split_accumulator: bool = False, grad: bool = False, ub=None, ub_type=None,
                 extra_output: Optional[torch.Tensor] = None, bulk_overlap: bool = False
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(out, bias_grad, gelu_input, extra_output), as TE's.

    `bias`: added to the product; with `grad=True` it only names the dtype of `bias_grad`, the sum
    of B over its rows (TE's fused dbias of a wgrad). `gelu`: out = gelu(product) (tanh
    approximation) and `gelu_input` = the product; with `grad=True`, out = product *
    gelu'(gelu_in). `accumulate`: out = alpha * product + beta * out (beta defaults to 1), into
    `out`. `quantization_params`: a quantizer for the output. `use_split_accumulator=False`: a
    per-tensor FP8 GEMM accumulates in the tensor cores' fast mode (`gemm.gemm`)."""
    if layout not in _LAYOUTS:
        raise ValueError(f"general_gemm: layout must be one of {_LAYOUTS}, got {layout!r}")
    if ub is not None or ub_type is not None or extra_output is not None or bulk_overlap:
        raise NotImplementedError("general_gemm: communication overlap (ub, ub_type, extra_output, bulk_overlap: "
                                  "TE's userbuffers) is not ported; run the collective separately")
    if accumulate and out is None:
        raise ValueError("general_gemm: accumulate=True adds into `out`; pass the output tensor")
    if gelu and grad and gelu_in is None:
        raise ValueError("general_gemm: gelu=True with grad=True is the GELU backward; pass gelu_in")
    if out_dtype is None:
        plain = [t for t in (A, B) if not isinstance(t, QuantizedTensorStorage)]
        out_dtype = out.dtype if out is not None else plain[0].dtype if plain else torch.float32
    trans_a, trans_b = layout[0] == "T", layout[1] == "T"
    # out = op_B(B) @ op_A(A): B is `gemm`'s left operand, A its right one
    left = _bare_usage(B, rowwise=not trans_b)
    right = _bare_usage(A, rowwise=trans_a)
    add_bias = bias if (bias is not None and not grad) else None
    epilogue = gelu or alpha != 1.0 or accumulate or quantization_params is not None
    product = gemm(left, right, out_dtype=torch.float32 if epilogue else out_dtype, trans_a=trans_b,
                   trans_b=trans_a, bias=add_bias, use_split_accumulator=use_split_accumulator)
    bias_grad = None
    if bias is not None and grad:
        rows = B.dequantize(dtype=torch.float32) if isinstance(B, QuantizedTensorStorage) else B.float()
        bias_grad = rows.reshape(-1, rows.shape[-1]).sum(0).to(bias.dtype)
    gelu_input = None
    if gelu and not grad:
        gelu_input = product.to(out_dtype)
        product = F.gelu(product, approximate="tanh")
    elif gelu:
        product = torch.ops.aten.gelu_backward(product, gelu_in.float(), approximate="tanh")
    if alpha != 1.0:
        product = product * alpha
    if accumulate:
        product = product + (1.0 if beta is None else beta) * out.float()
    result = product.to(out_dtype)
    if quantization_params is not None:
        return quantization_params.quantize(result), bias_grad, gelu_input, None
    if out is not None:
        out.copy_(result.view(out.shape))
        result = out
    return result, bias_grad, gelu_input, None
