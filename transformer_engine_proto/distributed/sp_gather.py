"""Sequence-parallel all-gather of a column-parallel GEMM's input in the recipe's format.

With `sequence_parallel=True` a column-parallel `Linear` / `LayerNormLinear` / `LayerNormMLP.fc1`
gets this rank's dim-0 (sequence) shard of its input and needs the whole tensor for its GEMM.
As in Transformer Engine, the shard is quantized first and the quantized bytes are all-gathered
(half the traffic of bf16 for FP8, about a quarter for NVFP4), instead of gathering the high
precision tensor and quantizing it whole. It is exact -- the gathered buffers equal those of
quantizing the full tensor, bit for bit -- because:

===========================  ========================================================================
input format                 why gathering shards equals quantizing the whole tensor
===========================  ========================================================================
FP8 current scaling          the amax is all-reduced (max) over the TP group first, so every rank
                             scales with the full tensor's scale; the rowwise fp8 bytes are gathered
                             and the transpose (columnwise, for wgrad) is built after the gather
FP8 delayed scaling          the scale is the module's buffer (identical on all ranks); the shard
                             amax is all-reduced before it is recorded, as the full tensor's amax
MXFP8                        rowwise 1x32 blocks run along K; columnwise 32x1 blocks need shard
                             rows % 32 == 0 (then both usages' data + scales are gathered)
Float8BlockScaling 1x128     rowwise tiles run along K; the columnwise tiles (128 along M) need
                             shard rows % 128 == 0
NVFP4 (1D, RHT)              global amaxes (rowwise, and columnwise after the Hadamard transform)
                             all-reduced; rowwise exact; columnwise 16-row blocks (and 16-row RHT
                             runs) need shard rows % 16 == 0
===========================  ========================================================================

Anything else (misaligned shards where wgrad needs the columnwise copy, 128x128 input tiles,
2D or stochastically rounded NVFP4 inputs, high precision, the debug GEMM path,
`save_original_input`) all-gathers in high precision, as before -- the same numbers.
`input_gather_format` says which; a one-time warning names the reason for a fallback.

Each format declares its part in its own module under `tensor/` (`tensor/format_api.py`):
`sp_gather_rule` (the layout, the row multiple a shard needs for the columnwise copy, or why it
gathers in high precision), `sp_quantize_shard` (the parts gathered, the buffers every rank
shares) and `sp_finish_gather` (buffers built after the gather). This file names no format.

The collective is one custom op (`te_proto::sp_all_gather_quantized`: quantize the shard, one
all-gather of all its buffers packed as bytes, rebuild the full buffers), opaque to
torch.compile. It returns the buffers the Linear op takes as a prequantized input, and a
stride-0 stand-in of the full high-precision input for autograd: the Linear op's input gradient
arrives there and the op's backward reduce-scatters it back to the shard. NVFP4 shards are
quantized with the pure-torch reference kernels (there is no fused kernel taking a global amax).
"""
from __future__ import annotations

import math
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..custom_ops.recipe_key import RecipeKey
from ..tensor import TensorProto
from . import tp as _tp
from .gemm_owner import GemmOwner

__all__ = ["HP", "input_gather_format", "all_gather_quantized", "set_quantized_sequence_parallel_gather"]

HP = "hp"  # gather in high precision; the Linear op quantizes the full tensor
_ALIGN = 16  # bytes: each packed buffer starts aligned, so it can be viewed back as its dtype


# ---- which format an input gathers in -------------------------------------------------------------
def input_gather_format(key: str, local_shape: Sequence[int], world: int, columnwise: bool) -> Tuple[str, str]:
    """(layout, why not quantized) for gathering an input shard of `local_shape` over `world` ranks
    along dim 0 under recipe `key`; `columnwise`: the GEMM's wgrad needs the columnwise copy.
    layout is the input format's `sp_gather_rule().layout` ("fp8_current" / "fp8_delayed" / "mxfp8"
    / "blockwise" / "nvfp4"), or HP with the reason ('' for high precision)."""
    local_shape = tuple(local_shape)
    if len(local_shape) < 2:
        return HP, f"input shape {local_shape} has no sequence dim to gather"
    rows = math.prod(local_shape[:-1])  # may be a SymInt: the bool below guards on it
    aligned = bool(rows % _row_block(key) == 0)
    return _format(key, int(local_shape[-1]), world, columnwise, aligned)


_WARNED = set()


@torch._dynamo.assume_constant_result
def _row_block(key: str) -> int:
    """The row multiple the input format's shards need for a columnwise gather (1: any)."""
    q = RecipeKey.quantizers(key).input
    return 1 if q is None else q.sp_gather_rule().row_block


@torch._dynamo.assume_constant_result
def _format(key: str, k: int, world: int, columnwise: bool, aligned: bool) -> Tuple[str, str]:
    """Depends on plain values only: a constant to dynamo (runs once at trace time)."""
    layout, reason = _decide(key, k, columnwise, aligned)
    if reason and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"sequence parallel: all-gathering the input in high precision: {reason}", stacklevel=2)
    return layout, reason


