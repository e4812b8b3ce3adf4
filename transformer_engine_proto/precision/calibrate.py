"""Measuring the cost table's points on this device: the library's own GEMM and quantize calls.

On CUDA a call is timed as a CUDA graph of several back-to-back calls (host time excluded: under
torch.compile and CUDA graphs the host is off the critical path, and a Linear's GEMM choice is
about GPU time); elsewhere by wall clock. Operands are random normal bf16.

    python -m transformer_engine_proto.precision --out tables/h100.json
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from .. import recipe as R
from ..custom_ops.recipe_key import RecipeKey
from ..gemm import gemm
from .cost_model import BF16, CostTable

__all__ = ["time_ms", "measure_gemm", "measure_quantize", "format_name_of", "device_name", "GRID", "calibrate_grid"]

GRID = (256, 512, 1024, 2048, 4096, 8192)
_QUANTIZE_ROWS = (256, 1024, 4096, 16384)  # x 2048 columns: the quantize sizes of the grid
_ROLE_OF = {"input": "input", "weight": "weight", "grad": "grad_output"}


def device_name(device: torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def format_name_of(recipe) -> str:
    """The cost table's name for a recipe: its public recipe class (a derived recipe, e.g. the TP
    amax-reducing one, counts as its base); a CustomRecipe by its repr (measured, never shipped)."""
    if recipe is None:
        return BF16
    if isinstance(recipe, R.CustomRecipe):
        return repr(recipe)
    for cls in type(recipe).__mro__:
        if cls.__module__ == R.__name__ and not cls.__name__.startswith("_"):
            return cls.__name__
    return type(recipe).__name__


def time_ms(fn: Callable[[], object], device: torch.device, budget_ms: float = 5.0) -> float:
    """Milliseconds per call of `fn` (median of three rounds of about `budget_ms` each)."""
    device = torch.device(device)
    fn()  # warm up: compile / autotune / allocate
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    reps = int(min(20, max(2, budget_ms / max((time.perf_counter() - t0) * 1e3, 1e-3))))
    if device.type == "cuda":
        graph = None
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    fn()
        except RuntimeError:
            graph = None  # not capturable: time the launches (host time included)
        rounds = []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            if graph is not None:
                graph.replay()
            else:
                for _ in range(reps):
                    fn()
            end.record()
            end.synchronize()
            rounds.append(start.elapsed_time(end) / reps)
        return sorted(rounds)[1]
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(max(1, reps // 5)):
            fn()
        rounds.append((time.perf_counter() - t0) * 1e3 / max(1, reps // 5))
    return sorted(rounds)[1]


def _bound(q, device):
    """q with fresh scale state where the format keeps one (delayed scaling)."""
    if q.has_scale_state():
        return q.with_scale_state(torch.ones(1, device=device), torch.zeros(1, device=device))
    return q


def measure_gemm(recipe, gemm_name: str, m: int, n: int, k: int, device) -> float:
    """ms of one GEMM (M, N, K; K the reduction) as a Linear runs it: `gemm_name` sets the
    operands' roles, usages and transposes; recipe None: bf16."""
    randn = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16)  # noqa: E731
    q = RecipeKey.quantizers(RecipeKey.of(recipe))
    if gemm_name == "fprop":  # x (M, K) @ w (N, K)^T
        a, b, ta, tb, ra, rb = randn(m, k), randn(n, k), False, True, ("input", True), ("weight", True)
    elif gemm_name == "dgrad":  # dy (M, K) @ w (K, N)
        a, b, ta, tb, ra, rb = randn(m, k), randn(k, n), False, False, ("grad_output", True), ("weight", False)
    elif gemm_name == "wgrad":  # dy (K, M)^T @ x (K, N)
        a, b, ta, tb, ra, rb = randn(k, m), randn(k, n), True, False, ("grad_output", False), ("input", False)
    else:
        raise ValueError(f"measure_gemm: gemm {gemm_name!r}, expected fprop, dgrad or wgrad")
    if q.enabled:
        a, b = (_bound(getattr(q, role).with_usage(rowwise=row, columnwise=not row), device).quantize(t, internal=True)
                for t, (role, row) in ((a, ra), (b, rb)))
    return time_ms(lambda: gemm(a, b, trans_a=ta, trans_b=tb, out_dtype=torch.bfloat16), device)


def measure_quantize(recipe, role: str, rows: int, cols: int, rowwise: bool, columnwise: bool, device) -> float:
    """ms of the recipe's quantize of a (rows, cols) tensor of `role` ("input", "weight", "grad")."""
    q = getattr(RecipeKey.quantizers(RecipeKey.of(recipe)), _ROLE_OF[role])
    q = _bound(q.with_usage(rowwise=rowwise, columnwise=columnwise), device)
    x = torch.randn(rows, cols, device=device, dtype=torch.bfloat16)
    return time_ms(lambda: q.quantize(x, internal=True), device)


def calibrate_grid(recipes, device, table: CostTable, grid=GRID, log=print, save=None) -> CostTable:
    """Fill `table` with fprop-oriented GEMMs over grid^3 for bf16 and each recipe, and the
    quantizes of every role and usage at the grid's quantize sizes (`save(table)` after each format_name)."""
    table.grid = tuple(grid)
    for recipe in [None, *recipes]:
        format_name = format_name_of(recipe)
        for m in grid:
            for n in grid:
                for k in grid:
                    table.add_gemm(format_name, "fprop", m, n, k, measure_gemm(recipe, "fprop", m, n, k, device))
        log(f"{format_name}: {len(grid) ** 3} GEMMs")
        if recipe is None:
            continue
        for role in _ROLE_OF:
            for rowwise, columnwise in ((True, False), (False, True), (True, True)):
                for rows in _QUANTIZE_ROWS:
                    ms = measure_quantize(recipe, role, rows, 2048, rowwise, columnwise, device)
                    table.add_quantize(format_name, role, rows * 2048, rowwise, columnwise, ms)
        if save is not None:
            save(table)
    return table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="*", default=list(GRID))
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    recipes = [R.Float8CurrentScaling(), R.DelayedScaling(), R.MXFP8BlockScaling(), R.Float8BlockScaling(),
               R.NVFP4BlockScaling()]
    table = CostTable(device_name(args.device))
    calibrate_grid(recipes, args.device, table, tuple(args.sizes), save=lambda t: t.save(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
