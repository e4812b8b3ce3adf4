"""LayerNorm / RMSNorm in Triton: one kernel for the forward (optionally with the amax of its
output, for current scaling), one for the backward.

Same names and signatures as `kernels/reference/norm.py`; the results are NOT bitwise the
reference's: the row sums (mu, var, and backward's two projections) are reduced in a different
order. Everything else follows the reference's fp32 op order, with FMA contraction disabled
(`enable_fp_fusion=False`) and rsigma = 1 / sqrt(var + eps) with correctly rounded sqrt and
division (what torch computes on CPU), so y is the reference's to about one ulp of its dtype.

- forward: a program normalizes ROWS rows. A row of K <= BLOCK stays in registers; a longer row
  is read in BLOCK-wide chunks three times (sum, centred sum of squares, output; RMSNorm skips
  the first): the re-reads of a 32 KiB row come from L1/L2. With AMAX the program max-reduces |y|
  over the finite values of y as rounded to the output dtype (what a quantize of y reads) and
  `atomic_max`es it into an int32-viewed fp32 buffer, as `float8._amax_kernel` does (float order
  is integer order for |y|).
- backward: dx per row; dgamma / dbeta as one fp32 partial row per program (a program owns
  ITERS consecutive row tiles; ITERS a power of two so that a new M rarely recompiles), summed
  afterwards by torch: deterministic, no atomics. A row longer than BLOCK is read twice (the two
  projections, then dx) and its partial row is accumulated in place in global memory.
- `norm_fp8_current_quantize`: the forward with AMAX, then the float8 cast / transpose kernel
  reading that amax: current scaling of the norm output without the separate amax pass, bitwise
  equal to the norm followed by `fp8_quantize_current` of its output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import norm as _ref
from ..zeroed import zeros
from . import float8 as _f8
from ._common import (
    as_kernel_input,
    cdiv,
    finite_abs_bits,
    fp8_params,
    next_power_of_2,
    soft_cast,
    to_f32,
    triton_kernel,
)
from .dequant import OUT_KIND, out_buffer, round_out
from .launch import fast_launch

# Launch configurations: a row longer than MAX_BLOCK is looped over in chunks; ROWS (rows per
# tile) is chosen so that a tile holds about TILE elements, with a warp per WARP_ELEMS of them
# (4 to 16 warps). Backward runs at most about MAX_PROGRAMS programs: two per SM of an H100 /
# H200, so few partial rows of dgamma are summed afterwards. Picked by device-time sweeps on an
# H200 (forward at hidden 1024-8192, backward at 2048 and 4096; `benchmarks/bench_norm.py
# --sweep` runs them and compares the kernels with inductor's). Tunable, like float8.CONFIG.
CONFIG = {
    "fwd": dict(MAX_BLOCK=8192, TILE=2048, WARP_ELEMS=1024),
    "bwd": dict(MAX_BLOCK=8192, TILE=4096, WARP_ELEMS=1024, MAX_PROGRAMS=264),
}


def _tile(k: int, cfg) -> dict:
    block = min(next_power_of_2(k), cfg["MAX_BLOCK"])
    rows = max(1, cfg["TILE"] // block)
    return dict(BLOCK=block, ROWS=rows, NCHUNK=cdiv(k, block),
                num_warps=min(16, max(4, rows * block // cfg["WARP_ELEMS"])))


@triton.jit
def _load_f32(ptr, offs, mask, BF16: tl.constexpr):
    return to_f32(tl.load(ptr + offs, mask=mask, other=0), BF16)


@triton.jit
def _row_mean(v, K):
    """sum(v, axis=1) / K with a correctly rounded division (torch's `mean`; `/` may be approximate)."""
    s = tl.sum(v, axis=1)
    return tl.math.div_rn(s, tl.zeros_like(s) + K)


@triton.jit
def _gamma(w_ptr, cols, cmask, W_BF16: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    g = _load_f32(w_ptr, cols, cmask, W_BF16)
    if ZERO_CENTERED:
        g = g + 1.0
    return g[None, :]


@triton.jit
def _write_y(x, mu, rs, y_ptr, offs, mask, w_ptr, b_ptr, cols, cmask,
             ZERO_CENTERED: tl.constexpr, HAS_BIAS: tl.constexpr, W_BF16: tl.constexpr,
             B_BF16: tl.constexpr, OUT: tl.constexpr, SOFT: tl.constexpr):
    """Store y = ((x - mu) * rs) * gamma (+ beta) in the output dtype; return |y| bits of the
    stored values (0 on masked lanes and where y is inf or NaN)."""
    y = (x - mu[:, None]) * rs[:, None] * _gamma(w_ptr, cols, cmask, W_BF16, ZERO_CENTERED)
    if HAS_BIAS:
        y = y + _load_f32(b_ptr, cols, cmask, B_BF16)[None, :]
    q = round_out(y, OUT, SOFT)
    tl.store(y_ptr + offs, q, mask=mask)
    if OUT == 1:
        stored = to_f32(q, True)
    else:
        stored = q.to(tl.float32)
    return tl.where(mask, finite_abs_bits(stored), 0)


@fast_launch
@triton.jit
def _fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mu_ptr, rs_ptr, amax_ptr, M, K, eps,
                RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_BIAS: tl.constexpr,
                AMAX: tl.constexpr, X_BF16: tl.constexpr, W_BF16: tl.constexpr, B_BF16: tl.constexpr,
                OUT: tl.constexpr, SOFT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                NCHUNK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK)
    if NCHUNK == 1:  # the row stays in registers
        cmask = cols < K
        mask = rmask[:, None] & cmask[None, :]
        x = _load_f32(x_ptr, base + cols[None, :], mask, X_BF16)
        if RMS:
            mu = tl.zeros([ROWS], tl.float32)
            var = _row_mean(x * x, K)
        else:
            mu = _row_mean(x, K)
            d = tl.where(mask, x - mu[:, None], 0.0)
            var = _row_mean(d * d, K)
    else:  # two passes over the chunks for the statistics (a third writes y)
        mu = tl.zeros([ROWS], tl.float32)
        if not RMS:
            s = tl.zeros([ROWS, BLOCK], tl.float32)
            for c in range(NCHUNK):
                ccols = c * BLOCK + cols
                s += _load_f32(x_ptr, base + ccols[None, :], rmask[:, None] & (ccols < K)[None, :], X_BF16)
            mu = _row_mean(s, K)
        s = tl.zeros([ROWS, BLOCK], tl.float32)
        for c in range(NCHUNK):
            ccols = c * BLOCK + cols
            mask = rmask[:, None] & (ccols < K)[None, :]
            d = tl.where(mask, _load_f32(x_ptr, base + ccols[None, :], mask, X_BF16) - mu[:, None], 0.0)
            s += d * d
        var = _row_mean(s, K)
    rs = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.math.sqrt_rn(var + tl.cast(eps, tl.float32)))
    tl.store(mu_ptr + rows, mu, mask=rmask)
    tl.store(rs_ptr + rows, rs, mask=rmask)

    if NCHUNK == 1:
        amax = _write_y(x, mu, rs, y_ptr, base + cols[None, :], mask, w_ptr, b_ptr, cols, cmask,
                        ZERO_CENTERED, HAS_BIAS, W_BF16, B_BF16, OUT, SOFT)
    else:
        amax = tl.zeros([ROWS, BLOCK], tl.int32)
        for c in range(NCHUNK):
            ccols = c * BLOCK + cols
            cmask = ccols < K
            mask = rmask[:, None] & cmask[None, :]
            x = _load_f32(x_ptr, base + ccols[None, :], mask, X_BF16)
            amax = tl.maximum(amax, _write_y(x, mu, rs, y_ptr, base + ccols[None, :], mask, w_ptr, b_ptr,
                                             ccols, cmask, ZERO_CENTERED, HAS_BIAS, W_BF16, B_BF16, OUT,
                                             SOFT))
    if AMAX:
        m = tl.max(tl.max(amax, axis=1), axis=0)
        cur = tl.load(amax_ptr)  # a stale read only under-estimates: skip the atomic when m <= it
        tl.atomic_max(amax_ptr, m, mask=m > cur, sem="relaxed")


