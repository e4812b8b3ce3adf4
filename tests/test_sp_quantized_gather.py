"""Sequence parallel with the input all-gathered quantized (distributed/sp_gather.py), 2 processes
(gloo, or NCCL: see dist_harness).

Each rank runs a column-parallel + SP module twice from the same weights and inputs: with the
quantized gather (the default) and with the high-precision gather (`set_quantized_sequence_
parallel_gather(m, False)`), two training steps each (so delayed scaling also uses the amax the
first step recorded). Every recipe's quantized gather is exact for aligned shards, so output,
input grad, every parameter grad and the delayed-scaling state must be bitwise equal -- eager
and torch.compile(backend="aot_eager", fullgraph=True), with 0 graph breaks. `dist.all_gather`
is wrapped to check what crosses the wire: uint8 bytes of the expected size, not fp32.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import compile_fresh, generator, init_worker, one_rank_group, spawn_and_collect  # noqa: F401  (fixture)
from test_linear_opcheck import fp8_harness  # noqa: F401  (opcheck on 1-byte float outputs)

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.distributed.sp_gather import (
    HP,
    input_gather_format,
    set_quantized_sequence_parallel_gather,
)

WORLD = 2
M_LOCAL, K, OUT, FFN, HEADS = 128, 128, 128, 256, 4  # 128 rows per shard: aligned for every block format
RECIPES = {"delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling(), "mxfp8": R.MXFP8BlockScaling(),
           "blockwise": R.Float8BlockScaling(), "nvfp4": R.NVFP4BlockScaling(), "high_precision": None}
CASES = ["linear", "lnl", "mlp", "layer"]
COMPILED_CASES = ["linear", "lnl", "mlp"]  # the layer compiles for current scaling only (CPU time)
# all-gather payload per rank and forward (M_LOCAL x K shard, both usages where wgrad needs them):
# per-tensor FP8 gathers rowwise bytes only (the transpose is built after the gather)
EXPECTED_BYTES = {"delayed": M_LOCAL * K, "current": M_LOCAL * K,
                  "mxfp8": 2 * M_LOCAL * K + M_LOCAL * K // 32 + M_LOCAL // 32 * K,
                  "blockwise": 2 * M_LOCAL * K + 4 * M_LOCAL * (K // 128) + 4 * (M_LOCAL // 128) * K,
                  "nvfp4": 2 * (M_LOCAL * K // 2 + M_LOCAL * K // 16), "high_precision": 4 * M_LOCAL * K}
# backward_override: a dequantized wgrad reads the rowwise input (gathered alone); a high-precision
# one reads the gathered input itself (gathered in high precision)
OVERRIDES = {"current-dequantized": R.Float8CurrentScaling(backward_override="dequantized"),
             "mxfp8-dequantized": R.MXFP8BlockScaling(backward_override="dequantized"),
             "mxfp8-high_precision": R.MXFP8BlockScaling(backward_override="high_precision")}
OVERRIDE_BYTES = {"current-dequantized": (torch.uint8, M_LOCAL * K),
                  "mxfp8-dequantized": (torch.uint8, M_LOCAL * K + M_LOCAL * K // 32),
                  "mxfp8-high_precision": (torch.float32, 4 * M_LOCAL * K)}

LOG = []


def _count_all_gathers():
    """Record (dtype, bytes) of every all-gather input on this rank (whichever form torch offers)."""
    def spy(orig):
        def wrapped(out, t, *args, **kwargs):
            LOG.append((t.dtype, t.numel() * t.element_size()))
            return orig(out, t, *args, **kwargs)
        return wrapped

    for name in ("all_gather", "all_gather_single", "all_gather_into_tensor"):
        if hasattr(dist, name):
            setattr(dist, name, spy(getattr(dist, name)))


def _ctx(recipe):
    return contextlib.nullcontext() if recipe is None else te.autocast(recipe=recipe)


def _module(case, group):
    torch.manual_seed(0)  # both runs of a rank start from the same weights
    kw = dict(tp_group=group, sequence_parallel=True)
    if case == "linear":
        return te.Linear(K, OUT, parallel_mode="column", **kw)
    if case == "lnl":
        return te.LayerNormLinear(K, OUT, parallel_mode="column", **kw)
    if case == "mlp":
        return te.LayerNormMLP(K, FFN, **kw)
    return te.TransformerLayer(K, FFN, HEADS, hidden_dropout=0.0, attention_dropout=0.0, **kw)


def _run(case, group, rank, recipe, quantized, compiled, rows=M_LOCAL, steps=2, grad=True):
    from torch._dynamo.utils import counters

    m = _module(case, group)
    set_quantized_sequence_parallel_gather(m, quantized)
    gen = generator(1 + rank)
    shape = (rows // 2, 2, K) if case == "layer" else (rows, K)
    x = torch.randn(shape, generator=gen).requires_grad_(grad)
    run = m
    if compiled:
        run = compile_fresh(m, recipe)
    fwd_log = None
    for _ in range(steps):
        LOG.clear()
        with _ctx(recipe), (contextlib.nullcontext() if grad else torch.no_grad()):
            y = run(x)
        fwd_log = list(LOG) if fwd_log is None else fwd_log  # the first forward's all-gathers
        if grad:
            (y * torch.randn(y.shape, generator=gen)).sum().backward()
    out = {"y": y.detach()}
    if grad:
        out["dx"] = x.grad
        out.update({n: p.grad for n, p in m.named_parameters()})
    out.update({n: b.clone() for n, b in m.named_buffers() if "amax_history" in n or "fp8_scale" in n})
    breaks = sum(counters["graph_break"].values()) if compiled else 0
    return out, breaks, fwd_log


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    init_worker(rank, WORLD, f"file://{init_file}")
    try:
        group = dist.new_group(list(range(WORLD)))
        _count_all_gathers()
        res = {}
        for rid, recipe in RECIPES.items():
            for case in CASES:
                ref, _, _ = _run(case, group, rank, recipe, quantized=False, compiled=False)
                got, _, log = _run(case, group, rank, recipe, quantized=True, compiled=False)
                res[("gathers", rid, case)] = log
                res[("eager", rid, case)] = (_max_diff(got, ref), 0)
                if case in COMPILED_CASES or (case == "layer" and rid == "current"):
                    got, breaks, clog = _run(case, group, rank, recipe, quantized=True, compiled=True)
                    res[("compiled", rid, case)] = (_max_diff(got, ref), breaks)
                    res[("compiled_gathers", rid, case)] = clog
        # fallbacks: MXFP8 shards of 16 rows cannot gather the 32-row columnwise blocks (high
        # precision gather, same numbers); without wgrad the rowwise-only gather is exact
        mx = RECIPES["mxfp8"]
        ref, _, _ = _run("linear", group, rank, mx, quantized=False, compiled=False, rows=16)
        got, _, log = _run("linear", group, rank, mx, quantized=True, compiled=False, rows=16)
        res["misaligned"] = (_max_diff(got, ref), log)
        ref, _, _ = _run("linear", group, rank, mx, quantized=False, compiled=False, rows=16, grad=False)
        got, _, log = _run("linear", group, rank, mx, quantized=True, compiled=False, rows=16, grad=False)
        res["rowwise_only"] = (_max_diff(got, ref), log)
        for name, recipe in OVERRIDES.items():
            for case in ("linear", "lnl"):
                ref, _, _ = _run(case, group, rank, recipe, quantized=False, compiled=False)
                got, _, log = _run(case, group, rank, recipe, quantized=True, compiled=False)
                res[("override", name, case)] = (_max_diff(got, ref), log)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_and_collect(_worker, tmp_path_factory, "sp_gather", WORLD)


RUNS = [(rid, case, mode) for rid in RECIPES for case in CASES for mode in ("eager", "compiled")
        if mode == "eager" or case in COMPILED_CASES or rid == "current"]


@pytest.mark.parametrize("rid,case,mode", RUNS)
def test_quantized_gather_matches_high_precision_gather(results, rid, case, mode):
    for res in results:
        diff, breaks = res[(mode, rid, case)]
        assert diff == 0.0, (rid, case, mode, diff)  # bitwise
        assert breaks == 0


@pytest.mark.parametrize("rid", list(RECIPES))
def test_gathered_bytes_are_quantized(results, rid):
    n_gathers = {"linear": 1, "lnl": 1, "mlp": 1, "layer": 2}  # layer: qkv and fc1
    for res in results:
        for case, n in n_gathers.items():
            dtype = torch.float32 if rid == "high_precision" else torch.uint8
            for mode in ("gathers", "compiled_gathers"):
                log = res.get((mode, rid, case))
                assert log is not None or mode == "compiled_gathers"
                assert log is None or log == [(dtype, EXPECTED_BYTES[rid])] * n, (case, mode, log)


def test_misaligned_shards_fall_back(results):
    for res in results:
        diff, log = res["misaligned"]
        assert diff == 0.0 and log == [(torch.float32, 4 * 16 * K)]
        diff, log = res["rowwise_only"]  # no wgrad: rowwise blocks run along K, any shard gathers exactly
        assert diff == 0.0 and log == [(torch.uint8, 16 * K + 16 * K // 32)]


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_backward_override_gathers_what_backward_reads(results, name):
    for res in results:
        for case in ("linear", "lnl"):
            diff, log = res[("override", name, case)]
            assert diff == 0.0 and log == [OVERRIDE_BYTES[name]], (name, case, diff, log)


# ---- in process: the format decision and the op's fake impl --------------------------------------------
def _key(recipe):
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    return RecipeKey.of(recipe)


def test_gather_format_decisions():
    rows = lambda n: (n, K)  # noqa: E731
    assert input_gather_format(_key(None), rows(8), 2, True) == (HP, "")
    assert input_gather_format(_key(R.Float8CurrentScaling()), rows(3), 2, True)[0] == "fp8_current"
    assert input_gather_format(_key(R.DelayedScaling()), rows(3), 2, True)[0] == "fp8_delayed"
    assert input_gather_format(_key(R.MXFP8BlockScaling()), rows(64), 2, True)[0] == "mxfp8"
    kind, why = input_gather_format(_key(R.MXFP8BlockScaling()), rows(48), 2, True)
    assert kind == HP and "multiple of 32" in why
    assert input_gather_format(_key(R.MXFP8BlockScaling()), rows(48), 2, False)[0] == "mxfp8"
    assert input_gather_format(_key(R.Float8BlockScaling()), rows(64), 2, True)[0] == HP
    assert input_gather_format(_key(R.Float8BlockScaling()), (64, 4, K), 2, True)[0] == "blockwise"  # 256 rows
    assert input_gather_format(_key(R.NVFP4BlockScaling()), rows(16), 2, True)[0] == "nvfp4"
    assert input_gather_format(_key(R.NVFP4BlockScaling()), rows(8), 2, True)[0] == HP


@pytest.mark.parametrize("rid", ["delayed", "current", "mxfp8", "blockwise", "nvfp4"])
def test_op_opcheck_and_matches_quantize(one_rank_group, fp8_harness, rid):  # noqa: F811
    """With one rank the gathered buffers are the input quantizer's own; fake == real (opcheck)."""
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
    from transformer_engine_proto.distributed.sp_gather import sp_all_gather_quantized

    key = _key(RECIPES[rid])
    x = torch.randn(2, 64, K, requires_grad=True)
    kind, _ = input_gather_format(key, tuple(x.shape), 1, True)
    assert kind == rid.replace("delayed", "fp8_delayed").replace("current", "fp8_current")
    scale = torch.full((1,), 2.0) if rid == "delayed" else None
    args = (x, scale, one_rank_group.group_name, 1, key, kind, True)
    torch.library.opcheck(sp_all_gather_quantized, args)
    full, amax, bufs = sp_all_gather_quantized(*args)
    assert full.shape == x.shape and full.stride() == (0, 0, 0)
    q = RecipeKey.quantizers(key).input.with_usage(rowwise=True, columnwise=True)
    if rid == "delayed":
        import dataclasses

        q = dataclasses.replace(q, scale=scale, amax=torch.zeros(1))
    ref = q.quantize(x.detach().reshape(-1, K)).get_buffers()
    assert list(ref) and len(ref) == len(bufs)
    for (name, r), b in zip(ref.items(), bufs):
        assert r.shape == b.shape and r.stride() == b.stride() and r.dtype == b.dtype, name
        assert torch.equal(r.flatten().view(torch.uint8), b.flatten().view(torch.uint8)), name
    (gx,) = torch.autograd.grad(full, x, torch.ones(x.shape))
    torch.testing.assert_close(gx, torch.ones_like(x))
