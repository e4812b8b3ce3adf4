"""Hybrid: one format for the rowwise usage and another for the columnwise usage (TE's
`HybridQuantizer`, `HybridQuantizedTensor`, `HybridQuantizedTensorStorage`).

A hybrid tensor holds two sub-storages, each quantized by its own quantizer pinned to one usage.
Its buffers are the sub-storages' buffers, their names prefixed by the usage (`_rowwise__` /
`_columnwise__`), so it flattens and crosses op boundaries as any storage does; the sub-quantizers
travel in the hybrid quantizer (the flatten context) and rebuild the sub-storages.

The Linear ops never quantize with a hybrid quantizer: `tensor/gemm_formats.py` reads, per GEMM,
which usage of which role it takes, and maps that onto the plan's per-GEMM choices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from .format_api import GatherRule
from .quantized_tensor import QuantizedTensor
from .quantizer import Quantizer, te_flags
from .storage import QuantizedTensorStorage

__all__ = ["HybridQuantizedTensorStorage", "HybridQuantizedTensor", "HybridQuantizer"]

_PREFIX = {"rowwise": "_rowwise__", "columnwise": "_columnwise__"}
_COLUMNWISE_SOURCES = ("original", "rowwise_dequantized")
_GATHER_REASON = "a hybrid tensor's two formats gather in high precision and quantize after"


def _prefixed(usage: str, buffers: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {_PREFIX[usage] + name: t for name, t in buffers.items()}


def _split(buffers: Dict[str, torch.Tensor]):
    """(rowwise buffers, columnwise buffers) of a hybrid's prefixed buffer dict."""
    parts = {"rowwise": {}, "columnwise": {}}
    for name, t in buffers.items():
        usage = next((u for u, p in _PREFIX.items() if name.startswith(p)), None)
        if usage is None:
            raise KeyError(f"HybridQuantizedTensorStorage: buffer {name!r} names no usage "
                           f"(expected a prefix of {sorted(_PREFIX.values())})")
        parts[usage][name[len(_PREFIX[usage]):]] = t
    return parts["rowwise"], parts["columnwise"]


class HybridQuantizedTensorStorage(QuantizedTensorStorage):
    """Two sub-storages: `_rowwise_storage` (read by rowwise GEMMs) and `_columnwise_storage`."""

    FORMAT_NAME = "hybrid"

    def __init__(self, *, shape, dtype, quantizer=None, requires_grad=False, rowwise_storage=None,
                 columnwise_storage=None):
        self._shape = torch.Size(shape)
        self._hp_dtype = dtype
        self._quantizer = quantizer
        self._rowwise_storage = rowwise_storage
        self._columnwise_storage = columnwise_storage

    @property
    def rowwise_sub_storage(self) -> Optional[QuantizedTensorStorage]:
        return self._rowwise_storage

    @property
    def columnwise_sub_storage(self) -> Optional[QuantizedTensorStorage]:
        return self._columnwise_storage

    def __getattr__(self, name):
        # torch's flatten protocol reads each buffer by its (prefixed) name
        for usage, prefix in _PREFIX.items():
            sub = self.__dict__.get(f"_{usage}_storage")
            if sub is not None and name.startswith(prefix):
                return getattr(sub, name[len(prefix):])
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def get_buffers(self) -> Dict[str, torch.Tensor]:
        out = {}
        for usage in _PREFIX:
            sub = getattr(self, f"_{usage}_storage")
            if sub is not None:
                out.update(_prefixed(usage, sub.get_buffers()))
        return out

    def prepare_for_saving(self):
        """Each sub-storage's slots, rowwise then columnwise (TE's save protocol)."""
        tensors = []
        for sub in (self._rowwise_storage, self._columnwise_storage):
            if sub is not None:
                tensors += sub.prepare_for_saving()[0]
        return tensors, self

    def restore_from_saved(self, tensors):
        for sub in (self._rowwise_storage, self._columnwise_storage):
            if sub is not None:
                tensors = sub.restore_from_saved(tensors)
        return list(tensors)

    @classmethod
    def _from_buffers(cls, buffers, *, shape, dtype, quantizer, requires_grad=False):
        row, col = _split(buffers)
        return cls(shape=shape, dtype=dtype, quantizer=quantizer, requires_grad=requires_grad,
                   rowwise_storage=quantizer.rowwise_quantizer.make_tensor(row, shape, dtype, True) if row else None,
                   columnwise_storage=(quantizer.columnwise_quantizer.make_tensor(col, shape, dtype, True)
                                       if col else None))

    def _buffer_device(self):
        return (self._rowwise_storage or self._columnwise_storage)._buffer_device()

    def has_rowwise(self) -> bool:
        return self._rowwise_storage is not None

    def has_columnwise(self) -> bool:
        return self._columnwise_storage is not None

    def _dequantize(self, dtype):
        sub = self._rowwise_storage if self._rowwise_storage is not None else self._columnwise_storage
        if sub is None:
            raise RuntimeError("HybridQuantizedTensorStorage holds neither usage: nothing to dequantize")
        return sub.dequantize(dtype=dtype)

    def _drop_usage(self, rowwise, columnwise) -> None:
        if not rowwise:
            self._rowwise_storage = None
        if not columnwise:
            self._columnwise_storage = None

    def _view_buffers(self, shape):
        out = {}
        for usage in _PREFIX:
            sub = getattr(self, f"_{usage}_storage")
            if sub is not None:
                bufs = sub._view_buffers(shape)
                if bufs is None:
                    return None
                out.update(_prefixed(usage, bufs))
        return out

    def gemm_native(self):
        return None  # a GEMM reads one sub-storage (`rowwise_sub_storage` / `columnwise_sub_storage`)


