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

from ._common import FLOAT32_MAX, next_power_of_2, triton_kernel
from .launch import fast_launch

_FMAX32 = tl.constexpr(FLOAT32_MAX)  # a jit function reads a module global only as a constexpr


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
        tl.store(count_ptr + 2, tl.load(count_ptr + 2) + (1 - finite.to(tl.int64)))
        gslot = tl.where(finite, folded, g0)
        if new_grad:
            _update_column(gscale_ptr, ghist_ptr, ghist_stride, gslot, L, BWD_MAX, MARGIN_MUL, MOST_RECENT, BLOCK)
        else:
            tl.store(ghist_ptr, gslot)


@fast_launch
@triton.jit
def _delayed_update_kernel(scale_ptr, hist_ptr, hist_stride, gscale_ptr, ghist_ptr, ghist_stride, pending_ptr,
                           seen_ptr, count_ptr, recorded_ptr, L, FWD_MAX: tl.constexpr, BWD_MAX: tl.constexpr,
                           MARGIN_MUL: tl.constexpr, MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr,
                           FORWARD_HALF: tl.constexpr, GRAD_HALF: tl.constexpr):
    _update_state(scale_ptr, hist_ptr, hist_stride, gscale_ptr, ghist_ptr, ghist_stride, pending_ptr, seen_ptr,
                  count_ptr, recorded_ptr, L, FWD_MAX, BWD_MAX, MARGIN_MUL, MOST_RECENT, BLOCK, FORWARD_HALF,
                  GRAD_HALF)


@fast_launch
@triton.jit
def _delayed_update_many_kernel(table_ptr, L, FWD_MAX: tl.constexpr, BWD_MAX: tl.constexpr,
                                MARGIN_MUL: tl.constexpr, MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr,
                                FORWARD_HALF: tl.constexpr, GRAD_HALF: tl.constexpr):
    """Program i updates GEMM i, whose eight state buffers' addresses are row i of the table."""
    row = table_ptr + tl.program_id(0) * 8
    f32 = tl.pointer_type(tl.float32)
    _update_state(tl.load(row).to(f32), tl.load(row + 1).to(f32), 2, tl.load(row + 2).to(f32),
                  tl.load(row + 3).to(f32), 1, tl.load(row + 4).to(f32), tl.load(row + 5).to(f32),
                  tl.load(row + 6).to(tl.pointer_type(tl.int64)), tl.load(row + 7).to(f32), L, FWD_MAX, BWD_MAX,
                  MARGIN_MUL, MOST_RECENT, BLOCK, FORWARD_HALF, GRAD_HALF)


def _check_histories(amax_history: torch.Tensor, grad_amax_history: torch.Tensor) -> None:
    if amax_history.shape[1:] != (2,) or grad_amax_history.shape[1:] != (1,) or amax_history.stride(1) != 1:
        raise ValueError(f"delayed_scaling_update: histories must be (rows, 2) with contiguous rows and "
                         f"(rows, 1), got {tuple(amax_history.shape)} (strides {amax_history.stride()}) and "
                         f"{tuple(grad_amax_history.shape)}")


