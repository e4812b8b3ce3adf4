"""Delayed scaling, in one place: a GEMM's scaling state, its update, its amax records, the gradient
amax's way from backward to the next forward, its checkpoint form and its non-finite report.

The state lives in buffers so torch.compile sees it as graph inputs it may mutate (no host sync):
two per GEMM, because each buffer has one writer inside the step. `delayed_state` (the forward's)
packs the scales, the amax histories and the counters, so a compiled forward touches one buffer and
its ops index it by slot (`layout` below); `grad_amax_handoff` (backward's) carries the gradient
amax to the next forward. The familiar names (`fp8_scale`, `amax_history`, ...) are views of them.
`DelayedScalingState` is a mixin of the module that owns one GEMM (`QuantizedGemm`), so the buffer
names (and checkpoints) stay that module's.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable, List, Sequence, Tuple

import torch

from .. import recipe as R
from ..kernels import kernel
from ..kernels.reference import delayed_scaling as layout
from ..kernels.reference.common import FP8_MAX, traced
from ..kernels.reference.delayed_scaling import fold_pending_grad_amax as _fold
from ..kernels.reference.delayed_scaling import only_where, update_from_history
from .inductor_lowering import inline_in_inductor
from .saved_state import saved_state

__all__ = ["DelayedScalingState", "DEFAULT_HISTORY_LEN", "record_grad_amax", "fold_pending_grad_amax",
           "update_delayed_scaling", "poll_nonfinite"]

DEFAULT_HISTORY_LEN = 1024
_NONFINITE_ROLES = ("input", "weight", "grad")
# the views of the two buffers, by their names before packing (checkpoints and users read these)
_VIEWS = ("fp8_scale", "amax_history", "grad_fp8_scale", "grad_amax_history", "grad_amax_pending", "grad_amax_seen",
          "nonfinite_amax_count", "amax_recorded")
_nonfinite_warned = False  # one warning per process (the counters keep counting)


def _view(name: str) -> property:
    def get(self):
        return layout.view(self._buffers["delayed_state"], self._buffers["grad_amax_handoff"], name)
    return property(get, doc=f"`{name}`: a view of the packed state (`layout.view`)")


class DelayedScalingState:
    """The delayed-scaling buffers and their updates, for an `nn.Module` that owns one GEMM."""

    def _register_delayed_state(self, device) -> None:
        # not in this module's state dict: the owning TE module checkpoints them in TE's layout
        # (its `_extra_state`, module/fp8_state.py)
        buffer = functools.partial(self.register_buffer, persistent=False)
        buffer("delayed_state", layout.new_state(DEFAULT_HISTORY_LEN, device))
        # backward's gradient amax waits here until the next forward folds it into the history
        # (`record_grad_amax`): [amax, generation, the generation last folded]
        buffer("grad_amax_handoff", torch.zeros(3, device=device))

    # scales (input, weight | gradient), histories (rows, 2 | 1), the pending gradient amax and the
    # generation last folded, inf/NaN amaxes skipped per role (input, weight, grad: counted in-graph,
    # reported once by `poll_nonfinite` at autocast entry) and the flag a forward sets when it records
    # its amaxes (only a GEMM that ran moves its forward scales, as TE updates the modules that ran)
    fp8_scale, amax_history, grad_fp8_scale, grad_amax_history = (_view(n) for n in _VIEWS[:4])
    grad_amax_pending, grad_amax_seen, nonfinite_amax_count, amax_recorded = (_view(n) for n in _VIEWS[4:])

    def grad_amax_state(self) -> List[torch.Tensor]:
        """The buffers backward writes the gradient amax into (`record_grad_amax`)."""
        return [self._buffers["grad_amax_handoff"]]

    # ---- eager: sizes -------------------------------------------------------------------------
    def history_rows(self) -> int:
        return layout.history_rows(self._buffers["delayed_state"])

    def ensure_history_len(self, recipe: R.DelayedScaling) -> None:
        """Grow the histories to the recipe's length (eager: a new buffer shape), keeping their amaxes."""
        # `history_rows()` inline: autocast asks every GEMM at each entry
        if recipe.amax_history_len > (self._buffers["delayed_state"].shape[0] - layout.HEADER) // layout.COLUMNS:
            self._resize_history(recipe.amax_history_len)

    def _resize_history(self, rows: int) -> None:
        old = self._buffers["delayed_state"]
        with torch.no_grad(), torch.inference_mode(False):  # state, not an inference tensor: training updates it
            new = layout.new_state(rows, old.device)
            keep = min(rows, layout.history_rows(old))
            new[:layout.HEADER].copy_(old[:layout.HEADER])
            layout.history(new)[:keep].copy_(layout.history(old)[:keep])
        self._buffers["delayed_state"] = new

    def load_state(self, name: str, saved: torch.Tensor) -> None:
        """State `name` (one of the views) from a checkpoint's tensor (any device / dtype); a history
        takes the checkpoint's length (both histories: they share the rows)."""
        with torch.no_grad(), torch.inference_mode(False):
            if name in ("amax_history", "grad_amax_history") and saved.dim() == 2 \
                    and saved.shape[0] != self.history_rows():
                self._resize_history(saved.shape[0])
            mine = getattr(self, name)  # a view, built after any resize
            mine.copy_(saved.reshape(mine.shape))

    def _load_buffer_checkpoint(self, state_dict, prefix: str) -> None:
        """Checkpoints that carry this state as the module's own entries (`gemm.fp8_scale`, ...,
        or the packed buffers): their entries are taken out of `state_dict` and loaded."""
        for name in ("delayed_state", "grad_amax_handoff"):
            saved = state_dict.pop(prefix + name, None)
            if isinstance(saved, torch.Tensor):
                with torch.no_grad(), torch.inference_mode(False):
                    if name == "delayed_state" and saved.shape != self._buffers[name].shape:
                        self._resize_history(layout.history_rows(saved))  # the checkpoint's history length
                    self._buffers[name].copy_(saved)
        for name in _VIEWS:
            saved = state_dict.pop(prefix + name, None)
            if isinstance(saved, torch.Tensor):
                self.load_state(name, saved)

    # ---- the step's update (eager, at autocast exit and entry) and the amax records (in the step)
    def update_scales(self, recipe: R.DelayedScaling, forward_half: bool = True, grad_half: bool = True) -> None:
        """The step's update with TE's rules (`kernels/reference/delayed_scaling.py`): the forward
        half (when a forward recorded an amax since its last update) moves the input and weight
        scales from their history, the gradient half (when backward left a new amax) folds it in
        and moves the gradient scale; each history then rolls.

        Autocast runs the forward half when an outermost training block exits (TE's timing) and the
        gradient half when the next one is entered, before its forward reads the scale (TE: after
        the backward). Both run eagerly, so no compiled graph holds them: TE's built-in rules are
        the `delayed_scaling_update` kernel (one launch on CUDA). Traced (FSDP2's pre-all-gather
        hook under torch.compile), or with the recipe's own functions, the rules run as torch ops.
        The histories grow to the recipe's length here if they are shorter (a GEMM built after
        autocast's entry grew the others'; forwards only write the newest row)."""
        if recipe.amax_history_len > self.history_rows():
            if torch.compiler.is_compiling():
                raise RuntimeError(f"delayed scaling: amax_history_len={recipe.amax_history_len} exceeds the "
                                   f"allocated history ({self.history_rows()}); enter autocast outside "
                                   "torch.compile first")
            self.ensure_history_len(recipe)
        if _builtin_rules(recipe) and _eager_device(self._buffers["delayed_state"]) is not None:
            kernel("delayed_scaling_update", self._buffers["delayed_state"].device)(
                *self.update_state(), *_kernel_args(recipe, forward_half, grad_half))
            return
        fwd_max, bwd_max = FP8_MAX[recipe.fp8_format.fwd_dtype], FP8_MAX[recipe.fp8_format.bwd_dtype]
        L = recipe.amax_history_len
        if forward_half:
            only_where(self.amax_recorded > 0, [self.fp8_scale, self.amax_history[:L]],
                       lambda s, h: update_from_history(s, h, recipe, fwd_max), pin=saved_state)
            self.amax_recorded.zero_()
        if grad_half:
            new_grad = self.grad_amax_pending[1:2] != self.grad_amax_seen
            fold_pending_grad_amax(self.grad_amax_history, [self.grad_amax_pending, self.grad_amax_seen],
                                   self.nonfinite_amax_count[2:3])
            only_where(new_grad, [self.grad_fp8_scale, self.grad_amax_history[:L]],
                       lambda s, h: update_from_history(s, h, recipe, bwd_max), pin=saved_state)

    def update_state(self) -> tuple:
        """The two buffers `delayed_scaling_update` takes (read from the buffer dict, not through
        `nn.Module.__getattr__`: autocast asks every GEMM at each exit and entry)."""
        return self._buffers["delayed_state"], self._buffers["grad_amax_handoff"]

    def forward_scales(self) -> torch.Tensor:
        """The scales this forward quantizes with (`layout`: slots 0 input, 1 weight, 2 gradient).
        Traced, the state pinned (`saved_state`), as backward must read the forward's scales after
        autocast's exit has rewritten the buffer; eager, the buffer itself (the op snapshots it)."""
        state = self._buffers["delayed_state"]
        return saved_state(state) if torch.compiler.is_compiling() else state

    def record_amax(self, amax: torch.Tensor, first: int = 0, scales=None) -> None:
        """History slot 0, columns first.. (0 input, 1 weight), takes the max with `amax`, except
        where `amax` is inf/NaN: that one is counted instead (`reference.delayed_scaling.keep_finite`).
        Eager: one launch; traced, the graph op `te_proto::delayed_record_amax` (`_written`), which
        also writes `scales` (the pinned `forward_scales()`: the same values) back into the state,
        so the forward graph computes the pinned scales even where only backward reads them."""
        state = self._buffers["delayed_state"]
        device = _eager_device(amax)
        if device is not None:
            kernel("delayed_record_amax", device)(state, amax, state, first)
            return
        state.copy_(torch.ops.te_proto.delayed_record_amax.default(
            state, amax, state if scales is None else scales, first))

    def reduce_pending_amaxes(self, all_reduce_max: Callable[[torch.Tensor], None]) -> None:
        """Reduce (max, across ranks) the amaxes not yet consumed by an update: the forward's
        (history slot 0) and the gradient's (still pending, or already folded into slot 0)."""
        buf = torch.cat([self.amax_history[0], self.grad_amax_pending[0:1], self.grad_amax_history[0]])
        all_reduce_max(buf)
        self.amax_history[0].copy_(buf[:2])
        self.grad_amax_pending[0:1].copy_(buf[2:3])
        self.grad_amax_history[0].copy_(buf[3:])

