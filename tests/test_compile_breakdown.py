"""benchmarks/compile_breakdown.py: the table of first compiled steps, cold and warm, per variant."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import compile_breakdown  # noqa: E402


def test_each_variant_runs_cold_then_warm_in_fresh_processes_with_its_own_caches(monkeypatch, capsys):
    calls = []

    def fake_child(variant, argv, env):
        calls.append((variant, env["TORCHINDUCTOR_CACHE_DIR"], env["TRITON_CACHE_DIR"]))
        cold = len([c for c in calls if c[0] == variant]) == 1
        if cold:  # the cold run compiles three kernels into Triton's cache, the warm one finds them
            for name in ("a", "b", "c"):
                os.makedirs(os.path.join(env["TRITON_CACHE_DIR"], name))
                open(os.path.join(env["TRITON_CACHE_DIR"], name, f"__grp__{name}.json"), "w").close()
        s = {"bf16": 10.0, "te:delayed": 30.0}[variant] / (1 if cold else 5)
        return {"variant": variant, "first_step_s": s, "phases_s": {"compile_fx_inner": s / 2}}

    monkeypatch.setattr(compile_breakdown, "run_child", fake_child)
    results = compile_breakdown.main(["--smoke", "--variants", "bf16,te:delayed"])
    assert [(r["variant"], r["caches"]) for r in results] == [
        ("bf16", "cold"), ("bf16", "warm"), ("te:delayed", "cold"), ("te:delayed", "warm")]
    assert calls[0][1:] == calls[1][1:] != calls[2][1:] == calls[3][1:]  # warm reuses its cold run's caches
    out = capsys.readouterr().out
    assert "| te:delayed | cold   | 30.0         | 3.00x   |" in out and "| te:delayed | warm   | 6.0" in out
    assert [r["graph"]["triton_compiled"] for r in results] == [3, 0, 3, 0]
    assert "Triton kernels compiled" in out


def test_results_are_saved_after_every_process_so_a_run_cut_short_keeps_them(monkeypatch, tmp_path, capsys):
    def fake_child(variant, argv, env):
        if variant == "te:delayed":
            raise KeyboardInterrupt  # the time limit, say: the run ends here
        return {"variant": variant, "first_step_s": 4.0, "phases_s": {"bytecode_tracing": 1.5}}

    monkeypatch.setattr(compile_breakdown, "run_child", fake_child)
    with pytest.raises(KeyboardInterrupt):
        compile_breakdown.main(["--smoke", "--variants", "bf16,te:delayed", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "compile_breakdown.json").read_text())
    assert saved["complete"] is False
    assert [(r["variant"], r["caches"]) for r in saved["results"]] == [("bf16", "cold"), ("bf16", "warm")]
    assert "bf16                   warm:     4.0 s (dynamo tracing s 1.50, guards s 0.00" in capsys.readouterr().out


def test_more_warm_runs_are_more_processes_on_the_same_caches(monkeypatch, capsys):
    calls = []

    def fake_child(variant, argv, env):
        calls.append((variant, env["TORCHINDUCTOR_CACHE_DIR"]))
        s = {"bf16": 4.0, "te:delayed": 8.0}[variant] / len([c for c in calls if c[0] == variant])
        return {"variant": variant, "first_step_s": s, "phases_s": {}}

    monkeypatch.setattr(compile_breakdown, "run_child", fake_child)
    results = compile_breakdown.main(["--smoke", "--variants", "bf16,te:delayed", "--caches", "cold,warm,warm2"])
    assert [r["caches"] for r in results] == ["cold", "warm", "warm2"] * 2
    assert len({c[1] for c in calls[:3]}) == 1 and calls[0][1] != calls[3][1]
    out = capsys.readouterr().out
    assert "| te:delayed | warm2  | 2.7          | 2.00x   |" in out  # 8 / 3 against bf16's 4 / 3
    # medians of the warm runs: bf16 (2 + 1.33) / 2, delayed (4 + 2.67) / 2
    assert "| te:delayed | 2    | 3.33         | 2.00x   |" in out, out
    rows = compile_breakdown.warm_summary([
        {"variant": "bf16", "caches": "cold", "first_step_s": 20.0},
        *({"variant": "bf16", "caches": f"warm{i}", "first_step_s": s, "phases_s": {"build_guards": g}}
          for i, (s, g) in enumerate(((3.0, 0.1), (9.0, 0.3), (4.0, 0.2)))),
        {"variant": "te:delayed", "caches": "warm", "first_step_s": 6.0, "phases_s": {"bytecode_tracing": 2.5}},
    ])
    assert rows == [["bf16", 3, "4.00", "1.00x", "0.00", "0.20", "0.00"],
                    ["te:delayed", 1, "6.00", "1.50x", "2.50", "0.00", "0.00"]], rows


@pytest.mark.slow
def test_first_step_reports_time_and_phases():
    args = compile_breakdown.parse_args(["--smoke", "--device", "cpu", "--cprofile"])
    r = compile_breakdown.first_step("te:current", args)
    assert r["first_step_s"] > 0 and r["phases_s"].get("compile_fx_inner", 0) > 0, r
    assert any("linear_fwd" in name for name, _ in r["library_cumulative_s"]), r["library_cumulative_s"]


def test_graph_counts_are_reported_per_compiled_graph():
    import torch
    from torch._inductor import config

    counts = {}
    # config.patch puts the pass back afterwards (pytest's monkeypatch would hide the config entry)
    with config.patch(post_grad_custom_pre_pass=None), torch.compiler.config.patch(force_disable_caches=True):
        compile_breakdown.count_graph_nodes(counts)
        torch._dynamo.reset()
        fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend="inductor", fullgraph=True)
        x = torch.randn(64, requires_grad=True)
        fn(x).backward()  # no cached graph: the pass runs
    assert config.post_grad_custom_pre_pass is None
    assert counts["graphs"] == 2 and counts["nodes"] >= 4 and counts["triton_calls"] == 0, counts
    assert 0 < counts["tiny_nodes"] < counts["nodes"], counts  # the sum is tiny, sin / mul are not


def _definition(var, name, meta, body="pass"):
    return (f"{var} = async_compile.triton('{name}', '''\nimport triton\n@triton_heuristics.user_autotune(\n"
            f"    triton_meta={meta},\n    inductor_meta={{'kernel_name': '{var}'}},\n)\n@triton.jit\n"
            f"def {name}(x_ptr, slot):\n    {body}\n''', device_str='cuda')\n")


def test_kernel_definitions_count_each_kernels_distinct_sources(tmp_path):
    """A user kernel defined with two specializations (in two generated files, one repeated under
    another number) has two sources; inductor's numbered kernels count under their name without the
    number, and definitions that differ only in their numbered names are one source; a line that
    differs is shown."""
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "fwd.py").write_text(
        _definition("_cast_0", "_cast", "{'constants': {'slot': 1}}")
        + _definition("triton_poi_fused_add_0", "triton_poi_fused_add_0", "{'constants': {}}")
        + _definition("triton_poi_fused_add_1", "triton_poi_fused_add_1", "{'constants': {}}")
        + _definition("triton_poi_fused_add_2", "triton_poi_fused_add_2", "{'constants': {}}", "x = 1"))
    (tmp_path / "ab" / "bwd.py").write_text(
        _definition("_cast_3", "_cast", "{'constants': {'slot': 1}}")
        + _definition("_cast_1", "_cast", "{'constants': {}}"))
    (tmp_path / "ab" / "other.txt").write_text(_definition("_x_0", "_x", "{}"))
    defs = compile_breakdown.kernel_definitions(str(tmp_path))
    assert {k: len(v) for k, v in defs.items()} == {"_cast": 2, "triton_poi_fused_add": 2}
    rows = compile_breakdown.definition_rows(defs, top=5)
    assert rows == [["_cast", 2, "triton_meta={'constants': {'slot': 1}},"],
                    ["triton_poi_fused_add", 2, "pass"]], rows
    long = ["triton_meta={" + "'a': 0, " * 30 + "'slot': 1}", "triton_meta={" + "'a': 0, " * 30 + "}"]
    assert compile_breakdown._where_they_differ(long) == "..." + long[0][len(long[1]) - 21:]
    assert compile_breakdown.definition_rows(defs, top=1) == rows[:1]
