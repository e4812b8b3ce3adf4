"""benchmarks/bench_llama.py: the swapped Llama is the same model, and the smoke run measures
every requested variant (transformers is a test extra; random init, no download)."""
import argparse
import os
import sys

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
