"""`TensorProto`: a data-free description of a (possibly quantized) tensor.

Fake impls of the custom ops build their outputs from protos, so the graph knows every shape
without running a kernel. `create_tensor` is pure Python over `torch.empty`, so it also traces
under torch.compile with no graph break.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .quantized_tensor import QuantizedTensor
from .quantizer import HIGH_PRECISION_DTYPES, Quantizer

__all__ = ["TensorProto", "to_tensor_proto"]


@dataclass
class TensorProto:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    quantizer: Optional[Quantizer] = None
    requires_grad: bool = False
    device: torch.device = torch.device("cpu")

    def __post_init__(self):
        self.shape = tuple(self.shape)
        for d in self.shape:
            if not isinstance(d, (int, torch.SymInt)) or isinstance(d, bool):
                raise TypeError(f"TensorProto: shape entries must be ints, got {self.shape!r}")
            if isinstance(d, int) and d < 0:
                raise ValueError(f"TensorProto: shape entries must be >= 0, got {self.shape}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"TensorProto: dtype must be a torch.dtype, got {self.dtype!r}")
        if self.quantizer is not None and self.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"TensorProto: a quantized tensor's nominal dtype (what it dequantizes to) must be "
                            f"one of {HIGH_PRECISION_DTYPES}, got {self.dtype}")
        self.device = torch.device(self.device)
        if self.quantizer is not None:
            self.quantizer = self.quantizer.copy()  # usage changes stay private to this proto

    @property
    def is_quantized(self) -> bool:
        return self.quantizer is not None

    def _layout(self):
        self.quantizer._check_usage()
        self.quantizer.check_shape(self.shape)
        return self.quantizer.buffer_layout(self.shape)

    def inner_names(self) -> Tuple[str, ...]:
        """Names of the buffers the tensor flattens into (just `("data",)` if not quantized)."""
        if not self.is_quantized:
            return ("data",)
        return tuple(self._layout())

    def inner_specs(self):
        """Name -> BufferSpec for each inner buffer (a plain tensor is its own single buffer)."""
        from .quantizer import BufferSpec

        if not self.is_quantized:
            return {"data": BufferSpec(self.shape, self.dtype)}
        return self._layout()

    def create_metadata(self):
        if not self.is_quantized:
            return torch.Tensor, dict(shape=self.shape, dtype=self.dtype)
        return self.quantizer.create_metadata(self.shape, self.dtype)

    def create_tensor(self):
        if not self.is_quantized:
            t = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            return t.requires_grad_(self.requires_grad) if self.requires_grad else t
        buffers = self.quantizer.alloc_tensors(self.shape, self.dtype, self.device)
        cls, kwargs = self.quantizer.create_metadata(self.shape, self.dtype)
        return cls._from_buffers(buffers, requires_grad=self.requires_grad, **kwargs)

    def create_buffers(self) -> Dict[str, torch.Tensor]:
        """The flattened buffers (what crosses a custom-op boundary), freshly allocated."""
        if not self.is_quantized:
            return {"data": torch.empty(self.shape, dtype=self.dtype, device=self.device)}
        return self.quantizer.alloc_tensors(self.shape, self.dtype, self.device)

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None):
        if self.is_quantized:
            self.quantizer = self.quantizer.with_usage(rowwise=rowwise_usage, columnwise=columnwise_usage)
        return self


def to_tensor_proto(tensor: torch.Tensor) -> TensorProto:
    """Describe an existing tensor (plain or quantized) without keeping its data."""
    if isinstance(tensor, QuantizedTensor):
        return TensorProto(tensor.shape, tensor.dtype, tensor._quantizer, tensor.requires_grad, tensor.device)
    return TensorProto(tensor.shape, tensor.dtype, None, tensor.requires_grad, tensor.device)
