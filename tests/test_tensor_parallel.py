"""Tensor-parallel Linear (column / row, optional sequence parallel) on 2 processes (gloo on CPU, or
NCCL on 2 GPUs with TE_PROTO_DIST_BACKEND=nccl).

One spawn runs every case; each rank compares its result with two single-process references
built from the same weights:
  * "same": the per-rank sub-Linears composed in one process (each shard quantized the way the
    rank quantizes it; the cross-rank sums done in the same order) -- must match to fp32 rounding;
  * "full": the full Linear -- exact up to the reduction order in high precision; with a quantized
    recipe per-shard quantization differs (per-tensor current scaling takes the amax of a shard
    of the row-parallel input / column-parallel weight and gradient), so a relative-error bound
    measured on these inputs is used (see FULL_TOL).
Eager and torch.compile(backend="aot_eager", fullgraph=True) both run; graph breaks are counted.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from dist_harness import ON_GPU, compile_fresh, generator, init_worker, one_rank_group, spawn_and_collect  # noqa: F401  (fixture)

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R

WORLD, TOKENS, IN, OUT = 2, 32, 64, 64
RECIPES = {"high_precision": None, "current": R.Float8CurrentScaling(), "mxfp8": R.MXFP8BlockScaling()}
MODES = ["column", "row", "column_sp", "row_sp"]
SAME_TOL = 1e-6  # max abs error vs the same-quantization reference (measured: 0.0, bitwise)
# relative (Frobenius) error vs the full Linear, measured max over all modes / tensors / ranks:
# high precision 1.4e-7 (reduction order); MXFP8 6.5e-9 (32-aligned shards quantize exactly as
# the full tensor); current scaling 0.074 (per-shard amax of the column-parallel grad_output and
# the row-parallel input: dW 0.074, dx 0.058, y 0.023)
FULL_TOL = {"high_precision": 1e-6, "current": 0.1, "mxfp8": 1e-6}
# On GPU (NCCL) the MXFP8 GEMM is emulated in bf16 (Hopper has no block-scaled MMA): each product
# is rounded to bf16 (2**-9 relative per element) at different points in the sharded and the full
# module, so "full" differs by bf16 rounding. Measured on 2 H200: max 1.7e-3 (Linear), 4.5e-3
# (TransformerLayer qkv.weight grad). The "same" comparisons stay exact (measured 0.0).
BF16_GEMM_TOL = 2.0**-7
if ON_GPU:
    FULL_TOL["mxfp8"] = BF16_GEMM_TOL


def _ctx(recipe):
    return contextlib.nullcontext() if recipe is None else te.autocast(recipe=recipe)


def _data():
    gen = generator(0)
    w = torch.randn(OUT, IN, generator=gen) * 0.1
    b = torch.randn(OUT, generator=gen)
    x = torch.randn(TOKENS, IN, generator=gen)
    g = torch.randn(TOKENS, OUT, generator=gen)
    return w, b, x, g


def _linear(w, b, **kw):
    m = te.Linear(w.shape[1] * (kw.get("tp_size", 1) if kw.get("parallel_mode") == "row" else 1),
                  w.shape[0] * (kw.get("tp_size", 1) if kw.get("parallel_mode") == "column" else 1),
                  bias=b is not None, **kw)
    with torch.no_grad():
        m.weight.copy_(w)
        if b is not None:
            m.bias.copy_(b)
    return m


def _run(m, x, g, recipe):
    x = x.clone().requires_grad_()
    with _ctx(recipe):
        y = m(x)
    (y * g).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "dw": m.weight.grad,
            "db": None if m.bias is None else m.bias.grad}


def _shard(t, dim, r):
    return t.chunk(WORLD, dim)[r].contiguous()


def _references(mode, recipe, rank):
    """(expected 'same' results, expected 'full' results) for this rank's outputs and grads."""
    w, b, x, g = _data()
    full = _run(_linear(w, b), x, g, recipe)
    col = mode.startswith("column")
    sp = mode.endswith("_sp")
    if col:
        subs = [_run(_linear(_shard(w, 0, r), _shard(b, 0, r)), x, _shard(g, 1, r), recipe) for r in range(WORLD)]
        dx = subs[0]["dx"] + subs[1]["dx"]  # the backward all-reduce (2 ranks: order-free)
        same = {"y": subs[rank]["y"], "dx": _shard(dx, 0, rank) if sp else dx, "dw": subs[rank]["dw"],
                "db": subs[rank]["db"]}
        fullr = {"y": _shard(full["y"], 1, rank), "dx": _shard(full["dx"], 0, rank) if sp else full["dx"],
                 "dw": _shard(full["dw"], 0, rank), "db": _shard(full["db"], 0, rank)}
    else:
        xs = [_shard(x, 1, r).requires_grad_() for r in range(WORLD)]
        mods = [_linear(_shard(w, 1, r), None) for r in range(WORLD)]
        bias = b.clone().requires_grad_()
        with _ctx(recipe):
            parts = [m(xi) for m, xi in zip(mods, xs)]
        y = parts[0] + parts[1] + bias
        (y * g).sum().backward()
        same = {"y": _shard(y.detach(), 0, rank) if sp else y.detach(), "dx": xs[rank].grad,
                "dw": mods[rank].weight.grad, "db": bias.grad}
        fullr = {"y": _shard(full["y"], 0, rank) if sp else full["y"], "dx": _shard(full["dx"], 1, rank),
                 "dw": _shard(full["dw"], 1, rank), "db": full["db"]}
        if sp:  # the bias is added to this rank's tokens only: its grad is partial (bias.sequence_parallel)
            same["db"] = fullr["db"] = _shard(g, 0, rank).sum(0)
    return same, fullr


