"""Per-tensor FP8 (delayed and current scaling) in Triton: amax, and one fused kernel that reads
x once and writes the rowwise fp8 data and its (K, M) transpose.

Same names, signatures and results (bit for bit) as `kernels/reference/float8.py`.

- amax: a (1,) fp32 buffer, zeroed, max-accumulated by `atomic_max` on the float bits as int32
  (|x| >= 0, so integer order is float order). The kernels cast the amax pointer to int32
  themselves, so an fp32 buffer is passed as it is: a dtype view made on the torch side would
  reach inductor, which cannot re-index a view of a buffer the graph computes (an amax slot that
  another quantize wrote through torch ops). The `amax` kernel and current scaling reduce the
  finite values only (inf / NaN lanes count as 0); delayed scaling records every value (a NaN's
  bits are above Inf's, so any NaN gives a NaN amax, as torch's `amax` does).
- current scaling: pass 1 amax; pass 2 the cast kernel reads the amax, computes the scale on
  the device (`scale_from_amax`), writes scale_inv (program 0) and the data. No host sync.
- delayed scaling: cast with the given scale; the amax max-accumulated into `amax_out` by atomic
  max (its bits viewed as int32: correct for amax_out >= 0 or +NaN): per tile inside the cast
  (one pass), except in the byte-transposing kernel (M % 4 != 0), where a tile reduction is
  slower than a separate amax pass (H100), so that pass runs first. The scale and the amax are
  element `slot` of their buffers (a GEMM's input and weight share one of each; a traced graph
  cannot hand a user kernel a slice of a buffer it writes), and no amax is taken where the
  caller records none.
- the transpose goes through registers (`tl.trans`), so both stores are coalesced. When the
  transpose's rows are whole int32 words (M % 4 == 0) the packed kernel loads the tile as four
  row-interleaved quarters (rows 4i + j), packs the four fp8 bytes of each column into one int32
  word (`pack4`) and transposes the words: a quarter of the elements through the layout change.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ..reference import float8 as _ref
from ..zeroed import zeros
from ._common import (
    INT32_LIMIT,
    abs_bits,
    as_kernel_input,
    cdiv,
    finite_abs_bits,
    flat_2d,
    fp8_params,
    fp8_scaled_bits,
    pack4,
    reciprocal,
    scale_from_amax,
    soft_cast,
    to_f32,
    triton_kernel,
)
from .launch import aligned, fast_launch, plan_key, planned, run_recorded

# Launch configurations (tunable: benchmarks/bench_quantize.py sweeps them; after editing one, call
# `launch.clear_plans()`: recorded eager launches replay the config they were recorded with).
CONFIG = {
    "amax": dict(BLOCK=16384, num_warps=8),
    "cast": dict(BM=128, BK=128, num_warps=8),
    # one-usage casts need no transpose: a wide row tile (4 warps: faster than 8 where the cast
    # also takes delayed scaling's tile amax)
    "cast_rowwise": dict(BM=32, BK=256, num_warps=4),
    # rowwise + transpose with M % 4 == 0: the int32-packed transpose (BM rows = BM // 4 words)
    "cast_packed": dict(BM=64, BK=128, num_warps=8),  # about copy speed at 8192^2 (H100)
    "pack_transpose": True,
}


@fast_launch
@triton.jit
def _amax_kernel(x_ptr, amax_ptr, N, amax_slot, FINITE: tl.constexpr, BF16_BITS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """max |x| into amax_ptr[amax_slot] (int32 bits): of the finite values with FINITE, else of all."""
    amax_ptr = amax_ptr.to(tl.pointer_type(tl.int32))  # the fp32 amax's bits (module docstring)
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = pid.to(tl.int64) * BLOCK
    mask = offs < N - base
    x = to_f32(tl.load(x_ptr + base + offs, mask=mask, other=0), BF16_BITS)
    if FINITE:
        m = tl.max(finite_abs_bits(x), axis=0)
    else:
        m = tl.max(abs_bits(x), axis=0)
    # a plain (possibly stale) read can only under-estimate the running max: skipping the
    # atomic when m <= it is safe, and spares most programs the contended atomic
    cur = tl.load(amax_ptr + amax_slot)
    tl.atomic_max(amax_ptr + amax_slot, m, mask=m > cur, sem="relaxed")


@triton.jit
def _tensor_scale(scale_ptr, amax_ptr, scale_inv_ptr, pid, slot, amax_slot, FMAX: tl.constexpr,
                  CURRENT: tl.constexpr, MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
                  EPS: tl.constexpr):
    """The tensor's scale: given (delayed: scale_ptr[slot]) or from the amax pass (current:
    amax_ptr[amax_slot]); program 0 writes its reciprocal."""
    if CURRENT:
        amax = tl.load(amax_ptr + amax_slot).to(tl.float32, bitcast=True)
        scale = scale_from_amax(amax, FMAX, MARGIN_MUL, POW2, EPS)
    else:
        scale = tl.load(scale_ptr + slot)
    tl.store(scale_inv_ptr, reciprocal(scale), mask=pid == 0)
    return scale


@fast_launch
@triton.jit
def _cast_transpose_kernel(x_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, scale_inv_ptr, M, K, n_k, slot,
                           amax_slot, FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr,
                           CURRENT: tl.constexpr, TILE_AMAX: tl.constexpr,
                           MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
                           EPS: tl.constexpr, ROWWISE: tl.constexpr, COLWISE: tl.constexpr,
                           BF16_BITS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    amax_ptr = amax_ptr.to(tl.pointer_type(tl.int32))  # the fp32 amax's bits (module docstring)
    scale = _tensor_scale(scale_ptr, amax_ptr, scale_inv_ptr, pid, slot, amax_slot, FMAX, CURRENT,
                          MARGIN_MUL, POW2, EPS)

    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    m0 = pid_m * BM
    k0 = pid_k * BK
    mask = ((m0 + rm)[:, None] < M) & ((k0 + rk)[None, :] < K)
    row_base = m0.to(tl.int64) * K + k0
    offs = rm[:, None] * K + rk[None, :]
    x = to_f32(tl.load(x_ptr + row_base + offs, mask=mask, other=0), BF16_BITS)
    if TILE_AMAX:
        tile_amax = tl.max(tl.max(abs_bits(x), axis=1), axis=0)
    q = fp8_scaled_bits(x, scale, FMAX, E4M3, SOFT, CURRENT)
    if ROWWISE:
        tl.store(row_ptr + row_base + offs, q, mask=mask)
    if COLWISE:
        col_base = k0.to(tl.int64) * M + m0
        offs_t = rk[:, None] * M + rm[None, :]
        tl.store(col_ptr + col_base + offs_t, tl.trans(q), mask=tl.trans(mask))
    if TILE_AMAX:
        # last and relaxed: an acq_rel atomic before the stores would pin the whole tile in
        # registers (208 instead of 64 at 128x128, 8 warps)
        cur = tl.load(amax_ptr + amax_slot)
        tl.atomic_max(amax_ptr + amax_slot, tile_amax, mask=tile_amax > cur, sem="relaxed")


@triton.jit
def _cast_quarter(x_ptr, row_ptr, base, m0, k0, j: tl.constexpr, M, K, rq, rk, scale, amax_acc,
                  FMAX: tl.constexpr, E4M3: tl.constexpr, SOFT: tl.constexpr, CURRENT: tl.constexpr,
                  ROWWISE: tl.constexpr, TILE_AMAX: tl.constexpr, BF16_BITS: tl.constexpr):
    """Rows m0 + 4 * rq + j of the tile (columns k0 + rk): cast and stored rowwise; returns the
    fp8 bytes and, with TILE_AMAX, `amax_acc` max-accumulated with the int32 bits of |x|."""
    r = 4 * rq + j
    mask = ((m0 + r) < M)[:, None] & ((k0 + rk) < K)[None, :]
    offs = r[:, None] * K + rk[None, :]
    x = to_f32(tl.load(x_ptr + base + offs, mask=mask, other=0), BF16_BITS)
    q = fp8_scaled_bits(x, scale, FMAX, E4M3, SOFT, CURRENT)
    if ROWWISE:
        tl.store(row_ptr + base + offs, q, mask=mask)
    if TILE_AMAX:
        amax_acc = tl.maximum(amax_acc, abs_bits(x))
    return q, amax_acc


@fast_launch
@triton.jit
def _cast_transpose_packed_kernel(x_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, scale_inv_ptr,
                                  M, K, n_k, slot, amax_slot, FMAX: tl.constexpr, E4M3: tl.constexpr,
                                  SOFT: tl.constexpr, CURRENT: tl.constexpr,
                                  MARGIN_MUL: tl.constexpr, POW2: tl.constexpr,
                                  EPS: tl.constexpr, ROWWISE: tl.constexpr,
                                  TILE_AMAX: tl.constexpr, BF16_BITS: tl.constexpr,
                                  BM: tl.constexpr, BK: tl.constexpr):
    """`_cast_transpose_kernel` with the transpose written as int32 words (`col_ptr` is the
    (K, M // 4) int32 view of the (K, M) fp8 transpose; M % 4 == 0). Here the tile amax is
    cheap (an elementwise max of the quarters, then one reduction): delayed scaling takes it in
    this pass instead of a separate amax pass, so x is read once."""
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    amax_ptr = amax_ptr.to(tl.pointer_type(tl.int32))  # the fp32 amax's bits (module docstring)
    scale = _tensor_scale(scale_ptr, amax_ptr, scale_inv_ptr, pid, slot, amax_slot, FMAX, CURRENT,
                          MARGIN_MUL, POW2, EPS)
    rq = tl.arange(0, BM // 4)
    rk = tl.arange(0, BK)
    m0 = pid_m * BM
    k0 = pid_k * BK
    base = m0.to(tl.int64) * K + k0
    # the tile amax as a running elementwise max over the quarters (masked lanes load 0), reduced
    # once: keeping each quarter's |x| live until the end costs registers, and occupancy with them
    acc = tl.zeros((BM // 4, BK), dtype=tl.int32)
    q0, acc = _cast_quarter(x_ptr, row_ptr, base, m0, k0, 0, M, K, rq, rk, scale, acc, FMAX, E4M3,
                            SOFT, CURRENT, ROWWISE, TILE_AMAX, BF16_BITS)
    q1, acc = _cast_quarter(x_ptr, row_ptr, base, m0, k0, 1, M, K, rq, rk, scale, acc, FMAX, E4M3,
                            SOFT, CURRENT, ROWWISE, TILE_AMAX, BF16_BITS)
    q2, acc = _cast_quarter(x_ptr, row_ptr, base, m0, k0, 2, M, K, rq, rk, scale, acc, FMAX, E4M3,
                            SOFT, CURRENT, ROWWISE, TILE_AMAX, BF16_BITS)
    q3, acc = _cast_quarter(x_ptr, row_ptr, base, m0, k0, 3, M, K, rq, rk, scale, acc, FMAX, E4M3,
                            SOFT, CURRENT, ROWWISE, TILE_AMAX, BF16_BITS)
    if TILE_AMAX:
        tile_amax = tl.max(tl.max(acc, axis=1), axis=0)
    words = pack4(q0, q1, q2, q3)  # [BM // 4, BK]: word (i, k) = rows 4i .. 4i + 3 of column k
    m4 = M // 4
    wmask = ((k0 + rk) < K)[:, None] & ((m0 // 4 + rq) < m4)[None, :]
    col_base = k0.to(tl.int64) * m4 + m0 // 4
    tl.store(col_ptr + col_base + rk[:, None] * m4 + rq[None, :], tl.trans(words), mask=wmask)
    if TILE_AMAX:  # last and relaxed, as in `_cast_transpose_kernel`
        cur = tl.load(amax_ptr + amax_slot)
        tl.atomic_max(amax_ptr + amax_slot, tile_amax, mask=tile_amax > cur, sem="relaxed")


def _amax_into(x2d: torch.Tensor, amax: torch.Tensor, finite: bool, amax_slot: int = 0) -> None:
    n = x2d.numel()
    cfg = CONFIG["amax"]
    grid = (cdiv(n, cfg["BLOCK"]),)
    xk, bf16_bits = as_kernel_input(x2d)
    _amax_kernel[grid](xk, amax, n, amax_slot, FINITE=finite, BF16_BITS=bf16_bits, BLOCK=cfg["BLOCK"],
                       num_warps=cfg["num_warps"])


def _packs(m: int, columnwise: bool) -> bool:
    """Whether the cast writes its transpose through the int32-packed kernel."""
    return columnwise and m % 4 == 0 and CONFIG["pack_transpose"]


def _launch_cast(x2d, fp8_dtype, rowwise, columnwise, scale=None, amax=None, current=False,
                 margin=0, power_2=False, epsilon=0.0, tile_amax=False, slot=0, amax_slot=0):
    m, k = x2d.shape
    dev = x2d.device
    fmax, e4m3 = fp8_params(fp8_dtype)
    data = torch.empty((m, k), dtype=fp8_dtype, device=dev) if rowwise else None
    transpose = torch.empty((k, m), dtype=fp8_dtype, device=dev) if columnwise else None
    scale_inv = torch.empty((1,), dtype=torch.float32, device=dev)
    packed = _packs(m, columnwise)
    cfg = CONFIG["cast_packed" if packed else "cast" if columnwise else "cast_rowwise"]
    bm, bk = cfg["BM"], cfg["BK"]
    n_k = cdiv(k, bk)
    grid = (cdiv(m, bm) * n_k,)
    row_arg = data.view(torch.uint8) if rowwise else scale_inv  # unused pointer when absent
    col_arg = (transpose.view(torch.int32) if packed else transpose.view(torch.uint8)
               ) if columnwise else scale_inv
    xk, bf16_bits = as_kernel_input(x2d)
    scale_arg = scale if scale is not None else scale_inv
    amax_arg = amax if amax is not None else scale_inv  # unused without an amax
    if packed:
        _cast_transpose_packed_kernel[grid](
            xk, row_arg, col_arg, scale_arg, amax_arg, scale_inv, m, k, n_k, slot, amax_slot,
            FMAX=fmax, E4M3=e4m3, SOFT=soft_cast(), CURRENT=current,
            MARGIN_MUL=float(2.0 ** -margin), POW2=bool(power_2), EPS=float(epsilon),
            ROWWISE=bool(rowwise), TILE_AMAX=bool(tile_amax), BF16_BITS=bf16_bits, BM=bm, BK=bk,
            num_warps=cfg["num_warps"],
        )
        return data, transpose, scale_inv
    _cast_transpose_kernel[grid](
        xk, row_arg, col_arg, scale_arg, amax_arg, scale_inv, m, k, n_k, slot, amax_slot,
        FMAX=fmax, E4M3=e4m3, SOFT=soft_cast(), CURRENT=current, TILE_AMAX=bool(tile_amax),
        MARGIN_MUL=float(2.0 ** -margin), POW2=bool(power_2), EPS=float(epsilon),
        ROWWISE=bool(rowwise), COLWISE=bool(columnwise), BF16_BITS=bf16_bits, BM=bm, BK=bk,
        num_warps=cfg["num_warps"],
    )
    return data, transpose, scale_inv


def _fits(x: torch.Tensor) -> bool:
    """Shapes the kernels index with int32 tile-local offsets (and not empty)."""
    m, k = flat_2d(x)
    if m == 0 or k == 0:
        return False
    cast, rowwise, packed = CONFIG["cast"], CONFIG["cast_rowwise"], CONFIG["cast_packed"]
    bm = max(cast["BM"], rowwise["BM"], packed["BM"])
    bk = max(cast["BK"], rowwise["BK"], packed["BK"])
    return bm * k < INT32_LIMIT and bk * m < INT32_LIMIT


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    m, k = flat_2d(x)
    return x.contiguous().reshape(m, k)


@triton_kernel("amax")
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| over the finite values of x, as a float32 tensor of shape (1,)."""
    if x.numel() == 0:
        return _ref.amax(x)
    out = zeros(1, x)
    _amax_into(x.contiguous().reshape(-1), out, finite=True)
    return out


class _CastPlan:
    """The launches of one eager call signature of a per-tensor cast, replayed for the next call
    with fresh buffers and none of the entry point's Python (grids, sizes and constexprs are the
    signature's: `launch.Replay`). Built from a recorded call of the full entry point."""

    __slots__ = ("launches", "shape", "transpose_shape", "fp8_dtype", "device", "rowwise", "columnwise")

    def __init__(self, x, fp8_dtype, rowwise, columnwise, launches):
        m, k = flat_2d(x)
        self.launches, self.shape, self.transpose_shape = tuple(launches), x.shape, (k, m)
        self.fp8_dtype, self.device, self.rowwise, self.columnwise = fp8_dtype, x.device, rowwise, columnwise

    def _cast(self, x, scale, amax, launch):
        dev = self.device
        data = torch.empty(self.shape, dtype=self.fp8_dtype, device=dev) if self.rowwise else None
        transpose = torch.empty(self.transpose_shape, dtype=self.fp8_dtype, device=dev) if self.columnwise else None
        scale_inv = torch.empty((1,), dtype=torch.float32, device=dev)
        launch(x, scale_inv if data is None else data, scale_inv if transpose is None else transpose,
               scale_inv if scale is None else scale, scale_inv if amax is None else amax, scale_inv)
        return data, transpose, scale_inv

    def current(self, x, existing_amax=None):
        amax = existing_amax
        if amax is None:
            amax = zeros(1, x)
            self.launches[0](x, amax)
        return (*self._cast(x, None, amax, self.launches[-1]), amax)

    def delayed(self, x, scale, amax_out):
        if len(self.launches) == 2:
            self.launches[0](x, amax_out)
        return self._cast(x, scale, amax_out, self.launches[-1])


@triton_kernel("fp8_quantize_delayed")
def fp8_quantize_delayed(x, scale, amax_out, fp8_dtype, rowwise, columnwise, slot=0
                         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], torch.Tensor]:
    """Cast with scale[slot]; max-accumulate max |x| of every value (inf / NaN included) into
    amax_out[slot] in place (amax_out None: no amax taken)."""
    _ref.check_slot(scale, amax_out, slot)
    key = plan_key(x, "delayed", fp8_dtype, rowwise, columnwise, slot, amax_out is None,
                   scale.numel() == 1, amax_out is not None and amax_out.numel() == 1)
    if key is not None and not (_slotted(scale) and (amax_out is None or _slotted(amax_out))):
        key = None
    elif key is not None:
        # the module's state is often a slot of a longer buffer: its alignment is part of the signature
        key = (*key, aligned(scale), amax_out is None or aligned(amax_out))
    plan = planned(key)
    if plan is not None:
        return plan.delayed(x, scale, amax_out)
    return run_recorded(key, lambda launches: _CastPlan(x, fp8_dtype, rowwise, columnwise, launches),
                        _fp8_quantize_delayed, x, scale, amax_out, fp8_dtype, rowwise, columnwise, slot,
                        expect=(1, 2))  # the cast, after an amax pass or with the tile amax


def _slotted(t: torch.Tensor) -> bool:
    """A float32 buffer the kernels can index by slot."""
    return t.dtype is torch.float32 and t.dim() == 1 and t.is_contiguous()


def _fp8_quantize_delayed(x, scale, amax_out, fp8_dtype, rowwise, columnwise, slot):
    if not _fits(x) or not (amax_out is None or _slotted(amax_out)) or not (slot == 0 or scale.is_contiguous()):
        return _ref.fp8_quantize_delayed(x, scale, amax_out, fp8_dtype, rowwise, columnwise, slot)
    fp8_params(fp8_dtype)
    x2d = _as_2d(x)
    scale = scale.reshape(-1).float()
    # the byte-transposing kernel is slower with a tile amax than with a separate amax pass
    # (H100), so it leaves the amax to that pass; the other kernels take it per tile
    tile_amax = amax_out is not None and (not columnwise or _packs(x2d.shape[0], columnwise))
    # a one-element buffer is its own slot (`reference.float8.check_slot`)
    amax_slot = slot if amax_out is not None and amax_out.numel() > 1 else 0
    if amax_out is not None and not tile_amax:
        _amax_into(x2d, amax_out, finite=False, amax_slot=amax_slot)
    data, transpose, scale_inv = _launch_cast(x2d, fp8_dtype, rowwise, columnwise, scale=scale,
                                              amax=amax_out, current=False, tile_amax=tile_amax,
                                              slot=slot if scale.numel() > 1 else 0, amax_slot=amax_slot)
    if data is not None:
        data = data.view(x.shape)
    return data, transpose, scale_inv


@triton_kernel("fp8_quantize_current")
def fp8_quantize_current(x, fp8_dtype, rowwise, columnwise, margin=0, power_2=False, epsilon=0.0,
                         existing_amax=None):
    """Scale from this tensor's own amax (of its finite values): returns (data, transpose,
    scale_inv, amax). `existing_amax`: that amax, taken already: the cast alone."""
    given = existing_amax is not None
    key = plan_key(x, "current", fp8_dtype, rowwise, columnwise, margin, power_2, epsilon, given)
    if key is not None and given and not _slotted(existing_amax):
        key = None
    plan = planned(key)
    if plan is not None:
        return plan.current(x, existing_amax)
    return run_recorded(key, lambda launches: _CastPlan(x, fp8_dtype, rowwise, columnwise, launches),
                        _fp8_quantize_current, x, fp8_dtype, rowwise, columnwise, margin, power_2, epsilon,
                        existing_amax, expect=(1,) if given else (2,))  # [amax,] cast


def _fp8_quantize_current(x, fp8_dtype, rowwise, columnwise, margin, power_2, epsilon, existing_amax):
    if not _fits(x) or not (existing_amax is None or _slotted(existing_amax)):
        return _ref.fp8_quantize_current(x, fp8_dtype, rowwise, columnwise, margin, power_2, epsilon, existing_amax)
    fp8_params(fp8_dtype)
    x2d = _as_2d(x)
    amax = existing_amax
    if amax is None:
        amax = zeros(1, x)
        _amax_into(x2d, amax, finite=True)
    data, transpose, scale_inv = _launch_cast(x2d, fp8_dtype, rowwise, columnwise, amax=amax,
                                              current=True, margin=margin, power_2=power_2,
                                              epsilon=epsilon)
    if data is not None:
        data = data.view(x.shape)
    return data, transpose, scale_inv, amax