@triton_kernel("delayed_scaling_update")
def delayed_scaling_update(fp8_scale: torch.Tensor, amax_history: torch.Tensor, grad_fp8_scale: torch.Tensor,
                           grad_amax_history: torch.Tensor, grad_amax_pending: torch.Tensor,
                           grad_amax_seen: torch.Tensor, nonfinite_count: torch.Tensor, amax_recorded: torch.Tensor,
                           history_len: int, most_recent: bool, fwd_max: float, bwd_max: float, margin: int,
                           forward_half: bool, grad_half: bool) -> None:
    _check_histories(amax_history, grad_amax_history)
    rows = min(history_len, amax_history.shape[0])
    _delayed_update_kernel[(1,)](
        fp8_scale, amax_history, amax_history.stride(0), grad_fp8_scale, grad_amax_history,
        grad_amax_history.stride(0), grad_amax_pending, grad_amax_seen, nonfinite_count, amax_recorded, rows,
        FWD_MAX=float(fwd_max), BWD_MAX=float(bwd_max), MARGIN_MUL=2.0 ** -margin, MOST_RECENT=bool(most_recent),
        BLOCK=next_power_of_2(rows), FORWARD_HALF=bool(forward_half), GRAD_HALF=bool(grad_half), num_warps=4)


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
    for state in states:
        _check_histories(state[1], state[3])
        if state[1].stride(0) != 2 or state[3].stride(0) != 1 or state[1].shape[0] < history_len:
            raise ValueError("delayed_scaling_update_many: histories must be contiguous and hold history_len rows")
    rows = history_len
    _delayed_update_many_kernel[(len(states),)](
        _address_table(states), rows, FWD_MAX=float(fwd_max), BWD_MAX=float(bwd_max), MARGIN_MUL=2.0 ** -margin,
        MOST_RECENT=bool(most_recent), BLOCK=next_power_of_2(rows), FORWARD_HALF=bool(forward_half),
        GRAD_HALF=bool(grad_half), num_warps=4)


@fast_launch
@triton.jit
def _record_amax_kernel(history_ptr, col_stride, amax_ptr, count_ptr, recorded_ptr, first, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < N
    slot = tl.load(history_ptr + (first + i) * col_stride, mask=m, other=0.0)
    new = tl.maximum(slot, tl.load(amax_ptr + i, mask=m, other=0.0), propagate_nan=tl.PropagateNan.ALL)
    ok = tl.abs(new) <= _FMAX32  # finite (NaN compares False)
    count = tl.load(count_ptr + first + i, mask=m, other=0)
    tl.debug_barrier()
    tl.store(history_ptr + (first + i) * col_stride, tl.where(ok, new, slot), mask=m)
    tl.store(count_ptr + first + i, count + (1 - ok.to(tl.int64)), mask=m)
    tl.store(recorded_ptr, 1.0)


@triton_kernel("delayed_record_amax")
def delayed_record_amax(history: torch.Tensor, amax: torch.Tensor, count: torch.Tensor, recorded: torch.Tensor,
                        first: int = 0) -> None:
    n = amax.shape[0]
    if (history.dim() != 2 or count.dim() != 1 or first + n > min(history.shape[1], count.shape[0])
            or not (amax.is_contiguous() and count.is_contiguous())):
        raise ValueError(f"delayed_record_amax: history (rows, columns), count (at least columns) and amax "
                         f"(contiguous) must hold columns {first}..{first + n - 1}, got {tuple(history.shape)}, "
                         f"{tuple(count.shape)}, {tuple(amax.shape)}")
    _record_amax_kernel[(1,)](history, history.stride(1), amax, count, recorded, first, n,
                              BLOCK=next_power_of_2(n), num_warps=1)


@fast_launch
@triton.jit
def _record_grad_amax_kernel(pending_ptr, seen_ptr, amax_ptr):
    p_amax = tl.load(pending_ptr)
    p_gen = tl.load(pending_ptr + 1)
    seen = tl.load(seen_ptr)
    amax = tl.load(amax_ptr)
    fresh = p_gen == seen
    new_amax = tl.where(fresh, amax, tl.maximum(p_amax, amax, propagate_nan=tl.PropagateNan.ALL))
    tl.debug_barrier()
    tl.store(pending_ptr, new_amax)
    tl.store(pending_ptr + 1, tl.where(fresh, 1.0 - seen, p_gen))


@triton_kernel("delayed_record_grad_amax")
def delayed_record_grad_amax(pending: torch.Tensor, seen: torch.Tensor, amax: torch.Tensor) -> None:
    if pending.shape != (2,) or seen.shape != (1,) or amax.shape != (1,) or not pending.is_contiguous():
        raise ValueError(f"delayed_record_grad_amax: pending (2,) contiguous, seen (1,) and amax (1,), got "
                         f"{tuple(pending.shape)}, {tuple(seen.shape)}, {tuple(amax.shape)}")
    _record_grad_amax_kernel[(1,)](pending, seen, amax, num_warps=1)