def _tp_case(mode, recipe, rank, group, compiled):
    from torch._dynamo.utils import counters

    w, b, x, g = _data()
    col = mode.startswith("column")
    sp = mode.endswith("_sp")
    kw = dict(tp_group=group, tp_size=WORLD, parallel_mode="column" if col else "row", sequence_parallel=sp)
    if col:
        m = _linear(_shard(w, 0, rank), _shard(b, 0, rank), **kw)
        xin, gin = (_shard(x, 0, rank) if sp else x), _shard(g, 1, rank)
    else:
        m = _linear(_shard(w, 1, rank), b, **kw)
        xin, gin = _shard(x, 1, rank), (_shard(g, 0, rank) if sp else g)
    breaks = 0
    if compiled:
        cm = compile_fresh(m, recipe)
        got = _run(cm, xin, gin, recipe)
        got["dw"], got["db"] = m.weight.grad, m.bias.grad
        breaks = sum(counters["graph_break"].values())
    else:
        got = _run(m, xin, gin, recipe)
    return got, breaks


def _worker(rank, init_file, out_dir):
    init_worker(rank, WORLD, f"file://{init_file}")
    try:
        group = dist.new_group(list(range(WORLD)))
        results = {}
        for rid, recipe in RECIPES.items():
            for mode in MODES:
                same, full = _references(mode, recipe, rank)
                for compiled in (False, True):
                    got, breaks = _tp_case(mode, recipe, rank, group, compiled)
                    metrics = {"breaks": breaks}
                    for k in ("y", "dx", "dw", "db"):
                        assert got[k].shape == same[k].shape == full[k].shape, (rid, mode, k, got[k].shape)
                        metrics[f"same_{k}"] = (got[k] - same[k]).abs().max().item()
                        metrics[f"full_{k}"] = ((got[k] - full[k]).norm() / full[k].norm()).item()
                    results[(rid, mode, compiled)] = metrics
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return spawn_and_collect(_worker, tmp_path_factory, "tp", WORLD)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rid", list(RECIPES))
def test_tp_linear_matches_single_process(tp_results, rid, mode, compiled):
    for rank, res in enumerate(tp_results):
        m = res[(rid, mode, compiled)]
        for k in ("y", "dx", "dw", "db"):
            assert m[f"same_{k}"] <= SAME_TOL, (rank, k, m)
            assert m[f"full_{k}"] <= FULL_TOL[rid], (rank, k, m)
        assert m["breaks"] == 0


# ---- argument checks (in process) -----------------------------------------------------------------------
def test_unknown_parallel_mode():
    with pytest.raises(ValueError, match="parallel_mode"):
        te.Linear(64, 64, parallel_mode="columns", tp_size=2)


@pytest.mark.parametrize("mode,inf,outf", [("column", 64, 30), ("row", 30, 64)])
def test_tp_size_must_divide_features(mode, inf, outf):
    with pytest.raises(ValueError, match=r"features=30.*tp_size=4"):
        te.Linear(inf, outf, parallel_mode=mode, tp_size=4)


