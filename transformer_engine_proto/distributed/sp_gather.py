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

from ..kernels.reference.common import transpose_2d
from ..kernels.reference.nvfp4 import _apply_rht, quantize_blocks
from ..ops.recipe_registry import quantizers_from_key
from ..tensor import (Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer,
                      NVFP4Quantizer, TensorProto)
from . import tp as _tp
from .amax_reduction import current_scaling_with_group_amax

__all__ = ["HP", "input_gather_format", "all_gather_quantized", "set_quantized_sequence_parallel_gather"]

HP = "hp"  # gather in high precision; the Linear op quantizes the full tensor
_ALIGN = 16  # bytes: each packed buffer starts aligned, so it can be viewed back as its dtype


# ---- which format an input gathers in -------------------------------------------------------------
def input_gather_format(key: str, local_shape: Sequence[int], world: int, columnwise: bool) -> Tuple[str, str]:
    """(kind, why not quantized) for gathering an input shard of `local_shape` over `world` ranks
    along dim 0 under recipe `key`; `columnwise`: the GEMM's wgrad needs the columnwise copy.
    kind is "fp8_current" / "fp8_delayed" / "mxfp8" / "blockwise" / "nvfp4", or HP with the
    reason ('' for high precision)."""
    local_shape = tuple(local_shape)
    if len(local_shape) < 2:
        return HP, f"input shape {local_shape} has no sequence dim to gather"
    rows = math.prod(local_shape[:-1])  # may be a SymInt: the bools below guard on it
    aligned = tuple(bool(rows % b == 0) for b in (16, 32, 128))
    return _format(key, int(local_shape[-1]), world, columnwise, aligned)


_WARNED = set()


@torch._dynamo.assume_constant_result
def _format(key: str, k: int, world: int, columnwise: bool, aligned: Tuple[bool, bool, bool]) -> Tuple[str, str]:
    """Depends on plain values only: a constant to dynamo (runs once at trace time)."""
    kind, reason = _decide(key, k, columnwise, dict(zip((16, 32, 128), aligned)))
    if reason and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"sequence parallel: all-gathering the input in high precision: {reason}", stacklevel=2)
    return kind, reason


def _decide(key, k, columnwise, aligned) -> Tuple[str, str]:
    q = quantizers_from_key(key).input
    if q is None:
        return HP, ""
    try:  # a recipe that cannot quantize this shape at all: the module raises its own error
        q.with_usage(rowwise=True, columnwise=False).check_shape((1, k))
    except ValueError as e:
        return HP, str(e)
    if isinstance(q, Float8Quantizer):
        return "fp8_delayed", ""
    if isinstance(q, Float8CurrentScalingQuantizer):
        return "fp8_current", ""
    if isinstance(q, MXFP8Quantizer):
        block, kind = 32, "mxfp8"
    elif isinstance(q, Float8BlockQuantizer):
        if q.block_scaling_dim != 1:
            return HP, "Float8BlockScaling with 128x128 input tiles (x_block_scaling_dim=2)"
        block, kind = 128, "blockwise"
    elif isinstance(q, NVFP4Quantizer):
        if q.with_2d_quantization or q.stochastic_rounding:
            return HP, "NVFP4 input with 2D blocks or stochastic rounding"
        block, kind = 16, "nvfp4"
    else:
        return HP, f"no quantized all-gather for {type(q).__name__}"
    if columnwise and not aligned[block]:
        return HP, (f"{kind}: the columnwise (wgrad) copy needs the sequence-parallel shard's rows "
                    f"(product of the leading dims) to be a multiple of {block}")
    return kind, ""