# ---- eager: the non-finite report ------------------------------------------------------------
_polls = {}  # CUDA device -> (host copy, event, GEMM names): the one count copy in flight per device


def poll_nonfinite(named_gemms: Sequence[Tuple[str, "DelayedScalingState"]]) -> None:
    """Warn once (per process) when delayed scaling has skipped an inf/NaN amax in any of
    `named_gemms` ((module name, GEMM) pairs).

    Called at autocast entry, in eager Python, never in the step itself. No host sync: on CPU
    the counters are read directly (no device to wait for); on CUDA each call reads the host
    copy started by an earlier call if its event has completed (`Event.query()` does not block)
    and starts the next one: the counters of every GEMM on the device stacked into one pinned
    copy, so a step pays three launches whatever the number of GEMMs. The warning comes one or
    two autocast entries after the step, which is enough to say the run has seen a NaN/inf;
    `nonfinite_amax_count` (a view of each GEMM's state) has the counts."""
    global _nonfinite_warned
    if _nonfinite_warned:
        return
    seen, on_cuda = [], {}
    for name, gemm in named_gemms:
        # the counters (`layout.counts`), from the buffer dict: no nn.Module.__getattr__ or call per GEMM
        count = gemm._buffers["delayed_state"][layout.COUNTS:layout.COUNTS + 3]
        if count.device.type == "cpu":
            seen.append((name, count.tolist()))  # a host read of 3 ints, no tensor op
        elif count.device.type == "cuda":  # meta / other devices: nothing to read without a sync
            on_cuda.setdefault(count.device, []).append((name, count))
    for device, entries in on_cuda.items():
        poll = _polls.get(device)
        if poll is not None and poll[1].query():
            host, _, names = _polls.pop(device)
            seen += zip(names, host.tolist())
        if device not in _polls:
            with torch.cuda.device(device):
                counts = torch.stack([count for _, count in entries])
                copy = torch.empty(counts.shape, dtype=counts.dtype, device="cpu", pin_memory=True)
                copy.copy_(counts, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
            _polls[device] = (copy, event, [name for name, _ in entries])
    bad = []
    for name, counts in seen:  # a loop, not a comprehension: this runs at every autocast entry
        if any(counts):
            bad.append((name, counts))
    if bad:
        _nonfinite_warned = True
        name, counts = bad[0]
        counts = ", ".join(f"{r} {int(n)}" for r, n in zip(_NONFINITE_ROLES, counts) if n)
        others = f" (and {len(bad) - 1} more GEMMs)" if len(bad) > 1 else ""
        warnings.warn(
            f"{name}: delayed scaling skipped non-finite (inf/NaN) amaxes ({counts}){others}; those steps "
            f"are left out of the amax history, so the scales keep following the finite amaxes. "
            f"Check the loss / inputs for overflow. Counts per GEMM are in the buffers "
            f"`*.nonfinite_amax_count` (input, weight, grad); this warning is shown once.",
            RuntimeWarning, stacklevel=5)


def update_delayed_scaling(states: Sequence[DelayedScalingState], recipe: R.DelayedScaling, forward_half: bool,
                           grad_half: bool) -> None:
    """`update_scales` of many GEMMs, as autocast's exit / entry asks: with TE's built-in rules, the
    GEMMs on one CUDA device in one launch (`delayed_scaling_update_many`, TE's multi-tensor
    update); the others one by one."""
    builtin = _builtin_rules(recipe)
    compiling = torch.compiler.is_compiling()
    need = layout.HEADER + layout.COLUMNS * recipe.amax_history_len  # the state's size with the recipe's rows
    by_device = {}
    for g in states:
        if not compiling:  # a GEMM built inside the block (autocast's entry grew the others' histories)
            g.ensure_history_len(recipe)
        state, handoff = g.update_state()
        device = None if compiling or traced(state) else state.device  # `_eager_device(state)`, is_compiling read once
        if builtin and device is not None and device.type == "cuda" and state.is_contiguous() \
                and state.shape[0] >= need:
            by_device.setdefault(device, []).append((state, handoff))
        elif device is not None and device.type == "cpu":
            # a host read, no sync: only GEMMs with a new amax run the rules (as torch ops, dozens)
            fwd = forward_half and bool(state[layout.RECORDED] > 0)
            grad = grad_half and bool(handoff[1] != handoff[2])
            if fwd or grad:
                g.update_scales(recipe, fwd, grad)
        elif not state.is_meta:  # meta: no values yet
            g.update_scales(recipe, forward_half, grad_half)
    for device, gemm_states in by_device.items():
        kernel("delayed_scaling_update_many", device)(gemm_states, *_kernel_args(recipe, forward_half, grad_half))


def _builtin_rules(recipe: R.DelayedScaling) -> bool:
    """Whether the recipe uses TE's built-in rules, which the one-launch kernels implement (a
    recipe's own amax or scaling function runs as torch ops)."""
    return recipe.scaling_factor_compute_algo is None and recipe.amax_compute_algo in ("max", "most_recent")


def _kernel_args(recipe: R.DelayedScaling, forward_half: bool, grad_half: bool) -> tuple:
    """The arguments after the state of `delayed_scaling_update` / `_many`."""
    return (recipe.amax_history_len, recipe.amax_compute_algo == "most_recent", FP8_MAX[recipe.fp8_format.fwd_dtype],
            FP8_MAX[recipe.fp8_format.bwd_dtype], recipe.margin, forward_half, grad_half)


# ---- the gradient amax crosses from backward to the next forward -----------------------------
def record_grad_amax(state: Sequence[torch.Tensor], amax: torch.Tensor) -> None:
    """Backward's half of the handoff. `state` is [the GEMM's `grad_amax_handoff`]: [pending amax,
    pending generation], written only here, and the generation the last forward folded, written
    only by `fold_pending_grad_amax`. The buffer has no other writer, so no buffer is mutated by
    both the forward and the backward graph (the default AOT partitioner, used by the `cudagraphs`
    backend, rejects that). The first backward after a fold starts a new generation; later ones (a
    module applied twice, micro-batches on the weight cache) take the max."""
    handoff, = state
    device = _eager_device(amax)
    if device is not None:
        kernel("delayed_record_grad_amax", device)(handoff, amax)
    else:
        handoff.copy_(torch.ops.te_proto.delayed_record_grad_amax.default(handoff, amax))


def fold_pending_grad_amax(history: torch.Tensor, state: Sequence[torch.Tensor], count: torch.Tensor) -> None:
    """Forward's half: move an amax recorded since the last fold into history slot 0 (an inf/NaN
    one is counted in `count`, not kept). `state`: (pending, seen), views of the handoff."""
    _fold(history, *state, count)


# ---- the records as graph ops -----------------------------------------------------------------
# Traced, each record is one functional op whose output is copied back into its buffer. Inductor
# traces the op's body (`inline_in_inductor`): on CUDA the record's one Triton launch on the whole
# buffer, which inductor writes in place (no copy is left), where the reference's ops would add a
# slice scatter and a few small generated kernels per GEMM. Other backends keep the op opaque and
# run its eager body, so none of them sees a user Triton kernel in its graph (torch's `cudagraphs`
# backend fails on one).
def _written(buffer: torch.Tensor, write: Callable) -> torch.Tensor:
    """`buffer` after `write(buffer)`: while inductor traces the op's body the tensor itself (a
    functional tensor: the write is recorded, the input stays as it was), else a fresh copy (the
    op is functional)."""
    out = buffer if traced(buffer) else buffer.clone()
    write(out)
    return out


@torch.library.custom_op("te_proto::delayed_record_amax", mutates_args=())
def _record_amax_op(state: torch.Tensor, amax: torch.Tensor, scales: torch.Tensor, first: int) -> torch.Tensor:
    record = kernel("delayed_record_amax", amax.device)
    return _written(state, lambda s: record(s, amax, scales, first))


@_record_amax_op.register_fake
def _(state, amax, scales, first):
    return torch.empty_like(state)


@torch.library.custom_op("te_proto::delayed_record_grad_amax", mutates_args=())
def _record_grad_amax_op(handoff: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    record = kernel("delayed_record_grad_amax", amax.device)
    return _written(handoff, lambda h: record(h, amax))


@_record_grad_amax_op.register_fake
def _(handoff, amax):
    return torch.empty_like(handoff)


inline_in_inductor(torch.ops.te_proto.delayed_record_amax.default, _record_amax_op._init_fn)
inline_in_inductor(torch.ops.te_proto.delayed_record_grad_amax.default, _record_grad_amax_op._init_fn)


def _eager_device(t: torch.Tensor):
    """`t`'s device when this runs eagerly on real tensors (a one-launch kernel may serve), else
    None: the rules as graph ops for torch.compile to trace (AOT traces a compiled backward
    outside dynamo, where `is_compiling()` can be False, so the tensor itself is asked too)."""
    return None if torch.compiler.is_compiling() or traced(t) else t.device
