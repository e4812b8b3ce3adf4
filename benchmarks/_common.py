"""Shared helpers of the benchmark scripts: timing, compile bookkeeping, tables, JSON and plots.

Not a test module: the scripts in this folder import it as `_common` (they put their own folder
and the repository root on `sys.path`, so they run as `python benchmarks/<script>.py` from the
repository root without installing the package).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Callable, Iterable, Optional, Sequence

import torch

# --------------------------------------------------------------------------------------------
# recipes by the names `examples/train.py` uses
# --------------------------------------------------------------------------------------------


def make_recipe(name: str):
    """None for 'none'/'bf16'; else a fresh recipe with TE's defaults. Suffixes after '+' are run
    options the scripts read ('+policy': `te_autocast` adds the GemmPolicy; '+soi', '+rc' in
    bench_llama); the recipe is the name before them. '+split': every GEMM with the split
    accumulator (the recipe's fast-accumulation fprop off, `recipe.MMParams`)."""
    from transformer_engine_proto import recipe as R

    name, _, options = name.partition("+")

    table = {
        "none": None,
        "bf16": None,
        "delayed": R.DelayedScaling,
        "current": R.Float8CurrentScaling,
        "blockwise": R.Float8BlockScaling,
        "mxfp8": R.MXFP8BlockScaling,
        "nvfp4": R.NVFP4BlockScaling,
    }
    if name not in table:
        raise ValueError(f"unknown recipe {name!r}; choose from {sorted(table)}")
    cls = table[name]
    recipe = None if cls is None else cls()
    if "split" in options.split("+"):
        if not hasattr(recipe, "fp8_gemm_fprop"):
            raise ValueError(f"'+split': recipe {name!r} has no fp8_gemm_* fields")
        recipe.fp8_gemm_fprop = R.MMParams(use_split_accumulator=True)
    return recipe


def te_autocast(recipe, variant: str):
    """`te.autocast(recipe=...)` for a te variant (with `te.GemmPolicy()` when the variant's name
    contains '+policy'); a no-op context for bf16 / torchao (recipe None)."""
    import transformer_engine_proto as te

    if recipe is None:
        return contextlib.nullcontext()
    policy = te.GemmPolicy() if "+policy" in variant else None
    return te.autocast(recipe=recipe, gemm_policy=policy)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ms(fn: Callable[[], object], device: torch.device, *, warmup_ms: float = 25.0,
             rep_ms: float = 100.0, cpu_warmup: int = 1, cpu_reps: int = 5) -> float:
    """Median milliseconds of one `fn()` call.

    CUDA: `triton.testing.do_bench(..., return_mode="median")` (per-call CUDA events, L2 flushed
    between calls outside the timed region); CUDA events by hand when triton is missing.
    CPU: `time.perf_counter` around each call, median of `cpu_reps` after `cpu_warmup` calls.
    """
    if device.type == "cuda":
        try:
            from triton.testing import do_bench
        except ImportError:
            do_bench = None
        if do_bench is not None:
            return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
        return _cuda_events_ms(fn, warmup_ms, rep_ms)
    for _ in range(cpu_warmup):
        fn()
    times = []
    for _ in range(max(1, cpu_reps)):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def device_ms(fn: Callable[[], object], device: torch.device, *, rep_ms: float = 100.0, **cpu_timing) -> float:
    """Median device milliseconds of one `fn()` call: on CUDA, `fn` captured in a CUDA graph and
    replayed (`triton.testing.do_bench_cudagraph`), so the host's launch cost is out of the
    measurement, as in a compiled step whose launches run ahead of the GPU. Inputs are not flushed
    from L2 between calls. CPU: `bench_ms`."""
    if device.type != "cuda":
        return bench_ms(fn, device, **cpu_timing)
    from triton.testing import do_bench_cudagraph

    fn()  # allocations and compiles happen before capture
    torch.cuda.synchronize(device)
    return float(do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))


def _cuda_events_ms(fn, warmup_ms: float, rep_ms: float) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / est))):
        fn()
    n = max(5, int(rep_ms / est))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)))