# ---- quantize the shard ---------------------------------------------------------------------------
def _quantize_shard(kind: str, q, x2d: torch.Tensor, scale: Optional[torch.Tensor], group):
    """(parts to gather as (tensor, dim along which M runs), buffers identical on every rank,
    amax to return). Amaxes that set a shared scale are all-reduced (max) over `group` here."""
    if kind == "fp8_current":
        data, _, scale_inv, amax = current_scaling_with_group_amax(q, x2d, group, True, False)
        return [("_data", data, 0)], {"_scale_inv": scale_inv}, amax
    if kind == "fp8_delayed":
        amax = torch.zeros(1, dtype=torch.float32, device=x2d.device)
        shard_q = Float8Quantizer(scale, amax, q.fp8_dtype, rowwise_usage=True, columnwise_usage=False)
        t = shard_q.quantize(x2d, internal=True)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # the amax the module records: the full tensor's
        return [("_data", t._data, 0)], {"_scale_inv": t._scale_inv}, amax
    none = torch.zeros(1, dtype=torch.float32, device=x2d.device)
    if kind == "mxfp8":
        bufs = q.quantize(x2d, internal=True).get_buffers()
        return [(name, b, 0) for name, b in bufs.items()], {}, none
    if kind == "blockwise":  # the 1x128 scales are stored transposed: gather them in that layout
        bufs = q.quantize(x2d, internal=True).get_buffers()
        parts = [("_rowwise_data", bufs["_rowwise_data"], 0), ("_rowwise_scale_inv", bufs["_rowwise_scale_inv"].t(), 1)]
        if q.columnwise_usage:
            parts += [("_columnwise_data", bufs["_columnwise_data"], 1),
                      ("_columnwise_scale_inv", bufs["_columnwise_scale_inv"].t(), 0)]
        return parts, {}, none
    # nvfp4: the kernel's math with global amaxes (rowwise, columnwise after the RHT), one all-reduce
    f = x2d.float()
    xt = transpose_2d(f) if q.columnwise_usage else None
    if xt is not None and q.with_rht:
        xt = _apply_rht(xt, q.rht_seed)
    amaxes = torch.cat([t.abs().amax().float().reshape(1) for t in (f, xt) if t is not None])
    dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)
    data, s = quantize_blocks(f, amaxes[0:1], False)
    parts, same = [("_rowwise_data", data, 0), ("_rowwise_scale_inv", s, 0)], {"_amax_rowwise": amaxes[0:1].clone()}
    if xt is not None:
        data, s = quantize_blocks(xt, amaxes[1:2], False)
        parts += [("_columnwise_data", data, 1), ("_columnwise_scale_inv", s, 1)]
        same["_amax_columnwise"] = amaxes[1:2].clone()
    return parts, same, amaxes[0:1].clone()


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
    return quantizers_from_key(key).input.with_usage(rowwise=True, columnwise=columnwise)


def _stand_in(shape, x: torch.Tensor) -> torch.Tensor:
    """The full input's shape and dtype without its storage (one zero, stride 0): what the
    Linear op and autograd see as the gathered input."""
    return x.new_zeros(1).as_strided(tuple(shape), (0,) * len(shape))


@torch.library.custom_op("te_proto::sp_all_gather_quantized", mutates_args=())
def sp_all_gather_quantized(x: torch.Tensor, scale: Optional[torch.Tensor], group_name: str, world: int, key: str,
                            kind: str, columnwise: bool) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """(stand-in of the gathered input, amax (the all-reduced one for per-tensor formats),
    the gathered input's quantized buffers as (M, K) in flatten order)."""
    q = _input_quantizer(key, columnwise)
    group = _tp._group(group_name)
    k = x.shape[-1]
    x2d = x.contiguous().reshape(-1, k)
    parts, same, amax = _quantize_shard(kind, q, x2d, scale, group)
    bufs = dict(same, **_gather_parts(parts, group, world))
    m = x2d.shape[0] * world
    if kind in ("fp8_current", "fp8_delayed") and columnwise:
        bufs["_transpose"] = transpose_2d(bufs["_data"])  # exact for per-tensor scaling
    if kind == "blockwise":
        bufs["_rowwise_scale_inv"] = bufs["_rowwise_scale_inv"].t()
        if columnwise:
            bufs["_columnwise_scale_inv"] = bufs["_columnwise_scale_inv"].t()
    full = (x.shape[0] * world,) + tuple(x.shape[1:])
    return _stand_in(full, x), amax, [bufs[name] for name in q.buffer_layout((m, k))]


@sp_all_gather_quantized.register_fake
def _(x, scale, group_name, world, key, kind, columnwise):
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
                         kind: str, columnwise: bool):
    """(stand-in of the gathered input, amax, buffers for the Linear op's `inp_quantized`)."""
    return sp_all_gather_quantized(x, scale, group_name, world, key, kind, columnwise)


# ---- user switch ----------------------------------------------------------------------------------------
def set_quantized_sequence_parallel_gather(model: torch.nn.Module, enabled: bool = True) -> int:
    """Turn the quantized sequence-parallel input gather on (the default) or off for every GEMM in
    `model`; off gathers in high precision and quantizes after (the same numbers, twice the bytes
    for FP8). Returns the number of GEMMs set."""
    from ..module.gemm_state import QuantizedGemm

    n = 0
    for m in model.modules():
        if isinstance(m, QuantizedGemm):
            m.quantized_sp_gather = bool(enabled)
            n += 1
    return n
