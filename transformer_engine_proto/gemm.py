"""One `gemm` for every format: out = op(a) @ op(b) (+ bias), op = optional transpose.

Operands are plain tensors, or quantized tensors or bare storages (`internal=True`) holding
exactly the usage the product needs (the ops drop the other usage before calling). Paths, picked
by format and device:

- CUDA, per-tensor FP8: `torch._scaled_mm` tensorwise. A must be row-major op(a) and B
  column-major op(b); the rowwise data of X is row-major X and the FP8 transpose is row-major X^T,
  so every GEMM of fprop/dgrad/wgrad reads existing buffers with no transpose copy.
- CUDA, FP8 blockwise: `F.scaled_mm` with 1x128 / 128x128 block scales (the v2 API: the v1 API
  silently mis-reads 128x128 scales unless K/128 is a multiple of 4); 128x128 scales are padded
  to a multiple of 4 blocks along the reduction dim (a copy of a few KB). K must be a multiple of
  128, and a 128x128 operand's other dim too (a Linear's in_features, for dgrad): else emulated.
- CUDA, MXFP8/NVFP4 on GPUs with block-scaled MMA (compute capability 10.x / 12.x): one native
  `F.scaled_mm` (`block_scaled_gemm.py`).
- CUDA otherwise (MXFP8/NVFP4 on Hopper, shapes cuBLAS rejects): dequantize to bf16 and matmul.
  For the NVFP4 wgrad (both operands columnwise, reduced over the tokens) the columnwise buffers
  are dequantized as they are stored, op(x) = x^T already, and the random Hadamard transform is
  not undone: H is orthonormal and both operands carry it along the reduction dim, so
  (H a)^T (H b) = a^T b. That saves two inverse transforms and two transposes per step.
- CPU: dequantize to float32 and matmul -- exact for the quantized values, so it is the numerical
  reference the fast paths are compared against.

The path is chosen by asking the operands (the format capabilities, `tensor/format_api.py`):
`gemm_native()` names the native path of two operands of one format, `gemm_operand()` hands over
the stored buffers it reads, and `gemm_emulated()` a format's cheaper emulation (NVFP4's wgrad).
No format class is named here.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .block_scaled_gemm import block_scaled_mm, native_layouts
from .tensor.storage import QuantizedTensorStorage

__all__ = ["gemm", "emulated_gemm", "tensorwise_mm"]


def _values(t: torch.Tensor, transpose: bool, dtype: torch.dtype) -> torch.Tensor:
    v = t.dequantize(dtype=dtype) if isinstance(t, QuantizedTensorStorage) else t.to(dtype)
    v = v.reshape(-1, v.shape[-1])
    return v.t() if transpose else v


def emulated_gemm(a, b, *, out_dtype, trans_a=False, trans_b=False, bias=None, compute_dtype=torch.float32,
                  dequantize_in: Callable[[], ContextManager] = contextlib.nullcontext):
    with dequantize_in():
        a2, b2 = _values(a, trans_a, compute_dtype), _values(b, trans_b, compute_dtype)
    if a2.shape[1] != b2.shape[0]:
        raise ValueError(f"gemm: inner dims differ: {tuple(a2.shape)} @ {tuple(b2.shape)}")
    out = a2 @ b2
    if bias is None:
        # one cast (none when the dtypes match): equal to the float32 round trip bit for bit, since
        # widening a bf16/fp32 product to float32 is exact; saves two passes over the output
        return out.to(out_dtype)
    return (out.float() + bias.float()).to(out_dtype)


# ---- per-tensor FP8 -----------------------------------------------------------------------------
def _tensorwise(a, b, trans_a, trans_b, out_dtype, bias, fast_accum):
    pa = a.gemm_operand(reduce_last=not trans_a)  # (M, K) row-major
    pb = b.gemm_operand(reduce_last=trans_b)  # (N, K) row-major, i.e. B column-major
    if pa is None or pb is None:
        return None
    a_mat, b_rows = pa.data, pb.data
    k, n = a_mat.shape[1], b_rows.shape[0]
    if k % 16 or n % 16 or (a_mat.dtype == b_rows.dtype == torch.float8_e5m2):
        return None
    return tensorwise_mm(a_mat, b_rows, pa.scale, pb.scale, out_dtype, bias, fast_accum)


def tensorwise_mm(a_rows, b_rows, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum: bool) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T, both row-major FP8 with one scale_inv each: the per-tensor FP8 GEMM's
    one `torch._scaled_mm` call (the bias fused where cuBLAS takes it), shared with the eager
    Linear programs (custom_ops/eager_program.py), which must make the same call."""
    fused_bias = bias is not None and out_dtype == torch.bfloat16 and bias.dtype == torch.bfloat16
    out = torch._scaled_mm(a_rows, b_rows.t(), a_scale_inv, b_scale_inv,
                           bias=bias if fused_bias else None, out_dtype=out_dtype, use_fast_accum=fast_accum)
    if bias is not None and not fused_bias:
        out = (out.float() + bias.float()).to(out_dtype)
    return out


# ---- FP8 blockwise ------------------------------------------------------------------------------
def _pad_128x128(scale: torch.Tensor) -> torch.Tensor:
    """(blocks_out, blocks_k) scales -> the (L4, blocks_out) stride-(1, L4) layout cuBLAS wants.
    A contiguous scale whose blocks_k is already a multiple of 4 has that layout as its
    transpose: no copy (two kernels and two allocations less per weight GEMM)."""
    rows, kb = scale.shape
    l4 = (kb + 3) // 4 * 4
    if l4 == kb and scale.is_contiguous():
        return scale.t()
    padded = scale.new_zeros(rows, l4)
    padded[:, :kb] = scale
    return padded.t()