# --------------------------------------------------------------------------------------------
# compile bookkeeping: graph breaks, cudagraph skips (with their reasons), fresh state per variant
# --------------------------------------------------------------------------------------------


class _SkipCapture:
    def __init__(self):
        self.messages: list[str] = []


_CAPTURE: Optional[_SkipCapture] = None


def _skip_capture() -> _SkipCapture:
    """Records the reason of every cudagraph skip.

    Inductor reports a skip through `cudagraph_utils.log_cudagraph_skip_and_bump_counter(msg)`,
    which other inductor modules import by name: wrap it in each of them (torch._logging may reset
    logger handlers, so a log handler alone is not reliable). Best effort: on a torch where this
    fails, the counters still work and only the reasons are missing.
    """
    global _CAPTURE
    if _CAPTURE is None:
        _CAPTURE = _SkipCapture()
        try:
            import importlib

            import torch._inductor.cudagraph_utils as cu

            original = cu.log_cudagraph_skip_and_bump_counter
            capture = _CAPTURE

            def wrapped(msg, *a, **kw):
                capture.messages.append(str(msg))
                return original(msg, *a, **kw)

            for modname in ("torch._inductor.cudagraph_utils", "torch._inductor.compile_fx",
                            "torch._inductor.output_code", "torch._inductor.cudagraph_trees"):
                try:
                    mod = importlib.import_module(modname)
                except Exception:
                    continue
                if getattr(mod, "log_cudagraph_skip_and_bump_counter", None) is original:
                    mod.log_cudagraph_skip_and_bump_counter = wrapped
        except Exception:
            pass
    return _CAPTURE


def reset_compile_state(device: torch.device) -> None:
    """Fresh dynamo caches, cudagraph trees and counters, and free memory: each variant compiles anew."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _skip_capture().messages.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compile_stats() -> dict:
    """Counters since the last `reset_compile_state`."""
    c = torch._dynamo.utils.counters
    breaks = dict(c.get("graph_break", {}))
    return {
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": {str(k)[:300]: int(v) for k, v in breaks.items()},
        "cudagraph_skips": int(c.get("inductor", {}).get("cudagraph_skips", 0)),
        "cudagraph_skip_reasons": list(dict.fromkeys(m[:300] for m in _skip_capture().messages)),
        "unique_graphs": int(c.get("stats", {}).get("unique_graphs", 0)),
    }


def configure_dynamo() -> None:
    # every variant is compiled after torch._dynamo.reset(), but be generous anyway so a recompile
    # (e.g. per-layer compile of identical layers) never silently falls back to eager
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    _skip_capture()


def short_error(exc: BaseException, limit: int = 160) -> str:
    # dynamo wraps a user exception raised while tracing (Unsupported: Observed exception ...):
    # name the innermost cause, which says what actually went wrong
    root, seen = exc, set()
    while root.__cause__ is not None and id(root) not in seen:
        seen.add(id(root))
        root = root.__cause__
    msg = " ".join(str(root).split())
    text = f"{type(root).__name__}: {msg}"
    return "error: " + (text if len(text) <= limit else text[: limit - 3] + "...")


def report_exception(what: str, exc: BaseException) -> str:
    """Print the traceback to stderr and return the short 'error: ...' table cell."""
    print(f"\n===== {what} failed =====", file=sys.stderr)
    traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    sys.stderr.flush()
    return short_error(exc)


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------


def _cell(v) -> str:
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence]) -> str:
    rows = [[_cell(c) for c in r] for r in rows]
    headers = [_cell(h) for h in headers]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    return "\n".join(out)


def environment(device: torch.device) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "host": platform.node(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        env["triton"] = None
    try:
        import torchao

        env["torchao"] = torchao.__version__
    except Exception:
        env["torchao"] = None
    # the library's own switches change what is measured: record them with the numbers
    from transformer_engine_proto.kernels import get_backend

    env["kernels"] = get_backend()  # TE_PROTO_KERNELS or kernels.set_backend(): "triton" (default) or "reference"
    try:
        from transformer_engine_proto.kernels.triton.launch import enabled as fast_launch_enabled

        env["fast_launch"] = fast_launch_enabled()
    except ImportError:  # no Triton: no Triton launches either
        env["fast_launch"] = None
    return env


def write_json(out_dir: str, name: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")
    return path


def try_pyplot():
    """matplotlib.pyplot with the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except Exception:
        return None


