"""Repeated layers traced once: a `te.Linear` call under torch.compile as a nested compile region.

A model calls many Linears of a few shapes (a Llama's q/k/v/o, gate/up, down projections in every
layer). Dynamo traces each call through the module's Python (checks, recipe key, call flags), and
AOT autograd and inductor then see one copy of the GEMM's graph per call. Marked as a
`torch.compiler.nested_compile_region`, the first call of a shape is traced and the later ones
stamp out the same subgraph (dynamo checks that the call's inputs and the guards it read match),
which AOT and inductor compile once.

Only calls whose trace has no side effect take the region: no delayed scaling (its forward
writes the amax history, and invoke_subgraph refuses buffer mutations in training), no precision
debug session, no tensor parallelism, weight caching, fused or delayed wgrad, and a plain weight
(not a quantized FSDP2 one). Everything else is traced inline as before.

`set_compile_regions(False)` (or `TE_PROTO_COMPILE_REGIONS=0`) traces every call inline.
"""
from __future__ import annotations

import os

import torch

from ..autocast import entered_recipe
from ..debug import state as _debug_state
from .. import recipe as R

__all__ = ["set_compile_regions", "compile_regions_enabled", "takes_region", "region"]

_enabled = os.environ.get("TE_PROTO_COMPILE_REGIONS", "1") != "0"


def set_compile_regions(enabled: bool) -> None:
    """Whether compiles after the call trace eligible Linear calls as nested compile regions."""
    global _enabled
    _enabled = bool(enabled)


def compile_regions_enabled() -> bool:
    return _enabled


def takes_region(module, is_first_microbatch) -> bool:
    """Whether this call, being traced by dynamo, is traced as the module class's region."""
    if not (_enabled and torch.compiler.is_dynamo_compiling()):
        return False
    if is_first_microbatch is not None or _debug_state.SESSION.active:
        return False
    if isinstance(entered_recipe(), R.DelayedScaling):
        return False
    if module.parallel_mode is not None or module.fuse_wgrad_accumulation or module.gemm.delay_wgrad:
        return False
    return all(type(p) is torch.nn.Parameter for p in module.parameters(recurse=False))


def region(forward):
    """`forward(module, inp)` marked as a nested compile region (eager: a plain call)."""
    return torch.compiler.nested_compile_region(forward)
