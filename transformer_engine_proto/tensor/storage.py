"""`QuantizedTensorStorage`: the inner buffers of a quantized tensor and their (un)flattening.

Each storage class declares `_FLATTEN_TENSOR_BUFFERS`, pairs of (attribute name, constructor
kwarg), in a fixed order. That order is the contract between real and fake op impls: a quantized
tensor crosses a custom-op boundary as that list of plain tensors. Classes register themselves by
qualified name in `__init_subclass__`, so `__tensor_unflatten__` can rebuild any of them from a
plain-Python context.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .format_api import GemmOperand, UsageView, missing_capability
from .straight_through import DequantizeStraightThrough, tracks_grad

__all__ = ["QuantizedTensorStorage", "storage_class_by_qualname", "registered_storage_classes",
           "storage_class_by_format"]

_REGISTRY: Dict[str, type] = {}


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def storage_class_by_qualname(name: str) -> type:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no quantized storage class registered under {name!r}") from None


def registered_storage_classes() -> Dict[str, type]:
    return dict(_REGISTRY)


def storage_class_by_format(name: str) -> type:
    """The storage class whose `FORMAT_NAME` is `name` (as `format_name()` answers)."""
    for cls in _REGISTRY.values():
        if cls.FORMAT_NAME == name:
            return cls
    raise KeyError(f"no quantized storage class declares the format {name!r}")


class QuantizedTensorStorage:
    """Holds the buffers; subclasses define the format (buffers, dequantize, layout helpers)."""

    _FLATTEN_TENSOR_BUFFERS: Tuple[Tuple[str, str], ...] = ()
    # Non-tensor constructor kwargs stored as attributes of the same name (e.g. fp8_dtype).
    _META_FIELDS: Tuple[str, ...] = ()
    # The format's name (the debug tools' format family, e.g. "mxfp8"); None: not declared.
    FORMAT_NAME: Optional[str] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _REGISTRY[_qualname(cls)] = cls
        if issubclass(cls, torch.Tensor):  # a tensor class answers size() as every tensor (not the storage's)
            cls.size = torch.Tensor.size

    def size(self, dim: Optional[int] = None):
        """TE's storage `size()`: the logical shape, or one of its dims."""
        return self._shape if dim is None else self._shape[dim]

    def __init__(self, *, shape=None, dtype=None, quantizer=None, requires_grad=False, **kwargs):
        if shape is None or dtype is None or "fake_dtype" in kwargs:
            shape, dtype = self._te_shape_and_dtype(shape, dtype, kwargs)
        self._shape = torch.Size(shape)
        self._hp_dtype = dtype
        self._quantizer = quantizer
        for attr, kw in self._FLATTEN_TENSOR_BUFFERS:
            setattr(self, attr, kwargs.pop(kw, None))
        for name in self._META_FIELDS:
            setattr(self, name, kwargs.pop(name))
        if kwargs:
            raise TypeError(f"{type(self).__name__}: unexpected constructor arguments {sorted(kwargs)}")

    @classmethod
    def _te_shape_and_dtype(cls, shape, dtype, kwargs):
        """(shape, dtype) from TE's constructor form: `fake_dtype=` names the dtype, and without a
        shape the first given buffer of `_LOGICAL_SHAPE_BUFFERS` gives it. Pops `fake_dtype`."""
        fake_dtype = kwargs.pop("fake_dtype", None)
        if dtype is not None and fake_dtype is not None and dtype != fake_dtype:
            raise TypeError(f"{cls.__name__}: dtype={dtype} and fake_dtype={fake_dtype} differ")
        dtype = dtype if dtype is not None else fake_dtype
        kw_of = dict(cls._FLATTEN_TENSOR_BUFFERS)
        names = [kw_of[a] for a in cls._LOGICAL_SHAPE_BUFFERS]  # the keywords whose buffer has the shape
        if shape is None:
            given = [kwargs[n] for n in names if kwargs.get(n) is not None]
            shape = given[0].shape if given else None
        if shape is None or dtype is None:
            raise TypeError(f"{cls.__name__}: needs dtype= (TE's fake_dtype=) and shape= (taken from "
                            f"{' or '.join(names) or 'no buffer'} when that is given)")
        return shape, dtype

    # ---- construction from / to named buffers ------------------------------------------
    @classmethod
    def _from_buffers(cls, buffers: Dict[str, torch.Tensor], **kwargs):
        ctor = dict(kwargs)
        known = {attr for attr, _ in cls._FLATTEN_TENSOR_BUFFERS}
        unknown = set(buffers) - known
        if unknown:
            raise KeyError(f"{cls.__name__}: unknown buffers {sorted(unknown)}")
        for attr, kw in cls._FLATTEN_TENSOR_BUFFERS:
            if attr in buffers:
                ctor[kw] = buffers[attr]
        return cls(**ctor)

    @classmethod
    def _bare(cls, buffers: Dict[str, torch.Tensor], shape, dtype, quantizer, meta: Dict[str, object]):
        """`cls._from_buffers(buffers, shape=, dtype=, quantizer=, **meta)` for a bare storage class
        (no tensor subclass: nothing to allocate), setting the attributes directly instead of
        going through keyword dicts; what quantizers build with `internal=True` on the ops' hot
        path. `meta`: the `_META_FIELDS` values."""
        layout = cls.__dict__.get("_BARE_LAYOUT")
        if layout is None:  # per class: ({buffer attribute: None}, the metadata names)
            layout = (dict.fromkeys(attr for attr, _ in cls._FLATTEN_TENSOR_BUFFERS), frozenset(cls._META_FIELDS))
            cls._BARE_LAYOUT = layout
        attrs, meta_names = layout
        state = dict(attrs)
        state.update(buffers)
        if len(state) != len(attrs):
            raise KeyError(f"{cls.__name__}: unknown buffers {sorted(set(buffers) - set(attrs))}")
        if meta.keys() != meta_names:
            raise TypeError(f"{cls.__name__}: constructor arguments {sorted(meta)}, expected "
                            f"{sorted(cls._META_FIELDS)}")
        self = object.__new__(cls)
        self.__dict__.update(state, _shape=torch.Size(shape), _hp_dtype=dtype, _quantizer=quantizer, **meta)
        return self

    def get_buffers(self) -> Dict[str, torch.Tensor]:
        """Present buffers, in `_FLATTEN_TENSOR_BUFFERS` order."""
        out = {}
        for attr, _ in self._FLATTEN_TENSOR_BUFFERS:
            t = getattr(self, attr)
            if t is not None:
                out[attr] = t
        return out

    # ---- TE's save protocol: an autograd ctx saves the buffers, not the object ---------------
    def prepare_for_saving(self):
        """TE's `prepare_for_saving`: (this object's buffer slots in `_FLATTEN_TENSOR_BUFFERS`
        order, each a tensor or None, for `ctx.save_for_backward`; this object, emptied of them)."""
        tensors = [getattr(self, attr) for attr, _ in self._FLATTEN_TENSOR_BUFFERS]
        for attr, _ in self._FLATTEN_TENSOR_BUFFERS:
            setattr(self, attr, None)
        return tensors, self

    def restore_from_saved(self, tensors):
        """TE's `restore_from_saved`: this object's slots back from the front of `tensors`; returns
        the rest (for the next object saved with it)."""
        n = len(self._FLATTEN_TENSOR_BUFFERS)
        for (attr, _), t in zip(self._FLATTEN_TENSOR_BUFFERS, tensors[:n]):
            setattr(self, attr, t)
        return list(tensors[n:])

    def _rebuild(self, buffers: Dict[str, torch.Tensor], shape=None, requires_grad=False):
        """A new object of this class over `buffers`, with this one's metadata."""
        meta = self.get_metadata()
        if shape is not None:
            meta["shape"] = tuple(shape)
        return type(self)._from_buffers(buffers, requires_grad=requires_grad, **meta)

    def _buffer_device(self) -> torch.device:
        """The device of the buffers (a bare storage is no tensor, so it has no `.device`)."""
        for attr, _ in self._FLATTEN_TENSOR_BUFFERS:
            t = getattr(self, attr)
            if t is not None:
                return t.device
        raise ValueError(f"{type(self).__name__}: no buffers")

    def only_usage(self, rowwise: bool):
        """A bare storage sharing this one's buffers of one usage (rowwise, or columnwise when
        False), so a GEMM reads the intended buffers. A shallow copy, no quantizer copy: the
        linear ops' hot path (host time per GEMM). Only for bare storages, not tensor subclasses."""
        if isinstance(self, torch.Tensor):
            raise TypeError("only_usage: a bare storage is required; use update_usage on a tensor")
        if not (self.has_rowwise() if rowwise else self.has_columnwise()):
            raise ValueError(f"only_usage: this {type(self).__name__} holds no "
                             f"{'rowwise' if rowwise else 'columnwise'} buffers; quantize with that usage")
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view._drop_usage(rowwise, not rowwise)
        return view

    def get_metadata(self) -> Dict[str, object]:
        meta = dict(shape=tuple(self._shape), dtype=self._hp_dtype, quantizer=self._quantizer)
        meta.update({name: getattr(self, name) for name in self._META_FIELDS})
        return meta

    def _flatten_ctx(self):
        meta = tuple((name, getattr(self, name)) for name in self._META_FIELDS)
        return (_qualname(type(self)), tuple(self._shape), self._hp_dtype, self._quantizer, meta)

    def __tensor_flatten__(self):
        return list(self.get_buffers()), self._flatten_ctx()

    @staticmethod
    def __tensor_unflatten__(inner_tensors, ctx, outer_size=None, outer_stride=None):
        qualname, shape, dtype, quantizer, meta = ctx
        cls = storage_class_by_qualname(qualname)
        if outer_size is not None:
            shape = tuple(outer_size)
        return cls._from_buffers(dict(inner_tensors), shape=shape, dtype=dtype, quantizer=quantizer, **dict(meta))

    # ---- format interface ------------------------------------------------------------------
    @property
    def quantizer(self):
        return self._quantizer

    @property
    def _fp8_dtype(self):
        """TE's attribute: the FP8 format as a `DType` (formats with an `fp8_dtype`)."""
        from ..constants import DType

        return DType.cast(self.fp8_dtype)

    def has_rowwise(self) -> bool:
        raise NotImplementedError

    def has_columnwise(self) -> bool:
        raise NotImplementedError

    def get_usages(self) -> Dict[str, bool]:
        """TE's name: which usages the storage holds, {"rowwise": ..., "columnwise": ...}."""
        return {"rowwise": self.has_rowwise(), "columnwise": self.has_columnwise()}

    def _dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def dequantize(self, *, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The high-precision values (`dtype`: the nominal one by default). Of a tensor that
        requires grad, in its graph: the gradient passes straight through (straight_through.py)."""
        dtype = self._hp_dtype if dtype is None else dtype
        if isinstance(self, torch.Tensor) and tracks_grad(self):
            return DequantizeStraightThrough.apply(self, dtype)
        return self._dequantize(dtype)

    def _drop_usage(self, rowwise: bool, columnwise: bool) -> None:
        """Forget buffers of the usages that are not kept (subclasses name them)."""
        raise NotImplementedError

    def _make_columnwise_from_rowwise(self) -> None:
        raise RuntimeError(
            f"{type(self).__name__}: columnwise data cannot be derived from rowwise data "
            "exactly in this format; quantize with columnwise usage instead"
        )

    def _make_rowwise_from_columnwise(self) -> None:
        raise RuntimeError(
            f"{type(self).__name__}: rowwise data cannot be derived from columnwise data "
            "exactly in this format; quantize with rowwise usage instead"
        )

    def derives_usages(self) -> bool:
        """Whether each usage is an exact relayout of the other (no requantization), so a tensor
        may keep one and build the other when a GEMM needs it."""
        return False

    def update_usage(self, rowwise_usage: Optional[bool] = None, columnwise_usage: Optional[bool] = None):
        """Keep/derive/drop usages in place; the stored quantizer follows the new usage."""
        rowwise = self.has_rowwise() if rowwise_usage is None else bool(rowwise_usage)
        columnwise = self.has_columnwise() if columnwise_usage is None else bool(columnwise_usage)
        if not (rowwise or columnwise):
            raise ValueError("update_usage: at least one of rowwise/columnwise usage must be kept")
        if columnwise and not self.has_columnwise():
            self._make_columnwise_from_rowwise()
        if rowwise and not self.has_rowwise():
            self._make_rowwise_from_columnwise()
        self._drop_usage(rowwise, columnwise)
        if self._quantizer is not None:
            self._quantizer = self._quantizer.with_usage(rowwise=rowwise, columnwise=columnwise)
        return self

    # ---- format capabilities (docs/adding_a_format.md): each format declares them; the defaults
    # raise NotImplementedError naming the format and the capability, never a quiet fallback ----
    @classmethod
    def format_name(cls) -> str:
        """The format family ("fp8_per_tensor", "mxfp8", ...): dumps record it, `reconstruct`
        finds the format's class by it (`storage_class_by_format`)."""
        if cls.FORMAT_NAME is None:
            raise missing_capability(cls, "format_name")
        return cls.FORMAT_NAME

    def gemm_native(self) -> Optional[str]:
        """The native scaled-GEMM path `gemm.py` may take when both operands are of this format:
        "tensorwise" (`torch._scaled_mm`, one scale per tensor), "blockwise" (`F.scaled_mm`
        1x128 / 128x128 fp32 block scales, Hopper), "block_scaled" (`F.scaled_mm` block-scaled
        MMA with E8M0 / E4M3 scales, compute capability 10.x / 12.x, `block_scaled_gemm.py`), or
        None: always emulated (dequantize + matmul)."""
        raise missing_capability(self, "gemm_native")

    def gemm_operand(self, reduce_last: bool) -> Optional[GemmOperand]:
        """This tensor as a native GEMM operand, from its stored buffers with no copy: reduced
        over its last dim (`reduce_last`, the rowwise buffers) or over its rows (columnwise);
        None when it lacks that usage. Asked only where `gemm_native()` is not None."""
        raise missing_capability(self, "gemm_operand")

    def gemm_emulated(self, other, trans_a: bool, trans_b: bool, out_dtype: torch.dtype,
                      bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Optional: a cheaper CUDA emulation of op(self) @ op(other) than dequantizing both
        (NVFP4's wgrad), or None (the default): `gemm.py` dequantizes and multiplies in bf16."""
        return None

    def debug_usage_view(self, x2d: torch.Tensor, columnwise: bool) -> UsageView:
        """The float32 original (M, K) `x2d` and this tensor's values side by side in one usage's
        buffer layout, with the saturated codes and every block's scale_inv (debug stats)."""
        raise missing_capability(self, "debug_usage_view")

    def debug_internals(self) -> Dict[str, object]:
        """The format's buffers decoded into plain tensors with plain row-major scale layouts
        (debug dumps), enough for `debug_reconstruct`; keys as `debug/quant_view.internals` says."""
        raise missing_capability(self, "debug_internals")

    @classmethod
    def debug_reconstruct(cls, d: Dict[str, object], usage: str) -> Tuple[torch.Tensor, bool]:
        """(float32 values of one usage, whether they are the transpose of the logical 2D tensor)
        from a dump `debug_internals` wrote, using plain torch only."""
        raise missing_capability(cls, "debug_reconstruct")

    # ---- native view / transpose hooks (return None when the layout does not allow it) ---
    def _view_buffers(self, shape) -> Optional[Dict[str, torch.Tensor]]:
        """Buffers for a view to `shape`; default: only views that keep the last dim."""
        shape = tuple(shape)
        if len(shape) == 0 or shape[-1] != self._shape[-1]:
            return None
        bufs = self.get_buffers()
        for name in self._LOGICAL_SHAPE_BUFFERS:
            if name in bufs:
                bufs[name] = bufs[name].view(shape)
        return bufs

    # Buffers whose shape is the tensor's logical shape (viewed along with it).
    _LOGICAL_SHAPE_BUFFERS: Tuple[str, ...] = ()

    def _transpose_buffers(self) -> Optional[Dict[str, torch.Tensor]]:
        """Buffers of the 2D transpose without requantizing, or None if impossible."""
        return None