class HybridQuantizedTensor(HybridQuantizedTensorStorage, QuantizedTensor):
    """A tensor quantized in one format per usage."""

    @staticmethod
    def __new__(cls, *, shape, dtype, quantizer=None, requires_grad=False, rowwise_storage=None,
                columnwise_storage=None):
        sub = rowwise_storage if rowwise_storage is not None else columnwise_storage
        if sub is None:
            raise ValueError("HybridQuantizedTensor: at least one sub-storage is required")
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=sub._buffer_device(),
                                                   requires_grad=requires_grad)


@te_flags
@dataclass(frozen=True)
class HybridQuantizer(Quantizer):
    """`rowwise_quantizer` for the rowwise usage (e.g. fprop's input and weight, dgrad's
    grad_output), `columnwise_quantizer` for the columnwise one (wgrad's input and grad_output,
    dgrad's weight). Each is kept as a copy pinned to its usage (TE pins the objects it is given
    in place). `columnwise_source`: "original" quantizes the columnwise copy from the input,
    "rowwise_dequantized" from the rowwise copy's dequantized values."""

    rowwise_quantizer: Optional[Quantizer] = None
    columnwise_quantizer: Optional[Quantizer] = None
    columnwise_source: str = "original"

    def __post_init__(self):
        for usage in _PREFIX:
            q = getattr(self, f"{usage}_quantizer")
            if not isinstance(q, Quantizer):
                raise TypeError(f"HybridQuantizer requires a concrete Quantizer for the {usage} usage, "
                                f"got {type(q).__name__}")
            if isinstance(q, HybridQuantizer):
                raise TypeError(f"HybridQuantizer: the {usage} quantizer cannot itself be a HybridQuantizer")
            if q.has_scale_state():
                raise NotImplementedError(f"HybridQuantizer: the {usage} quantizer {type(q).__name__} keeps delayed-"
                                          "scaling state, which lives in the modules: use recipe.DelayedScaling")
            object.__setattr__(self, f"{usage}_quantizer",
                               q.with_usage(rowwise=usage == "rowwise", columnwise=usage == "columnwise"))
        if self.columnwise_source not in _COLUMNWISE_SOURCES:
            raise ValueError(f"HybridQuantizer columnwise_source must be one of {_COLUMNWISE_SOURCES}, "
                             f"got {self.columnwise_source!r}")

    @property
    def tensor_class(self):
        return HybridQuantizedTensor

    def _used(self):
        return [(u, getattr(self, f"{u}_quantizer")) for u in _PREFIX if getattr(self, f"{u}_usage")]

    def check_shape(self, shape) -> None:
        for _, q in self._used():
            q.check_shape(shape)

    def buffer_layout(self, shape):
        out = {}
        for usage, q in self._used():
            out.update(_prefixed(usage, q.buffer_layout(shape)))
        return out

    def alloc_tensors(self, shape, dtype, device=None):
        self._check_usage()
        out = {}
        for usage, q in self._used():
            out.update(_prefixed(usage, q.alloc_tensors(shape, dtype, device)))
        return out

    def make_tensor(self, buffers, shape, dtype, internal: bool = False):
        cls = HybridQuantizedTensorStorage if internal else HybridQuantizedTensor
        return cls._from_buffers(buffers, shape=tuple(shape), dtype=dtype, quantizer=self)

    def _quantize_buffers(self, x) -> Dict[str, torch.Tensor]:
        row = None
        if self.rowwise_usage or self.columnwise_source == "rowwise_dequantized":
            row = self.rowwise_quantizer.quantize(x, internal=True)
        out = _prefixed("rowwise", row.get_buffers()) if self.rowwise_usage else {}
        if self.columnwise_usage:
            src = row.dequantize(dtype=x.dtype) if self.columnwise_source == "rowwise_dequantized" else x
            out.update(_prefixed("columnwise", self.columnwise_quantizer.quantize(src, internal=True).get_buffers()))
        return out

    def row_block(self) -> int:
        return math.lcm(*(q.row_block() for _, q in self._used())) if self._used() else 1

    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    def has_scale_state(self):
        return False  # refused in __post_init__

    def fsdp_gather_rule(self):
        return GatherRule(None, reason=_GATHER_REASON)

    def sp_gather_rule(self):
        return GatherRule(None, reason=_GATHER_REASON)
