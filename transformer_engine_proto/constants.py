"""`DType`: TE's data-type tags, so TE code that names formats by `DType.kFloat8E4M3` ports as is.

Everywhere a quantizer takes a torch dtype it also takes a `DType` (`as_torch_dtype` converts);
quantizers and quantized tensors answer TE's `dtype` / `_fp8_dtype` attributes with a `DType`.
"""
from __future__ import annotations

import enum

import torch

__all__ = ["DType", "TE_DType", "as_torch_dtype", "FP8TensorMeta"]


class DType(enum.IntEnum):
    """TE's `transformer_engine.pytorch.DType` members (same names and integer values)."""

    kByte = 0
    kInt16 = 1
    kInt32 = 2
    kInt64 = 3
    kFloat32 = 4
    kFloat16 = 5
    kBFloat16 = 6
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kFloat8E8M0 = 9
    kFloat4E2M1 = 10

    @classmethod
    def cast(cls, dtype) -> "DType":
        """A `DType` from a `DType`, its integer value or a torch dtype."""
        if isinstance(dtype, torch.dtype):
            try:
                return TE_DType[dtype]
            except KeyError:
                raise TypeError(f"DType: no Transformer Engine data type for {dtype}") from None
        return cls(int(dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPE[self]


_TORCH_DTYPE = {
    DType.kByte: torch.uint8,
    DType.kInt16: torch.int16,
    DType.kInt32: torch.int32,
    DType.kInt64: torch.int64,
    DType.kFloat32: torch.float32,
    DType.kFloat16: torch.float16,
    DType.kBFloat16: torch.bfloat16,
    DType.kFloat8E4M3: torch.float8_e4m3fn,
    DType.kFloat8E5M2: torch.float8_e5m2,
    DType.kFloat8E8M0: torch.float8_e8m0fnu,
    DType.kFloat4E2M1: torch.float4_e2m1fn_x2,
}

# TE's name for the torch dtype -> DType map
TE_DType = {torch_dtype: te_dtype for te_dtype, torch_dtype in _TORCH_DTYPE.items()}


def as_torch_dtype(dtype):
    """The torch dtype for a `DType` (anything else is returned unchanged for the caller to check)."""
    if isinstance(dtype, DType):
        return dtype.torch_dtype
    return dtype


class FP8TensorMeta:
    """TE's `tex.FP8TensorMeta`: one pass's delayed-scaling `scale`, `scale_inv` and `amax_history`
    (a module's `fp8_meta["scaling_fwd"]` / `["scaling_bwd"]` are these)."""

    def __init__(self, scale=None, scale_inv=None, amax_history=None):
        self.scale, self.scale_inv, self.amax_history = scale, scale_inv, amax_history

    def __repr__(self) -> str:
        return f"FP8TensorMeta(scale={self.scale}, scale_inv={self.scale_inv}, amax_history={self.amax_history})"
