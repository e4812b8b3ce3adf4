"""Eager delayed scaling's state changes, one launch each: a GEMM's whole per-step update
(`delayed_scaling_update`), a forward's amax record (`delayed_record_amax`) and a backward's
gradient amax record (`delayed_record_grad_amax`).

Bit for bit their references in `reference/delayed_scaling.py` (the spec). As torch ops these are
about forty, six and five small kernels per GEMM per step, each a launch and its host time. Under
torch.compile the records stay one launch each, inlined by inductor from their graph ops
(`custom_ops/delayed_scaling.py`); the update runs eagerly at autocast's exit and entry.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import delayed_scaling as layout
from ._common import FLOAT32_MAX, next_power_of_2, triton_kernel
from .launch import fast_launch

_FMAX32 = tl.constexpr(FLOAT32_MAX)  # a jit function reads a module global only as a constexpr
# the state's layout (`reference.delayed_scaling`), as constexprs
_RECORDED, _COUNTS, _HEADER, _COLS = (tl.constexpr(v) for v in (layout.RECORDED, layout.COUNTS, layout.HEADER,
                                                                 layout.COLUMNS))
_GRAD = tl.constexpr(2)  # the gradient's scale slot and history column


@triton.jit
def _new_scale(scale_ptr, amax, nan_seen, FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr):
    """TE's scale from `amax` (kept where amax <= 0, is inf/NaN, or the quotient is not finite)."""
    old = tl.load(scale_ptr)
    new = tl.math.div_rn(tl.zeros_like(amax) + FMAX, amax)
    if MARGIN_MUL != 1.0:
        new = new * MARGIN_MUL  # an exact power of two
    ok = (amax > 0) & (amax <= _FMAX32) & (new <= _FMAX32) & (nan_seen == 0)
    tl.store(scale_ptr, tl.where(ok, new, old))


@triton.jit
def _update_column(scale_ptr, hist_ptr, stride, slot0, L, FMAX: tl.constexpr, MARGIN_MUL: tl.constexpr,
                   MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr):
    """One history column (rows 0..L-1, row 0 holding `slot0`): its scale, then TE's roll."""
    rows = tl.arange(0, BLOCK)
    h = tl.load(hist_ptr + rows * stride, mask=rows < L, other=0.0)
    h = tl.where(rows == 0, slot0, h)
    if MOST_RECENT:
        amax = slot0
        nan_seen = (slot0 != slot0).to(tl.int32)
    else:
        amax = tl.max(tl.where(rows < L, h, -_FMAX32), axis=0)
        nan_seen = tl.max(((h != h) & (rows < L)).to(tl.int32), axis=0)  # torch's amax propagates NaN
    _new_scale(scale_ptr, amax, nan_seen, FMAX, MARGIN_MUL)
    shifted = tl.load(hist_ptr + (rows + 1) * stride, mask=rows + 1 < L, other=0.0)
    shifted = tl.where(rows == L - 1, slot0, shifted)
    tl.debug_barrier()  # every warp has read rows r and r + 1 before any warp writes row r
    tl.store(hist_ptr + rows * stride, tl.where(rows == 0, 0.0, shifted), mask=rows < L)


@triton.jit
def _update_state(scale_ptr, hist_ptr, hist_stride, gscale_ptr, ghist_ptr, ghist_stride, pending_ptr, seen_ptr,
                  count_ptr, recorded_ptr, L, FWD_MAX: tl.constexpr, BWD_MAX: tl.constexpr, MARGIN_MUL: tl.constexpr,
                  MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr, FORWARD_HALF: tl.constexpr,
                  GRAD_HALF: tl.constexpr):
    """One GEMM's update (the reference's `delayed_scaling_update`)."""
    if FORWARD_HALF:
        recorded = tl.load(recorded_ptr)
        tl.debug_barrier()  # every warp has read the flag before it is cleared
        tl.store(recorded_ptr, 0.0)
        if recorded > 0:  # a forward recorded its amaxes since the last update
            for col in tl.static_range(2):  # input, weight
                _update_column(scale_ptr + col, hist_ptr + col, hist_stride, tl.load(hist_ptr + col), L, FWD_MAX,
                               MARGIN_MUL, MOST_RECENT, BLOCK)
    if GRAD_HALF:
        # the gradient amax backward left pending: folded into slot 0 when new, kept out if inf/NaN
        g0 = tl.load(ghist_ptr)
        p_amax = tl.load(pending_ptr)
        p_gen = tl.load(pending_ptr + 1)
        new_grad = p_gen != tl.load(seen_ptr)
        folded = tl.where(new_grad, tl.maximum(g0, p_amax, propagate_nan=tl.PropagateNan.ALL), g0)
        finite = tl.abs(folded) <= _FMAX32
        tl.debug_barrier()  # every warp has read the flags before they are written
        tl.store(seen_ptr, p_gen)
        tl.store(count_ptr + 2, tl.load(count_ptr + 2) + (1.0 - finite.to(tl.float32)))
        gslot = tl.where(finite, folded, g0)
        if new_grad:
            _update_column(gscale_ptr, ghist_ptr, ghist_stride, gslot, L, BWD_MAX, MARGIN_MUL, MOST_RECENT, BLOCK)
        else:
            tl.store(ghist_ptr, gslot)


