"""`QuantizedTensor`: a torch.Tensor wrapper subclass over a `QuantizedTensorStorage`.

It presents the logical (high-precision) shape and dtype. A handful of ops are implemented on the
quantized buffers directly (detach, view/reshape that keep the last dim, clone, copy_,
empty_like, and 2D transposes for formats that keep a transpose); anything else runs on the
dequantized tensor, with a one-time warning per op so silent precision loss stays visible. An
in-place op (an optimizer step on a quantized parameter) writes its result back, re-quantized.
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_map

from .storage import QuantizedTensorStorage

__all__ = ["QuantizedTensor", "handles"]

aten = torch.ops.aten
_WARNED_OPS = set()


def _warn_fallback(func) -> None:
    if func not in _WARNED_OPS:
        _WARNED_OPS.add(func)
        warnings.warn(
            f"QuantizedTensor: {func} has no quantized implementation; running it on the "
            "dequantized tensor, re-quantizing what it writes in place (this warning is shown once per op)",
            stacklevel=3,
        )


class QuantizedTensor(torch.Tensor):
    """Base of the per-format tensor classes (`class Float8Tensor(Float8TensorStorage, QuantizedTensor)`)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # the format's bare storage class (`Float8TensorStorage` for `Float8Tensor`): what quantizers
        # build with `internal=True`, as in TE, for tensors that never leave an op
        cls.storage_class = next(b for b in cls.__mro__
                                 if issubclass(b, QuantizedTensorStorage) and not issubclass(b, torch.Tensor))

    @staticmethod
    def __new__(cls, *, shape=None, dtype=None, quantizer=None, requires_grad=False, **kwargs):
        if shape is None or dtype is None or "fake_dtype" in kwargs:  # TE's form (the storage's __init__)
            shape, dtype = cls._te_shape_and_dtype(shape, dtype, kwargs)
        device = None
        for _, kw in cls._FLATTEN_TENSOR_BUFFERS:
            buf = kwargs.get(kw)
            if buf is not None:
                device = buf.device
                break
        if device is None:
            raise ValueError(f"{cls.__name__}: at least one data buffer is required")
        return torch.Tensor._make_wrapper_subclass(
            cls, tuple(shape), dtype=dtype, device=device, requires_grad=requires_grad
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"quantizer={self._quantizer!r}, buffers={list(self.get_buffers())})"
        )

    def _stable_hash_for_caching(self) -> str:
        return repr(self._flatten_ctx())

    # ---- dispatch ---------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            out = handler(func, args, kwargs)
            if out is not NotImplemented:
                return out
        _warn_fallback(func)

        def unwrap(t):
            return t.dequantize() if isinstance(t, QuantizedTensor) else t

        plain_args, plain_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        out = func(*plain_args, **plain_kwargs)
        written = _write_back(func, args, kwargs, plain_args, plain_kwargs)
        if written is None or not func._schema.returns:  # a functional op, or one returning nothing
            return out
        return written


def _write_back(func, args, kwargs, plain_args, plain_kwargs):
    """Copy what an in-place op wrote into dequantized stand-ins back into the quantized tensors
    (re-quantizing); returns the op's first mutated argument, or None for a functional op."""
    first = None
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        if i < len(args):
            orig, plain = args[i], plain_args[i]
        elif arg.name in kwargs:
            orig, plain = kwargs[arg.name], plain_kwargs[arg.name]
        else:
            continue
        pairs = zip(orig, plain) if isinstance(orig, (list, tuple)) else [(orig, plain)]
        for o, p in pairs:
            if isinstance(o, QuantizedTensor):
                o.copy_(p)
        if first is None:
            first = orig
    return first


# ---- natively handled ops ---------------------------------------------------------------------
_HANDLERS = {}


def handles(*funcs):
    """Decorator: `fn(func, args, kwargs)` handles these aten / custom ops on a QuantizedTensor
    (return NotImplemented to fall back). Public so other layers (distributed/fsdp.py) add theirs."""

    def register(fn):
        for f in funcs:
            _HANDLERS[f] = fn
        return fn

    return register


@handles(aten.detach.default, aten.alias.default)
def _detach(func, args, kwargs):
    # a normal tensor (as torch's detach of a normal tensor under inference_mode): autograd then
    # shares its version counter with the source, which an inference tensor cannot have
    with torch.inference_mode(False):
        return args[0]._rebuild(args[0].get_buffers())


@handles(aten.clone.default)
def _clone(func, args, kwargs):
    src = args[0]
    return src._rebuild({k: v.clone() for k, v in src.get_buffers().items()})


@handles(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    src = args[0]
    if kwargs.get("dtype") not in (None, src.dtype):
        return NotImplemented
    return src._rebuild({k: torch.empty_like(v) for k, v in src.get_buffers().items()})


@handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    src, shape = args[0], list(args[1])
    if -1 in shape:
        known = 1
        for s in shape:
            if s != -1:
                known *= s
        shape[shape.index(-1)] = src.numel() // max(known, 1)
    bufs = src._view_buffers(shape)
    if bufs is None:
        return NotImplemented
    return src._rebuild(bufs, shape=shape)


@handles(aten.t.default, aten.transpose.int)
def _transpose(func, args, kwargs):
    src = args[0]
    if src.dim() != 2:
        return NotImplemented
    if func is aten.transpose.int and sorted(d % 2 for d in args[1:3]) != [0, 1]:
        return NotImplemented
    bufs = src._transpose_buffers()
    if bufs is None:
        return NotImplemented
    return src._rebuild(bufs, shape=(src.shape[1], src.shape[0]))


@handles(aten.copy_.default)
def _copy(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QuantizedTensor):
        return dst.copy_(src.dequantize(dtype=dst.dtype))
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy_: shape mismatch {tuple(src.shape)} -> {tuple(dst.shape)}")
    mine = dst.get_buffers()
    same_layout = type(src) is type(dst) and all(getattr(src, m) == getattr(dst, m) for m in dst._META_FIELDS)
    theirs = src.get_buffers() if same_layout else {}
    if all(n in theirs and theirs[n].dtype == b.dtype and theirs[n].shape == b.shape for n, b in mine.items()):
        # the same format holding (at least) our buffers: its values exactly, no re-rounding on our
        # scale (a source with more usages, e.g. a transpose, gives the buffers this tensor keeps)
        for name, buf in mine.items():
            buf.copy_(theirs[name])
        return dst
    if isinstance(src, QuantizedTensor):
        src = src.dequantize()
    if dst._quantizer is None:
        raise RuntimeError(f"copy_ into {type(dst).__name__} needs a quantizer to re-quantize with")
    dst._quantizer.update_quantized(src, dst)
    return dst
