"""What a Linear's GEMMs and quantizes cost on one device: measured points plus a shipped grid.

Times are GPU (or CPU) milliseconds of the library's own calls: `gemm()` on operands of one
format (or bf16), and the recipe's quantize of one role with given usages. A `CostTable` holds
measured points keyed exactly; a GEMM it has not measured is predicted from its grid (a full
cartesian grid of M, N, K sizes, interpolated in log space), and returns None when the format_name
has no grid, so the caller measures the point (`calibrate.py`) and adds it.

GEMM shapes are (M, N, K) with K the reduction: fprop (tokens, out, in), dgrad (tokens, in,
out), wgrad (out, in, tokens).
"""
from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

__all__ = ["CostTable", "gemm_shapes", "BF16", "shipped_table_path", "cache_path"]

BF16 = "bf16"  # the format_name of a high-precision GEMM
_TABLES_DIR = os.path.join(os.path.dirname(__file__), "tables")


def gemm_shapes(m: int, n: int, k: int) -> Dict[str, Tuple[int, int, int]]:
    """(M, N, K) of the three GEMMs of a Linear with `m` tokens, `n` out and `k` in features."""
    return {"fprop": (m, n, k), "dgrad": (m, k, n), "wgrad": (n, k, m)}


def _interp(xs, x):
    """(i, w): x sits between xs[i] and xs[i+1] at weight w (log2 scale), clamped to the ends."""
    lx = math.log2(max(x, 1))
    lo = [math.log2(v) for v in xs]
    if lx <= lo[0]:
        return 0, 0.0
    if lx >= lo[-1]:
        return len(xs) - 2, 1.0
    i = bisect.bisect_right(lo, lx) - 1
    return i, (lx - lo[i]) / (lo[i + 1] - lo[i])


@dataclass
class CostTable:
    """GEMM and quantize times (ms) of one device, by format_name (`BF16` or a recipe class name)."""

    device: str
    gemm: Dict[str, Dict[str, float]] = field(default_factory=dict)  # format_name -> "gemm:M,N,K" -> ms
    quantize: Dict[str, Dict[str, float]] = field(default_factory=dict)  # format_name -> "role,numel,r,c" -> ms
    grid: Tuple[int, ...] = ()  # sizes measured for every format_name in `gemm` over M x N x K

    # ---- GEMMs ------------------------------------------------------------------------------
    def gemm_ms(self, format_name: str, gemm: str, m: int, n: int, k: int) -> Optional[float]:
        """This GEMM measured, else the same (M, N, K) as an fprop (the grid's orientation)."""
        points = self.gemm.get(format_name, {})
        for name in (gemm, "fprop"):
            exact = points.get(f"{name}:{m},{n},{k}")
            if exact is not None:
                return exact
        if not self.grid or not all(f"fprop:{g},{g},{g}" in points for g in (self.grid[0], self.grid[-1])):
            return None
        return self._gemm_from_grid(points, m, n, k)

    def _gemm_from_grid(self, points, m, n, k) -> float:
        """Trilinear in log(size) of log(time) inside the grid; beyond its largest size, time grows
        with the flops (the GEMM is compute bound there); below its smallest, the smallest's time."""
        g = self.grid
        (i, wi), (j, wj), (l, wl) = _interp(g, m), _interp(g, n), _interp(g, k)
        log_t = 0.0
        for di, fi in ((0, 1 - wi), (1, wi)):
            for dj, fj in ((0, 1 - wj), (1, wj)):
                for dl, fl in ((0, 1 - wl), (1, wl)):
                    f = fi * fj * fl
                    if f:
                        log_t += f * math.log(points[f"fprop:{g[i + di]},{g[j + dj]},{g[l + dl]}"])
        over = max(m / g[-1], 1.0) * max(n / g[-1], 1.0) * max(k / g[-1], 1.0)
        return math.exp(log_t) * over

    def add_gemm(self, format_name: str, gemm: str, m: int, n: int, k: int, ms: float) -> None:
        self.gemm.setdefault(format_name, {})[f"{gemm}:{m},{n},{k}"] = float(ms)

    # ---- quantizes --------------------------------------------------------------------------
    @staticmethod
    def _qkey(role: str, numel: int, rowwise: bool, columnwise: bool) -> str:
        return f"{role},{numel},{int(rowwise)},{int(columnwise)}"

    def quantize_ms(self, format_name: str, role: str, numel: int, rowwise: bool, columnwise: bool) -> Optional[float]:
        """Exact point, else interpolated (log-log) between the measured sizes of the same role and
        usages, scaled linearly beyond the largest; None when fewer than two sizes are known."""
        points = self.quantize.get(format_name, {})
        exact = points.get(self._qkey(role, numel, rowwise, columnwise))
        if exact is not None:
            return exact
        prefix = f"{role},"
        suffix = f",{int(rowwise)},{int(columnwise)}"
        sizes = sorted((int(key.split(",")[1]), ms) for key, ms in points.items()
                       if key.startswith(prefix) and key.endswith(suffix))
        if len(sizes) < 2:
            return None
        xs = [s for s, _ in sizes]
        if numel >= xs[-1]:
            return sizes[-1][1] * numel / xs[-1]
        i, w = _interp(xs, numel)
        return math.exp((1 - w) * math.log(sizes[i][1]) + w * math.log(sizes[i + 1][1]))

    def add_quantize(self, format_name: str, role: str, numel: int, rowwise: bool, columnwise: bool, ms: float) -> None:
        self.quantize.setdefault(format_name, {})[self._qkey(role, numel, rowwise, columnwise)] = float(ms)

    # ---- persistence ------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"device": self.device, "grid": list(self.grid), "gemm": self.gemm, "quantize": self.quantize}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        return cls(d["device"], {k: dict(v) for k, v in d.get("gemm", {}).items()},
                   {k: dict(v) for k, v in d.get("quantize", {}).items()}, tuple(d.get("grid", ())))

    @classmethod
    def load(cls, path: str) -> "CostTable":
        with open(path) as f:
            return cls.from_json(json.load(f))

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=0, sort_keys=True)
        os.replace(tmp, path)  # atomic: another process never reads half a file

    def merge(self, other: "CostTable") -> None:
        """Add `other`'s points (its grid only when this table has none)."""
        for format_name, pts in other.gemm.items():
            self.gemm.setdefault(format_name, {}).update(pts)
        for format_name, pts in other.quantize.items():
            self.quantize.setdefault(format_name, {}).update(pts)
        if not self.grid:
            self.grid = other.grid


def shipped_table_path(device_name: str) -> Optional[str]:
    """The table shipped with the package for this device, or None: `tables/<model>.json` where
    the device's name contains the model (e.g. h100.json for "NVIDIA H100 80GB HBM3")."""
    if not os.path.isdir(_TABLES_DIR):
        return None
    for name in sorted(os.listdir(_TABLES_DIR)):
        model, ext = os.path.splitext(name)
        if ext == ".json" and model.upper() in device_name.upper():
            return os.path.join(_TABLES_DIR, name)
    return None


def cache_path(device_name: str) -> str:
    """Where measurements for this device / torch / triton version are kept:
    $TE_PROTO_CACHE_DIR, else $XDG_CACHE_HOME/transformer_engine_proto, else ~/.cache/..."""
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    root = os.environ.get("TE_PROTO_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "transformer_engine_proto")
    slug = "".join(c if c.isalnum() else "_" for c in device_name)
    return os.path.join(root, "gemm_costs", f"{slug}-torch{torch.__version__}-triton{triton_version}.json")