def test_bad_tp_size():
    with pytest.raises(ValueError, match="tp_size"):
        te.Linear(64, 64, parallel_mode="row", tp_size=0)


def test_unknown_kwarg_still_rejected():
    with pytest.raises(TypeError, match="unsupported"):
        te.Linear(64, 64, tensor_parallel=True)


def test_no_tp_arguments_unchanged():
    m = te.Linear(64, 32)
    assert m.weight.shape == (32, 64) and m.tp_size == 1 and m.parallel_mode is None
    assert m._tp_group_name is None


def test_group_size_mismatch(one_rank_group):  # noqa: F811  (pytest fixture)
    with pytest.raises(ValueError, match=r"tp_size=2.*tp_group \(1\)"):
        te.Linear(64, 64, parallel_mode="column", tp_group=one_rank_group, tp_size=2)


def test_one_rank_group_is_plain_linear(one_rank_group):  # noqa: F811  (pytest fixture)
    torch.manual_seed(0)
    tp = te.Linear(64, 32, parallel_mode="row", tp_group=one_rank_group)
    ref = te.Linear(64, 32)
    with torch.no_grad():
        ref.weight.copy_(tp.weight)
    x = torch.randn(8, 64)
    torch.testing.assert_close(tp(x), ref(x), rtol=0, atol=0)


