"""FSDP2 (`fully_shard`) on TE-proto modules with the weights all-gathered in the recipe's format.

One spawn of 2 processes (gloo on CPU; NCCL on 2 GPUs, see dist_harness) runs every distributed
case; each rank compares with a single-process reference built from the same weights and saves
its metrics, which the tests read:
  * "same data" (both ranks see the same batch), 2 steps with an SGD update in between: output,
    input grad and every parameter's gradient (after FSDP's reduce-scatter, `full_tensor()`) must
    equal the single-process module bitwise -- the gathered quantized weight is bit-identical to
    quantizing the full weight (per-tensor scales from the all-reduced amax, block scales from
    block-aligned shards), and averaging two identical gradients is exact. Eager and
    torch.compile(backend="aot_eager", fullgraph=True) of each FSDP unit's inner forward (FSDP2's
    hooks are `torch._dynamo.disable`d, so the unit's `__call__` cannot be one graph). Plus one
    step of bf16 mixed precision (`MixedPrecisionPolicy`) against a module holding bf16 weights.
  * "data parallel" (rank r sees its half of the batch), 1 step: rank r's output / input grad equal
    the single-process module on that half, the gradients equal the mean of the two halves'
    (division by 2 is exact) -- bitwise.
  * delayed scaling: after 2 data-parallel steps every rank holds the same scales, and the amaxes
    of step 1 are the max over ranks.
  * the all-gather moved quantized bytes (the all-gather inputs are counted by wrapping it).
"""
import contextlib
import copy
import re

import pytest
import torch
import torch.distributed as dist
from dist_harness import device_type, generator, init_worker, spawn_and_collect
from torch import nn

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.distributed import fsdp as F

WORLD = 2
H, FFN, HEADS, SEQ, BATCH = 256, 512, 4, 32, 2  # every weight's shard is a multiple of 128 rows
from linear_cases import RECIPES  # noqa: E402  (NVFP4 without stochastic rounding: runs must agree)

# out_features of a Linear whose FSDP shard cannot be gathered quantized (uneven or misaligned
# rows): per-tensor FP8 still gathers quantized (zero-padded shard), block formats fall back
ODD_OUT = {"high_precision": 97, "delayed": 97, "current": 97, "mxfp8": 96, "block": 96, "nvfp4": 48}
EXPECTED_KIND = {"high_precision": "hp", "delayed": "fp8", "current": "fp8", "mxfp8": "mxfp8",
                 "block": "blockwise", "nvfp4": "nvfp4"}
ODD_KIND = {"high_precision": "hp", "delayed": "fp8", "current": "fp8", "mxfp8": "hp", "block": "hp", "nvfp4": "hp"}
LR = 0.5


def _ctx(recipe):
    return contextlib.nullcontext() if recipe is None else te.autocast(recipe=recipe)


def _build(case, rid):
    gen = generator(3)
    if case == "linear":
        model = te.Linear(H, H)
        x, g = torch.randn(SEQ * BATCH, H, generator=gen), torch.randn(SEQ * BATCH, H, generator=gen)
    elif case == "linear_odd":
        model = te.Linear(64, ODD_OUT[rid])
        x, g = torch.randn(SEQ * BATCH, 64, generator=gen), torch.randn(SEQ * BATCH, ODD_OUT[rid], generator=gen)
    else:
        kw = dict(hidden_dropout=0.0, attention_dropout=0.0, fuse_qkv_params=True)  # one QKV weight to gather
        model = nn.Sequential(te.TransformerLayer(H, FFN, HEADS, **kw), te.TransformerLayer(H, FFN, HEADS, **kw))
        x, g = torch.randn(SEQ, BATCH, H, generator=gen), torch.randn(SEQ, BATCH, H, generator=gen)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model, x, g