@triton.jit
def _update_gemm(state_ptr, handoff_ptr, L, FWD_MAX: tl.constexpr, BWD_MAX: tl.constexpr, MARGIN_MUL: tl.constexpr,
                 MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr, FORWARD_HALF: tl.constexpr, GRAD_HALF: tl.constexpr):
    """`_update_state` on one GEMM's packed state and handoff (`layout`)."""
    _update_state(state_ptr, state_ptr + _HEADER, _COLS, state_ptr + _GRAD, state_ptr + _HEADER + _GRAD, _COLS,
                  handoff_ptr, handoff_ptr + 2, state_ptr + _COUNTS, state_ptr + _RECORDED, L, FWD_MAX, BWD_MAX,
                  MARGIN_MUL, MOST_RECENT, BLOCK, FORWARD_HALF, GRAD_HALF)


@fast_launch
@triton.jit
def _delayed_update_kernel(state_ptr, handoff_ptr, L, FWD_MAX: tl.constexpr, BWD_MAX: tl.constexpr,
                           MARGIN_MUL: tl.constexpr, MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr,
                           FORWARD_HALF: tl.constexpr, GRAD_HALF: tl.constexpr):
    _update_gemm(state_ptr, handoff_ptr, L, FWD_MAX, BWD_MAX, MARGIN_MUL, MOST_RECENT, BLOCK, FORWARD_HALF, GRAD_HALF)


@fast_launch
@triton.jit
def _delayed_update_many_kernel(table_ptr, L, FWD_MAX: tl.constexpr, BWD_MAX: tl.constexpr,
                                MARGIN_MUL: tl.constexpr, MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr,
                                FORWARD_HALF: tl.constexpr, GRAD_HALF: tl.constexpr):
    """Program i updates GEMM i, whose state and handoff addresses are row i of the table."""
    row = table_ptr + tl.program_id(0) * 2
    f32 = tl.pointer_type(tl.float32)
    _update_gemm(tl.load(row).to(f32), tl.load(row + 1).to(f32), L, FWD_MAX, BWD_MAX, MARGIN_MUL, MOST_RECENT, BLOCK,
                 FORWARD_HALF, GRAD_HALF)


def _check_state(state: torch.Tensor, handoff: torch.Tensor, history_len: int, name: str) -> None:
    if (state.dim() != 1 or state.dtype != torch.float32 or not state.is_contiguous()
            or layout.history_rows(state) < history_len or handoff.shape != (3,) or not handoff.is_contiguous()):
        raise ValueError(f"{name}: a GEMM's state must be a contiguous float32 ({layout.HEADER} + "
                         f"{layout.COLUMNS} * rows,) buffer holding "
                         f"history_len={history_len} rows and its handoff a contiguous (3,), got "
                         f"{tuple(state.shape)} {state.dtype} (strides {state.stride()}) and {tuple(handoff.shape)}")


@triton_kernel("delayed_scaling_update")
def delayed_scaling_update(state: torch.Tensor, handoff: torch.Tensor, history_len: int, most_recent: bool,
                           fwd_max: float, bwd_max: float, margin: int, forward_half: bool, grad_half: bool) -> None:
    rows = min(history_len, layout.history_rows(state))
    _check_state(state, handoff, rows, "delayed_scaling_update")
    _delayed_update_kernel[(1,)](
        state, handoff, rows, FWD_MAX=float(fwd_max), BWD_MAX=float(bwd_max), MARGIN_MUL=2.0 ** -margin,
        MOST_RECENT=bool(most_recent), BLOCK=next_power_of_2(rows), FORWARD_HALF=bool(forward_half),
        GRAD_HALF=bool(grad_half), num_warps=4)


