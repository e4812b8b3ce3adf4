"""Current scaling across tensor-parallel shards: one amax for the whole tensor (TE's `amax_reduction_group`).

A column-parallel GEMM holds a dim-0 shard of the weight and produces a column shard of the
output (so its grad_output is one too); a row-parallel GEMM holds a dim-1 shard of the weight and
takes a column shard of the input. Per-tensor current scaling of a shard uses the shard's amax,
so TP results differ from the unsharded Linear by a few percent. `enable_tp_amax_reduction(model)`
makes those operands use the amax all-reduced (max) over the module's TP group, so every shard is
quantized exactly as its slice of the full tensor and TP matches the full Linear up to fp32
summation order:

  column parallel: weight, grad_output        row parallel: input, weight

(TE reduces only what it all-gathers in FP8 -- the column + SP input, the row + SP grad. Here
the column + SP input is quantized before its all-gather with the amax all-reduced inside the
gather op (distributed/sp_gather.py), and the row + SP grad is gathered in high precision, so
neither needs this switch.)

How it reaches the ops: the GEMM passes a derived recipe key whose recipe builds
`AmaxReducingQuantizer`s for those roles (the reduction is a collective inside the Linear op,
so it stays one opaque node under torch.compile). Other recipes are left unchanged.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

from .. import recipe as R
from ..custom_ops.recipe_key import RecipeKey
from ..extra_state_policy import CheckpointExtraStatePolicy, register_recipe_policy
from ..tensor import Float8CurrentScalingQuantizer
from ..tensor.quantizer import te_flags
from ..tensor.recipe_quantizers import quantizers_for_recipe
from . import tp as _tp
from .gemm_owner import GemmOwner

__all__ = ["AmaxReducingQuantizer", "current_scaling_with_group_amax", "enable_tp_amax_reduction", "tp_amax_key",
           "TP_REDUCED_ROLES"]

TP_REDUCED_ROLES = {"column": ("weight", "grad_output"), "row": ("input", "weight")}


@te_flags
@dataclass(frozen=True)
class AmaxReducingQuantizer(Float8CurrentScalingQuantizer):
    """Current scaling with the amax all-reduced (max) over the process group named
    `amax_reduction_group` before the scale is computed; the same buffers otherwise."""

    amax_reduction_group: str = ""

    def _quantize_buffers(self, x):
        data, transpose, scale_inv, _ = current_scaling_with_group_amax(
            self, x, _tp.group_by_name(self.amax_reduction_group), self.rowwise_usage, self.columnwise_usage)
        return self._pack(data, transpose, scale_inv)


def current_scaling_with_group_amax(q: Float8CurrentScalingQuantizer, x: torch.Tensor, group, rowwise: bool,
                                    columnwise: bool):
    """Current scaling of `x` (q's format and options) with the amax all-reduced (max) over
    `group` first, so every rank's shard gets the whole tensor's scale: (data, transpose,
    scale_inv, the reduced amax). Used for TP operands here and for the quantized SP gather."""
    return q.quantize_with_reduced_amax(x, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group),
                                        rowwise, columnwise)


@dataclass
class _TPReducedCurrentScaling(R.Float8CurrentScaling):
    """A Float8CurrentScaling whose `reduced_roles` quantizers reduce their amax over a group."""

    amax_reduction_group: str = ""
    reduced_roles: Tuple[str, ...] = ()

    def role_quantizers(self):
        """Hook read by `RecipeKey.quantizers`."""
        base = quantizers_for_recipe(self)
        changes = {}
        for role in self.reduced_roles:
            q = getattr(base, role)
            changes[role] = AmaxReducingQuantizer(
                q.fp8_dtype, force_pow_2_scales=q.force_pow_2_scales, amax_epsilon=q.amax_epsilon,
                margin=q.margin, amax_reduction_group=self.amax_reduction_group)
        return dataclasses.replace(base, **changes)


register_recipe_policy(_TPReducedCurrentScaling, CheckpointExtraStatePolicy.STATELESS)


@torch._dynamo.assume_constant_result
def tp_amax_key(key: str, group_name: str, roles: Tuple[str, ...]) -> str:
    """The recipe key a TP GEMM passes to the Linear op: for current scaling, one whose `roles`
    reduce their amax over `group_name`; any other recipe's key unchanged. A constant to dynamo."""
    recipe = RecipeKey.recipe(key)
    if type(recipe) is not R.Float8CurrentScaling:
        return key
    fields = {f.name: getattr(recipe, f.name) for f in dataclasses.fields(recipe)}
    return RecipeKey.of(_TPReducedCurrentScaling(**fields, amax_reduction_group=group_name, reduced_roles=tuple(roles)))


def enable_tp_amax_reduction(model: torch.nn.Module) -> int:
    """Reduce the current-scaling amax of every TP-sharded GEMM operand in `model` over its module's
    TP group (see the module docstring). Returns the number of GEMMs changed."""
    n = 0
    for m in model.modules():
        if not isinstance(m, GemmOwner):
            continue
        for gemm, group_name, mode in m.tp_sharded_gemms():
            if mode in TP_REDUCED_ROLES:
                gemm.tp_amax_reduction = (group_name, TP_REDUCED_ROLES[mode])
                n += 1
    return n