def _shard_model(model, mesh, compiled, mp_policy=None):
    """enable_quantized_all_gather + fully_shard (each layer, then the root); compiled: each FSDP
    unit's inner forward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    F.enable_quantized_all_gather(model)
    kw = dict(mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy or MixedPrecisionPolicy())
    units = list(model) if isinstance(model, nn.Sequential) else []
    for u in units:
        fully_shard(u, **kw)
    fully_shard(model, **kw)  # root too: reshard after forward, so the backward re-gathers
    if compiled:
        for u in units or [model]:
            u.forward = torch.compile(u.forward, backend="aot_eager", fullgraph=True)
    return model


def _full_grads(model):
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        out[name] = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return out


def _step(model, x, g, recipe):
    x = x.clone().requires_grad_()
    with _ctx(recipe):
        y = model(x)
    (y * g).sum().backward()
    return y.detach(), x.grad


def _sgd(model):
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(LR * p.grad)
            p.grad = None


def _diff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    d = (a.float() - b.float()).abs().max().item()
    rel = ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
    return d, rel


def _same_data_case(case, rid, mesh, compiled):
    """Both ranks on the full batch: FSDP vs single process, per step and tensor. 2 steps with an
    SGD update between; "linear_bf16": 1 step of FSDP2 bf16 mixed precision (fp32 master weights)
    vs a single-process module holding the bf16 weights."""
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import MixedPrecisionPolicy

    recipe = RECIPES[rid]
    bf16 = case == "linear_bf16"
    ref, x, g = _build("linear" if bf16 else case, rid)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    model = _shard_model(copy.deepcopy(ref), mesh, compiled, policy)
    if bf16:
        for p in ref.parameters():
            p.data = p.data.bfloat16()
    torch._dynamo.reset()
    counters.clear()
    errs = {}
    for step in range(1 if bf16 else 2):
        xr, gr = (x.bfloat16(), g.bfloat16()) if bf16 else (x, g)
        yr, dxr = _step(ref, xr, gr, recipe)
        y, dx = _step(model, x, gr, recipe)  # FSDP casts the input to bf16
        errs[f"{step}.y"], errs[f"{step}.dx"] = _diff(y, yr), _diff(dx, dxr)
        got, exp = _full_grads(model), _full_grads(ref)
        for name in exp:
            errs[f"{step}.d{name}"] = _diff(got[name], exp[name])
        _sgd(ref)
        _sgd(model)
        F.precompute_fp8_scales_for_fsdp(model)
    return {"err": errs, "breaks": sum(counters["graph_break"].values())}


def _dp_case(rid, mesh, rank):
    """1 step, rank r on half r of the batch: vs the single-process module on each half."""
    recipe = RECIPES[rid]
    ref, x, g = _build("layers", rid)
    halves = [copy.deepcopy(ref) for _ in range(WORLD)]
    model = _shard_model(copy.deepcopy(ref), mesh, False)
    xs, gs = x.chunk(WORLD, 1), g.chunk(WORLD, 1)  # [seq, batch, hidden]: split the batch
    outs = [_step(m, xi.contiguous(), gi.contiguous(), recipe) for m, xi, gi in zip(halves, xs, gs)]
    y, dx = _step(model, xs[rank].contiguous(), gs[rank].contiguous(), recipe)
    errs = {"y": _diff(y, outs[rank][0]), "dx": _diff(dx, outs[rank][1])}
    got, parts = _full_grads(model), [_full_grads(m) for m in halves]
    for name in got:
        errs[f"d{name}"] = _diff(got[name], (parts[0][name] + parts[1][name]) / WORLD)
    result = {"err": errs}
    if isinstance(recipe, R.DelayedScaling):  # step 2: amaxes reduced, scales identical everywhere
        gemms = [m for m in model.modules() if type(m).__name__ == "QuantizedGemm"]
        pending = [torch.cat([q.amax_history[0], q.grad_amax_pending[0:1]]) for q in gemms]
        _sgd(model)
        _step(model, xs[rank].contiguous(), gs[rank].contiguous(), recipe)
        last = recipe.amax_history_len - 1  # the scale update rolls slot 0 to the end of the history
        state = [torch.cat([q.fp8_scale, q.grad_fp8_scale, q.amax_history[last], q.grad_amax_history[last]])
                 for q in gemms]
        mine = torch.stack(state)
        every = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(every, mine)
        pend = torch.stack(pending)
        pend_all = [torch.empty_like(pend) for _ in range(WORLD)]
        dist.all_gather(pend_all, pend)
        result["scales_equal"] = all(torch.equal(e, mine) for e in every)
        result["amax_is_max"] = torch.equal(mine[:, 3:], torch.maximum(*pend_all))
        result["amax_differs"] = not torch.equal(*pend_all)  # the data halves really differ
    return result


def _bytes_case(rid, mesh):
    """The all-gather inputs (dtype, bytes) of one forward of a bias-free Linear(H, H)."""
    seen = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    saved = {n: getattr(dist, n) for n in names}

    def spy(orig):
        def wrapped(output, input, *args, **kwargs):
            seen.append((input.dtype, input.numel() * input.element_size()))
            return orig(output, input, *args, **kwargs)
        return wrapped

    model = te.Linear(H, H, bias=False)
    _shard_model(model, mesh, False)
    x = torch.randn(SEQ * BATCH, H)
    try:
        for n in names:
            setattr(dist, n, spy(saved[n]))
        with _ctx(RECIPES[rid]):
            model(x)
    finally:
        for n in names:
            setattr(dist, n, saved[n])
    return {"seen": seen}


def _errors_case(mesh):
    """Bad input raises clear errors on both ranks (before any collective, so no rank hangs)."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    m = te.Linear(64, 96)  # MXFP8: a shard of 48 rows is not a multiple of 32
    F.enable_quantized_all_gather(m, strict=True)
    fully_shard(m, mesh=mesh)
    try:
        with _ctx(RECIPES["mxfp8"]):
            m(torch.randn(32, 64))
    except ValueError as e:
        out["strict"] = str(e)
    try:
        F.enable_quantized_all_gather(m)
    except ValueError as e:
        out["after_fully_shard"] = str(e)
    m = te.Linear(64, 64)
    F.enable_quantized_all_gather(m)
    fully_shard(m, mesh=mesh)
    with _ctx(RECIPES["current"]):
        m(torch.randn(32, 64)).sum().backward()
    try:
        with _ctx(RECIPES["mxfp8"]):
            m(torch.randn(32, 64))
    except RuntimeError as e:
        out["format_change"] = str(e)
    return out


