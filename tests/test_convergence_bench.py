"""benchmarks/convergence.py on a tiny model for a few steps: it reads the standard library, trains
each recipe, and reports final validation losses relative to bf16."""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import convergence  # noqa: E402


def test_tiny_run_learns_and_reports(tmp_path):
    runs = convergence.main(["--size", "tiny", "--steps", "30", "--warmup", "5", "--lr", "3e-3", "--eval-every",
                             "15", "--val-batches", "2", "--data-mb", "1", "--recipes", "bf16,current",
                             "--seeds", "0,1", "--no-compile", "--device", "cpu", "--out", str(tmp_path)])
    assert len(runs) == 4
    for r in runs:
        assert all(math.isfinite(v) for v in r["train"]) and "diverged_at" not in r
        assert r["train"][-1] < r["train"][0] - 0.5  # bytes of Python source are learnable fast
        assert [s for s, _ in r["val"]] == [15, 30]
    table = json.loads((tmp_path / "convergence.json").read_text())["table"]
    assert set(table) == {"bf16", "current"} and table["bf16"]["seeds"] == 2
    assert table["bf16"]["diff_to_bf16"] == 0.0
    assert abs(table["current"]["mean"] - table["bf16"]["mean"]) < 0.3  # FP8 tracks bf16 on this toy
    assert "| current |" in (tmp_path / "convergence.md").read_text()
