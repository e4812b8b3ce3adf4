"""The main example as a newcomer meets it: it says when it compiles and for how long,
writes plain lines to a log, leaves compilation out of ms/step, and checks --plot's dependency
before training."""
import math
import sys

import pytest
import torch

from transformer_engine_proto.examples import train as ex

TINY = ex.Config(hidden=32, ffn=64, heads=2, layers=1, seq=8, batch=2, steps=12)


@pytest.fixture
def tiny(monkeypatch):
    real = ex.Config
    monkeypatch.setattr(ex, "Config", lambda: real(**vars(TINY)))


def test_log_output_has_plain_lines_and_a_table(tiny, capsys):
    ex.main(["--no-compile", "--recipe", "current", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "\r" not in out  # captured stdout is not a terminal: no progress bar redrawn in place
    lines = out.splitlines()
    assert [ln for ln in lines if "step 12/12 loss" in ln]
    progress = [ln for ln in lines if " step " in ln and "/12 loss" in ln]
    assert len(progress) == 12 // max(1, 12 // 10)  # one line per tenth of the run, not per step
    row = lines[-1]  # the table: recipe, final loss, vs none, ms/step
    assert row.split()[0] == "current" and float(row.split()[-1]) > 0
    assert "first 3 steps" in out


def test_compile_is_announced_and_timed_and_left_out_of_ms_per_step(monkeypatch, capsys):
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, **kw: real_compile(m, fullgraph=True, backend="aot_eager"))
    times = iter([0.0, 30.0] + [k * 0.5 for k in range(2, 40)])  # step 0 takes 30 s, then 0.5 s per call
    monkeypatch.setattr(ex.time, "perf_counter", lambda: next(times))
    cfg = ex.Config(**{**vars(TINY), "steps": 5})
    losses, step_s, _ = ex.train("current", cfg, "default", torch.device("cpu"), torch.float32)
    out = capsys.readouterr().out
    assert "current: compiling (torch.compile, first step) ..." in out
    assert "current: compiled in 30.0 s" in out
    assert len(losses) == 5 and step_s == pytest.approx(0.5)  # steps 3 and 4 only


def test_too_few_steps_for_a_step_time_says_so(capsys):
    cfg = ex.Config(**{**vars(TINY), "steps": 2})
    _, step_s, _ = ex.train("none", cfg, None, torch.device("cpu"), torch.float32, progress=False)
    assert math.isnan(step_s)


def test_plot_without_matplotlib_fails_before_training(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(ex, "train", lambda *a, **k: pytest.fail("trained before checking matplotlib"))
    with pytest.raises(SystemExit, match=r'pip install -e "\.\[plot\]"'):
        ex.main(["--plot", "loss.png"])


def test_compare_plot_panel_is_the_difference_to_the_baseline():
    results = {"none": ([3.0, 2.0, 1.5], 0.1), "current": ([3.0, 2.5, 1.25], 0.1), "mxfp8": ([2.0, 2.0, 2.0], 0.1)}
    assert ex.loss_deltas(results) == {"current": [0.0, 0.5, -0.25], "mxfp8": [-1.0, 0.0, 0.5]}


def test_numpy_is_a_dependency():
    """torch warns `Failed to initialize NumPy` at import when numpy is missing."""
    from pathlib import Path

    import tomllib

    deps = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "numpy" in deps


def test_gemm_policy_flag_prints_the_choices(tiny, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TE_PROTO_CACHE_DIR", str(tmp_path))  # CPU costs measured on first use, cached here
    from transformer_engine_proto.precision import policy as P

    P.cost_table.cache_clear()
    ex.main(["--no-compile", "--recipe", "current", "--gemm-policy", "--quiet", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "GEMM precision chosen by te.GemmPolicy" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| ") and ".gemm" in ln or "fc1" in ln or "fc2" in ln]
    assert rows, out
    assert list((tmp_path / "gemm_costs").glob("cpu-*.json"))
    P.cost_table.cache_clear()


def test_cpu_compile_keeps_the_ops_opaque_and_restores_the_setting(tiny, capsys, monkeypatch):
    """On CPU the example compiles with the library's ops opaque (seconds, not minutes, for MXFP8 /
    NVFP4), says so, and leaves the process's setting as it found it."""
    from transformer_engine_proto.custom_ops import inductor_lowering

    seen = []
    real_compile = torch.compile

    def compile_and_record(m, **kw):
        seen.append(inductor_lowering.cpu_inlining_enabled())
        return real_compile(m, fullgraph=True, backend="aot_eager")

    monkeypatch.setattr(torch, "compile", compile_and_record)
    ex.main(["--recipe", "current", "--steps", "2", "--quiet", "--device", "cpu"])
    assert seen == [False] and inductor_lowering.cpu_inlining_enabled()
    assert "opaque to inductor on CPU" in capsys.readouterr().out
