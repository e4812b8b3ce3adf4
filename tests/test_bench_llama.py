"""benchmarks/bench_llama.py: the swapped Llama is the same model, and the smoke run measures
every requested variant (transformers is a test extra; random init, no download)."""
import argparse
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_llama  # noqa: E402

import transformer_engine_proto as te  # noqa: E402

SMOKE = argparse.Namespace(hidden=64, ffn=128, layers=2, heads=4, vocab=256, seq=32, batch=2)


def test_te_variant_converts_every_linear_and_keeps_the_function():
    ids = torch.randint(0, SMOKE.vocab, (SMOKE.batch, SMOKE.seq))
    with torch.no_grad():
        before = bench_llama.build_llama(SMOKE, "cpu", torch.float32)(input_ids=ids).logits
        model, recipe = bench_llama.make_variant("te:current", SMOKE, "cpu", torch.float32)
        after = model(input_ids=ids).logits  # no autocast: the high-precision path of the same weights
    assert isinstance(recipe, te.recipe.Float8CurrentScaling)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert sum(isinstance(m, te.Linear) for m in model.modules()) == 7 * SMOKE.layers + 1  # + lm_head
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_smoke_run_measures_each_variant():
    results = bench_llama.main(["--smoke", "--variants", "bf16,te:current", "--modes", "eager",
                                "--cpu-warmup", "0", "--cpu-reps", "1"])
    assert [(r["variant"], r["mode"]) for r in results] == [("bf16", "eager"), ("te:current", "eager")]
    assert all(r["ms"] > 0 and torch.isfinite(torch.tensor(r["last_loss"])) for r in results), results


def test_op_variant_turns_the_eager_programs_off_for_that_variant_only():
    from transformer_engine_proto.custom_ops import eager_program

    bench_llama.make_variant("te:current+op", SMOKE, "cpu", torch.float32)
    assert not eager_program.enabled()
    bench_llama.make_variant("te:current", SMOKE, "cpu", torch.float32)
    assert eager_program.enabled()


def test_kernel_families_by_name():
    cases = {"sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64": "gemm", "nvjet_tst_128x256": "gemm",
             "aten::mm": "gemm", "_cast_transpose_packed_kernel": "quantize", "_amax_kernel": "quantize",
             "triton_red_fused_abs_amax_clamp_0": "quantize", "_rmsnorm_fwd_kernel": "norm",
             "triton_per_fused_mean_mul_pow_rsqrt_1": "norm", "triton_poi_fused_silu_mul_2": "other",
             "triton_poi_fused__to_copy_clamp_mul_silu_3": "quantize",
             "triton_poi_fused__scaled_mm__to_copy_clamp_clone_mul_reciprocal_silu_13": "quantize",
             "triton_poi_fused__log_softmax__scaled_mm_add_arange_clone": "other"}
    assert {n: bench_llama.kernel_family(n) for n in cases} == cases


def test_wide_preset_sets_the_model_and_explicit_sizes_win():
    wide = bench_llama.parse_args(["--preset", "wide"])
    assert (wide.hidden, wide.ffn, wide.layers, wide.heads) == (4096, 11008, 2, 32)
    assert bench_llama.parse_args(["--preset", "wide", "--layers", "1"]).layers == 1
    assert bench_llama.parse_args([]).hidden == 2048


def test_several_presets_run_in_turn_each_with_its_sizes_and_outputs(tmp_path):
    each = bench_llama.preset_args(["--preset", "llama,wide", "--layers", "1", "--name", "b"])
    assert [(a.preset, a.hidden, a.layers, a.name) for a in each] == [("llama", 2048, 1, "b_llama"),
                                                                      ("wide", 4096, 1, "b_wide")]
    results = bench_llama.main(["--smoke", "--preset", "llama,wide", "--variants", "bf16", "--modes", "eager",
                                "--cpu-warmup", "0", "--cpu-reps", "1", "--out", str(tmp_path)])
    assert [(r["preset"], r["variant"]) for r in results] == [("llama", "bf16"), ("wide", "bf16")]
    assert {p.name for p in tmp_path.glob("*.json")} == {"bench_llama_llama.json", "bench_llama_wide.json"}


def test_unknown_preset_is_named(capsys):
    import pytest
    with pytest.raises(SystemExit):
        bench_llama.parse_args(["--preset", "llama,tall"])
    assert "--preset: unknown ['tall']" in capsys.readouterr().err


def test_profile_splits_the_step_by_family():
    """`--profile` adds each variant's time per step by kernel family (norms swapped: `+norms`)."""
    (r,) = bench_llama.main(["--smoke", "--variants", "te:current+norms", "--modes", "eager", "--cpu-warmup", "0",
                             "--cpu-reps", "1", "--profile", "--profile-steps", "1"])
    assert set(r["family_ms"]) == set(bench_llama.FAMILIES) and r["family_ms"]["gemm"] > 0
    assert all(v >= 0 for v in r["family_ms"].values())


def _kernel(name, grid, dur, ts=0.0):
    return {"cat": "kernel", "name": name, "dur": dur, "ts": ts, "args": {"grid": grid}}


