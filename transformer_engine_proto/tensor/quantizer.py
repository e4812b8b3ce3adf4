"""`Quantizer`: a value-opaque description of how to quantize, plus the buffer layout it produces.

A quantizer is a frozen dataclass: it compares and hashes by its settings, so torch.compile
treats it as a constant (and guards on it). Everything a fake impl needs -- the names, shapes,
strides and dtypes of the buffers a real quantize returns -- is computed here in pure Python by
`buffer_layout`, with no tensor data involved.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch

from ..constants import DType, as_torch_dtype
from ..errors import raise_error
from .format_api import GatherRule, missing_capability
from .straight_through import QuantizeStraightThrough, tracks_grad

__all__ = ["Quantizer", "BufferSpec", "HIGH_PRECISION_DTYPES", "check_input", "te_constructor",
           "debug_recipe_names", "quantizer_class_by_debug_recipe"]

HIGH_PRECISION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: a quantized parameter is its tensor subclass


@dataclass(frozen=True)
class BufferSpec:
    """Shape, dtype and stride of one inner buffer; `stride=None` means contiguous."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    stride: Optional[Tuple[int, ...]] = None

    def empty(self, device) -> torch.Tensor:
        if self.stride is None:
            return torch.empty(self.shape, dtype=self.dtype, device=device)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)


def flat_2d(shape: Sequence[int]) -> Tuple[int, int]:
    """(M, K): all leading dims folded into rows, the last dim is the reduction dim K."""
    if len(shape) == 0:
        raise ValueError("cannot quantize a 0-dim tensor: need at least one dimension")
    return math.prod(shape[:-1]), shape[-1]


