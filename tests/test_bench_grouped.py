"""benchmarks/bench_grouped.py: the smoke run measures each requested variant, and its uneven
splits are what the GEMMs get (aligned, summing to the token count)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_grouped  # noqa: E402


def test_splits_are_uneven_aligned_and_sum_to_tokens():
    splits = bench_grouped.make_splits(8, 16384, 128)
    assert len(splits) == 8 and sum(splits) == 16384 and all(s % 128 == 0 for s in splits)
    assert len(set(splits)) > 1


def test_smoke_run_measures_each_variant():
    variants = ["bf16:loop", "bf16:grouped_mm", "te:current", "te-loop:current"]
    results = bench_grouped.main(["--smoke", "--variants", ",".join(variants), "--modes", "eager",
                                  "--cpu-warmup", "0", "--cpu-reps", "1"])
    assert [r["variant"] for r in results] == variants
    assert all(r["ms"] > 0 and r["graph_breaks"] == 0 for r in results), results
