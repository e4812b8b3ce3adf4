"""FSDP2 (`torch.distributed.fsdp.fully_shard`) with GEMM weights all-gathered in the recipe's format.

`enable_quantized_all_gather(model)` turns every TE-proto GEMM weight into an `FSDPWeight`: a
wrapper parameter holding the high-precision (master) weight, with FSDP2's tensor-subclass hooks.
Before each all-gather, `fsdp_pre_all_gather` quantizes this rank's dim-0 shard and hands FSDP the
raw bytes (uint8 views); `fsdp_post_all_gather` rebuilds the full weight as our `QuantizedTensor`
(both usages: the columnwise/transposed buffers are derived locally from the gathered rowwise
ones where the format allows) and the module feeds it to the Linear op as a prequantized weight
(the op's weight-cache path), so it is never quantized again.

What gathers quantized (a shard = ceil(rows / world) rows of the [out, in] weight):

==========================  =================================================================
recipe (weight format)      gathered as
==========================  =================================================================
high precision              param dtype (FSDP's own path)
DelayedScaling, current     fp8 bytes; one scale for the whole weight (current scaling: the
                            amax is all-reduced (max) across the shard group first, or taken
                            from `precompute_fp8_scales_for_fsdp`); uneven shards are padded
MXFP8 (1x32 and 32x1)       both usages' data + E8M0 scales, when the shard is a multiple of 32
Float8BlockScaling 128x128  rowwise data + tile scales when the shard is a multiple of 128;
                            the columnwise copy is the exact transpose (built after gather)
NVFP4 2D (16x16)            packed data + E4M3 scales when the shard is a multiple of 16, with
                            the all-reduced global amax; columnwise by exact relayout
otherwise                   param dtype, quantized after the gather by the module (same
                            numbers; `strict=True` raises instead, naming shape and block)
==========================  =================================================================

(Float8BlockScaling with 1x128 weight tiles and NVFP4 with 1D weight blocks fall back: their
columnwise copy is not derivable from the rowwise one, and FSDP gathers along dim 0 only.)

Each format declares its part in its own module under `tensor/` (`tensor/format_api.py`):
`fsdp_gather_rule` (the layout, the shard's row multiple, whether uneven shards may be padded, or
why it gathers in high precision), `fsdp_quantize_shard` (what is gathered) and `fsdp_rebuild`
(the full buffers, and which were built after the gather). This file names no format.

Delayed scaling: the module's scale buffer is used, and the pre-all-gather of each forward
all-reduces (max) the GEMM's pending amaxes (input, weight, grad) across the shard group before
the scale update (`DelayedScaling.reduce_amax`), so scales stay identical on every rank: the
update of these GEMMs runs in the hook, after the reduction (not at autocast exit / entry, as for other
GEMMs), and the all-reduced weight amax of a quantized gather is recorded there.

A backward re-gather (reshard_after_forward) reuses the forward's recipe and scales. FSDP2's
hooks are `torch._dynamo.disable`d: compile each FSDP unit's inner `forward`. Limits: the gather
format is fixed at the first all-gather (FSDP2 reuses the unsharded parameter object); a second
forward without a new gather (reshard_after_forward=False) skips the delayed-scaling update, like
TE's later micro-batches; `is_first_microbatch` has no effect (the gathered weight is quantized
already), `fuse_wgrad_accumulation` is not supported.
"""
from __future__ import annotations

import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map, tree_map_only

from .. import recipe as R
from ..autocast import get_fp8_recipe_key, in_training_autocast
from ..custom_ops import linear as _linear_ops
from ..custom_ops.recipe_key import RecipeKey
from ..tensor import QuantizedTensor
from ..tensor.quantized_tensor import handles
from .gemm_owner import GemmOwner

__all__ = ["FSDPWeight", "enable_quantized_all_gather", "precompute_fp8_scales_for_fsdp", "gather_format",
           "gathered_weight_cache"]

aten = torch.ops.aten
HP = "hp"  # gather in the param dtype; the module quantizes after the gather


