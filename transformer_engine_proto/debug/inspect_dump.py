"""Offline analysis of DumpTensors files: per-tensor quantization error tables and histograms.

    python -m transformer_engine_proto.debug.inspect_dump PATH [PATH ...] [--hist] [--bins 40]
                                                          [--plot-dir DIR] [--usage rowwise|columnwise]

PATH is a dump file or a directory (searched recursively for `*_iter_*.pt`). For every dump with a
high-precision tensor and a quantized one (the `quantized` values, or rebuilt from
`quantized_internals`) it prints amax, max/mean absolute error, RMSE, relative L2 error, SQNR (dB),
underflows (non-zero values quantized to 0) and whether the internals rebuild `quantized` exactly.
`--hist` prints a text histogram of log10 |error|; `--plot-dir` writes one PNG histogram per dump
(needs matplotlib).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Dict, List, Optional

import torch

from .quant_view import reconstruct

__all__ = ["find_dumps", "error_stats", "main"]

COLUMNS = ("file", "format", "shape", "amax", "max_abs_err", "mean_abs_err", "rmse", "rel_l2_err", "sqnr_db",
           "underflow%", "rebuild")


def find_dumps(paths: List[str]) -> List[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                out += [os.path.join(root, f) for f in files if f.endswith(".pt") and "_iter_" in f]
        elif os.path.isfile(p):
            out.append(p)
        else:
            raise FileNotFoundError(f"no such dump file or directory: {p}")
    return sorted(out)


def _quantized(d: Dict, usage: Optional[str]):
    """(quantized values, 'ok'/'MISMATCH'/'-' for the internals rebuild check)."""
    q = d.get("quantized")
    internals = d.get("quantized_internals")
    if internals is None:
        return q, "-"
    rebuilt = reconstruct(internals, usage)
    if q is None:
        return rebuilt, "-"
    if usage not in (None, "rowwise") and "rowwise_data" in internals:
        return rebuilt, "-"
    return q, "ok" if torch.equal(rebuilt.float(), q.float()) else "MISMATCH"


def error_stats(hp: torch.Tensor, q: torch.Tensor) -> Dict[str, float]:
    hp, q = hp.double().reshape(-1), q.double().reshape(-1)
    err = q - hp
    n = max(hp.numel(), 1)
    sig, noise = float((hp * hp).sum()), float((err * err).sum())
    return {
        "amax": float(hp.abs().max()) if hp.numel() else 0.0,
        "max_abs_err": float(err.abs().max()) if hp.numel() else 0.0,
        "mean_abs_err": float(err.abs().sum()) / n,
        "rmse": math.sqrt(noise / n),
        "rel_l2_err": math.sqrt(noise / sig) if sig > 0 else float("nan"),
        "sqnr_db": 10 * math.log10(sig / noise) if noise > 0 and sig > 0 else float("inf"),
        "underflow%": 100.0 * float(((hp != 0) & (q == 0)).sum()) / n,
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _text_hist(err: torch.Tensor, bins: int) -> str:
    e = err.double().abs().reshape(-1)
    zero = int((e == 0).sum())
    e = e[e > 0]
    lines = [f"    exact (error 0): {zero}"]
    if e.numel():
        lg = e.log10()
        lo, hi = float(lg.min()), float(lg.max())
        hi = lo + 1e-9 if hi <= lo else hi
        counts = torch.histc(lg, bins=bins, min=lo, max=hi)
        peak = float(counts.max())
        for i, c in enumerate(counts.tolist()):
            left = lo + (hi - lo) * i / bins
            lines.append(f"    1e{left:+6.2f} | {'#' * int(round(40 * c / peak)) if peak else ''} {int(c)}")
    return "\n".join(lines)


def _plot(path: str, err: torch.Tensor, bins: int, out_dir: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.hist(err.double().reshape(-1).numpy(), bins=bins)
    ax.set_title(os.path.basename(path))
    ax.set_xlabel("quantized - high precision")
    ax.set_yscale("log")
    out = os.path.join(out_dir, os.path.basename(path)[:-3] + "_error_hist.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m transformer_engine_proto.debug.inspect_dump", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--hist", action="store_true", help="print a text histogram of log10 |error| per dump")
    ap.add_argument("--bins", type=int, default=20)
    ap.add_argument("--plot-dir", default=None, help="write PNG error histograms here (needs matplotlib)")
    ap.add_argument("--usage", choices=("rowwise", "columnwise"), default=None,
                    help="which quantized usage to compare (rebuilt from the internals)")
    args = ap.parse_args(argv)
    rows, details = [], []
    for path in find_dumps(args.paths):
        d = torch.load(path, weights_only=True)
        hp = d.get("high_precision")
        q, rebuild = _quantized(d, args.usage)
        ref = hp if hp is not None else q
        row = {"file": os.path.basename(path), "format": d.get("format", "-"),
               "shape": "x".join(str(s) for s in ref.shape) if ref is not None else "-", "rebuild": rebuild}
        if hp is not None and q is not None:
            row.update(error_stats(hp, q))
            details.append((path, (q.double() - hp.double())))
        rows.append(row)
    if not rows:
        print("no dumps found", file=sys.stderr)
        return 1
    table = [[_fmt(r.get(c, "-")) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
    for path, err in details:
        if args.hist:
            print(f"\n{os.path.basename(path)}: log10 |quantized - high precision|")
            print(_text_hist(err, args.bins))
        if args.plot_dir:
            try:
                print(f"wrote {_plot(path, err, args.bins, args.plot_dir)}")
            except ImportError:
                print("--plot-dir needs matplotlib (pip install matplotlib); use --hist for text histograms",
                      file=sys.stderr)
                return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
