"""`delayed_scaling_update` in one launch: a GEMM's whole per-step delayed-scaling update.

Bit for bit `reference.delayed_scaling.delayed_scaling_update` (the spec): one program reads the
pending gradient amax and both histories, computes the three scales and writes the rolled
histories back. Eager delayed scaling ran about forty small torch ops per GEMM per step for this,
each a launch; under torch.compile the reference's ops are fused by inductor instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import FLOAT32_MAX, triton_kernel

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
def _delayed_update_kernel(scale_ptr, hist_ptr, hist_stride, gscale_ptr, ghist_ptr, ghist_stride, pending_ptr,
                           seen_ptr, count_ptr, L, FWD_MAX: tl.constexpr, BWD_MAX: tl.constexpr,
                           MARGIN_MUL: tl.constexpr, MOST_RECENT: tl.constexpr, BLOCK: tl.constexpr):
    # the gradient amax backward left pending: folded into slot 0 when new, kept out if inf/NaN
    g0 = tl.load(ghist_ptr)
    p_amax = tl.load(pending_ptr)
    p_gen = tl.load(pending_ptr + 1)
    folded = tl.where(p_gen != tl.load(seen_ptr), tl.maximum(g0, p_amax, propagate_nan=tl.PropagateNan.ALL), g0)
    finite = tl.abs(folded) <= _FMAX32
    tl.store(seen_ptr, p_gen)
    tl.store(count_ptr + 2, tl.load(count_ptr + 2) + (1 - finite.to(tl.int64)))
    gslot = tl.where(finite, folded, g0)
    for col in tl.static_range(2):  # forward: input, weight
        _update_column(scale_ptr + col, hist_ptr + col, hist_stride, tl.load(hist_ptr + col), L, FWD_MAX,
                       MARGIN_MUL, MOST_RECENT, BLOCK)
    _update_column(gscale_ptr, ghist_ptr, ghist_stride, gslot, L, BWD_MAX, MARGIN_MUL, MOST_RECENT, BLOCK)


@triton_kernel("delayed_scaling_update")
def delayed_scaling_update(fp8_scale: torch.Tensor, amax_history: torch.Tensor, grad_fp8_scale: torch.Tensor,
                           grad_amax_history: torch.Tensor, grad_amax_pending: torch.Tensor,
                           grad_amax_seen: torch.Tensor, nonfinite_count: torch.Tensor, history_len: int,
                           most_recent: bool, fwd_max: float, bwd_max: float, margin: int) -> None:
    if amax_history.shape[1:] != (2,) or grad_amax_history.shape[1:] != (1,) or amax_history.stride(1) != 1:
        raise ValueError(f"delayed_scaling_update: histories must be (rows, 2) with contiguous rows and "
                         f"(rows, 1), got {tuple(amax_history.shape)} (strides {amax_history.stride()}) and "
                         f"{tuple(grad_amax_history.shape)}")
    rows = min(history_len, amax_history.shape[0])
    _delayed_update_kernel[(1,)](
        fp8_scale, amax_history, amax_history.stride(0), grad_fp8_scale, grad_amax_history,
        grad_amax_history.stride(0), grad_amax_pending, grad_amax_seen, nonfinite_count, rows,
        FWD_MAX=float(fwd_max), BWD_MAX=float(bwd_max), MARGIN_MUL=2.0 ** -margin, MOST_RECENT=bool(most_recent),
        BLOCK=triton.next_power_of_2(rows), num_warps=4)