def _worker(rank, init_file, out_dir):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore")
    init_worker(rank, WORLD, f"file://{init_file}")
    torch.manual_seed(0)
    try:
        mesh = init_device_mesh(device_type(), (WORLD,))
        res = {}
        for rid in RECIPES:
            for case in ("linear", "linear_odd", "linear_bf16", "layers"):
                for compiled in (False, True):
                    if compiled and case != "layers":
                        continue
                    res[("same", rid, case, compiled)] = _same_data_case(case, rid, mesh, compiled)
            res[("dp", rid)] = _dp_case(rid, mesh, rank)
            res[("bytes", rid)] = _bytes_case(rid, mesh)
        res["errors"] = _errors_case(mesh)
        torch.save(res, f"{out_dir}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return spawn_and_collect(_worker, tmp_path_factory, "fsdp", WORLD)


SAME_CASES = [(rid, case, compiled) for rid in RECIPES for case, compiled in
              (("linear", False), ("linear_odd", False), ("linear_bf16", False), ("layers", False), ("layers", True))]


@pytest.mark.parametrize("rid,case,compiled", SAME_CASES,
                         ids=[f"{r}-{c}-{'compiled' if k else 'eager'}" for r, c, k in SAME_CASES])
def test_fsdp_matches_single_process(fsdp_results, rid, case, compiled):
    for rank, res in enumerate(fsdp_results):
        r = res[("same", rid, case, compiled)]
        bad = {k: v for k, v in r["err"].items() if v[0] != 0.0}
        assert not bad, (rank, bad)  # bitwise
        assert r["breaks"] == 0


@pytest.mark.parametrize("rid", list(RECIPES))
def test_fsdp_data_parallel_matches_per_shard_reference(fsdp_results, rid):
    for rank, res in enumerate(fsdp_results):
        r = res[("dp", rid)]
        bad = {k: v for k, v in r["err"].items() if v[0] != 0.0}
        assert not bad, (rank, bad)
        if rid == "delayed":
            assert r["amax_differs"] and r["amax_is_max"] and r["scales_equal"], r


@pytest.mark.parametrize("rid", list(RECIPES))
def test_fsdp_all_gather_moves_quantized_bytes(fsdp_results, rid):
    shard = H // WORLD * H  # elements of one rank's weight shard
    expected = {"high_precision": [(torch.float32, 4 * shard)],
                "delayed": [(torch.uint8, shard)], "current": [(torch.uint8, shard)],
                # data + (1x32 rowwise, 32x1 columnwise) E8M0 scales, both usages
                "mxfp8": [(torch.uint8, 2 * shard + 2 * shard // 32)],
                # rowwise data + one fp32 scale per 128x128 tile
                "block": [(torch.uint8, shard + 4 * shard // (128 * 128))],
                # packed E2M1 data + an E4M3 scale per 16 values
                "nvfp4": [(torch.uint8, shard // 2 + shard // 16)]}[rid]
    for res in fsdp_results:
        assert res[("bytes", rid)]["seen"] == expected


def test_fsdp_gather_format_table():
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    for rid, rec in RECIPES.items():
        assert F.gather_format(RecipeKey.of(rec), (H, H), WORLD)[0] == EXPECTED_KIND[rid]
        assert F.gather_format(RecipeKey.of(rec), (ODD_OUT[rid], 64), WORLD)[0] == ODD_KIND[rid]
    kind, why = F.gather_format(RecipeKey.of(RECIPES["mxfp8"]), (96, 64), WORLD)
    assert kind == "hp" and "(96, 64)" in why and "48 rows" in why and "block of 32" in why
    kind, why = F.gather_format(RecipeKey.of(R.Float8BlockScaling(w_block_scaling_dim=1)), (256, 256), WORLD)
    assert kind == "hp" and "1x128" in why
    kind, why = F.gather_format(RecipeKey.of(R.NVFP4BlockScaling(disable_2d_quantization=True)), (256, 256), WORLD)
    assert kind == "hp" and "1D" in why


def test_fsdp_bad_input_errors(fsdp_results):
    for res in fsdp_results:
        e = res["errors"]
        assert re.search(r"strict.*\(96, 64\).*48 rows.*block of 32", e["strict"]), e
        assert "before fully_shard" in e["after_fully_shard"]
        assert "cannot change after the first all-gather" in e["format_change"]
