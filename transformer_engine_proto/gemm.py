"""One `gemm` for every format: out = op(a) @ op(b) (+ bias), op = optional transpose.

Operands are plain tensors, or quantized tensors or bare storages (`internal=True`) holding
exactly the usage the product needs (the ops drop the other usage before calling). Paths, picked
by format and device:

- CUDA, per-tensor FP8: `torch._scaled_mm` tensorwise. A must be row-major op(a) and B
  column-major op(b); the rowwise data of X is row-major X and the FP8 transpose is row-major X^T,
  so every GEMM of fprop/dgrad/wgrad reads existing buffers with no transpose copy.
- CUDA, FP8 blockwise: `F.scaled_mm` with 1x128 / 128x128 block scales (the v2 API: the v1 API
  silently mis-reads 128x128 scales unless K/128 is a multiple of 4); 128x128 scales are padded
  to a multiple of 4 blocks along the reduction dim (a copy of a few KB).
- CUDA, MXFP8/NVFP4 on GPUs with block-scaled MMA (compute capability 10.x / 12.x): one native
  `F.scaled_mm` (`block_scaled_gemm.py`).
- CUDA otherwise (MXFP8/NVFP4 on Hopper, shapes cuBLAS rejects): dequantize to bf16 and matmul.
  For the NVFP4 wgrad (both operands columnwise, reduced over the tokens) the columnwise buffers
  are dequantized as they are stored, op(x) = x^T already, and the random Hadamard transform is
  not undone: H is orthonormal and both operands carry it along the reduction dim, so
  (H a)^T (H b) = a^T b. That saves two inverse transforms and two transposes per step.
- CPU: dequantize to float32 and matmul -- exact for the quantized values, so it is the numerical
  reference the fast paths are compared against.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .block_scaled_gemm import block_scaled_mm, native_layouts
from .kernels import kernel
from .tensor.float8 import Float8TensorStorage
from .tensor.float8_blockwise import Float8BlockwiseQTensorStorage
from .tensor.mxfp8 import MXFP8TensorStorage
from .tensor.nvfp4 import NVFP4TensorStorage
from .tensor.storage import QuantizedTensorStorage

__all__ = ["gemm", "emulated_gemm"]


def _values(t: torch.Tensor, transpose: bool, dtype: torch.dtype) -> torch.Tensor:
    v = t.dequantize(dtype=dtype) if isinstance(t, QuantizedTensorStorage) else t.to(dtype)
    v = v.reshape(-1, v.shape[-1])
    return v.t() if transpose else v


def emulated_gemm(a, b, *, out_dtype, trans_a=False, trans_b=False, bias=None, compute_dtype=torch.float32):
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
def _rowmajor_fp8(t: Float8TensorStorage, transpose: bool) -> Optional[torch.Tensor]:
    """Row-major fp8 matrix of t (transpose=False) or t^T (True) from existing buffers."""
    if transpose:
        return t._transpose
    return None if t._data is None else t._data.reshape(-1, t._shape[-1])


def _tensorwise(a, b, trans_a, trans_b, out_dtype, bias):
    a_mat = _rowmajor_fp8(a, trans_a)  # (M, K) row-major
    b_rows = _rowmajor_fp8(b, not trans_b)  # (N, K) row-major, i.e. B column-major
    if a_mat is None or b_rows is None:
        return None
    k, n = a_mat.shape[1], b_rows.shape[0]
    if k % 16 or n % 16 or (a.fp8_dtype == b.fp8_dtype == torch.float8_e5m2):
        return None
    fused_bias = bias is not None and out_dtype == torch.bfloat16 and bias.dtype == torch.bfloat16
    out = torch._scaled_mm(a_mat, b_rows.t(), a._scale_inv, b._scale_inv,
                           bias=bias if fused_bias else None, out_dtype=out_dtype)
    if bias is not None and not fused_bias:
        out = (out.float() + bias.float()).to(out_dtype)
    return out


# ---- FP8 blockwise ------------------------------------------------------------------------------
def _block_operand(t: Float8BlockwiseQTensorStorage, transpose: bool):
    """(row-major fp8 matrix of op(t), its scales, block dim) from t's existing buffers."""
    if transpose:
        return t._columnwise_data, t._columnwise_scale_inv
    if t._rowwise_data is None:
        return None, None
    return t._rowwise_data.reshape(-1, t._shape[-1]), t._rowwise_scale_inv


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
    a_mat, sa = _block_operand(a, trans_a)  # (M, K)
    b_rows, sb = _block_operand(b, not trans_b)  # (N, K)
    if a_mat is None or b_rows is None or a.block_scaling_dim == 2 and b.block_scaling_dim == 2:
        return None
    m, k = a_mat.shape
    n = b_rows.shape[0]
    if k % 128 or n % 16 or m % 4:
        return None
    st = F.ScalingType
    if a.block_scaling_dim == 2:
        rec_a, sa = st.BlockWise128x128, _pad_128x128(sa)
    else:
        rec_a = st.BlockWise1x128
    if b.block_scaling_dim == 2:
        rec_b, sb = st.BlockWise128x128, _pad_128x128(sb)
    else:
        rec_b = st.BlockWise1x128  # stored as (N, kb) with strides (1, N): what v2 wants
    out = F.scaled_mm(a_mat, b_rows.t(), sa, rec_a, sb, rec_b, output_dtype=out_dtype)
    if bias is not None:
        out = (out.float() + bias.float()).to(out_dtype)
    return out