def _blockwise(a, b, trans_a, trans_b, out_dtype, bias):
    if not hasattr(F, "scaled_mm"):
        return None
    pa = a.gemm_operand(reduce_last=not trans_a)  # (M, K) row-major and its tile scales
    pb = b.gemm_operand(reduce_last=trans_b)  # (N, K)
    if pa is None or pb is None or pa.block[0] > 1 and pb.block[0] > 1:
        return None  # two 128x128 operands: no such kernel
    a_mat, sa, b_rows, sb = pa.data, pa.scale, pb.data, pb.scale
    m, k = a_mat.shape
    n = b_rows.shape[0]
    if k % 128 or n % 16 or m % 4:
        return None
    if pa.block[0] > 1 and m % 128 or pb.block[0] > 1 and n % 128:
        return None  # cuBLAS reads a 128x128 operand's scales as (K/128, outer dim / 128): whole tiles only
    st = F.ScalingType
    if pa.block[0] > 1:
        rec_a, sa = st.BlockWise128x128, _pad_128x128(sa)
    else:
        rec_a = st.BlockWise1x128
    if pb.block[0] > 1:
        rec_b, sb = st.BlockWise128x128, _pad_128x128(sb)
    else:
        rec_b = st.BlockWise1x128  # stored as (N, kb) with strides (1, N): what v2 wants
    out = F.scaled_mm(a_mat, b_rows.t(), sa, rec_a, sb, rec_b, output_dtype=out_dtype)
    if bias is not None:
        out = (out.float() + bias.float()).to(out_dtype)
    return out


# ---- a format's own emulation (NVFP4's wgrad on Hopper) --------------------------------------------
def _emulated_by_format(a, b, trans_a, trans_b, out_dtype, bias):
    """The format's cheaper emulation of op(a) @ op(b) (`gemm_emulated`), or None."""
    if not isinstance(a, QuantizedTensorStorage):
        return None
    return a.gemm_emulated(b, trans_a, trans_b, out_dtype, bias)


_nvfp4_wgrad = _emulated_by_format  # the name tests/test_cuda.py calls (NVFP4's is the only one)


def _high_precision(a, b, trans_a, trans_b, out_dtype, bias):
    """Plain tensors on CUDA: one cuBLAS call in the operands' dtype, like torch.nn.Linear."""
    a2 = a.reshape(-1, a.shape[-1]).to(out_dtype)
    b2 = b.reshape(-1, b.shape[-1]).to(out_dtype)
    a2 = a2.t() if trans_a else a2
    b2 = b2.t() if trans_b else b2
    if bias is not None:
        return torch.addmm(bias.to(out_dtype), a2, b2)
    return a2 @ b2


def _empty(t) -> bool:
    shape = t._shape if isinstance(t, QuantizedTensorStorage) else t.shape
    n = math.prod(shape)
    return n == 0 if type(n) is int else statically_known_true(n == 0)  # eager: no symbolic machinery


def _same_format(a, b) -> bool:
    return isinstance(b, QuantizedTensorStorage) and a.format_name() == b.format_name()


def gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype, trans_a: bool = False,
         trans_b: bool = False, bias: Optional[torch.Tensor] = None,
         dequantize_in: Callable[[], ContextManager] = contextlib.nullcontext,
         use_split_accumulator: bool = True) -> torch.Tensor:
    """op(a) (M,K) @ op(b) (K,N), + bias, in out_dtype. An empty operand (no tokens) takes the
    emulated path: a matmul gives the empty output, or zeros for a reduction over no tokens.
    `dequantize_in`: the context the emulated path dequantizes the operands in (the Linear op
    tags them for inductor's partitioner). `use_split_accumulator=False`: a native per-tensor FP8
    GEMM accumulates in the tensor cores' fast mode (recipe.MMParams); other paths ignore it."""
    a_quantized = isinstance(a, QuantizedTensorStorage)
    device = a._buffer_device() if a_quantized else a.device
    if device.type == "cuda" and not (_empty(a) or _empty(b)):
        out = None
        path = a.gemm_native() if a_quantized else None
        if path is not None and _same_format(a, b):
            if path == "tensorwise":
                out = _tensorwise(a, b, trans_a, trans_b, out_dtype, bias, not use_split_accumulator)
            elif path == "blockwise":
                out = _blockwise(a, b, trans_a, trans_b, out_dtype, bias)
            elif path == "block_scaled":
                layouts = native_layouts(device)
                if layouts is not None:
                    out = block_scaled_mm(a, b, trans_a, trans_b, out_dtype, bias, layouts)
            else:
                raise NotImplementedError(f"gemm: {type(a).__name__}.gemm_native() named an unknown path {path!r}")
        if out is None and a_quantized:
            out = a.gemm_emulated(b, trans_a, trans_b, out_dtype, bias)
        if out is not None:
            return out
        if not a_quantized and not isinstance(b, QuantizedTensorStorage):
            return _high_precision(a, b, trans_a, trans_b, out_dtype, bias)
        return emulated_gemm(a, b, out_dtype=out_dtype, trans_a=trans_a, trans_b=trans_b, bias=bias,
                             compute_dtype=torch.bfloat16, dequantize_in=dequantize_in)
    return emulated_gemm(a, b, out_dtype=out_dtype, trans_a=trans_a, trans_b=trans_b, bias=bias,
                         dequantize_in=dequantize_in)