def test_comm_ops_opcheck_and_autograd(one_rank_group):  # noqa: F811  (pytest fixture)
    from transformer_engine_proto.distributed import tp

    name = one_rank_group.group_name
    x = torch.randn(4, 8, requires_grad=True)
    for op, args in [(tp.all_reduce_sum, (name,)), (tp.copy_to_tp_region, (name,)),
                     (tp.all_gather_first_dim, (name, 1)), (tp.reduce_scatter_first_dim, (name, 1))]:
        torch.library.opcheck(op, (x,) + args)
        y = op(x, *args)
        torch.testing.assert_close(y, x)
        (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        torch.testing.assert_close(gx, torch.ones_like(x))


def test_tp_module_deepcopies(one_rank_group):  # noqa: F811  (pytest fixture)
    import copy

    m = te.Linear(64, 32, parallel_mode="column", tp_group=one_rank_group)
    m2 = copy.deepcopy(m)
    assert m2.tp_group is not None and m2._tp_group_name == m._tp_group_name


# ---- LayerNormLinear / LayerNormMLP / TransformerLayer (2 ranks) ---------------------------------------
# Each rank builds its TP module from the shards of a single-process reference's full weights, runs
# forward + backward on its input shard and compares output, input grad and every parameter grad
# with the reference's (sharded the same way). Grads of parameters marked `sequence_parallel`
# (norms under SP, row-parallel biases under SP) are partial per rank and all-reduced first, as a
# training loop does. LayerNormLinear row mode normalizes each rank's input shard (TE): its
# reference is the full Linear after per-shard norms.
# Relative (Frobenius) errors measured, max over cases / tensors / ranks / eager+compiled:
# high precision 3.3e-7 (mlp_sp norm.bias), MXFP8 (all shards 32-aligned, so each quantizes
# exactly as its part of the full tensor) 7.7e-8 (layer_sp qkv.norm.weight) -- reduction order only.
# With TE's separate query / key / value parameters the small query-bias grad (a 500th of the value
# bias's) measures 1.1e-6; the key bias's grad is zero in exact arithmetic (4.7e-8): its absolute norm.
# On GPU the bf16 rounding of the emulated MXFP8 GEMM (see BF16_GEMM_TOL) reaches the norm weight
# grads, which sum over every token: measured max 9.2e-3 (layer qkv.norm.weight) on 2 H200.
MOD_TOL = {"high_precision": 2e-6, "mxfp8": 2.0**-6 if ON_GPU else 2e-6}
MOD_RECIPES = {"high_precision": None, "mxfp8": R.MXFP8BlockScaling()}
MOD_CASES = ["lnl_column", "lnl_column_sp", "lnl_row", "lnl_row_sp", "mlp", "mlp_sp", "layer", "layer_sp"]
H, FFN, HEADS, SEQ, BATCH = 64, 128, 4, 16, 2  # 32 tokens


class _RowLNLRef(torch.nn.Module):
    """Full-weight reference of a row-parallel LayerNormLinear: a norm per input shard, one Linear."""

    def __init__(self):
        super().__init__()
        self.norms = torch.nn.ModuleList([te.LayerNorm(H // WORLD) for _ in range(WORLD)])
        self.lin = te.Linear(H, H)

    def forward(self, x):
        return self.lin(torch.cat([n(p) for n, p in zip(self.norms, x.chunk(WORLD, -1))], -1))


def _mod_case(case, rank, group):
    """(tp module, reference, full input, full grad_output, {tp param: (ref param, shard fn)}, in_dim, out_dim)."""
    sp = case.endswith("_sp")
    kw = dict(tp_group=group, tp_size=WORLD, sequence_parallel=sp)
    rep = lambda t: t  # noqa: E731
    c0 = lambda t: _shard(t, 0, rank)  # noqa: E731
    c1 = lambda t: _shard(t, 1, rank)  # noqa: E731
    gen = generator(1)
    if case.startswith("lnl_column"):
        ref, m = te.LayerNormLinear(H, 2 * H), te.LayerNormLinear(H, 2 * H, parallel_mode="column", **kw)
        pmap = {"layer_norm_weight": ("layer_norm_weight", rep), "layer_norm_bias": ("layer_norm_bias", rep),
                "weight": ("weight", c0), "bias": ("bias", c0)}
        x, g = torch.randn(SEQ * BATCH, H, generator=gen), torch.randn(SEQ * BATCH, 2 * H, generator=gen)
        dims = (0 if sp else None, -1)
    elif case.startswith("lnl_row"):
        ref, m = _RowLNLRef(), te.LayerNormLinear(H, H, parallel_mode="row", **kw)
        pmap = {"layer_norm_weight": (f"norms.{rank}.weight", rep), "layer_norm_bias": (f"norms.{rank}.bias", rep),
                "weight": ("lin.weight", c1), "bias": ("lin.bias", rep)}
        x, g = torch.randn(SEQ * BATCH, H, generator=gen), torch.randn(SEQ * BATCH, H, generator=gen)
        dims = (-1, 0 if sp else None)
    elif case.startswith("mlp"):
        ref = te.LayerNormMLP(H, FFN, activation="swiglu")
        m = te.LayerNormMLP(H, FFN, activation="swiglu", **kw)
        half = lambda t: te.LayerNormMLP.shard_fc1(t, "swiglu", WORLD, rank)  # noqa: E731  gated halves
        pmap = {"layer_norm_weight": ("layer_norm_weight", rep), "layer_norm_bias": ("layer_norm_bias", rep),
                "fc1_weight": ("fc1_weight", half), "fc1_bias": ("fc1_bias", half),
                "fc2_weight": ("fc2_weight", c1), "fc2_bias": ("fc2_bias", rep)}
        x, g = torch.randn(SEQ * BATCH, H, generator=gen), torch.randn(SEQ * BATCH, H, generator=gen)
        dims = (0 if sp else None, 0 if sp else None)
    else:
        lkw = dict(hidden_dropout=0.0, attention_dropout=0.0)
        ref, m = te.TransformerLayer(H, FFN, HEADS, **lkw), te.TransformerLayer(H, FFN, HEADS, **lkw, **kw)
        pmap = {}
        for name, _ in m.named_parameters():  # query/key/value_weight: each part column sharded
            if name.startswith(("self_attention.layernorm_qkv.query", "self_attention.layernorm_qkv.key",
                                "self_attention.layernorm_qkv.value", "layernorm_mlp.fc1_")):
                pmap[name] = (name, c0)
            elif name == "self_attention.proj.weight" or name == "layernorm_mlp.fc2_weight":
                pmap[name] = (name, c1)
            else:
                pmap[name] = (name, rep)
        x, g = torch.randn(SEQ, BATCH, H, generator=gen), torch.randn(SEQ, BATCH, H, generator=gen)
        dims = (0 if sp else None, 0 if sp else None)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        refp = dict(ref.named_parameters())
        for name, p in m.named_parameters():
            rname, fn = pmap[name]
            p.copy_(fn(refp[rname]))
    return m, ref, x, g, pmap, dims


def _module_step_errors(m, ref, x, g, pmap, dims, rank, group, recipe, compiled):
    """One fwd+bwd of the sharded module `m` (eager or compiled) and of the full `ref`: relative
    errors of the output, the input grad and every parameter grad against the matching shard of
    the reference's (sequence-parallel grads all-reduced first)."""
    din, dout = dims
    sh = lambda t, d: t if d is None else _shard(t, d, rank)  # noqa: E731
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    xr = x.clone().requires_grad_()
    with _ctx(recipe):
        yr = ref(xr)
    (yr * g).sum().backward()
    xl = sh(x, din).clone().requires_grad_()
    run = compile_fresh(m, recipe) if compiled else m
    with _ctx(recipe):
        y = run(xl)
    (y * sh(g, dout)).sum().backward()
    errs = {"y": rel(y.detach(), sh(yr.detach(), dout)), "dx": rel(xl.grad, sh(xr.grad, din))}
    refp = dict(ref.named_parameters())
    for name, p in m.named_parameters():
        grad = p.grad.clone()
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(grad, group=group)
        rname, fn = pmap[name]
        exp = fn(refp[rname].grad)
        assert grad.shape == exp.shape, (name, grad.shape, exp.shape)
        # softmax ignores a bias all keys share: its grad is zero but for rounding, compared absolutely
        errs[name] = max(grad.norm(), exp.norm()).item() if name.endswith("key_bias") else rel(grad, exp)
    return errs


def _mod_worker_cases(rank, group):
    from torch._dynamo.utils import counters

    results = {}
    for rid, recipe in MOD_RECIPES.items():
        for case in MOD_CASES:
            for compiled in (False, True):
                m, ref, x, g, pmap, dims = _mod_case(case, rank, group)
                errs = _module_step_errors(m, ref, x, g, pmap, dims, rank, group, recipe, compiled)
                results[(rid, case, compiled)] = {
                    "err": errs, "breaks": sum(counters["graph_break"].values()) if compiled else 0}
    return results


def _mod_worker(rank, init_file, out_dir):
    init_worker(rank, WORLD, f"file://{init_file}")
    try:
        group = dist.new_group(list(range(WORLD)))
        torch.save(_mod_worker_cases(rank, group), f"{out_dir}/mod_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_module_results(tmp_path_factory):
    return spawn_and_collect(_mod_worker, tmp_path_factory, "tp_mod", WORLD, prefix="mod_rank")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("case", MOD_CASES)
@pytest.mark.parametrize("rid", list(MOD_RECIPES))
def test_tp_modules_match_single_process(tp_module_results, rid, case, compiled):
    for rank, res in enumerate(tp_module_results):
        r = res[(rid, case, compiled)]
        for k, e in r["err"].items():
            assert e <= MOD_TOL[rid], (rank, k, r["err"])
        assert r["breaks"] == 0


def test_transformer_layer_heads_not_divisible():
    with pytest.raises(ValueError, match=r"num_attention_heads=6 is not divisible by tp_size=4"):
        te.TransformerLayer(96, 128, 6, tp_size=4)


def test_layernorm_mlp_ffn_not_divisible():
    with pytest.raises(ValueError, match=r"ffn_hidden_size=100 is not divisible by tp_size=3"):
        te.LayerNormMLP(64, 100, tp_size=3)


@pytest.mark.parametrize("mode,inf,outf", [("column", 64, 30), ("row", 30, 64)])
def test_layernorm_linear_tp_size_must_divide_features(mode, inf, outf):
    with pytest.raises(ValueError, match=r"features=30.*tp_size=4"):
        te.LayerNormLinear(inf, outf, parallel_mode=mode, tp_size=4)


def test_tp_modules_one_rank_group_unchanged(one_rank_group):  # noqa: F811  (pytest fixture)
    mlp = te.LayerNormMLP(64, 128, activation="swiglu", tp_group=one_rank_group, sequence_parallel=True)
    assert mlp.fc1_weight.shape == (256, 64) and mlp.tp_size == 1 and mlp._tp_group_name is None
    layer = te.TransformerLayer(64, 128, 4, tp_group=one_rank_group)
    assert layer.qkv.query_weight.shape == (64, 64) and layer.qkv.gemm_weight().shape == (192, 64)
    assert layer.local_heads == 4
    layer(torch.randn(8, 2, 64)).sum().backward()