# ---- NVFP4 wgrad on Hopper (emulated) ---------------------------------------------------------------
def _stored_columnwise(t: NVFP4TensorStorage, dtype) -> torch.Tensor:
    """x^T (K, M) as stored (after the RHT, if any), dequantized to `dtype`."""
    return kernel("nvfp4_dequantize_to", t._columnwise_data.device)(
        t._columnwise_data, t._columnwise_scale_inv, t._amax_columnwise, None, None, None,
        dtype=dtype)


def _nvfp4_wgrad(a, b, trans_a, trans_b, out_dtype, bias):
    """a^T @ b from both columnwise buffers, or None when the shortcut does not apply."""
    if not (trans_a and not trans_b and isinstance(a, NVFP4TensorStorage) and isinstance(b, NVFP4TensorStorage)):
        return None
    if a._columnwise_data is None or b._columnwise_data is None:
        return None
    if a._rowwise_data is not None or b._rowwise_data is not None:
        return None  # only-usage views are what the ops pass; anything else takes the plain path
    if a.with_rht != b.with_rht or (a.with_rht and a.rht_seed != b.rht_seed):
        return None  # the rotations must cancel
    a_t = _stored_columnwise(a, torch.bfloat16)  # (N, M)
    b_t = _stored_columnwise(b, torch.bfloat16)  # (K, M)
    out = a_t @ b_t.t()
    if bias is not None:
        out = out.float() + bias.float()
    return out.to(out_dtype)


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
    return statically_known_true(math.prod(shape) == 0)


def gemm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: torch.dtype, trans_a: bool = False,
         trans_b: bool = False, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """op(a) (M,K) @ op(b) (K,N), + bias, in out_dtype. An empty operand (no tokens) takes the
    emulated path: a matmul gives the empty output, or zeros for a reduction over no tokens."""
    a_quantized = isinstance(a, QuantizedTensorStorage)
    device = a._buffer_device() if a_quantized else a.device
    if device.type == "cuda" and not (_empty(a) or _empty(b)):
        out = None
        if isinstance(a, Float8TensorStorage) and isinstance(b, Float8TensorStorage):
            out = _tensorwise(a, b, trans_a, trans_b, out_dtype, bias)
        elif isinstance(a, Float8BlockwiseQTensorStorage) and isinstance(b, Float8BlockwiseQTensorStorage):
            out = _blockwise(a, b, trans_a, trans_b, out_dtype, bias)
        elif isinstance(a, (MXFP8TensorStorage, NVFP4TensorStorage)):
            layouts = native_layouts(device)
            if layouts is not None:
                out = block_scaled_mm(a, b, trans_a, trans_b, out_dtype, bias, layouts)
            if out is None and isinstance(a, NVFP4TensorStorage):
                out = _nvfp4_wgrad(a, b, trans_a, trans_b, out_dtype, bias)
        if out is not None:
            return out
        if not a_quantized and not isinstance(b, QuantizedTensorStorage):
            return _high_precision(a, b, trans_a, trans_b, out_dtype, bias)
        return emulated_gemm(a, b, out_dtype=out_dtype, trans_a=trans_a, trans_b=trans_b, bias=bias,
                             compute_dtype=torch.bfloat16)
    return emulated_gemm(a, b, out_dtype=out_dtype, trans_a=trans_a, trans_b=trans_b, bias=bias)