_TABLES = {}  # the address table of a set of GEMM states, on their device: built once per set


def _address_table(states) -> torch.Tensor:
    key = tuple(t.data_ptr() for state in states for t in state)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 64:
            _TABLES.clear()
        table = torch.tensor(key, dtype=torch.int64).to(states[0][0].device)
        _TABLES[key] = table
    return table


@triton_kernel("delayed_scaling_update_many")
def delayed_scaling_update_many(states, history_len: int, most_recent: bool, fwd_max: float, bwd_max: float,
                                margin: int, forward_half: bool, grad_half: bool) -> None:
    for state, handoff in states:
        _check_state(state, handoff, history_len, "delayed_scaling_update_many")
    rows = history_len
    _delayed_update_many_kernel[(len(states),)](
        _address_table(states), rows, FWD_MAX=float(fwd_max), BWD_MAX=float(bwd_max), MARGIN_MUL=2.0 ** -margin,
        MOST_RECENT=bool(most_recent), BLOCK=next_power_of_2(rows), FORWARD_HALF=bool(forward_half),
        GRAD_HALF=bool(grad_half), num_warps=4)


@fast_launch
@triton.jit
def _record_amax_kernel(state_ptr, amax_ptr, scales_ptr, first, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < N
    slot_ptr = state_ptr + _HEADER + first + i  # history row 0, columns first..
    slot = tl.load(slot_ptr, mask=m, other=0.0)
    new = tl.maximum(slot, tl.load(amax_ptr + i, mask=m, other=0.0), propagate_nan=tl.PropagateNan.ALL)
    ok = tl.abs(new) <= _FMAX32  # finite (NaN compares False)
    count = tl.load(state_ptr + _COUNTS + first + i, mask=m, other=0.0)
    s = tl.arange(0, 4)
    scales = tl.load(scales_ptr + s, mask=s < 3)
    tl.debug_barrier()
    tl.store(slot_ptr, tl.where(ok, new, slot), mask=m)
    tl.store(state_ptr + _COUNTS + first + i, count + (1.0 - ok.to(tl.float32)), mask=m)
    tl.store(state_ptr + _RECORDED, 1.0)
    tl.store(state_ptr + s, scales, mask=s < 3)


@triton_kernel("delayed_record_amax")
def delayed_record_amax(state: torch.Tensor, amax: torch.Tensor, scales: torch.Tensor, first: int = 0) -> None:
    n = amax.shape[0]
    if (state.dim() != 1 or not state.is_contiguous() or first + n > layout.COLUMNS - 1 or not amax.is_contiguous()
            or scales.shape[0] < 3 or not scales.is_contiguous()):
        raise ValueError(f"delayed_record_amax: a contiguous state, amax (contiguous) for forward columns "
                         f"{first}..{first + n - 1} of 0..1 and scales holding slots 0..2, got {tuple(state.shape)}, "
                         f"{tuple(amax.shape)}, {tuple(scales.shape)}")
    _record_amax_kernel[(1,)](state, amax, scales, first, n, BLOCK=next_power_of_2(n), num_warps=1)


@fast_launch
@triton.jit
def _record_grad_amax_kernel(handoff_ptr, amax_ptr):
    p_amax = tl.load(handoff_ptr)
    p_gen = tl.load(handoff_ptr + 1)
    seen = tl.load(handoff_ptr + 2)
    amax = tl.load(amax_ptr)
    fresh = p_gen == seen
    new_amax = tl.where(fresh, amax, tl.maximum(p_amax, amax, propagate_nan=tl.PropagateNan.ALL))
    tl.debug_barrier()
    tl.store(handoff_ptr, new_amax)
    tl.store(handoff_ptr + 1, tl.where(fresh, 1.0 - seen, p_gen))


@triton_kernel("delayed_record_grad_amax")
def delayed_record_grad_amax(handoff: torch.Tensor, amax: torch.Tensor) -> None:
    if handoff.shape != (3,) or amax.shape != (1,) or not handoff.is_contiguous():
        raise ValueError(f"delayed_record_grad_amax: handoff (3,) contiguous and amax (1,), got "
                         f"{tuple(handoff.shape)}, {tuple(amax.shape)}")
    _record_grad_amax_kernel[(1,)](handoff, amax, num_warps=1)
