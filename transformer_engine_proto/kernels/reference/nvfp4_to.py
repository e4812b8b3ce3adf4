"""`nvfp4_dequantize_to`: NVFP4 dequantize straight to a given dtype (bf16 for the emulated GEMM).

Defined as the reference fp32 dequantize rounded once with `.to(dtype)`; fast backends must match
it bit for bit (the Triton kernel rounds the same fp32 value once, in registers).
"""
from __future__ import annotations

import torch

from .. import register_kernel
from .nvfp4 import nvfp4_dequantize


@register_kernel("nvfp4_dequantize_to")
def nvfp4_dequantize_to(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                        columnwise_scale_inv, amax_columnwise, rht: bool = False, rht_seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(M, K) values in `dtype` (see `reference.nvfp4.nvfp4_dequantize`)."""
    return nvfp4_dequantize(rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                            columnwise_scale_inv, amax_columnwise, rht, rht_seed).to(dtype)