def check_input(x: torch.Tensor, what: str = "quantize") -> None:
    """Reject inputs no format can represent, naming the problem."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{what}: input dtype {x.dtype} is not supported; expected one of "
            f"{', '.join(str(d) for d in HIGH_PRECISION_DTYPES)}"
        )
    if x.dim() == 0:
        raise ValueError(f"{what}: cannot quantize a 0-dim tensor")


TE_FLAGS = ("internal", "optimize_for_gemm")  # TE's plain mutable quantizer attributes: not settings


def te_flags(cls):
    """Let code assign TE's mutable quantizer flags (`q.internal = True`, `TE_FLAGS`) on a frozen
    quantizer dataclass; every field stays frozen. The flags take no part in equality or hashing.
    `te_constructor` applies it; a quantizer class without that decorator takes this one."""
    frozen = cls.__setattr__

    def __setattr__(self, name, value):
        if name not in TE_FLAGS:
            frozen(self, name, value)
        elif getattr(self, "_sealed", False):
            raise TypeError(f"{type(self).__name__}.{name}: this quantizer is shared (a recipe's cached quantizer); "
                            "setting it would change every layer's: set it on a copy (q.copy())")
        else:
            object.__setattr__(self, name, bool(value))

    cls.__setattr__ = __setattr__
    return cls


def te_constructor(te_positional: Tuple[str, ...] = (), te_only: Optional[Dict[str, tuple]] = None):
    """Let a quantizer dataclass also take TE's constructor: `rowwise=` / `columnwise=` for
    `rowwise_usage` / `columnwise_usage`, a `DType` for any `*_dtype`, TE-only keywords
    (`te_only`: name -> the values this package implements, or a function of the call's keywords
    giving them; any other value is a NotImplementedError naming it, never silently ignored), and
    where TE's positional order differs from the dataclass's (`te_positional`), TE's order when the
    first argument is a dtype (TE's first parameter; a call whose first argument is not a dtype
    keeps the dataclass's order, the one dynamo rebuilds quantizers with). Under torch.compile
    positional arguments win over same-named keywords: torch 2.11's dynamo counts the kw_only
    usage fields as positional and passes every later field's default as a keyword."""
    te_only = te_only or {}

    def decorate(cls):
        init = cls.__init__
        positional = [f.name for f in dataclasses.fields(cls) if f.init and not f.kw_only]

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            if te_positional and args and isinstance(args[0], (DType, torch.dtype)):
                if len(args) > len(te_positional):
                    raise TypeError(f"{cls.__name__}() takes at most {len(te_positional)} positional arguments "
                                    f"({', '.join(te_positional)}), got {len(args)}")
                compiling = torch.compiler.is_compiling()
                for name, value in zip(te_positional, args):
                    if name in kwargs and not compiling:
                        raise TypeError(f"{cls.__name__}() got multiple values for argument {name!r}")
                    kwargs[name] = value
                args = ()
            elif args and torch.compiler.is_compiling():
                for name in positional[:len(args)]:
                    kwargs.pop(name, None)
            for te_name, ours in (("rowwise", "rowwise_usage"), ("columnwise", "columnwise_usage")):
                if te_name in kwargs:
                    kwargs[ours] = bool(kwargs.pop(te_name))
            for name, supported in te_only.items():
                if name in kwargs:
                    if callable(supported):
                        supported = supported(kwargs)
                    value = as_torch_dtype(kwargs.pop(name))
                    if not any(value is s or value == s for s in supported):
                        raise NotImplementedError(f"{cls.__name__}: {name}={value!r} is not supported by "
                                                  f"transformer_engine_proto (supported: {supported})")
            for name, value in kwargs.items():
                if name.endswith("dtype") and isinstance(value, DType):
                    kwargs[name] = value.torch_dtype
            args = tuple(a.torch_dtype if isinstance(a, DType) else a for a in args)
            init(self, *args, **kwargs)

        cls.__init__ = __init__
        return te_flags(cls)

    return decorate


_DEBUG_RECIPES: Dict[str, type] = {}  # debug recipe name -> the quantizer class that declares it


def debug_recipe_names() -> Tuple[str, ...]:
    """Every declared `DEBUG_RECIPE`, in the order the formats were defined."""
    return tuple(_DEBUG_RECIPES)


def quantizer_class_by_debug_recipe(name: str) -> type:
    return _DEBUG_RECIPES[name]  # KeyError: no format declares it


@te_constructor()  # TE's `Quantizer.__init__(self, rowwise=..., columnwise=...)`, as TE-style subclasses call it
@dataclass(frozen=True)
class Quantizer:
    """Base quantizer. Subclasses declare their tensor class and `buffer_layout`.

    `rowwise_usage` produces the buffers used when the tensor is the reduction-dim-last GEMM
    operand (fprop); `columnwise_usage` the buffers for the transposed use (dgrad/wgrad).
    """

    rowwise_usage: bool = field(default=True, kw_only=True)
    columnwise_usage: bool = field(default=True, kw_only=True)

    # TE's mutable flags (`te_flags`), not dataclass fields. `internal`: `q(x)` and `make_empty`
    # give the bare storage class, as `quantize(x, internal=True)` does; `optimize_for_gemm` is
    # kept for TE code that sets and copies it (every layout here is already the GEMM's).
    internal = False
    optimize_for_gemm = False

    # TE's recipe name of this quantizer in the debug tools ("mxfp8", ...); a class attribute, not
    # a field. The class that sets it registers it (`quantizer_class_by_debug_recipe`).
    DEBUG_RECIPE = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("DEBUG_RECIPE")
        if name is not None:
            _DEBUG_RECIPES.setdefault(name, cls)

    # ---- what subclasses provide -------------------------------------------------------
    @property
    def tensor_class(self):
        raise NotImplementedError

    def buffer_layout(self, shape: Sequence[int]) -> Dict[str, BufferSpec]:
        """Name -> spec of every buffer that quantizing a tensor of `shape` creates."""
        raise NotImplementedError

    def check_shape(self, shape: Sequence[int]) -> None:
        """Raise ValueError if the format cannot represent `shape` with this usage."""
        flat_2d(shape)

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """TE's name: whether `inp`'s shape can be quantized with both usages (TE asks before a
        quantized all-gather); a block format needs whole blocks along both dims."""
        try:
            self.with_usage(rowwise=True, columnwise=True).check_shape(tuple(inp.shape))
        except ValueError:
            return False
        return True

    def row_block(self) -> int:
        """The multiple the rows (product of the leading dims) must be for this usage; 1: any.
        The Linear op zero-pads a GEMM's tokens to it (`custom_ops/row_padding.py`). A format capability:
        each format declares it."""
        raise missing_capability(self, "row_block")

    def _quantize_buffers(self, x: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Run the kernels: returns exactly the buffers `buffer_layout` describes."""
        raise NotImplementedError

    # ---- format capabilities (docs/adding_a_format.md): each format declares them; the defaults
    # raise NotImplementedError naming the format and the capability, never a quiet fallback ----
    def has_scale_state(self) -> bool:
        """Whether the scale comes from module state the linear op passes in and the amax is
        recorded there (delayed scaling: the module's scale / amax-history buffers), rather than
        from the tensor itself."""
        raise missing_capability(self, "has_scale_state")

    def takes_existing_amax(self) -> bool:
        """Whether `with_existing_amax` applies: the scale comes from one amax of the whole tensor
        (current scaling), which a caller that took it already may pass in."""
        return False

    def with_existing_amax(self, amax: torch.Tensor) -> "Quantizer":
        """This quantizer bound to `amax`, the amax of the tensor it will quantize, taken already
        (TE's `use_existing_amax`): its quantize skips the amax pass and writes the bytes a fresh
        pass would. Only where `takes_existing_amax()`."""
        raise missing_capability(self, "with_existing_amax")

    def with_scale_state(self, scale: torch.Tensor, amax: Optional[torch.Tensor], slot: int = 0) -> "Quantizer":
        """This quantizer bound to a module's `scale` and `amax` buffers (formats with scale
        state), element `slot` of each (a GEMM's input and weight share one buffer of each);
        `amax` None: no amax is recorded (a tensor quantized again with a scale whose amax was
        recorded already). A format without scale state returns itself."""
        if not self.has_scale_state():
            return self
        raise missing_capability(self, "with_scale_state")

    def fsdp_gather_rule(self) -> GatherRule:
        """How a GEMM weight of this quantizer all-gathers under FSDP2 (dim-0 shards, both usages
        needed after the gather): the gather layout and the shard's row multiple, or layout None with
        the reason it gathers in high precision (`distributed/fsdp.py`)."""
        raise missing_capability(self, "fsdp_gather_rule")

    def fsdp_quantize_shard(self, x: torch.Tensor, global_amax, scale: Optional[torch.Tensor]):
        """(tensors FSDP2 all-gathers along dim 0, extra per-tensor metadata tensors) for this rank's
        (M, K) weight shard `x`, for a format whose `fsdp_gather_rule` names a layout. `global_amax()`
        gives the whole weight's amax (all-reduced, cached); `scale` is the module's scale for a
        format with scale state, else None."""
        raise missing_capability(self, "fsdp_quantize_shard")

    def fsdp_rebuild(self, outputs, extra, rows: int):
        """(named buffers of the full weight in flatten order, names of the buffers built locally
        after the gather) from the gathered `outputs` and `fsdp_quantize_shard`'s `extra`; `rows`:
        the weight's dim 0 (uneven shards were zero-padded)."""
        raise missing_capability(self, "fsdp_rebuild")

    def sp_gather_rule(self) -> GatherRule:
        """How a GEMM input of this quantizer all-gathers under sequence parallelism: the gather
        layout and the row multiple a shard needs when the columnwise (wgrad) copy is gathered too,
        or layout None with the reason (`distributed/sp_gather.py`)."""
        raise missing_capability(self, "sp_gather_rule")

    def sp_quantize_shard(self, x2d: torch.Tensor, scale: Optional[torch.Tensor], all_reduce_max):
        """(parts to all-gather as (buffer name, tensor, the dim along which the rows run), buffers
        identical on every rank, the amax the module records) for this rank's (M, K) input shard,
        for a format whose `sp_gather_rule` names a layout. `all_reduce_max(t)` all-reduces (max) a
        tensor in place over the group (amaxes that set a shared scale); `scale` is the module's
        scale for a format with scale state, else None. The gathered buffers must equal those of
        quantizing the whole input, bit for bit."""
        raise missing_capability(self, "sp_quantize_shard")

    def sp_finish_gather(self, bufs: Dict[str, torch.Tensor]) -> None:
        """Complete the gathered buffers in place into this quantizer's `buffer_layout` (e.g. build
        a transpose after the gather, or restore a scale layout the parts were gathered in)."""
        raise missing_capability(self, "sp_finish_gather")

    def fused_norm_quantize(self, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            eps: float, normalization: str, zero_centered_gamma: bool):
        """Optional: (y, mu, rsigma, buffers in `buffer_layout` order) of a LayerNorm / RMSNorm and
        this quantize of its (M, K) output in one fused kernel, or None (the default): the norm
        runs, then `quantize` (`custom_ops/norm.py`, `te_proto::norm_quantize_fwd`)."""
        return None

    def debug_recipe_name(self) -> str:
        """TE's recipe name for this quantizer in the debug tools' stat names: `DEBUG_RECIPE`."""
        if type(self).DEBUG_RECIPE is None:
            raise missing_capability(self, "DEBUG_RECIPE")
        return type(self).DEBUG_RECIPE

    @classmethod
    def debug_quantizer(cls, fp8_dtype: Optional[torch.dtype], tensor_name: str) -> "Quantizer":
        """A quantizer of this format for a tensor role (`tensor_name`: "weight", "activation",
        ...), for debug stats of this recipe while another one trains (`fp8_dtype`: the
        requested FP8 dtype or None)."""
        raise missing_capability(cls, "debug_quantizer")

    @property
    def dtype(self) -> DType:
        """TE's name: the low-precision format as a `DType` (the FP8 formats' `fp8_dtype`)."""
        return DType.cast(self.fp8_dtype)

    def metadata(self) -> Dict[str, object]:
        """Non-tensor constructor kwargs beyond shape/dtype/quantizer (e.g. fp8_dtype)."""
        return {}

    # ---- usage --------------------------------------------------------------------------
    def seal(self):
        """Refuse `set_usage` from now on: for quantizers shared by every layer of a recipe (the
        recipe registry's), where an in-place change would reach all of them."""
        object.__setattr__(self, "_sealed", True)
        return self

    def set_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None):
        """TE-style in-place usage change, for quantizers the caller owns (TE code builds its own).
        Prefer `with_usage` (a copy): quantizers hash by their settings."""
        if getattr(self, "_sealed", False):
            raise TypeError(f"{type(self).__name__}.set_usage: this quantizer is shared (a recipe's cached "
                            "quantizer); changing it in place would change every layer's: use with_usage(...), "
                            "which returns a copy")
        if rowwise is not None:
            object.__setattr__(self, "rowwise_usage", bool(rowwise))
        if columnwise is not None:
            object.__setattr__(self, "columnwise_usage", bool(columnwise))
        self.__dict__.pop("_checked_inputs", None)  # the shape checks depend on the usage: check again
        return self

    def with_usage(self, *, rowwise: Optional[bool] = None, columnwise: Optional[bool] = None):
        """A copy with a different usage; the original is left untouched."""
        changes = {}
        if rowwise is not None:
            changes["rowwise_usage"] = bool(rowwise)
        if columnwise is not None:
            changes["columnwise_usage"] = bool(columnwise)
        return self._with_flags(dataclasses.replace(self, **changes))

    def copy(self):
        return self._with_flags(dataclasses.replace(self))

    def _with_flags(self, other):
        """`other` (a copy of this quantizer) with this one's TE flags."""
        for name in TE_FLAGS:
            if name in self.__dict__:
                object.__setattr__(other, name, self.__dict__[name])
        return other

    # ---- allocation (pure Python, safe under tracing) ---------------------------------
    def _check_usage(self) -> None:
        if not (self.rowwise_usage or self.columnwise_usage):
            raise ValueError(f"{type(self).__name__}: neither rowwise nor columnwise usage is set")

    def alloc_tensors(self, shape, dtype: torch.dtype, device=None) -> Dict[str, torch.Tensor]:
        """Empty inner buffers with exactly the names/shapes/strides/dtypes a real quantize makes."""
        shape = tuple(shape)  # may hold SymInts (a dynamic batch dim): never int() them
        self._check_usage()
        self.check_shape(shape)
        return {name: spec.empty(device) for name, spec in self.buffer_layout(shape).items()}

    def create_metadata(self, shape, dtype: torch.dtype):
        """(tensor class, non-tensor constructor kwargs) for a quantized tensor of this shape."""
        kwargs = dict(shape=tuple(shape), dtype=dtype, quantizer=self)
        kwargs.update(self.metadata())
        return self.tensor_class, kwargs

    def make_tensor(self, buffers: Dict[str, torch.Tensor], shape, dtype: torch.dtype, internal: bool = False):
        """Wrap named buffers (as returned by alloc_tensors / a kernel) in the tensor class, or
        with `internal=True` in its bare storage class (as TE's internal quantizers do): no
        wrapper tensor, for values that never leave an op (host time per GEMM)."""
        if internal:  # keeps this (possibly stateful) quantizer, as the base metadata: never leaves the op
            return self.tensor_class.storage_class._bare(buffers, shape, dtype, self, self.metadata())
        cls, kwargs = self.create_metadata(shape, dtype)
        return cls._from_buffers(buffers, **kwargs)

    def make_empty(self, shape, dtype: torch.dtype = torch.float32, device=None):
        return self.make_tensor(self.alloc_tensors(shape, dtype, device), shape, dtype, self.internal)

    # ---- quantization -------------------------------------------------------------------
    def _check_quantize_input(self, x: torch.Tensor) -> None:
        """dtype, usage and shape checks; their errors keep type and message under torch.compile
        (`errors.raise_error`; with a dynamic shape the shape messages do not trace yet)."""
        try:
            check_input(x, f"{type(self).__name__}.quantize")
            self._check_usage()
            self.check_shape(tuple(x.shape))
        except (TypeError, ValueError) as e:
            raise_error(type(e), str(e))

    def quantize(self, x: torch.Tensor, *, internal: Optional[bool] = None):
        """Quantize a high-precision tensor into a new QuantizedTensor (a bare storage with
        `internal=True`, see `make_tensor`; None: this quantizer's `internal` flag). A tensor that
        requires grad gives one that does, its gradient passed straight through to x
        (tensor/straight_through.py)."""
        if internal is None:
            internal = self.internal
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            if not internal and tracks_grad(x):
                return QuantizeStraightThrough.apply(x, self.quantize)
            with torch.no_grad():  # the buffers are values, not functions of x for autograd
                return self.quantize(x, internal=internal)
        if type(x) in _PLAIN and not torch.compiler.is_dynamo_compiling():
            # an eager plain tensor or parameter: its checks once per (shape, dtype) on this quantizer
            checked = self.__dict__.get("_checked_inputs")
            if checked is None:  # frozen dataclass: write the dict directly; copies by `with_scale_state` share it
                checked = self.__dict__["_checked_inputs"] = set()
            signature = (x.shape, x.dtype)
            if signature not in checked:
                self._check_quantize_input(x)
                checked.add(signature)
        else:
            from .quantized_tensor import QuantizedTensor

            if isinstance(x, QuantizedTensor):
                x = x.dequantize()
            self._check_quantize_input(x)
        buffers = self._quantize_buffers(x.contiguous())
        return self.make_tensor(buffers, tuple(x.shape), x.dtype, internal)

    def __call__(self, x: torch.Tensor):
        return self.quantize(x)

    def update_quantized(self, src: torch.Tensor, dst, *, noop_flag: Optional[torch.Tensor] = None) -> None:
        """Re-quantize `src` into the existing buffers of `dst` (used by `copy_`). `noop_flag`
        (TE's: a one-element tensor): where it is nonzero `dst` keeps its bytes; chosen on the
        device, no host sync (CUDA-graph safe)."""
        new = self.quantize(src).get_buffers()
        for name, buf in dst.get_buffers().items():
            if name in new:
                write_unless(noop_flag, buf, new[name])


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def write_unless(noop_flag: Optional[torch.Tensor], dst: torch.Tensor, new: torch.Tensor) -> None:
    """dst <- new, or (noop_flag nonzero) dst unchanged, bit for bit: selected on integer views,
    which every buffer dtype has (fp8 / e8m0 / packed fp4 have no `where` of their own)."""
    if noop_flag is None:
        dst.copy_(new)
        return
    bits = _SAME_SIZE_INT[dst.element_size()]
    keep = noop_flag.reshape(()).to(dst.device) != 0
    dst.view(bits).copy_(torch.where(keep, dst.view(bits), new.to(dst.dtype).view(bits)))