def _decide(key, k, columnwise, aligned) -> Tuple[str, str]:
    q = RecipeKey.quantizers(key).input
    if q is None:
        return HP, ""
    try:  # a recipe that cannot quantize this shape at all: the module raises its own error
        q.with_usage(rowwise=True, columnwise=False).check_shape((1, k))
    except ValueError as e:
        return HP, str(e)
    rule = q.sp_gather_rule()  # the format's own rule (its module under tensor/)
    if rule.layout is None:
        return HP, rule.reason
    if columnwise and not aligned:
        return HP, (f"{rule.layout}: the columnwise (wgrad) copy needs the sequence-parallel shard's rows "
                    f"(product of the leading dims) to be a multiple of {rule.row_block}")
    return rule.layout, ""


def _gather_parts(parts, group, world: int) -> Dict[str, torch.Tensor]:
    """All-gather every part in one collective (packed as bytes) and concatenate the ranks' pieces
    along each part's M dim."""
    flats, sizes = [], []
    for _, t, _ in parts:
        b = t.contiguous().view(torch.uint8).reshape(-1)
        pad = (-b.numel()) % _ALIGN
        flats.append(torch.cat([b, b.new_zeros(pad)]) if pad else b)
        sizes.append(b.numel())
    flat = torch.cat(flats) if len(flats) > 1 else flats[0]
    out = flat.new_empty((world, flat.numel()))
    _tp.all_gather_into(out.view(-1), flat, group)
    result, off = {}, 0
    for (name, t, dim), n, f in zip(parts, sizes, flats):
        pieces = [out[r, off:off + n].view(t.dtype).view(t.shape) for r in range(world)]
        result[name] = torch.cat(pieces, dim)
        off += f.numel()
    return result


# ---- the op ---------------------------------------------------------------------------------------------
def _input_quantizer(key: str, columnwise: bool):
    return RecipeKey.quantizers(key).input.with_usage(rowwise=True, columnwise=columnwise)


def _stand_in(shape, x: torch.Tensor) -> torch.Tensor:
    """The full input's shape and dtype without its storage (one zero, stride 0): what the
    Linear op and autograd see as the gathered input."""
    return x.new_zeros(1).as_strided(tuple(shape), (0,) * len(shape))


@torch.library.custom_op("te_proto::sp_all_gather_quantized", mutates_args=())
def sp_all_gather_quantized(x: torch.Tensor, scale: Optional[torch.Tensor], group_name: str, world: int, key: str,
                            layout: str, columnwise: bool) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """(stand-in of the gathered input, amax (the all-reduced one for per-tensor formats),
    the gathered input's quantized buffers as (M, K) in flatten order)."""
    q = _input_quantizer(key, columnwise)
    group = _tp.group_by_name(group_name)
    k = x.shape[-1]
    x2d = x.contiguous().reshape(-1, k)
    # the format quantizes the shard and completes the gathered buffers (its module under tensor/)
    parts, same, amax = q.sp_quantize_shard(x2d, scale, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX,
                                                                                  group=group))
    bufs = dict(same, **_gather_parts(parts, group, world))
    m = x2d.shape[0] * world
    q.sp_finish_gather(bufs)
    full = (x.shape[0] * world,) + tuple(x.shape[1:])
    return _stand_in(full, x), amax, [bufs[name] for name in q.buffer_layout((m, k))]


@sp_all_gather_quantized.register_fake
def _(x, scale, group_name, world, key, layout, columnwise):
    k = x.shape[-1]
    m = math.prod(x.shape[:-1]) * world
    proto = TensorProto((m, k), x.dtype, _input_quantizer(key, columnwise), device=x.device)
    full = (x.shape[0] * world,) + tuple(x.shape[1:])
    return _stand_in(full, x), x.new_empty((1,), dtype=torch.float32), list(proto.create_buffers().values())


def _setup(ctx, inputs, output):
    ctx.group_name, ctx.world = inputs[2], inputs[3]


def _backward(ctx, grad, _grad_amax, _grad_buffers):
    """The gather's conjugate: reduce-scatter the full input's gradient back to the shard."""
    dx = None if grad is None else _tp._reduce_scatter(grad.contiguous(), ctx.group_name, ctx.world)
    return dx, None, None, None, None, None, None


sp_all_gather_quantized.register_autograd(_backward, setup_context=_setup)


def all_gather_quantized(x: torch.Tensor, scale: Optional[torch.Tensor], group_name: str, world: int, key: str,
                         layout: str, columnwise: bool):
    """(stand-in of the gathered input, amax, buffers for the Linear op's `inp_quantized`)."""
    return sp_all_gather_quantized(x, scale, group_name, world, key, layout, columnwise)


# ---- user switch ----------------------------------------------------------------------------------------
def set_quantized_sequence_parallel_gather(model: torch.nn.Module, enabled: bool = True) -> int:
    """Turn the quantized sequence-parallel input gather on (the default) or off for every GEMM in
    `model`; off gathers in high precision and quantizes after (the same numbers, twice the bytes
    for FP8). Returns the number of GEMMs set."""
    n = 0
    for m in model.modules():
        if isinstance(m, GemmOwner):
            for gemm, _ in m.gemm_weights():
                gemm.quantized_sp_gather = bool(enabled)
                n += 1
    return n
