"""MXFP8: fp8 data with one E8M0 (power-of-two) scale per block of 32 values.

Buffers (all contiguous, no padding or swizzle), in flatten order:
`_rowwise_data` (logical shape, fp8), `_rowwise_scale_inv` (M, K/32) e8m0,
`_columnwise_data` (logical shape, fp8, NOT transposed), `_columnwise_scale_inv` (M/32, K) e8m0,
where M is the product of the leading dims and K the last dim. The two usages block along
different dims, so neither can be derived from the other without the original values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

from ..kernels import kernel
from ..kernels.reference.common import FP8_MAX, fp8_max
from .format_api import GatherRule, GemmOperand, UsageView
from .quantized_tensor import QuantizedTensor
from .quantizer import BufferSpec, Quantizer, flat_2d, te_constructor
from .storage import QuantizedTensorStorage

__all__ = ["MXFP8TensorStorage", "MXFP8Tensor", "MXFP8Quantizer", "MXFP8_BLOCK_SIZE"]

MXFP8_BLOCK_SIZE = 32
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALE_DTYPE = torch.float8_e8m0fnu


class MXFP8TensorStorage(QuantizedTensorStorage):
    _FLATTEN_TENSOR_BUFFERS = (
        ("_rowwise_data", "rowwise_data"),
        ("_rowwise_scale_inv", "rowwise_scale_inv"),
        ("_columnwise_data", "columnwise_data"),
        ("_columnwise_scale_inv", "columnwise_scale_inv"),
    )
    _META_FIELDS = ("fp8_dtype",)
    # Scales are 2D over (M, K) and stay as they are under views that keep the last dim.
    _LOGICAL_SHAPE_BUFFERS = ("_rowwise_data", "_columnwise_data")

    def has_rowwise(self) -> bool:
        return self._rowwise_data is not None

    def has_columnwise(self) -> bool:
        return self._columnwise_data is not None

    def _dequantize(self, dtype):
        dequant = kernel("mxfp8_dequantize", self._buffer_device())
        if self._rowwise_data is not None:
            out = dequant(self._rowwise_data, self._rowwise_scale_inv, False, dtype)
        else:
            out = dequant(self._columnwise_data, self._columnwise_scale_inv, True, dtype)
        return out.reshape(self._shape)

    def _drop_usage(self, rowwise, columnwise) -> None:
        if not rowwise:
            self._rowwise_data = self._rowwise_scale_inv = None
        if not columnwise:
            self._columnwise_data = self._columnwise_scale_inv = None

    # Base `_make_columnwise_from_rowwise` (an error) is kept: columnwise blocks need the
    # original values. Base `_transpose_buffers` (None) is kept: a transpose would change the
    # block direction, so t() falls back to the dequantized tensor.


    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    FORMAT_NAME = "mxfp8"

    def gemm_native(self):
        return "block_scaled"

    def gemm_operand(self, reduce_last):
        """Rowwise: K-major as stored. Columnwise (blocks of 32 down the rows, not transposed):
        a transposed view, K-minor (cuBLAS runs that layout on 10.x only)."""
        b = MXFP8_BLOCK_SIZE
        if reduce_last:
            if self._rowwise_data is None:
                return None
            return GemmOperand(self._rowwise_data.reshape(-1, self._shape[-1]), self._rowwise_scale_inv, (1, b))
        if self._columnwise_data is None:
            return None
        data = self._columnwise_data.reshape(-1, self._shape[-1])  # (rows, cols), blocks down the rows
        return GemmOperand(data.t(), self._columnwise_scale_inv.t(), (1, b), k_major=False)

    def debug_usage_view(self, x2d, columnwise):
        m, k = x2d.shape
        b = MXFP8_BLOCK_SIZE
        data = (self._columnwise_data if columnwise else self._rowwise_data).reshape(m, k).float()
        s = (self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv).float()
        dq = (data.reshape(m // b, b, k) * s.unsqueeze(1) if columnwise
              else data.reshape(m, k // b, b) * s.unsqueeze(2)).reshape(m, k)
        return UsageView(x2d, dq, data.abs() == FP8_MAX[self.fp8_dtype], s)

    def debug_internals(self):
        k = self._shape[-1]
        return {"fp8_dtype": str(self.fp8_dtype).replace("torch.", ""), "block_size": MXFP8_BLOCK_SIZE,
                "rowwise_data": None if self._rowwise_data is None else self._rowwise_data.reshape(-1, k),
                "columnwise_data": None if self._columnwise_data is None else self._columnwise_data.reshape(-1, k),
                "rowwise_scale_inv": self._rowwise_scale_inv, "columnwise_scale_inv": self._columnwise_scale_inv}

    @classmethod
    def debug_reconstruct(cls, d, usage):
        data, b = d[f"{usage}_data"], MXFP8_BLOCK_SIZE
        s = d[f"{usage}_scale_inv"].float()
        r, c = data.shape
        vals = (data.float().reshape(r // b, b, c) * s.unsqueeze(1) if usage == "columnwise"
                else data.float().reshape(r, c // b, b) * s.unsqueeze(2)).reshape(r, c)
        return vals, False  # the columnwise data is not transposed


class MXFP8Tensor(MXFP8TensorStorage, QuantizedTensor):
    """MXFP8 tensor: 1x32 rowwise and 32x1 columnwise blocks with E8M0 scales."""


@te_constructor(te_only={"with_2d_quantization": (False,)})
@dataclass(frozen=True)
class MXFP8Quantizer(Quantizer):
    """MX block scaling: per 32 values, scale 2**ceil(log2(amax / fp8_max)) stored as E8M0."""

    fp8_dtype: torch.dtype = torch.float8_e4m3fn

    def __post_init__(self):
        if self.fp8_dtype not in _FP8_DTYPES:
            raise TypeError(
                f"MXFP8Quantizer.fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {self.fp8_dtype}"
            )

    @property
    def fp8_max(self) -> float:
        return fp8_max(self.fp8_dtype)

    @property
    def tensor_class(self):
        return MXFP8Tensor

    def metadata(self):
        return {"fp8_dtype": self.fp8_dtype}

    def check_shape(self, shape) -> None:
        m, k = flat_2d(shape)
        shape = tuple(shape)
        b = MXFP8_BLOCK_SIZE
        if self.rowwise_usage and k % b != 0:
            raise ValueError(
                f"MXFP8 rowwise usage: shape {shape} has last dim {k}, which is not a multiple "
                f"of the MXFP8 block of {b}"
            )
        if self.columnwise_usage and m % b != 0:
            raise ValueError(
                f"MXFP8 columnwise usage: shape {shape} has {m} rows (product of the leading dims), "
                f"which is not a multiple of the MXFP8 block of {b}"
            )

    def row_block(self) -> int:
        return MXFP8_BLOCK_SIZE if self.columnwise_usage else 1  # columnwise blocks run along rows

    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    def has_scale_state(self):
        return False

    def fsdp_gather_rule(self):
        return GatherRule("mxfp8", MXFP8_BLOCK_SIZE)  # both usages gathered (32x1 blocks need whole blocks)

    def fsdp_quantize_shard(self, x, global_amax, scale):
        t = self.with_usage(rowwise=True, columnwise=True).quantize(x)
        return tuple(b.view(torch.uint8) for b in t.get_buffers().values()), ()

    def fsdp_rebuild(self, outputs, extra, rows):
        rd, rs, cd, cs = outputs
        return {"_rowwise_data": rd.view(self.fp8_dtype), "_rowwise_scale_inv": rs.view(_SCALE_DTYPE),
                "_columnwise_data": cd.view(self.fp8_dtype), "_columnwise_scale_inv": cs.view(_SCALE_DTYPE)}, ()

    def sp_gather_rule(self):
        return GatherRule("mxfp8", MXFP8_BLOCK_SIZE)

    def sp_quantize_shard(self, x2d, scale, all_reduce_max):
        bufs = self.quantize(x2d, internal=True).get_buffers()  # every buffer's rows run along dim 0
        return [(name, b, 0) for name, b in bufs.items()], {}, torch.zeros(1, dtype=torch.float32, device=x2d.device)

    def sp_finish_gather(self, bufs):
        pass  # gathered as they are laid out

    DEBUG_RECIPE = "mxfp8"

    @classmethod
    def debug_quantizer(cls, fp8_dtype, tensor_name):
        return MXFP8Quantizer(fp8_dtype or torch.float8_e4m3fn)

    def buffer_layout(self, shape) -> Dict[str, BufferSpec]:
        m, k = flat_2d(shape)
        b = MXFP8_BLOCK_SIZE
        out = {}
        if self.rowwise_usage:
            out["_rowwise_data"] = BufferSpec(tuple(shape), self.fp8_dtype)
            out["_rowwise_scale_inv"] = BufferSpec((m, k // b), _SCALE_DTYPE)
        if self.columnwise_usage:
            out["_columnwise_data"] = BufferSpec(tuple(shape), self.fp8_dtype)
            out["_columnwise_scale_inv"] = BufferSpec((m // b, k), _SCALE_DTYPE)
        return out

    def _quantize_buffers(self, x) -> Dict[str, torch.Tensor]:
        row_data, row_scale, col_data, col_scale = kernel("mxfp8_quantize", x.device)(
            x, self.fp8_dtype, self.rowwise_usage, self.columnwise_usage
        )
        out = {}
        if self.rowwise_usage:
            out["_rowwise_data"] = row_data
            out["_rowwise_scale_inv"] = row_scale
        if self.columnwise_usage:
            out["_columnwise_data"] = col_data
            out["_columnwise_scale_inv"] = col_scale
        return out