@triton.jit
def _dx(xhat, dxhat, rs, proj, mdx, RMS: tl.constexpr):
    """dx in the reference's op order, from the row means proj = <dxhat * xhat>, mdx = <dxhat>."""
    if RMS:
        dx = dxhat - xhat * proj[:, None]
    else:
        dx = dxhat - mdx[:, None] - xhat * proj[:, None]
    return dx * rs[:, None]


@fast_launch
@triton.jit
def _bwd_kernel(dy_ptr, x_ptr, mu_ptr, rs_ptr, w_ptr, dx_ptr, dw_ptr, db_ptr, M, K,
                RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_BIAS: tl.constexpr,
                DY_BF16: tl.constexpr, X_BF16: tl.constexpr, W_BF16: tl.constexpr,
                OUT: tl.constexpr, SOFT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                NCHUNK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    row0 = pid * (ITERS * ROWS)  # this program's ITERS row tiles
    part = pid.to(tl.int64) * K  # this program's row of the (programs, K) partial sums
    cols = tl.arange(0, BLOCK)
    if NCHUNK == 1:
        cmask = cols < K
        g = _gamma(w_ptr, cols, cmask, W_BF16, ZERO_CENTERED)
        dw = tl.zeros([ROWS, BLOCK], tl.float32)
        db = tl.zeros([ROWS, BLOCK], tl.float32)
        for i in range(ITERS):
            rows = row0 + i * ROWS + tl.arange(0, ROWS)
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
            dy = _load_f32(dy_ptr, offs, mask, DY_BF16)
            x = _load_f32(x_ptr, offs, mask, X_BF16)
            mu = tl.load(mu_ptr + rows, mask=rmask, other=0.0)
            rs = tl.load(rs_ptr + rows, mask=rmask, other=0.0)
            xhat = (x - mu[:, None]) * rs[:, None]
            dxhat = dy * g
            proj = _row_mean(dxhat * xhat, K)
            mdx = _row_mean(dxhat, K)
            dx = _dx(xhat, dxhat, rs, proj, mdx, RMS)
            tl.store(dx_ptr + offs, round_out(dx, OUT, SOFT), mask=mask)
            dw += dy * xhat  # masked lanes: dy = 0, xhat finite
            db += dy
        tl.store(dw_ptr + part + cols, tl.sum(dw, axis=0), mask=cmask)
        if HAS_BIAS:
            tl.store(db_ptr + part + cols, tl.sum(db, axis=0), mask=cmask)
    else:  # per row tile: one pass for the two projections, one for dx and the partial sums
        for i in range(ITERS):
            rows = row0 + i * ROWS + tl.arange(0, ROWS)
            rmask = rows < M
            base = rows.to(tl.int64)[:, None] * K
            mu = tl.load(mu_ptr + rows, mask=rmask, other=0.0)
            rs = tl.load(rs_ptr + rows, mask=rmask, other=0.0)
            s_proj = tl.zeros([ROWS, BLOCK], tl.float32)
            s_dx = tl.zeros([ROWS, BLOCK], tl.float32)
            for c in range(NCHUNK):
                ccols = c * BLOCK + cols
                cmask = ccols < K
                mask = rmask[:, None] & cmask[None, :]
                xhat = (_load_f32(x_ptr, base + ccols[None, :], mask, X_BF16) - mu[:, None]) * rs[:, None]
                dxhat = _load_f32(dy_ptr, base + ccols[None, :], mask, DY_BF16) * _gamma(
                    w_ptr, ccols, cmask, W_BF16, ZERO_CENTERED)
                s_proj += dxhat * xhat
                s_dx += dxhat
            proj = _row_mean(s_proj, K)
            mdx = _row_mean(s_dx, K)
            # the partial row is read back by the threads that hold it in the sum's layout, which
            # may not be those that stored it last tile (replicas): make those stores visible
            tl.debug_barrier()
            for c in range(NCHUNK):
                ccols = c * BLOCK + cols
                cmask = ccols < K
                mask = rmask[:, None] & cmask[None, :]
                dy = _load_f32(dy_ptr, base + ccols[None, :], mask, DY_BF16)
                x = _load_f32(x_ptr, base + ccols[None, :], mask, X_BF16)
                xhat = (x - mu[:, None]) * rs[:, None]
                dx = _dx(xhat, dy * _gamma(w_ptr, ccols, cmask, W_BF16, ZERO_CENTERED), rs, proj, mdx, RMS)
                tl.store(dx_ptr + base + ccols[None, :], round_out(dx, OUT, SOFT), mask=mask)
                # read-modify-write of this program's own partial row: no other program touches it
                pw = dw_ptr + part + ccols
                tl.store(pw, tl.load(pw, mask=cmask, other=0.0) + tl.sum(dy * xhat, axis=0), mask=cmask)
                if HAS_BIAS:
                    pb = db_ptr + part + ccols
                    tl.store(pb, tl.load(pb, mask=cmask, other=0.0) + tl.sum(dy, axis=0), mask=cmask)


def _usable(inp: torch.Tensor) -> bool:
    return inp.numel() > 0


def _run_fwd(inp, weight, bias, eps, normalization, zero_centered_gamma, with_amax):
    _ref.check_norm_args(inp, weight, bias, normalization)
    k = inp.shape[-1]
    m = inp.numel() // k
    x = inp.contiguous()
    y, y_k = out_buffer(inp.shape, inp.dtype, inp.device)
    mu = torch.empty(inp.shape[:-1], dtype=torch.float32, device=inp.device)
    rsigma = torch.empty_like(mu)
    amax = zeros(1, inp, torch.int32)
    xk, x_bf16 = as_kernel_input(x)
    wk, w_bf16 = as_kernel_input(weight.contiguous())
    bk, b_bf16 = as_kernel_input(bias.contiguous()) if bias is not None else (wk, False)
    cfg = _tile(k, CONFIG["fwd"])
    _fwd_kernel[(cdiv(m, cfg["ROWS"]),)](
        xk, wk, bk, y_k, mu, rsigma, amax, m, k, float(eps),
        RMS=normalization == "RMSNorm", ZERO_CENTERED=bool(zero_centered_gamma), HAS_BIAS=bias is not None,
        AMAX=bool(with_amax), X_BF16=x_bf16, W_BF16=w_bf16, B_BF16=b_bf16, OUT=OUT_KIND[inp.dtype],
        SOFT=soft_cast(), enable_fp_fusion=False, **cfg)
    return y, mu, rsigma, amax.view(torch.float32)


@triton_kernel("norm_fwd")
def norm_fwd(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool):
    """(y in inp.dtype, mu fp32, rsigma fp32); mu and rsigma have shape inp.shape[:-1]."""
    if not _usable(inp):
        return _ref.norm_fwd(inp, weight, bias, eps, normalization, zero_centered_gamma)
    return _run_fwd(inp, weight, bias, eps, normalization, zero_centered_gamma, False)[:3]


@triton_kernel("norm_fwd_amax")
def norm_fwd_amax(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool):
    """(y, mu, rsigma, amax): the norm plus max |y| over the finite values of y as stored (fp32 (1,))."""
    if not _usable(inp):
        return _ref.norm_fwd_amax(inp, weight, bias, eps, normalization, zero_centered_gamma)
    return _run_fwd(inp, weight, bias, eps, normalization, zero_centered_gamma, True)


@triton_kernel("norm_bwd")
def norm_bwd(grad_out, inp, mu, rsigma, weight, normalization: str, zero_centered_gamma: bool, has_bias: bool):
    """[dx, dgamma] (+ [dbeta] with a bias); dgamma / dbeta in weight.dtype."""
    if not _usable(inp):
        return _ref.norm_bwd(grad_out, inp, mu, rsigma, weight, normalization, zero_centered_gamma, has_bias)
    _ref.check_norm_args(inp, weight, None, normalization)
    if grad_out.shape != inp.shape or grad_out.dtype not in _ref.NORM_DTYPES:
        raise ValueError(f"norm_bwd: grad_out {tuple(grad_out.shape)} {grad_out.dtype} does not match "
                         f"input {tuple(inp.shape)}")
    k = inp.shape[-1]
    m = inp.numel() // k
    cfg = _tile(k, CONFIG["bwd"])
    # a power-of-two count of row tiles per program (a constexpr: one compile per bucket of M)
    tiles = cdiv(m, cfg["ROWS"])
    iters = next_power_of_2(cdiv(tiles, CONFIG["bwd"]["MAX_PROGRAMS"]))
    programs = cdiv(tiles, iters)
    new = torch.empty if cfg["NCHUNK"] == 1 else torch.zeros  # the chunked path accumulates in place
    dw = new((programs, k), dtype=torch.float32, device=inp.device)
    db = new((programs, k), dtype=torch.float32, device=inp.device) if has_bias else dw
    dx, dx_k = out_buffer(inp.shape, inp.dtype, inp.device)
    dyk, dy_bf16 = as_kernel_input(grad_out.contiguous())
    xk, x_bf16 = as_kernel_input(inp.contiguous())
    wk, w_bf16 = as_kernel_input(weight.contiguous())
    _bwd_kernel[(programs,)](
        dyk, xk, mu.contiguous(), rsigma.contiguous(), wk, dx_k, dw, db, m, k,
        RMS=normalization == "RMSNorm", ZERO_CENTERED=bool(zero_centered_gamma), HAS_BIAS=bool(has_bias),
        DY_BF16=dy_bf16, X_BF16=x_bf16, W_BF16=w_bf16, OUT=OUT_KIND[inp.dtype], SOFT=soft_cast(),
        ITERS=iters, enable_fp_fusion=False, **cfg)
    grads = [dx, dw.sum(0).to(weight.dtype)]
    if has_bias:
        grads.append(db.sum(0).to(weight.dtype))
    return grads


@triton_kernel("norm_fp8_current_quantize")
def norm_fp8_current_quantize(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool,
                              fp8_dtype, rowwise: bool, columnwise: bool, margin: int = 0,
                              power_2: bool = False, epsilon: float = 0.0):
    """(y, mu, rsigma, data, transpose, scale_inv, amax): the norm writes y and its amax, the cast
    kernel reads that amax (no separate amax pass over y)."""
    fp8_params(fp8_dtype)
    y, mu, rsigma, amax = norm_fwd_amax(inp, weight, bias, eps, normalization, zero_centered_gamma)
    y2d = y.reshape(-1, y.shape[-1])
    if not _f8._fits(y2d):  # what the unfused quantize of y would do for this shape
        data, transpose, scale_inv, amax = _f8.fp8_quantize_current(y2d, fp8_dtype, rowwise, columnwise,
                                                                     margin, power_2, epsilon)
    else:
        data, transpose, scale_inv = _f8._launch_cast(
            y2d, fp8_dtype, rowwise, columnwise, amax=amax, current=True,
            margin=margin, power_2=power_2, epsilon=epsilon)
    return y, mu, rsigma, data, transpose, scale_inv, amax