def test_launches_grouped_by_kernel_and_grid():
    """`launches_by_grid` groups the trace's quantize / norm kernels by (name, grid), per step,
    largest time first, and leaves the other families out."""
    events = [_kernel("_cast_transpose_packed_kernel", [2048, 1, 1], 20.0),
              _kernel("_cast_transpose_packed_kernel", [2048, 1, 1], 30.0),
              _kernel("_cast_transpose_packed_kernel", [32768, 1, 1], 300.0),
              _kernel("_amax_kernel", [1024, 1, 1], 10.0),
              _kernel("nvjet_sm90_gemm", [2, 66, 1], 900.0)]
    rows = bench_llama.launches_by_grid(events, steps=2)
    assert rows == [["_cast_transpose_packed_kernel", "[32768, 1, 1]", 0.5, 300.0, 0.15],
                    ["_cast_transpose_packed_kernel", "[2048, 1, 1]", 1.0, 25.0, 0.025],
                    ["_amax_kernel", "[1024, 1, 1]", 0.5, 10.0, 0.005]]


def test_kernel_events_of_a_trace_in_start_order():
    import json

    events = [_kernel("b", [1, 1, 1], 1.0, ts=5.0), {"cat": "cpu_op", "name": "aten::abs", "dur": 5.0, "ts": 0.0},
              _kernel("a", [1, 1, 1], 1.0, ts=2.0)]

    class Trace:
        def export_chrome_trace(self, path):
            with open(path, "w") as f:
                json.dump({"traceEvents": events}, f)

    assert [e["name"] for e in bench_llama.kernel_events(Trace())] == ["a", "b"]


def test_idle_gaps_between_kernels():
    """Idle time is where no kernel runs (an overlapping kernel covers its neighbour's gap); the
    long gaps are named by the kernels around them, per step."""
    events = [_kernel("gemm", [1, 1, 1], 100.0, ts=0.0),
              _kernel("side", [1, 1, 1], 10.0, ts=20.0),       # inside gemm: no gap
              _kernel("cast", [1, 1, 1], 10.0, ts=105.0),      # 5 us after gemm ends
              _kernel("update", [1, 1, 1], 5.0, ts=215.0),     # 100 us after cast: a long gap
              _kernel("norm", [1, 1, 1], 5.0, ts=260.0)]       # 40 us after update: a long gap
    idle = bench_llama.idle_gaps(events, steps=1)
    assert idle["idle_ms"] == (5 + 100 + 40) / 1e3 and idle["long_idle_ms"] == 140 / 1e3
    assert idle["places"] == [["cast", "update", 1.0, 100.0], ["update", "norm", 1.0, 40.0]]


def test_host_profile_times_each_part_of_an_eager_step(tmp_path):
    """host_profile.py: each part of the step timed on the host (CPU: no GPU column), the cProfile logged."""
    import host_profile

    (r,) = host_profile.main(["--smoke", "--variants", "te:delayed", "--steps", "1", "--step-times", "3",
                              "--top", "5", "--out", str(tmp_path)])
    assert list(r["parts"]) == list(bench_llama.STEP_PARTS)
    assert all(gpu is None and host > 0 for gpu, host in r["parts"].values()), r["parts"]
    assert r["cpu_ms"] > 0 and 0 < r["main_thread_cpu_ms"] <= r["cpu_ms"] and r["involuntary_switches"] >= 0
    text = (tmp_path / "host_profile.txt").read_text()
    assert "| optimizer |" in text and "tottime" in text and "involuntary switches/step" in text


@pytest.mark.slow  # an inductor compile of the smoke Llama: 1.5 min on CPU
def test_host_profile_of_a_compiled_step(tmp_path):
    """host_profile.py --mode default: the compiled step's host time and its cProfile, per variant."""
    import host_profile

    (r,) = host_profile.main(["--smoke", "--mode", "default", "--variants", "te:delayed", "--steps", "2",
                              "--step-times", "2", "--top", "5", "--out", str(tmp_path)])
    assert r["mode"] == "default" and r["variant"] == "te:delayed"
    assert 0 < r["host_ms"] <= r["wall_ms"] and r["step_min_ms"] <= r["step_median_ms"]
    text = (tmp_path / "host_profile.txt").read_text()
    assert "te:delayed (default)" in text and "tottime" in text


def test_trace_profile_times_dynamo_per_library_function():
    """trace_profile.py: one traced forward per Linear shows up in the inliner's table, with the
    library's instructions counted apart from the model's."""
    import trace_profile

    (r,) = trace_profile.main(["--variants", "te:delayed", "--repeats", "1", "--functions", "200", "--hidden", "32",
                               "--ffn", "64", "--layers", "1", "--heads", "2", "--vocab", "64", "--seq", "8"])
    calls = {(name.split(":")[0], name.split(":")[-1]): n for name, n, _, _ in r["functions"]}
    assert calls[("transformer_engine_proto/module/quantized_gemm.py", "forward")] == 7 + 1  # + lm_head
    assert r["instructions"] > r["library_instructions"] > 0 and r["tracing_s"] > 0
    assert all(inc >= exc >= 0 for _, _, inc, exc in r["functions"])
