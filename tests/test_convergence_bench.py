"""benchmarks/convergence.py on a tiny model for a few steps: it reads the standard library, trains
each recipe, and reports final validation losses relative to bf16."""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import convergence  # noqa: E402


def test_splits_hold_out_whole_files():
    train, val, info = convergence.stdlib_sources(0.5, 4)
    assert info["files"] >= 4 and "site-packages" not in info["root"]
    assert 0 < val.numel() < train.numel() and train.numel() + val.numel() == info["bytes"]


def test_tiny_run_learns_and_reports(tmp_path):
    runs = convergence.main(["--size", "tiny", "--steps", "30", "--warmup", "5", "--lr", "3e-3", "--eval-every",
                             "15", "--val-batches", "2", "--data-mb", "1", "--recipes", "bf16", "--seeds", "0,1",
                             "--no-compile", "--device", "cpu", "--out", str(tmp_path),
                             "--gemm-sensitivity", "current"])
    found = runs[0]["gemm_sensitivity"]["current"]
    assert found["baseline"] == runs[0]["val"][-1][1]  # measuring leaves the high-precision model as it was
    assert len(found["modules"]) == 2 * 3 + 1  # per layer qkv, proj, mlp; and the head
    assert found["all"] != found["baseline"] and all(r["out_rel_err"] > 0 for r in found["modules"])
    assert "only `head`" in (tmp_path / "gemm_sensitivity-seed0.md").read_text()
    runs = convergence.main(["--size", "tiny", "--steps", "30", "--warmup", "5", "--lr", "3e-3", "--eval-every",
                             "15", "--val-batches", "2", "--data-mb", "1", "--recipes", "current", "--seeds", "0",
                             "--no-compile", "--device", "cpu", "--out", str(tmp_path)])
    assert [(r["recipe"], r["seed"]) for r in runs] == [("bf16", 0), ("bf16", 1), ("current", 0)]  # out's runs
    for r in runs:
        assert all(math.isfinite(v) for v in r["train"]) and "diverged_at" not in r
        assert r["train"][-1] < r["train"][0] - 0.5  # bytes of Python source are learnable fast
        assert [s for s, _ in r["val"]] == [15, 30]
    table = json.loads((tmp_path / "convergence.json").read_text())["table"]
    assert set(table) == {"bf16", "current"} and table["bf16"]["seeds"] == 2
    assert table["bf16"]["diff_to_bf16"] == 0.0 and table["bf16"]["std"] > 0
    assert math.isfinite(table["bf16"]["last_10pct_change_pct"])
    assert abs(table["current"]["diff_pct"]) < 10  # FP8 tracks bf16 on this toy
    assert table["current"]["diff_in_bf16_std"] == table["current"]["diff_to_bf16"] / table["bf16"]["std"]
    (tmp_path / "convergence.md").unlink()
    convergence.main(["--summarize", "--out", str(tmp_path), "--device", "cpu"])
    assert "| current |" in (tmp_path / "convergence.md").read_text()
