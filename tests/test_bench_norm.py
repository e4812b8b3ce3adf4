"""benchmarks/bench_norm.py's wiring on CPU: every row timed and checked against inductor's."""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_norm  # noqa: E402


def test_smoke_run_times_and_checks_every_row(tmp_path):
    results = bench_norm.main(["--smoke", "--cpu-warmup", "0", "--cpu-reps", "1", "--out", str(tmp_path)])
    assert [(r["norm"], r["op"]) for r in results] == [
        (n, op) for n in ("RMSNorm", "LayerNorm") for op in ("fwd", "bwd", "fwd + fp8 current rw+cw")]
    assert all(r["close"] and r["inductor_ms"] > 0 and r["te_ms"] > 0 for r in results), results
    assert (tmp_path / "bench_norm.json").exists()


def test_sweep_times_each_configuration_and_restores_the_library_config(monkeypatch):
    """`--sweep` sets each candidate into the kernels' CONFIG, times it, reports the fastest, and
    leaves CONFIG as it was (on CPU a stand-in CONFIG module: the reference kernels take none)."""
    import types

    stand_in = types.ModuleType("norm")
    stand_in.CONFIG = {"fwd": dict(MAX_BLOCK=8192, TILE=2048, WARP_ELEMS=1024),
                       "bwd": dict(MAX_BLOCK=8192, TILE=4096, WARP_ELEMS=1024, MAX_PROGRAMS=264)}
    before = {d: dict(c) for d, c in stand_in.CONFIG.items()}
    monkeypatch.setitem(sys.modules, "transformer_engine_proto.kernels.triton.norm", stand_in)
    seen = []
    real = bench_norm.C.device_ms

    def timed(fn, device, **kw):  # what CONFIG each timing ran under
        seen.append({d: dict(c) for d, c in stand_in.CONFIG.items()})
        return real(fn, device, **kw)

    monkeypatch.setattr(bench_norm.C, "device_ms", timed)
    args = argparse.Namespace(smoke=True, rep_ms=1.0)
    rows = bench_norm.sweep(args, torch.device("cpu"))
    assert [(r["norm"], r["op"]) for r in rows] == [(n, op) for n in ("RMSNorm", "LayerNorm") for op in ("fwd", "bwd")]
    assert all(r["best"] in bench_norm.SWEEP[r["op"]][:2] and r["best_ms"] > 0 for r in rows)
    fwd = {(s["fwd"]["TILE"], s["fwd"]["WARP_ELEMS"]) for s in seen if s["fwd"] != before["fwd"]}
    bwd = {(s["bwd"]["TILE"], s["bwd"]["WARP_ELEMS"], s["bwd"]["MAX_PROGRAMS"]) for s in seen
           if s["bwd"] != before["bwd"]}
    assert fwd == {(1024, 512), (1024, 1024)} and bwd == {(2048, 512, 132), (2048, 512, 264)}  # the smoke candidates
    assert not any(s["fwd"] != before["fwd"] and s["bwd"] != before["bwd"] for s in seen)  # one direction at a time
    assert stand_in.CONFIG == before
