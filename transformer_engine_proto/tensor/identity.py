"""Identity: a "quantized" tensor that holds its high-precision values as they are (TE's
`IdentityQuantizer`, `IdentityTensor`, `IdentityTensorStorage`).

It exists so a `CustomRecipe` factory can say "keep this operand in high precision" with a
quantizer, alone or as one usage of a `HybridQuantizer`. One buffer, `_hp_data` (the logical
shape, the held dtype), serves both usages: a GEMM reads it transposed or not as it needs. The
Linear ops never quantize with it: `tensor/gemm_formats.py` turns identity operands into GEMMs
run in high precision on the original operands, exactly the recipe-off call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .format_api import GatherRule
from .quantized_tensor import QuantizedTensor
from .quantizer import HIGH_PRECISION_DTYPES, BufferSpec, Quantizer, flat_2d, te_constructor
from .storage import QuantizedTensorStorage

__all__ = ["IdentityTensorStorage", "IdentityTensor", "IdentityQuantizer"]

_HP_REASON = "identity holds high-precision values: they gather as they are"


class IdentityTensorStorage(QuantizedTensorStorage):
    _FLATTEN_TENSOR_BUFFERS = (("_hp_data", "hp_data"),)
    _LOGICAL_SHAPE_BUFFERS = ("_hp_data",)
    FORMAT_NAME = "identity"

    def has_rowwise(self) -> bool:
        return self._hp_data is not None

    def has_columnwise(self) -> bool:
        return self._hp_data is not None

    def _dequantize(self, dtype):
        """The held tensor itself (no copy) in its own dtype, else a cast."""
        if self._hp_data is None:
            raise RuntimeError("IdentityTensorStorage has no data to dequantize")
        data = self._hp_data if self._hp_data.shape == self._shape else self._hp_data.view(self._shape)
        return data if data.dtype == dtype else data.to(dtype)

    def _drop_usage(self, rowwise, columnwise) -> None:
        pass  # the one buffer serves both usages: nothing to drop

    def derives_usages(self) -> bool:
        return True

    def _make_columnwise_from_rowwise(self) -> None:
        pass

    def _make_rowwise_from_columnwise(self) -> None:
        pass

    def _view_buffers(self, shape):
        return {"_hp_data": self._hp_data.view(tuple(shape))}  # any view of the held tensor

    def _transpose_buffers(self):
        return {"_hp_data": self._hp_data.t()}

    def gemm_native(self):
        return None  # a plain matmul on the held values


class IdentityTensor(IdentityTensorStorage, QuantizedTensor):
    """High-precision passthrough tensor: presents as its held dtype and shape."""


@te_constructor()
@dataclass(frozen=True)
class IdentityQuantizer(Quantizer):
    """Keeps a tensor in high precision. `dtype`: the dtype held (a cast on quantize); None keeps
    the input's. The usages are kept for TE's interface: one buffer serves both."""

    dtype: Optional[torch.dtype] = None

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"IdentityQuantizer.dtype must be one of {HIGH_PRECISION_DTYPES} or None, "
                            f"got {self.dtype}")

    @property
    def tensor_class(self):
        return IdentityTensor

    def held_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype if self.dtype is None else self.dtype

    def buffer_layout(self, shape, dtype: torch.dtype = torch.float32) -> Dict[str, BufferSpec]:
        flat_2d(shape)
        return {"_hp_data": BufferSpec(tuple(shape), self.held_dtype(dtype))}

    def alloc_tensors(self, shape, dtype, device=None):
        shape = tuple(shape)
        self._check_usage()
        return {name: spec.empty(device) for name, spec in self.buffer_layout(shape, dtype).items()}

    def make_tensor(self, buffers, shape, dtype, internal: bool = False):
        # the tensor presents as the dtype it holds (TE: a cast quantizer's tensor is of its dtype)
        return super().make_tensor(buffers, shape, buffers["_hp_data"].dtype, internal)

    def _quantize_buffers(self, x) -> Dict[str, torch.Tensor]:
        data = x.detach()
        return {"_hp_data": data if self.dtype in (None, data.dtype) else data.to(self.dtype)}

    def row_block(self) -> int:
        return 1

    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    def has_scale_state(self):
        return False

    def fsdp_gather_rule(self):
        return GatherRule(None, reason=_HP_REASON)

    def sp_gather_rule(self):
        return GatherRule(None, reason=_HP_REASON)
