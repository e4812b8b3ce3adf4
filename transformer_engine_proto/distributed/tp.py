"""Tensor-parallel collectives as `torch.library` custom ops (namespace `te_proto`).

The process group travels as its name (`group.group_name`) and is resolved inside the op with
`_resolve_process_group`, so the ops are opaque, graph-break-free nodes under torch.compile.
Every op returns a fresh tensor (custom ops may not alias their inputs).

Megatron/TE conjugate pairs (forward / backward):
  copy_to_tp_region        identity   / all-reduce (sum)     column-parallel input
  reduce_from_tp_region    all-reduce / identity              row-parallel output
  gather_from_sequence_parallel_region   all-gather(dim 0) / reduce-scatter(dim 0)   column + SP input
  reduce_scatter_to_sequence_parallel_region reduce-scatter(dim 0) / all-gather(dim 0)  row + SP output
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum", "copy_to_tp_region", "reduce_from_tp_region", "all_gather_first_dim",
           "reduce_scatter_first_dim", "gather_from_sequence_parallel_region",
           "reduce_scatter_to_sequence_parallel_region", "resolve_tp", "group_name_of", "group_by_name",
           "all_gather_into"]


def group_by_name(name: str):
    """The process group registered as `name` (modules and ops keep groups by name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def group_name_of(group) -> str:
    """The registered name of a process group (the default group when `group` is None)."""
    if group is None:
        group = dist.group.WORLD
    return group.group_name


# ---- raw collectives (no autograd) ----------------------------------------------------------------
@torch.library.custom_op("te_proto::tp_all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group_by_name(group_name))
    return out


@_all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """`out` (the ranks' contiguous `x` concatenated along dim 0) <- one all-gather: the
    single-tensor collective where torch has it (looked up at call time, so wrappers that count
    bytes see it), else the list form."""
    x = x.contiguous()
    single = getattr(dist, "all_gather_single", None)
    if single is None and dist.get_backend(group) != "gloo":
        single = dist.all_gather_into_tensor
    if single is not None:
        single(out, x, group=group)
    else:
        dist.all_gather(list(out.chunk(dist.get_world_size(group), 0)), x, group=group)


@torch.library.custom_op("te_proto::tp_all_gather_first_dim", mutates_args=())
def _all_gather(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
    all_gather_into(out, x, group_by_name(group_name))
    return out


@_all_gather.register_fake
def _(x, group_name, world):
    return x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))


@torch.library.custom_op("te_proto::tp_reduce_scatter_first_dim", mutates_args=())
def _reduce_scatter(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    group = group_by_name(group_name)
    single = getattr(dist, "reduce_scatter_single", None)  # torch >= 2.13 (gloo included)
    if single is None and dist.get_backend(group) != "gloo":
        single = dist.reduce_scatter_tensor
    if single is not None:
        out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
        single(out, x.contiguous(), group=group)
        return out
    # older gloo has no reduce-scatter: all-reduce, then keep this rank's chunk
    full = x.contiguous().clone()
    dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
    rank = dist.get_rank(group)
    return full.chunk(world, 0)[rank].clone()


@_reduce_scatter.register_fake
def _(x, group_name, world):
    return x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))


# ---- autograd pairs ---------------------------------------------------------------------------------
@torch.library.custom_op("te_proto::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum over the group; backward is the identity (the gradient is already replicated)."""
    return _all_reduce(x, group_name)


@all_reduce_sum.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


all_reduce_sum.register_autograd(lambda ctx, g: (g, None), setup_context=lambda ctx, inputs, output: None)


@torch.library.custom_op("te_proto::copy_to_tp_region", mutates_args=())
def copy_to_tp_region(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Identity forward (a copy); backward all-reduces (sums) the gradient over the group."""
    return x.clone()


@copy_to_tp_region.register_fake
def _(x, group_name):
    return torch.empty_like(x)


def _copy_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


copy_to_tp_region.register_autograd(lambda ctx, g: (_all_reduce(g, ctx.group_name), None),
                                    setup_context=_copy_setup)


@torch.library.custom_op("te_proto::all_gather_first_dim", mutates_args=())
def all_gather_first_dim(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Concatenate the ranks' shards along dim 0; backward reduce-scatters the gradient."""
    return _all_gather(x, group_name, world)


@all_gather_first_dim.register_fake
def _(x, group_name, world):
    return x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))


