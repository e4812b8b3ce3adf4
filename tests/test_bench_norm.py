"""benchmarks/bench_norm.py's wiring on CPU: every row timed and checked against inductor's."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_norm  # noqa: E402


def test_smoke_run_times_and_checks_every_row(tmp_path):
    results = bench_norm.main(["--smoke", "--cpu-warmup", "0", "--cpu-reps", "1", "--out", str(tmp_path)])
    assert [(r["norm"], r["op"]) for r in results] == [
        (n, op) for n in ("RMSNorm", "LayerNorm") for op in ("fwd", "bwd", "fwd + fp8 current rw+cw")]
    assert all(r["close"] and r["inductor_ms"] > 0 and r["te_ms"] > 0 for r in results), results
    assert (tmp_path / "bench_norm.json").exists()
