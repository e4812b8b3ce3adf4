"""Current scaling with the TP amax reduction (`enable_tp_amax_reduction`) matches the full module.

Without it a TP current-scaling Linear differs from the full one by up to ~7% (per-shard amaxes,
see test_tensor_parallel.FULL_TOL); with it every sharded operand is quantized with the whole
tensor's amax, so only fp32 summation order differs. One spawn of 2 processes (gloo, or NCCL: see dist_harness) runs the
Linear modes and the TP modules of test_tensor_parallel, eager and compiled (aot_eager, fullgraph).
"""
import pytest
import test_tensor_parallel as TPT
import torch
import torch.distributed as dist
from dist_harness import ON_GPU, compile_fresh, init_worker, spawn_and_collect

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.distributed.amax_reduction import enable_tp_amax_reduction

RECIPE = R.Float8CurrentScaling()
# relative (Frobenius) error vs the full module, measured max over cases / tensors / ranks:
# 3.2e-7 (reduction order of the TP sums); without the reduction the same Linears reach 0.074
TOL = 1e-6
# On GPU the FP8 GEMMs run on Hopper tensor cores, whose FP8 accumulation is not fp32 per step
# (cuBLAS promotes partial sums to fp32 every few K blocks), so splitting a reduction across ranks
# moves the result by more than fp32 ordering: measured max 1.3e-4 on 2 H200 (mlp input grad)
if ON_GPU:
    TOL = 5e-4
MOD_CASES = ["lnl_column_sp", "lnl_row", "mlp", "layer_sp"]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _linear_case(mode, rank, group, compiled, reduce):
    from torch._dynamo.utils import counters

    w, b, x, g = TPT._data()
    _, full = TPT._references(mode, RECIPE, rank)
    col, sp = mode.startswith("column"), mode.endswith("_sp")
    kw = dict(tp_group=group, tp_size=TPT.WORLD, parallel_mode="column" if col else "row", sequence_parallel=sp)
    sh = TPT._shard
    if col:
        m = TPT._linear(sh(w, 0, rank), sh(b, 0, rank), **kw)
        xin, gin = (sh(x, 0, rank) if sp else x), sh(g, 1, rank)
    else:
        m = TPT._linear(sh(w, 1, rank), b, **kw)
        xin, gin = sh(x, 1, rank), (sh(g, 0, rank) if sp else g)
    if reduce:
        assert enable_tp_amax_reduction(m) == 1
    run = m
    if compiled:
        run = compile_fresh(m, RECIPE)
    got = TPT._run(run, xin, gin, RECIPE)
    got["dw"], got["db"] = m.weight.grad, m.bias.grad
    errs = {k: _rel(got[k], full[k]) for k in ("y", "dx", "dw", "db")}
    return {"err": errs, "breaks": sum(counters["graph_break"].values()) if compiled else 0}


def _module_case(case, rank, group, compiled):
    from torch._dynamo.utils import counters

    m, ref, x, g, pmap, dims = TPT._mod_case(case, rank, group)
    assert enable_tp_amax_reduction(m) > 0
    errs = TPT._module_step_errors(m, ref, x, g, pmap, dims, rank, group, RECIPE, compiled)
    return {"err": errs, "breaks": sum(counters["graph_break"].values()) if compiled else 0}


def _worker(rank, init_file, out_dir):
    init_worker(rank, TPT.WORLD, f"file://{init_file}")
    try:
        group = dist.new_group(list(range(TPT.WORLD)))
        res = {}
        for mode in TPT.MODES:
            res[("plain", mode)] = _linear_case(mode, rank, group, False, reduce=False)
            for compiled in (False, True):
                res[("linear", mode, compiled)] = _linear_case(mode, rank, group, compiled, reduce=True)
        for case in MOD_CASES:
            for compiled in (False, True):
                res[("module", case, compiled)] = _module_case(case, rank, group, compiled)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_and_collect(_worker, tmp_path_factory, "tp_amax", TPT.WORLD)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", TPT.MODES)
def test_tp_linear_current_scaling_matches_full(results, mode, compiled):
    for rank, res in enumerate(results):
        r = res[("linear", mode, compiled)]
        assert max(r["err"].values()) <= TOL, (rank, r)
        assert r["breaks"] == 0


def test_without_reduction_differs(results):
    """The reduction is what closes the gap (guards against a test that compares nothing)."""
    worst = max(max(res[("plain", m)]["err"].values()) for res in results for m in TPT.MODES)
    assert worst > 1e-3


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", MOD_CASES)
def test_tp_modules_current_scaling_match_full(results, case, compiled):
    for rank, res in enumerate(results):
        r = res[("module", case, compiled)]
        assert max(r["err"].values()) <= TOL, (rank, r)
        assert r["breaks"] == 0


def test_other_recipes_keep_their_key():
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
    from transformer_engine_proto.distributed.amax_reduction import tp_amax_key

    for rec in (R.DelayedScaling(), R.MXFP8BlockScaling(), None):
        assert tp_amax_key(RecipeKey.of(rec), "g", ("weight",)) == RecipeKey.of(rec)
    q = RecipeKey.quantizers(tp_amax_key(RecipeKey.of(RECIPE), "g", ("input", "weight")))
    assert type(q.input).__name__ == type(q.weight).__name__ == "AmaxReducingQuantizer"
    assert q.input.amax_reduction_group == "g" and type(q.grad_output).__name__ == "Float8CurrentScalingQuantizer"
    # same buffers as plain current scaling (the fake impls stay valid)
    plain = RecipeKey.quantizers(RecipeKey.of(RECIPE)).input
    assert q.input.buffer_layout((64, 32)) == plain.buffer_layout((64, 32))


def test_module_without_tp_group_untouched():
    assert enable_tp_amax_reduction(torch.nn.Sequential(te.Linear(64, 64), te.LayerNormMLP(64, 128))) == 0
