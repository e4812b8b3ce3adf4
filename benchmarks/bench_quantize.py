"""Quantize kernels as a fraction of device-to-device copy bandwidth: reference (torch eager) vs
Triton, one row per format, at 8192x8192 bf16 by default.

    python benchmarks/bench_quantize.py                 # table (+ PNG bar chart if matplotlib)
    python benchmarks/bench_quantize.py --sweep         # also try launch configs of each kernel
    python benchmarks/bench_quantize.py --shape 4096 8192 --out /tmp/res

Bytes counted: x read once plus every output buffer written once (data, transpose or
columnwise copy, scales). Current scaling necessarily reads x twice (amax pass, then cast
pass); its row also shows the fraction with that second read counted ("2-pass"). The copy
ceiling is a `torch` device-to-device copy of a buffer of the same bytes (half read, half
written). Times are `triton.testing.do_bench` medians. Each Triton result is first checked
bitwise against the reference on the same input (the LayerNorm rows: to about one ulp, "close").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformer_engine_proto.kernels.reference import blockwise as ref_bw  # noqa: E402
from transformer_engine_proto.kernels.reference import float8 as ref_f8  # noqa: E402
from transformer_engine_proto.kernels.reference import mxfp8 as ref_mx  # noqa: E402
from transformer_engine_proto.kernels.reference import norm as ref_norm  # noqa: E402
from transformer_engine_proto.kernels.reference import nvfp4 as ref_nv  # noqa: E402
from transformer_engine_proto.kernels.reference import nvfp4_to as ref_nv_to  # noqa: E402

E4M3 = torch.float8_e4m3fn


def nbytes(outs):
    return sum(t.untyped_storage().nbytes() for t in outs if isinstance(t, torch.Tensor))


def same_bits(a, b):
    for x, y in zip(a, b):
        if x is None or y is None:
            if (x is None) != (y is None):
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype or x.stride() != y.stride():
            return False
        xb = x.view(torch.uint8) if x.dtype.itemsize == 1 else x.view(torch.int32)
        yb = y.view(torch.uint8) if y.dtype.itemsize == 1 else y.view(torch.int32)
        if not torch.equal(xb, yb):
            return False
    return True


def bench(fn, warmup=25, rep=100):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median") * 1e-3  # s


def copy_time(total_bytes, device):
    n = max(1, total_bytes // 2)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return bench(lambda: dst.copy_(src)), 2 * n


def _fn(tri, mod, name):
    """tri[mod].name, or None without the triton backend."""
    return getattr(tri[mod], name) if tri and mod in tri else None


def cases(x, tri):
    """(name, reference fn, triton fn or None, extra bytes read by the implementation, bytes of
    the input when it is not x)."""
    scale = torch.tensor([0.37], device=x.device)
    amax_ref, amax_tri = torch.zeros(1, device=x.device), torch.zeros(1, device=x.device)
    xb = x.numel() * x.element_size()
    out = [
        ("amax", lambda: (ref_f8.amax(x),), (lambda: (tri["f8"].amax(x),)) if tri else None, 0),
        ("fp8 delayed rw+cw (cast+transpose)",
         lambda: ref_f8.fp8_quantize_delayed(x, scale, amax_ref, E4M3, True, True),
         (lambda: tri["f8"].fp8_quantize_delayed(x, scale, amax_tri, E4M3, True, True)) if tri else None, 0),
        # ablation: the transposed store alone (plus the amax pass a transpose takes), against rw+cw
        ("fp8 delayed cw (transpose only)",
         lambda: ref_f8.fp8_quantize_delayed(x, scale, amax_ref, E4M3, False, True),
         (lambda: tri["f8"].fp8_quantize_delayed(x, scale, amax_tri, E4M3, False, True)) if tri else None, 0),
        ("fp8 delayed rw",
         lambda: ref_f8.fp8_quantize_delayed(x, scale, amax_ref, E4M3, True, False),
         (lambda: tri["f8"].fp8_quantize_delayed(x, scale, amax_tri, E4M3, True, False)) if tri else None, 0),
        ("fp8 current rw+cw",
         lambda: ref_f8.fp8_quantize_current(x, E4M3, True, True),
         (lambda: tri["f8"].fp8_quantize_current(x, E4M3, True, True)) if tri else None, xb),
        ("fp8 current rw",
         lambda: ref_f8.fp8_quantize_current(x, E4M3, True, False),
         (lambda: tri["f8"].fp8_quantize_current(x, E4M3, True, False)) if tri else None, xb),
        ("blockwise 1x128 rw+cw",
         lambda: ref_bw.fp8_blockwise_quantize(x, E4M3, 1, True, True),
         (lambda: tri["bw"].fp8_blockwise_quantize(x, E4M3, 1, True, True)) if tri else None, 0),
        ("blockwise 1x128 rw",
         lambda: ref_bw.fp8_blockwise_quantize(x, E4M3, 1, True, False),
         (lambda: tri["bw"].fp8_blockwise_quantize(x, E4M3, 1, True, False)) if tri else None, 0),
        ("blockwise 128x128 rw+cw",
         lambda: ref_bw.fp8_blockwise_quantize(x, E4M3, 2, True, True),
         (lambda: tri["bw"].fp8_blockwise_quantize(x, E4M3, 2, True, True)) if tri else None, 0),
        ("mxfp8 rw+cw",
         lambda: ref_mx.mxfp8_quantize(x, E4M3, True, True),
         (lambda: tri["mx"].mxfp8_quantize(x, E4M3, True, True)) if tri else None, 0),
        ("mxfp8 rw",
         lambda: ref_mx.mxfp8_quantize(x, E4M3, True, False),
         (lambda: tri["mx"].mxfp8_quantize(x, E4M3, True, False)) if tri else None, 0),
    ]
    # dequantize (the emulated MXFP8 / NVFP4 GEMM on Hopper): quantized buffers in, bf16 out
    mx_data, mx_scale = ref_mx.mxfp8_quantize(x, E4M3, True, False)[:2]
    mx_dq = _fn(tri, "dq", "mxfp8_dequantize")
    out.append(("mxfp8 dequantize -> bf16",
                lambda: (ref_mx.mxfp8_dequantize(mx_data, mx_scale, False, torch.bfloat16),),
                (lambda: (mx_dq(mx_data, mx_scale, False, torch.bfloat16),)) if mx_dq else None, 0,
                nbytes((mx_data, mx_scale))))
    # NVFP4: the amax pass is a second read of x (like current scaling)
    nv_q = _fn(tri, "nv", "nvfp4_quantize")
    for label, kw in (("nvfp4 rw", dict(rowwise=True, columnwise=False)),
                      ("nvfp4 rw+cw (RHT cw)", dict(rowwise=True, columnwise=True, rht=True)),
                      ("nvfp4 2D rw+cw (weight)", dict(rowwise=True, columnwise=True, two_d=True))):
        out.append((label, (lambda kw=kw: ref_nv.nvfp4_quantize(x, **kw)),
                    (lambda kw=kw: nv_q(x, **kw)) if nv_q else None, xb))
    nv = ref_nv.nvfp4_quantize(x, True, False)
    nv_dq = _fn(tri, "nv", "nvfp4_dequantize_to")
    nv_args = (nv[0], nv[1], nv[4], None, None, None)
    out.append(("nvfp4 dequantize -> bf16",
                lambda: (ref_nv_to.nvfp4_dequantize_to(*nv_args, dtype=torch.bfloat16),),
                (lambda: (nv_dq(*nv_args, dtype=torch.bfloat16),)) if nv_dq else None, 0,
                nbytes((nv[0], nv[1], nv[4]))))
    out += norm_cases(x, tri)
    return out


def norm_cases(x, tri):
    """LayerNorm rows (x (M, K), gamma, beta): forward, forward + amax, forward fused with current
    scaling (its 2-pass column counts the cast pass re-reading y), backward (input: dy, x, mu,
    rsigma). Not bitwise the reference (row sums in another order): checked for closeness."""
    tn = tri.get("norm") if tri else None
    w = torch.randn(x.shape[-1], device=x.device, dtype=x.dtype)
    b = torch.randn_like(w)
    args = (x, w, b, 1e-5, "LayerNorm", False)
    y, mu, rs = ref_norm.norm_fwd(*args)
    bwd = (torch.randn_like(x), x, mu, rs, w, "LayerNorm", False, True)
    xb = x.numel() * x.element_size()
    return [
        ("layernorm fwd", lambda: ref_norm.norm_fwd(*args), (lambda: tn.norm_fwd(*args)) if tn else None, 0),
        ("layernorm fwd + amax", lambda: ref_norm.norm_fwd_amax(*args),
         (lambda: tn.norm_fwd_amax(*args)) if tn else None, 0),
        ("layernorm + fp8 current rw+cw", lambda: ref_norm.norm_fp8_current_quantize(*args, E4M3, True, True),
         (lambda: tn.norm_fp8_current_quantize(*args, E4M3, True, True)) if tn else None, xb),
        ("layernorm bwd", lambda: ref_norm.norm_bwd(*bwd), (lambda: tn.norm_bwd(*bwd)) if tn else None, 0,
         nbytes(bwd[:4])),
    ]


def close(a, b):
    """The first outputs (y or dx) agree to about one ulp of their dtype."""
    eps = torch.finfo(a[0].dtype).eps
    return torch.allclose(a[0].float(), b[0].float(), rtol=2 * eps, atol=2 * eps)


def clear_plans():
    """Forget the Triton entry points' recorded launch plans: they replay the launch config they
    were recorded with (`kernels/triton/launch.py`)."""
    from transformer_engine_proto.kernels.triton.launch import clear_plans as clear

    clear()


def with_config(table, key, value, fn):
    """fn run with table[key] = value (to time a kernel that a newer one replaced by default)."""
    def run():
        saved = table[key]
        table[key] = value
        clear_plans()  # a plan replays the config it was recorded with
        try:
            return fn()
        finally:
            table[key] = saved
            clear_plans()
    return run


def sweep(x, tri, log):
    """Try launch configs of each Triton kernel; set the best into the modules' CONFIG and
    return {kernel: (best config, seconds)}."""
    f8, bw, mx = tri["f8"], tri["bw"], tri["mx"]
    scale = torch.tensor([0.37], device=x.device)
    amax = torch.zeros(1, device=x.device)
    plans = [
        ("f8.amax", f8.CONFIG, "amax", lambda: f8.amax(x),
         [dict(BLOCK=b, num_warps=w) for b in (4096, 8192, 16384, 32768) for w in (4, 8, 16)]),
        ("f8.cast", f8.CONFIG, "cast",
         with_config(f8.CONFIG, "pack_transpose", False,
                     lambda: f8.fp8_quantize_delayed(x, scale, amax, E4M3, True, True)),
         [dict(BM=bm, BK=bk, num_warps=w) for bm, bk in ((64, 64), (64, 128), (128, 64), (128, 128),
                                                         (64, 256), (256, 64), (32, 128))
          for w in (4, 8)]),
        ("f8.cast_packed", f8.CONFIG, "cast_packed",
         lambda: f8.fp8_quantize_delayed(x, scale, amax, E4M3, True, True),
         [dict(BM=bm, BK=bk, num_warps=w) for bm, bk in ((32, 128), (64, 64), (64, 128), (128, 64),
                                                         (128, 128), (256, 64), (64, 256), (128, 256))
          for w in (4, 8)]),
        ("f8.cast_rowwise", f8.CONFIG, "cast_rowwise",
         lambda: f8.fp8_quantize_delayed(x, scale, amax, E4M3, True, False),
         [dict(BM=bm, BK=bk, num_warps=w) for bm, bk in ((16, 512), (32, 256), (64, 256), (64, 128),
                                                         (8, 1024)) for w in (4, 8)]),
        ("bw.1x128 rw+cw", bw.CONFIG, (1, True, True), lambda: bw.fp8_blockwise_quantize(x, E4M3, 1, True, True),
         [dict(BM=128, BK=128, CH=ch, num_warps=w) for ch in (16, 32, 64, 128) for w in (4, 8)]),
        ("bw.1x128 rw", bw.CONFIG, (1, True, False), lambda: bw.fp8_blockwise_quantize(x, E4M3, 1, True, False),
         [dict(BM=bm, BK=128, num_warps=w) for bm in (16, 32, 64, 128) for w in (4, 8)]),
        ("bw.1x128 cw", bw.CONFIG, (1, False, True), lambda: bw.fp8_blockwise_quantize(x, E4M3, 1, False, True),
         [dict(BM=128, BK=bk, num_warps=w) for bk in (32, 64, 128) for w in (4, 8)]),
        ("bw.128x128 rw+cw", bw.CONFIG, (2, True, True), lambda: bw.fp8_blockwise_quantize(x, E4M3, 2, True, True),
         [dict(BM=128, BK=128, CH=ch, num_warps=w) for ch in (16, 32, 64, 128) for w in (4, 8)]),
        ("mx rw+cw", mx.CONFIG, (True, True),
         with_config(mx.CONFIG, "quarters", False, lambda: mx.mxfp8_quantize(x, E4M3, True, True)),
         [dict(MB=a, NB=b, num_warps=w) for a in (1, 2, 4) for b in (2, 4, 8) for w in (4, 8)]),
        ("mx quarters rw+cw", mx.CONFIG, "quarters", lambda: mx.mxfp8_quantize(x, E4M3, True, True),
         [dict(NB=b, num_warps=w) for b in (1, 2, 4, 8) for w in (1, 2, 4, 8)]),
        ("mx rw", mx.CONFIG, (True, False), lambda: mx.mxfp8_quantize(x, E4M3, True, False),
         [dict(MB=a, NB=b, num_warps=w) for a in (1, 2, 4) for b in (2, 4, 8) for w in (4, 8)]),
    ]
    best = {}
    for name, table, key, fn, candidates in plans:
        results = []
        for cfg in candidates:
            table[key] = cfg
            clear_plans()
            try:
                t = bench(fn, warmup=10, rep=40)
            except Exception as e:  # e.g. out of shared memory / registers for a big tile
                log(f"  {name} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            results.append((t, cfg))
            log(f"  {name} {cfg}: {t * 1e6:8.1f} us")
        t, cfg = min(results, key=lambda r: r[0])
        table[key] = cfg
        clear_plans()
        best[name] = (cfg, t)
        log(f"best {name}: {cfg} {t * 1e6:.1f} us")
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=2, default=(8192, 8192))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sweep", action="store_true", help="try launch configs of each Triton kernel first")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the torch reference")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for JSON and PNG")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quantize: needs a CUDA GPU")
        return 0
    dev = torch.device("cuda")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_lines = []

    def log(s):
        print(s, flush=True)
        log_lines.append(s)

    try:
        from transformer_engine_proto.kernels.triton import blockwise as tbw
        from transformer_engine_proto.kernels.triton import float8 as tf8
        from transformer_engine_proto.kernels.triton import mxfp8 as tmx
        tri = {"f8": tf8, "bw": tbw, "mx": tmx}
        try:  # the NVFP4 and dequantize kernels
            from transformer_engine_proto.kernels.triton import dequant as tdq
            from transformer_engine_proto.kernels.triton import nvfp4 as tnv
            tri.update(dq=tdq, nv=tnv)
        except ImportError as e:
            log(f"no NVFP4 / dequantize Triton kernels ({e})")
        try:
            from transformer_engine_proto.kernels.triton import norm as tnorm
            tri.update(norm=tnorm)
        except ImportError as e:
            log(f"no norm Triton kernels ({e})")
    except ImportError as e:
        log(f"triton backend unavailable ({e}); timing the reference only")
        tri = None

    torch.manual_seed(0)
    x = torch.randn(*args.shape, device=dev, dtype=getattr(torch, args.dtype))
    log(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
        f"x: {tuple(x.shape)} {x.dtype}")
    if tri and args.sweep:
        log("sweeping launch configs ...")
        best = sweep(x, tri, log)
        log("best configs (paste into the modules' CONFIG):")
        for name, (cfg, t) in best.items():
            log(f"  {name}: {cfg}   # {t * 1e6:.1f} us")

    xb = x.numel() * x.element_size()
    rows = []
    for name, ref_fn, tri_fn, extra_read, *in_bytes in cases(x, tri):
        ref_out = ref_fn()
        moved = (in_bytes[0] if in_bytes else xb) + nbytes(ref_out)
        t_copy, copy_bytes = copy_time(moved, dev)
        copy_bw = copy_bytes / t_copy
        row = dict(name=name, bytes=moved, copy_GBps=copy_bw / 1e9)
        if not args.no_reference:
            t = bench(ref_fn)
            row.update(ref_us=t * 1e6, ref_GBps=moved / t / 1e9, ref_frac=moved / t / copy_bw)
        if tri_fn is not None:
            tri_out = tri_fn()
            if name.startswith("layernorm"):
                ok = "close" if close(tri_out, ref_out) else False
            else:
                ok = same_bits(tri_out, ref_out) if name != "amax" else torch.equal(
                    tri_out[0].view(torch.int32), ref_out[0].view(torch.int32))
            t = bench(tri_fn)
            row.update(tri_us=t * 1e6, tri_GBps=moved / t / 1e9, tri_frac=moved / t / copy_bw,
                       tri_frac_2pass=(moved + extra_read) / t / copy_bw if extra_read else None,
                       bitwise=ok)
        rows.append(row)
        del ref_out

    hdr = (f"{'kernel':36s} {'MB':>7s} {'copy GB/s':>9s} | {'ref us':>8s} {'GB/s':>7s} {'frac':>5s} | "
           f"{'triton us':>9s} {'GB/s':>7s} {'frac':>5s} {'2-pass':>6s} {'bitwise':>7s}")
    log("")
    log(hdr)
    log("-" * len(hdr))
    for r in rows:
        def f(k, fmt, r=r):
            v = r.get(k)
            return format(v, fmt) if v is not None else "-"
        log(f"{r['name']:36s} {r['bytes'] / 2**20:7.1f} {r['copy_GBps']:9.0f} | "
            f"{f('ref_us', '8.1f'):>8s} {f('ref_GBps', '7.0f'):>7s} {f('ref_frac', '5.2f'):>5s} | "
            f"{f('tri_us', '9.1f'):>9s} {f('tri_GBps', '7.0f'):>7s} {f('tri_frac', '5.2f'):>5s} "
            f"{f('tri_frac_2pass', '6.2f'):>6s} {str(r.get('bitwise', '-')):>7s}")

    (out_dir / "bench_quantize.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name(), shape=list(args.shape), dtype=args.dtype, rows=rows,
        configs=({k: {str(kk): vv for kk, vv in m.CONFIG.items()} for k, m in tri.items()} if tri else None),
    ), indent=2))
    (out_dir / "bench_quantize.log").write_text("\n".join(log_lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not importable: no plot")
        return 0
    names = [r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(11, 5))
    w = 0.4
    pos = range(len(rows))
    ax.bar([p - w / 2 for p in pos], [r.get("ref_frac", 0) or 0 for r in rows], w, label="reference (torch eager)")
    ax.bar([p + w / 2 for p in pos], [r.get("tri_frac", 0) or 0 for r in rows], w, label="triton")
    ax.axhline(0.85, color="gray", linestyle="--", linewidth=1, label="85% of copy")
    ax.set_xticks(list(pos))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fraction of D2D copy bandwidth")
    ax.set_title(f"quantize {tuple(args.shape)} {args.dtype} on {torch.cuda.get_device_name()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "bench_quantize.png", dpi=120)
    log(f"wrote {out_dir / 'bench_quantize.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