def save_figure(fig, out_dir: str, name: str) -> str:
    """Lay out `fig`, write it as <out_dir>/<name>.png, close it and say so."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def grouped_bars(ax, groups: Sequence[str], series: Sequence[str], value: Callable[[str, str], Optional[float]],
                 **tick_kw) -> None:
    """A bar per series around each group's tick, `value(series, group)` high (None: no bar)."""
    width = 0.8 / max(1, len(series))
    for i, s in enumerate(series):
        bars = [(j + (i - (len(series) - 1) / 2) * width, value(s, g)) for j, g in enumerate(groups)]
        bars = [(x, y) for x, y in bars if y is not None]
        ax.bar([x for x, _ in bars], [y for _, y in bars], width, label=s)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, **tick_kw)


# --------------------------------------------------------------------------------------------
# command line and the variant loop
# --------------------------------------------------------------------------------------------


def script_parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser: its docstring's first line as the description, the whole as the epilog."""
    return argparse.ArgumentParser(description=doc.splitlines()[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)


def names(arg: str) -> list:
    """The non-empty, stripped items of a comma-separated option."""
    return [s.strip() for s in arg.split(",") if s.strip()]


def add_model_args(p, **defaults: int) -> None:
    """Integer options of the model's size (`--hidden`, `--ffn`, `--seq`, ...) with the script's defaults."""
    for name, default in defaults.items():
        p.add_argument(f"--{name}", type=int, default=default)


def add_run_args(p, name: str, warmup_ms: float, rep_ms: float) -> None:
    """The device, timing, budget and output options every benchmark script takes."""
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    p.add_argument("--warmup-ms", type=float, default=warmup_ms, help="do_bench warm-up (CUDA)")
    p.add_argument("--rep-ms", type=float, default=rep_ms, help="do_bench measuring time (CUDA)")
    p.add_argument("--cpu-warmup", type=int, default=1)
    p.add_argument("--cpu-reps", type=int, default=5)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="soft budget: variants not started by then are reported as skipped")
    p.add_argument("--out", default=None, help="directory for <name>.json and <name>.png")
    p.add_argument("--name", default=name, help="file stem of the outputs in --out")


def device_from_arg(arg: Optional[str]) -> torch.device:
    if arg:
        return torch.device(arg)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def measure(keys: dict, label: str, run: Callable[[], dict], budget: "Budget",
            device: Optional[torch.device] = None) -> dict:
    """`run()`'s result, or `keys` with an `error`: skipped once `budget` is spent, or what `run`
    raised (so one failing variant does not stop the others). With `device`, a failure also keeps
    the compile counters so far and resets the compile state for the next variant."""
    if budget.exhausted():
        return dict(keys, error="skipped: time budget (--max-minutes)")
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - reported per variant
        res = dict(keys, error=report_exception(label, e))
        if device is not None:
            try:
                res.update(compile_stats())
            except Exception:
                pass
            reset_compile_state(device)
        return res


def measure_grid(modes: Sequence[str], variants: Sequence[str], run: Callable[[str, str], dict], budget: "Budget",
                 line: Callable[[dict], str]) -> list:
    """`measure` of `run(variant, mode)` for every mode and variant, with a progress line each
    (`line(result)` for a measured one, else its error)."""
    results = []
    for mode in modes:
        for v in variants:
            r = measure(dict(variant=v, mode=mode), f"{v} {mode}", lambda v=v, mode=mode: run(v, mode), budget)
            results.append(r)
            print(f"{mode:16s} {v:20s} " + (line(r) if "ms" in r else r["error"]), flush=True)
    return results


class Budget:
    """Soft wall-clock budget: variants not started in time are reported as skipped."""

    def __init__(self, minutes: Optional[float]):
        self.deadline = None if not minutes else time.monotonic() + 60.0 * minutes

    def exhausted(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline
