"""Delayed scaling's rules for one GEMM's state, in one place.

They are TE's: the new scale is `fp8_max / amax` (amax: the max or the most recent of the history,
or the recipe's function of it) times 2**-margin, kept where the amax is 0 or non-finite (or the
recipe's own scaling function); the history then rolls so slot 0 is free for the step's amax. The
gradient's amax, recorded by the previous backward, is folded into its history first, and an
inf/NaN one is counted, not kept. As in TE, only state that saw a new amax moves: the
forward half when a forward recorded one since its last update (`amax_recorded`), the gradient half
when a backward did (its pending generation is new).
`custom_ops/delayed_scaling.py` applies them to a module's buffers; `quantization.py` to TE-layout state.

The layout of a GEMM's state is here too, as the kernels index it: one float32 buffer, the forward's
(`new_state`): the scales (input, weight, gradient), the `amax_recorded` flag, the non-finite
counters (input, weight, gradient), one pad, then the history rows, each [input, weight, gradient];
and backward's handoff (3,): [pending gradient amax, its generation, the generation last folded].
"""
from __future__ import annotations

import math

import torch

from .. import register_kernel
from .common import true_div

SCALES, RECORDED, COUNTS, HEADER = 0, 3, 4, 8  # offsets in the state; history row r starts at HEADER + 3 r
COLUMNS = 3  # a history row: input, weight, gradient


def new_state(history_rows: int, device=None) -> torch.Tensor:
    """A fresh state: scales 1, everything else 0."""
    state = torch.zeros(HEADER + COLUMNS * history_rows, dtype=torch.float32, device=device)
    state[SCALES:SCALES + 3] = 1.0
    return state


def history_rows(state: torch.Tensor) -> int:
    return (state.shape[0] - HEADER) // COLUMNS


def history(state: torch.Tensor) -> torch.Tensor:
    """The (rows, 3) history view of a state."""
    return state[HEADER:].view(-1, COLUMNS)


def counts(state: torch.Tensor) -> torch.Tensor:
    return state[COUNTS:COUNTS + 3]


_PARTS = {  # name: its view of (state, handoff)
    "fp8_scale": lambda s, h: s[SCALES:SCALES + 2],
    "grad_fp8_scale": lambda s, h: s[SCALES + 2:SCALES + 3],
    "amax_recorded": lambda s, h: s[RECORDED:RECORDED + 1],
    "nonfinite_amax_count": lambda s, h: counts(s),
    "amax_history": lambda s, h: history(s)[:, 0:2],
    "grad_amax_history": lambda s, h: history(s)[:, 2:3],
    "grad_amax_pending": lambda s, h: h[0:2],
    "grad_amax_seen": lambda s, h: h[2:3],
}


def view(state: torch.Tensor, handoff: torch.Tensor, name: str) -> torch.Tensor:
    """The state's part `name` (a view: writes reach the buffer)."""
    return _PARTS[name](state, handoff)


def views(state: torch.Tensor, handoff: torch.Tensor) -> dict:
    """Every part of the state by its name (views)."""
    return {name: part(state, handoff) for name, part in _PARTS.items()}


def history_amax(history: torch.Tensor, algo) -> torch.Tensor:
    """The amax a scale is computed from: the max over the history's rows, its most recent row
    (row 0), or the recipe's callable of the history."""
    return history.amax(0) if algo == "max" else history[0] if algo == "most_recent" else algo(history)


def scale_from_history_amax(scale: torch.Tensor, amax: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """TE's default scaling factor: the correctly rounded `fp8_max / amax`, then the margin as an
    exact power-of-two product (the bits of TE's division by 2**margin, no fp32 division for
    inductor to approximate); the old scale where amax <= 0, amax is inf/NaN or the quotient is
    not finite (where amax is positive and finite the quotient lies in [0, inf])."""
    new = true_div(fp8_max, amax)
    if margin:
        new = new * (2.0 ** -margin)
    ok = (amax > 0) & (amax < math.inf) & (new < math.inf)
    return torch.where(ok, new, scale)


def roll_history(history: torch.Tensor) -> None:
    """TE's roll: row i takes row i + 1 (the first row goes last), then row 0 is zeroed."""
    history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()


def keep_finite(slot: torch.Tensor, new: torch.Tensor, fallback: torch.Tensor, count: torch.Tensor) -> None:
    """slot = new where new is finite, else fallback, and count += 1 there. An inf/NaN amax never
    enters the history: one would make `max` of the history non-finite, and the scale would stay
    frozen (silently) until it rolled out, amax_history_len steps later. In-graph, no host sync."""
    ok = new.abs() < math.inf  # isfinite in two elementwise ops: NaN and +-inf compare False
    slot.copy_(torch.where(ok, new, fallback))
    count.add_((~ok).to(count.dtype))


def fold_pending_grad_amax(history: torch.Tensor, pending: torch.Tensor, seen: torch.Tensor,
                           count: torch.Tensor) -> None:
    """Move the gradient amax backward recorded since the last fold (`pending`: [amax, generation];
    new when its generation differs from `seen`) into history slot 0, except an inf/NaN result,
    which is counted in `count` and left out (`keep_finite`)."""
    slot = history[0]
    folded = torch.where(pending[1:2] != seen, torch.maximum(slot, pending[0:1]), slot)
    keep_finite(slot, folded, slot, count)
    seen.copy_(pending[1:2])


def only_where(flag: torch.Tensor, tensors, update, pin=lambda t: t) -> None:
    """Run the in-place `update(*tensors)` and keep its result only where the one-element bool
    `flag` is set (else the tensors keep their values); a select, no host sync. `pin` wraps each
    value before it is written (as `update_scale_and_roll`'s)."""
    new = [t.clone() for t in tensors]
    update(*new)
    for t, n in zip(tensors, new):
        t.copy_(pin(torch.where(flag, n, t)))


def update_from_history(scale: torch.Tensor, amax_history: torch.Tensor, recipe, fp8_max: float,
                        pin=lambda t: t) -> None:
    """One history's step by a recipe, in place: `update_scale_and_roll` over its first
    `recipe.amax_history_len` rows with its `amax_compute_algo`, `margin` or
    `scaling_factor_compute_algo`."""
    scaling = recipe.scaling_factor_compute_algo
    scale_of = None if scaling is None else (lambda amax: scaling(amax, scale, fp8_max, recipe))
    update_scale_and_roll(scale, amax_history[: recipe.amax_history_len], recipe.amax_compute_algo, fp8_max,
                          recipe.margin, scale_of, pin)


def update_scale_and_roll(scale: torch.Tensor, history: torch.Tensor, algo, fp8_max: float, margin: int,
                          scale_of=None, pin=lambda t: t) -> None:
    """`scale` from the history's amax (by `algo`) with TE's rule, or the recipe's `scale_of(amax)`;
    then the roll. `pin` wraps the new scale before it is written (under torch.compile:
    `saved_state`, so backward reads this step's scale)."""
    amax = history_amax(history, algo)
    if scale_of is None:
        new = scale_from_history_amax(scale, amax, fp8_max, margin)
    else:
        new = scale_of(amax).to(scale.dtype).expand_as(scale)
    scale.copy_(pin(new))
    roll_history(history)


@register_kernel("delayed_record_amax")
def delayed_record_amax(state: torch.Tensor, amax: torch.Tensor, scales: torch.Tensor, first: int = 0) -> None:
    """A forward's amaxes into history slot 0, columns `first`.. (the whole buffer is passed, so a
    compiled graph launches the kernel on its input, with no slice to scatter back): the max with
    what the slot holds, except an inf/NaN amax, which is counted (per column) instead; the
    `amax_recorded` flag set, so the next update moves the forward scales; and the scales taken from
    `scales` (slots 0-2: the values the forward pinned, equal to the state's own)."""
    cols = slice(first, first + amax.shape[0])
    slot = history(state)[0, cols]
    keep_finite(slot, torch.maximum(slot, amax), slot, counts(state)[cols])
    state[RECORDED] = 1.0
    state[SCALES:SCALES + 3] = scales[SCALES:SCALES + 3]


@register_kernel("delayed_record_grad_amax")
def delayed_record_grad_amax(handoff: torch.Tensor, amax: torch.Tensor) -> None:
    """Backward's gradient amax into the handoff's pending [amax, generation] for the next forward's
    fold: the first backward after a fold (generation == the one folded) starts a new generation
    with `amax`, later ones (a module applied twice, micro-batches) take the max."""
    pending, seen = handoff[0:2], handoff[2:3]
    fresh = pending[1:2] == seen
    new_amax = torch.where(fresh, amax, torch.maximum(pending[0:1], amax))
    new_gen = torch.where(fresh, 1.0 - seen, pending[1:2])
    pending.copy_(torch.cat([new_amax, new_gen]))


@register_kernel("delayed_scaling_update")
def delayed_scaling_update(state: torch.Tensor, handoff: torch.Tensor, history_len: int, most_recent: bool,
                           fwd_max: float, bwd_max: float, margin: int, forward_half: bool, grad_half: bool) -> None:
    """One GEMM's update with TE's built-in rules, in place (the spec of the one-launch Triton
    kernel). The forward half, when a forward recorded its amaxes since the last one
    (`amax_recorded`, then cleared): the scales from the history, then the roll. The gradient half,
    when backward left a new amax pending: the fold (an inf/NaN amax counted in the gradient's
    counter and left out), the scale from the history, the roll."""
    algo = "most_recent" if most_recent else "max"
    v = views(state, handoff)
    if forward_half:
        only_where(v["amax_recorded"] > 0, [v["fp8_scale"], v["amax_history"][:history_len]],
                   lambda s, h: update_scale_and_roll(s, h, algo, fwd_max, margin))
        v["amax_recorded"].zero_()
    if grad_half:
        new_grad = v["grad_amax_pending"][1:2] != v["grad_amax_seen"]
        fold_pending_grad_amax(v["grad_amax_history"], v["grad_amax_pending"], v["grad_amax_seen"],
                               v["nonfinite_amax_count"][2:3])
        only_where(new_grad, [v["grad_fp8_scale"], v["grad_amax_history"][:history_len]],
                   lambda s, h: update_scale_and_roll(s, h, algo, bwd_max, margin))


@register_kernel("delayed_scaling_update_many")
def delayed_scaling_update_many(states, history_len: int, most_recent: bool, fwd_max: float, bwd_max: float,
                                margin: int, forward_half: bool, grad_half: bool) -> None:
    """`delayed_scaling_update` of several GEMMs (each a (state, handoff) pair) with one recipe; the
    Triton kernel does them in one launch."""
    for state, handoff in states:
        delayed_scaling_update(state, handoff, history_len, most_recent, fwd_max, bwd_max, margin, forward_half,
                               grad_half)