# ---- which format a weight gathers in -------------------------------------------------------------
def gather_format(key: str, shape, world: int) -> Tuple[str, str]:
    """(layout, why not quantized) for a weight of full `shape` under recipe `key` sharded over `world`
    ranks along dim 0. layout is the weight format's `fsdp_gather_rule().layout` ("fp8" / "mxfp8" /
    "blockwise" / "nvfp4"), or "hp" with the reason
    ('' for high precision). Depends on global values only, so every rank decides alike."""
    q = RecipeKey.quantizers(key).weight
    if q is None:
        return HP, ""
    shape = tuple(shape)
    if len(shape) != 2:
        return HP, f"weight shape {shape} is not 2D"
    try:
        q.with_usage(rowwise=True, columnwise=True).check_shape(shape)
    except ValueError as e:
        return HP, str(e)  # the module raises the recipe's own error after the gather
    rows = shape[0]
    shard = -(-rows // world)
    rule = q.fsdp_gather_rule()  # the format's own rule (its module under tensor/)
    if rule.pads_uneven and rule.layout is not None:
        return rule.layout, ""  # one scale per tensor: any shard (uneven ones are zero-padded)
    if rows % world:
        return HP, (f"weight shape {shape}: dim 0 ({rows}) is not divisible by the FSDP world size {world} "
                    f"(uneven shards are padded, which block scales cannot express)")
    if rule.layout is None:
        return HP, rule.reason
    block, layout = rule.row_block, rule.layout
    if shard % block:
        return HP, (f"weight shape {shape}: the FSDP shard of {shard} rows (dim 0 {rows} / world {world}) is "
                    f"not a multiple of the {layout} block of {block} rows")
    return layout, ""


# ---- the wrapper parameter ---------------------------------------------------------------------------
# ops whose outputs stay FSDPWeight (what FSDP2 does to a parameter while sharding it, plus copies)
_WRAP_OPS = {aten.view.default, aten._unsafe_view.default, aten.as_strided.default, aten.slice.Tensor,
             aten.split.Tensor, aten.split_with_sizes.default, aten.new_zeros.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.empty_like.default, aten.clone.default, aten.detach.default,
             aten.alias.default, aten._to_copy.default, aten._pin_memory.default}


class FSDPWeight(torch.Tensor):
    """A high-precision GEMM weight that FSDP2 all-gathers in the active recipe's format.

    Any op runs on the inner tensor (sharding views and copies stay `FSDPWeight`, in-place ops
    such as the optimizer's update the inner tensor). `gemm_name` names the module's
    `QuantizedGemm` for this weight (delayed-scaling state)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, gemm_name: Optional[str] = None, strict: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, gemm_name: Optional[str] = None, strict: bool = False):
        self._tensor = tensor
        self._gemm_name = gemm_name
        self._strict = strict
        self._amax_cache = None  # (inner version, fp32 amax of the whole weight)
        self._fwd_key = None     # recipe of the last forward gather (backward re-gathers alike)
        self._gathered_as = None  # (layout, key) of the first gather: FSDP reuses the unsharded param

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self, *, tensor_contents=None):
        return f"FSDPWeight({self._tensor!r}, gemm_name={self._gemm_name!r})"

    def __tensor_flatten__(self):
        return ["_tensor"], (self._gemm_name, self._strict)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FSDPWeight(inner["_tensor"], *ctx)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = next(t for t in _leaves((args, kwargs)) if isinstance(t, FSDPWeight))
        unwrap = lambda t: t._tensor if isinstance(t, FSDPWeight) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        schema = func._schema
        if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
            return args[0] if schema.returns else None  # in place: the caller's object was updated
        if func in _WRAP_OPS:
            return tree_map_only(torch.Tensor, lambda t: FSDPWeight(t, first._gemm_name, first._strict), out)
        return out

    # ---- FSDP2 all-gather extension --------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        group = mesh.get_group()
        world = dist.get_world_size(group)
        dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        in_backward = torch._C._current_graph_task_id() != -1  # a re-gather for backward
        if in_backward and self._fwd_key is not None:
            key = self._fwd_key  # autocast has exited by now: gather as the forward did
        else:
            key = get_fp8_recipe_key()
            self._fwd_key = key
        layout, reason = gather_format(key, tuple(outer_size), world)
        if layout == HP and reason:
            if self._strict:
                raise ValueError(f"FSDP2 quantized all-gather (strict): {reason}")
            _warn_once(reason)
        self._check_same_format(layout, key, outer_size)
        recipe = RecipeKey.recipe(key)
        gemm = getattr(module, self._gemm_name) if self._gemm_name else None
        delayed = isinstance(recipe, R.DelayedScaling) and gemm is not None
        if delayed and not in_backward:  # this GEMM's update: after the reduction, not at autocast exit / entry
            if recipe.reduce_amax:
                gemm.reduce_pending_amaxes(lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
            if in_training_autocast():
                gemm.update_scales(recipe)
        rows = -(-outer_size[0] // world)
        x = _pad_rows(self._tensor.to(dtype), rows)
        meta = (layout, key, tuple(outer_size))
        if layout == HP:
            return (x,), meta
        q = RecipeKey.quantizers(key).weight
        scale = None
        if delayed:  # the module's weight scale; the all-reduced weight amax goes into its history
            amax = self._global_amax(group, dtype)
            scale = gemm.fp8_scale[1:2].clone()
            if not in_backward:
                gemm.record_amax(amax.reshape(1), first=1)
        # the format quantizes the shard (its module under tensor/: `fsdp_quantize_shard`)
        outputs, extra = q.fsdp_quantize_shard(x, lambda: self._global_amax(group, dtype), scale)
        return outputs, meta + tuple(extra)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        layout, key, shape = metadata[:3]
        n = shape[0]
        if layout == HP:
            if out is not None:
                return  # `out` views the all-gather output, already refilled
            (x,) = all_gather_outputs
            return x, (x,)
        q = RecipeKey.quantizers(key).weight
        extra = tuple(_read_on_this_stream(t) for t in metadata[3:])
        bufs, derived = q.fsdp_rebuild(all_gather_outputs, extra, n)  # the format's own rebuild
        if out is not None:
            if not isinstance(out, QuantizedTensor) or set(out.get_buffers()) != set(bufs):
                raise RuntimeError(f"FSDP2: the unsharded weight {tuple(shape)} was first gathered in another "
                                   f"format than {layout!r}; the gather format cannot change after the first "
                                   "all-gather (keep one recipe, evaluation included)")
            targets = [getattr(out, name) for name in derived]
            with torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
                for t, name in zip(targets, derived):
                    t.copy_(bufs[name])
            return
        qt = q.with_usage(rowwise=True, columnwise=True).make_tensor(bufs, tuple(shape), param_dtype)
        # FSDP frees these after forward and re-allocates them before the next gather (the
        # one-element scales / amaxes stay allocated)
        big = tuple(bufs[name] for name in derived if bufs[name].numel() > 1)
        return qt, tuple(all_gather_outputs) + big

    # ---- helpers -----------------------------------------------------------------------------------
    def _global_amax(self, group, dtype) -> torch.Tensor:
        """max |w| over the whole weight (fp32, shape (1,)), in `dtype`'s rounding: cached until the
        weight changes in place (the optimizer step), so a backward re-gather needs no collective."""
        cache = self._amax_cache
        if cache is None or cache[0] != self._tensor._version:
            amax = _local_amax(self._tensor)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            self._amax_cache = cache = (self._tensor._version, amax)
        # rounding is monotonic, so the amax of the cast weight is the cast of the amax
        return _read_on_this_stream(cache[1]).to(dtype).float().clone()

    def _check_same_format(self, layout: str, key: str, shape) -> None:
        if self._gathered_as is None:
            self._gathered_as = (layout, key)
        elif self._gathered_as[0] != layout or (layout != HP and self._gathered_as[1] != key):
            was, now = (_recipe_name(k) for k in (self._gathered_as[1], key))
            raise RuntimeError(
                f"FSDP2: weight of shape {tuple(shape)} was first all-gathered as {self._gathered_as[0]!r} "
                f"({was}), now as {layout!r} ({now}). FSDP2 reuses the unsharded parameter, so the gather "
                "format cannot change after the first all-gather: keep one recipe (evaluation included)")


def _recipe_name(key: str) -> str:
    recipe = RecipeKey.recipe(key)
    return "high precision" if recipe is None else type(recipe).__name__


def _leaves(tree):
    if isinstance(tree, (list, tuple)):
        for t in tree:
            yield from _leaves(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _leaves(t)
    else:
        yield tree


_WARNED = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"FSDP2: all-gathering in high precision and quantizing after the gather: {reason}",
                      stacklevel=3)


def _read_on_this_stream(t: torch.Tensor) -> torch.Tensor:
    """Mark a tensor made on another CUDA stream as used by the current one. FSDP2 runs
    `fsdp_pre_all_gather` on its copy-in stream and drops the metadata (our scale / amax) right
    after `fsdp_post_all_gather` queued its reads on the compute stream; without this the caching
    allocator hands that block to the next unit's copy-in while the read is still queued, and the
    read sees that unit's data (wrong results that CUDA_LAUNCH_BLOCKING=1 hides)."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))
    return t


def _local_amax(t: torch.Tensor) -> torch.Tensor:
    if t.numel() == 0:  # an empty shard (more ranks than rows)
        return torch.zeros(1, dtype=torch.float32, device=t.device)
    return t.detach().abs().amax().float().reshape(1)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """The shard with zero rows appended up to FSDP's padded shard size (uneven sharding)."""
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros((rows,) + tuple(x.shape[1:]))
    out[: x.shape[0]].copy_(x)
    return out


# ---- the gathered weight inside the module -------------------------------------------------------------
def gathered_weight_cache(owner: str, weight: QuantizedTensor, key: str,
                          columnwise_read: bool = True) -> List[torch.Tensor]:
    """The buffers of a quantized weight (an FSDP2 quantized all-gather, or a parameter made by
    `quantized_model_init`) in the order the Linear op's weight cache takes them (both usages;
    one stored usage is relayed out into the other where the format allows), after checking
    it suits this call. Only with a recipe active: without one, `QuantizedGemm` dequantizes the
    weight for a high-precision GEMM. `columnwise_read` False (no dgrad will run): a columnwise
    usage the weight lacks is not built; zero-stride stand-ins of its shapes fill its slots,
    which is what lets a weight stored for inference (rowwise only, as TE stores one built
    without grad) run where its format cannot derive the other usage (MXFP8). The weight is the
    cache: `is_first_microbatch` changes nothing for it, as in TE."""
    names = _weight_cache_names(key, tuple(weight.shape))
    if type(weight).__qualname__ != names[0]:
        raise RuntimeError(f"{owner}: Recipe mismatch for the weight: it is stored quantized as a "
                           f"{type(weight).__name__} (quantized_model_init or an FSDP2 quantized all-gather), "
                           f"recipe {key} takes a {names[0]}; check the recipes given to quantized_model_init() "
                           "and autocast()")
    q = weight._quantizer
    stored = _stored_buffer_names(key, tuple(weight.shape), q.rowwise_usage, q.columnwise_usage)
    buffers = {n: getattr(weight, n) for n in stored}
    missing = [n for n in names[1] if n not in buffers]  # attribute reads only: dynamo traces them
    columnwise = _columnwise_buffer_specs(key, tuple(weight.shape))
    if missing and not columnwise_read and all(n in columnwise for n in missing):
        for n in missing:
            shape, dtype = columnwise[n]
            buffers[n] = torch.empty((), dtype=dtype, device=weight.device).expand(shape)
    elif missing:
        meta = {m: getattr(weight, m) for m in type(weight)._META_FIELDS}
        storage = type(weight).storage_class._from_buffers(buffers, shape=tuple(weight.shape), dtype=weight.dtype,
                                                           quantizer=weight._quantizer, **meta)
        if not storage.derives_usages():
            raise RuntimeError(f"{owner}: the weight is stored quantized without the {', '.join(missing)} that "
                               f"backward reads, which a {type(weight).__name__} cannot derive from what it keeps "
                               "(a model built inside quantized_model_init under torch.no_grad / inference_mode "
                               "stores its weights for inference, as TE does): build it with grad enabled to train")
        buffers = storage.update_usage(rowwise_usage=True, columnwise_usage=True).get_buffers()
    return [buffers[n] for n in names[1]]


@torch._dynamo.assume_constant_result
def _columnwise_buffer_specs(key: str, shape) -> dict:
    """name -> (shape, dtype) of the buffers of the weight's columnwise usage (constants to dynamo)."""
    q = RecipeKey.quantizers(key).weight.with_usage(rowwise=False, columnwise=True)
    return {n: (tuple(spec.shape), spec.dtype) for n, spec in q.buffer_layout(shape).items()}


@torch._dynamo.assume_constant_result
def _stored_buffer_names(key: str, shape, rowwise: bool, columnwise: bool) -> Tuple[str, ...]:
    """The buffers a weight of this layout stores (plain arguments: dynamo cannot rebuild a
    quantizer object to pass it here)."""
    q = RecipeKey.quantizers(key).weight.with_usage(rowwise=rowwise, columnwise=columnwise)
    return tuple(q.buffer_layout(shape))


@torch._dynamo.assume_constant_result
def _weight_cache_names(key: str, shape) -> Tuple[str, Tuple[str, ...]]:
    """(tensor class name, buffer names) of a weight cache: constants to torch.compile."""
    q = RecipeKey.quantizers(key).weight.with_usage(rowwise=True, columnwise=True)
    return q.tensor_class.__qualname__, tuple(q.buffer_layout(shape))


@handles(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    """FSDP2 views the unsharded tensor with its own (contiguous) size: the identity here."""
    src, size, stride = args[0], tuple(args[1]), tuple(args[2])
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
    contiguous = tuple(torch.empty(size, device="meta").stride())
    if size != tuple(src.shape) or stride != contiguous or offset not in (0, None):
        return NotImplemented
    return src._rebuild(src.get_buffers())


def _stand_in(w: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the weight's shape and dtype (stride 0: no storage to speak of)."""
    return torch.empty_strided(tuple(w.shape), (0,) * w.dim(), dtype=w.dtype, device=w.device)


@handles(torch.ops.te_proto.linear_fwd.default)
def _linear_fwd_prequantized(func, args, kwargs):
    """The Linear op with an FSDP2-gathered quantized weight: autograd saw the parameter (its grad
    is the op's wgrad); below autograd the weight's buffers arrive as the weight cache
    (CACHE_USE), so the parameter itself is only a shape/dtype stand-in."""
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **kwargs)
    others = [v for n, v in bound.items() if n != "weight"]
    cache_mode = _linear_ops.LinearCall.of(bound["flags"]).cache_mode
    if cache_mode != _linear_ops.CACHE_USE or any(isinstance(t, QuantizedTensor) for t in _leaves(others)):
        return NotImplemented
    bound["weight"] = _stand_in(bound["weight"])
    return func(*(bound[n] for n in names))


# ---- user API -------------------------------------------------------------------------------------------
def enable_quantized_all_gather(model: nn.Module, strict: bool = False) -> int:
    """Make every TE-proto GEMM weight in `model` an `FSDPWeight` (call before `fully_shard`).
    With `strict`, a weight the recipe cannot gather quantized raises instead of falling back
    to a high-precision gather. Returns the number of weights converted."""
    from torch.distributed.tensor import DTensor

    n = 0
    for m in model.modules():
        if not isinstance(m, GemmOwner):
            continue
        for gemm, weight in m.gemm_weights():
            pname = next((k for k, p in m._parameters.items() if p is weight), None)
            gname = next((k for k, s in m._modules.items() if s is gemm), None)
            if pname is None and len(getattr(m, "weight_names", ())) > 1:
                why = (f"{m.name}: its weight is split into parameters {m.weight_names} (TE's parameters_split / "
                       "fuse_qkv_params=False), gathered in high precision")
                if strict:
                    raise ValueError(why + "; build it with fuse_qkv_params=True to gather it quantized")
                warnings.warn(f"FSDP2: all-gathering in high precision and quantizing after the gather: {why}",
                              stacklevel=2)
                continue
            if pname is None or gname is None:
                raise ValueError(f"{m.name}: cannot find the attribute names of a GEMM weight / its QuantizedGemm")
            if isinstance(weight, DTensor):
                raise ValueError(f"{m.name}.{pname} is already a DTensor: call enable_quantized_all_gather "
                                 "before fully_shard")
            if getattr(m, "fuse_wgrad_accumulation", False):
                raise ValueError(f"{m.name}: fuse_wgrad_accumulation is not supported with FSDP2")
            if isinstance(weight, FSDPWeight):
                continue
            gemm.scales_updated_by_autocast = False  # the pre-all-gather reduces, then updates
            new = nn.Parameter(FSDPWeight(weight.data, gname, strict), requires_grad=weight.requires_grad)
            new.__dict__.update({k: v for k, v in weight.__dict__.items() if not k.startswith("_")})
            setattr(m, pname, new)
            n += 1
    return n


def _shard_group(p):
    """The process group over which `p` (a DTensor parameter) is sharded."""
    from torch.distributed.tensor import Shard

    dims = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
    return p.device_mesh.get_group(dims[-1] if dims else 0)


@torch.no_grad()
def precompute_fp8_scales_for_fsdp(model: nn.Module) -> int:
    """Compute the whole-weight amax of every `FSDPWeight` in `model` with one all-reduce (max) per
    shard group, for the per-tensor scales the next all-gathers use (current scaling, NVFP4,
    and the amax delayed scaling records). Call after each optimizer step (like torchao's
    `precompute_float8_dynamic_scale_for_fsdp`); without it each weight all-reduces its own amax
    inside its pre-all-gather. Returns the number of weights covered."""
    from torch.distributed.tensor import DTensor

    groups = {}
    for p in model.parameters():
        if isinstance(p, DTensor) and isinstance(p._local_tensor, FSDPWeight):
            group = _shard_group(p)
            groups.setdefault(group.group_name, (group, []))[1].append(p._local_tensor)
    for group, weights in groups.values():
        amaxes = torch.cat([_local_amax(w._tensor) for w in weights])
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
        for w, a in zip(weights, amaxes.split(1)):
            w._amax_cache = (w._tensor._version, a.clone())
    return sum(len(ws) for _, ws in groups.values())
