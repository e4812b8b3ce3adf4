"""`DType`: TE's data-type tags, so TE code that names formats by `DType.kFloat8E4M3` ports as is.

Everywhere a quantizer takes a torch dtype it also takes a `DType` (`as_torch_dtype` converts);
quantizers and quantized tensors answer TE's `dtype` / `_fp8_dtype` attributes with a `DType`.
"""
from __future__ import annotations

import enum

import torch

__all__ = ["DType", "TE_DType", "as_torch_dtype", "FP8TensorMeta", "fused_amax_and_scale_update_after_reduction"]


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


def fused_amax_and_scale_update_after_reduction(amax_reduction_buffer, amax_histories, scales,
                                                amax_compute_algo: str, fp8_dtype, margin: float) -> None:
    """TE's multi-tensor delayed-scaling update (`tex`), in place, for TE-layout state (each
    history `(length, n)`, each scale `(n,)`). The buffer holds every history's reduced newest
    amaxes back to back; a 0 there means "take the history's row 0". A nonzero newest amax
    rolls its history (row i takes row i + 1, the last row takes the newest, row 0 is zeroed);
    the scale becomes `fp8_max * 2**-margin / amax` (amax: the newest, or the max over the
    rolled history), kept where amax is 0, inf or NaN, and float32's max where it overflows."""
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"fused_amax_and_scale_update_after_reduction: amax_compute_algo must be 'max' or "
                         f"'most_recent', got {amax_compute_algo!r}")
    scaled_max = torch.finfo(as_torch_dtype(DType(fp8_dtype))).max * 2.0 ** -margin
    offset = 0
    for history, scale in zip(amax_histories, scales):
        h = history.view(history.shape[0], -1)
        n = h.shape[1]
        reduced = amax_reduction_buffer[offset:offset + n] if amax_reduction_buffer is not None else h[0]
        offset += n
        newest = torch.where(reduced != 0, reduced, h[0])
        shifted = torch.cat([h[1:], newest[None]])  # row i: what row i holds after the roll (row 0 aside)
        rolls = newest != 0
        amax = torch.where(rolls, shifted.amax(0), 0.0) if amax_compute_algo == "max" else newest
        h.copy_(torch.where(rolls, torch.cat([torch.zeros_like(h[:1]), shifted[1:]]), h))
        s = scale.view(-1)
        new = torch.where(torch.isfinite(amax) & (amax > 0), scaled_max / amax, s)
        s.copy_(torch.where(torch.isinf(new), torch.finfo(torch.float32).max, new))