def _ws_setup(ctx, inputs, output):
    ctx.group_name, ctx.world = inputs[1], inputs[2]


all_gather_first_dim.register_autograd(
    lambda ctx, g: (_reduce_scatter(g, ctx.group_name, ctx.world), None, None), setup_context=_ws_setup)


@torch.library.custom_op("te_proto::reduce_scatter_first_dim", mutates_args=())
def reduce_scatter_first_dim(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """Sum over the group and keep this rank's dim-0 chunk; backward all-gathers the gradient."""
    return _reduce_scatter(x, group_name, world)


@reduce_scatter_first_dim.register_fake
def _(x, group_name, world):
    return x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))


reduce_scatter_first_dim.register_autograd(
    lambda ctx, g: (_all_gather(g, ctx.group_name, ctx.world), None, None), setup_context=_ws_setup)

def reduce_row_parallel_output(out: torch.Tensor, group_name: str, world: int, sequence_parallel: bool,
                               bias: Optional[torch.Tensor]) -> torch.Tensor:
    """A row-parallel GEMM's partial sums: summed over the group (reduce-scattered along dim 0
    with sequence parallelism), then the bias added once."""
    if sequence_parallel:
        out = reduce_scatter_first_dim(out, group_name, world)
    else:
        out = all_reduce_sum(out, group_name)
    return out if bias is None else out + bias


# Megatron / TE names
reduce_from_tp_region = all_reduce_sum
gather_from_sequence_parallel_region = all_gather_first_dim
reduce_scatter_to_sequence_parallel_region = reduce_scatter_first_dim


# ---- argument checks ----------------------------------------------------------------------------------
def resolve_tp(owner: str, in_features: int, out_features: int, tp_group, tp_size: Optional[int],
               parallel_mode: Optional[str], sequence_parallel: bool) -> Tuple[int, Optional[str]]:
    """Validate TE's TP arguments (before any communication); return (tp_size, group name or None:
    no group given and none needed).

    `in_features` / `out_features` are the full (unsharded) sizes, as in TE."""
    if parallel_mode not in (None, "column", "row"):
        raise ValueError(f"{owner}: parallel_mode must be None, 'column' or 'row', got {parallel_mode!r}")
    if tp_size is not None and (not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1):
        raise ValueError(f"{owner}: tp_size must be a positive int, got {tp_size!r}")
    if tp_group is not None:
        group_size = dist.get_world_size(tp_group)
        if tp_size is not None and tp_size != group_size:
            raise ValueError(f"{owner}: tp_size={tp_size} does not match the size of tp_group ({group_size})")
        tp_size = group_size
    tp_size = tp_size or 1
    if parallel_mode == "column" and out_features % tp_size:
        raise ValueError(f"{owner}: out_features={out_features} is not divisible by tp_size={tp_size} "
                         "(column parallel shards the output features)")
    if parallel_mode == "row" and in_features % tp_size:
        raise ValueError(f"{owner}: in_features={in_features} is not divisible by tp_size={tp_size} "
                         "(row parallel shards the input features)")
    if sequence_parallel and parallel_mode is None and tp_size > 1:
        raise ValueError(f"{owner}: sequence_parallel=True needs parallel_mode 'column' or 'row'")
    name = None if tp_group is None else group_name_of(tp_group)
    if name is None and parallel_mode is not None and tp_size > 1:
        if tp_group is None:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(f"{owner}: tp_size={tp_size} needs tp_group (or an initialized default process group)")
            if dist.get_world_size() != tp_size:
                raise ValueError(f"{owner}: tp_size={tp_size} does not match the default process group's size "
                                 f"({dist.get_world_size()}); pass tp_group")
        name = group_name_of(tp_group)
    return tp_size, name
