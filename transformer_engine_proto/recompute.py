"""`checkpoint`: TE's activation recompute (`transformer_engine.pytorch.distributed.checkpoint`).

Built on `torch.utils.checkpoint.checkpoint`. The recomputed forward runs in the autocast state of
the first forward (the recipe is put back for it, since backward usually runs after autocast has
exited) with `FP8GlobalState.recompute_phase` set: modules then quantize with the scales the
first forward used (each delayed-scaling GEMM keeps a copy of them in the first forward, since
autocast's exit rewrites the buffers before backward, as TE's checkpoint does) and record no amax,
so each amax is recorded once per step and the numbers equal the un-checkpointed run bit for bit.

Under torch.compile the function is traced once, as non-reentrant `torch.utils.checkpoint`, and
AOT autograd's partitioner replays graph ops (not Python) in backward: the flag is a trace-time
constant (False). An op replayed in backward reads the state buffers as they are then, after
autocast's exit has updated them, so a selective-checkpoint policy (`_keep_small`) saves the
step's scales (`saved_state`) and every op whose tensor inputs are all small (at most
`SMALL_NUMEL` elements: amaxes, scales), and recomputes the rest (everything on activations).
`use_reentrant=True` (TE's default) is eager only; under compile the
non-reentrant form is traced (torch logs a one-time warning that context_fn is used).
"""
from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable

import torch

from .autocast import FP8GlobalState

__all__ = ["checkpoint"]


@contextlib.contextmanager
def _first_forward(scales):
    """The first forward: delayed-scaling GEMMs append their forward scales to `scales`."""
    saved = FP8GlobalState.checkpoint_scales
    FP8GlobalState.checkpoint_scales = scales
    try:
        yield
    finally:
        FP8GlobalState.checkpoint_scales = saved


@contextlib.contextmanager
def _recompute_phase(state, scales, first_microbatch):
    """The first forward's autocast state (and default `is_first_microbatch`), with the recompute
    flag set and its scales to take back."""
    g = FP8GlobalState
    saved = g.state, g.recompute_phase, g.checkpoint_scales, g.first_microbatch
    g.state, g.recompute_phase, g.checkpoint_scales, g.first_microbatch = state, True, scales, first_microbatch
    try:
        yield
    finally:
        g.state, g.recompute_phase, g.checkpoint_scales, g.first_microbatch = saved


# Ops whose tensor inputs are all at most this many elements are saved, not recomputed, under compile
SMALL_NUMEL = 1 << 16


def _keep_small(ctx, op, *args, **kwargs):
    """Selective-checkpoint policy under compile: recompute ops on activations, save ops on small
    tensors. The delayed-scaling state (amax history, scales, the grad-amax handoff) is small and
    mutated in place by the forward; an op recomputed in backward from it would read the mutated
    buffer (the next step's scale), so the scale computation is saved (a few floats) instead."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.te_proto.saved_state.default:  # the step's scales: autocast's exit rewrites the buffers
        return CheckpointPolicy.MUST_SAVE
    sizes = [a.numel() for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if sizes and max(sizes) <= SMALL_NUMEL:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _compiled_context():
    return torch.utils.checkpoint.create_selective_checkpoint_contexts(_keep_small)


def _reject(distribute_saved_activations, get_rng_state_tracker, tp_group) -> None:
    if distribute_saved_activations:
        raise NotImplementedError("te.checkpoint: distribute_saved_activations=True (saving the first input "
                                  "sharded over tp_group) is not supported")
    if get_rng_state_tracker is not None:
        raise NotImplementedError("te.checkpoint: get_rng_state_tracker is not supported (the CPU and current "
                                  "CUDA RNG states are kept and restored by torch.utils.checkpoint)")
    del tp_group  # only used with distribute_saved_activations


def checkpoint(function: Callable, *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker=None, tp_group=None, use_reentrant: bool = True, **kwargs: Any):
    """Run `function(*args, **kwargs)` without keeping its activations; backward recomputes them.

    TE's signature: `use_reentrant` (default True, as TE) picks torch's reentrant or
    non-reentrant checkpoint in eager; under torch.compile the non-reentrant one is traced.
    `preserve_rng_state` (default True) passes through; `distribute_saved_activations=True` and
    a `get_rng_state_tracker` are NotImplementedError."""
    _reject(distribute_saved_activations, get_rng_state_tracker, tp_group)
    preserve_rng_state = kwargs.pop("preserve_rng_state", True)
    for name in ("context_fn", "determinism_check", "debug"):
        if name in kwargs:
            raise NotImplementedError(f"te.checkpoint: {name}= is not supported")
    if torch.compiler.is_dynamo_compiling():
        # traced once; AOT autograd replays the graph's ops for the recompute (see the module docstring)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=_compiled_context,
                                                 preserve_rng_state=preserve_rng_state, **kwargs)
    state, first_microbatch = FP8GlobalState.state, FP8GlobalState.first_microbatch
    scales = collections.deque()
    if not use_reentrant:
        def context_fn():
            return _first_forward(scales), _recompute_phase(state, scales, first_microbatch)

        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                                                 preserve_rng_state=preserve_rng_state, **kwargs)
    # reentrant: torch calls `run` in the forward (no grad) and again in backward (the recompute)
    calls = []

    def run(*a):
        ctx = _recompute_phase(state, scales, first_microbatch) if calls else _first_forward(scales)
        calls.append(None)
        with ctx:
            return function(*a, **kwargs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=True, preserve_rng_state=preserve_rng_state)
