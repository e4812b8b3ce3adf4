"""Per-GEMM precision: pins and the GemmPolicy.

A GEMM kept in high precision gives bitwise the bf16 path's result and a quantized one the
recipe's; the policy's choice follows its cost table, never overrides a pin, is the same in
eager and compiled runs and in another process, and never measures in a multi-process run.
"""
import itertools
import json
import math
import subprocess
import sys

import pytest
import torch
from linear_cases import QUANTIZED_IDS, RECIPES, backend_params, fresh_dynamo, graph_breaks

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.precision import policy as P
from transformer_engine_proto.precision.cost_model import CostTable, gemm_shapes

SUBSETS = [frozenset(c) for r in range(4) for c in itertools.combinations(("fprop", "dgrad", "wgrad"), r)]
M, N, K = 48, 128, 256  # 48 tokens: MXFP8 / NVFP4 pad the wgrad operands' rows


def _run(module, x, recipe, pins=None):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    if pins is not None:
        te.pin_gemm_precision(module, **{g: "bf16" for g in pins})
    ctx = te.autocast(recipe=recipe) if recipe is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        y = module(x)
    y.backward(torch.linspace(-2, 2, y.numel()).reshape(y.shape).to(y.dtype))
    weight = getattr(module, "_orig_mod", module).weight
    return y.detach(), x.grad, weight.grad


def _fresh(cls, seed=0):
    torch.manual_seed(seed)
    if cls is te.Linear:
        return te.Linear(K, N, bias=True, params_dtype=torch.bfloat16)
    return te.LayerNormLinear(K, N, bias=True, params_dtype=torch.bfloat16)


@pytest.mark.parametrize("cls", [te.Linear, te.LayerNormLinear], ids=["Linear", "LayerNormLinear"])
@pytest.mark.parametrize("recipe_id", QUANTIZED_IDS)
def test_pinned_gemms_bitwise(cls, recipe_id):
    """Each GEMM pinned to bf16 returns the bf16 path's bits; each other GEMM the recipe's."""
    recipe = RECIPES[recipe_id]
    x = torch.randn(M, K, dtype=torch.bfloat16)
    bf16 = _run(_fresh(cls), x, None)
    full = _run(_fresh(cls), x, recipe)
    for hp in SUBSETS:
        got = _run(_fresh(cls), x, recipe, pins=hp)
        for i, gemm in enumerate(("fprop", "dgrad", "wgrad")):
            want = bf16[i] if gemm in hp else full[i]
            # dgrad / wgrad read grad_output, which is the same in every run (the loss is linear)
            assert torch.equal(got[i], want), (recipe_id, sorted(hp), gemm)


def test_pins_apply_without_recipe_change_and_validate():
    m = _fresh(te.Linear)
    assert te.pin_gemm_precision(m, fprop="bf16", wgrad="fp8") == 1
    assert m.gemm.pinned_precision == "fprop=high_precision,wgrad=recipe"
    with pytest.raises(ValueError, match="unknown GEMM|expected one of"):
        te.pin_gemm_precision(m, fprop="int8")
    with pytest.raises(ValueError, match="holds no quantized GEMM"):
        te.pin_gemm_precision(torch.nn.Linear(2, 2), fprop="bf16")


# ---- the policy -------------------------------------------------------------------------------
def _synthetic_table(path, fp8_speedup=2.0, fp8_overhead_ms=0.02):
    """bf16 GEMMs at 1 TFLOP/s + 5 us; the recipe's at `fp8_speedup` the rate + an overhead;
    quantizes at 3 bytes / ns. Small GEMMs favour bf16, large ones the recipe."""
    grid = (16, 64, 256, 1024, 4096)
    t = CostTable("synthetic", grid=grid)
    for m, n, k in itertools.product(grid, repeat=3):
        flops = 2 * m * n * k
        t.add_gemm("bf16", "fprop", m, n, k, 5e-3 + flops / 1e9)
        t.add_gemm("Float8CurrentScaling", "fprop", m, n, k, fp8_overhead_ms + flops / (1e9 * fp8_speedup))
    for role in ("input", "weight", "grad"):
        for r, c in ((True, False), (False, True), (True, True)):
            for numel in (2 ** 10, 2 ** 20, 2 ** 24):
                t.add_quantize("Float8CurrentScaling", role, numel, r, c, 2e-3 + numel * (2 + r + c) / 3e6)
    t.save(str(path))
    return str(path)


def _expected(table_path, m, n, k, margin=0.02, pins=None):
    """The choice by brute force over the table (independent of policy.decide's bookkeeping)."""
    t = CostTable.load(table_path)
    pins = pins or {}
    shapes = gemm_shapes(m, n, k)
    best = None
    for bits in itertools.product((False, True), repeat=3):
        q = dict(zip(("fprop", "dgrad", "wgrad"), bits))
        if any((pins.get(g) == "bf16" and q[g]) or (pins.get(g) == "fp8" and not q[g]) for g in q):
            continue
        total = sum(t.gemm_ms("Float8CurrentScaling" if q[g] else "bf16", g, *shapes[g]) for g in q)
        qz = lambda role, numel, r, c: t.quantize_ms("Float8CurrentScaling", role, numel, r, c) if (r or c) else 0  # noqa: E731
        total += qz("input", m * k, q["fprop"], q["wgrad"]) + qz("weight", n * k, q["fprop"], False)
        total += qz("weight", n * k, False, q["dgrad"]) + qz("grad", m * n, q["dgrad"], q["wgrad"])
        score = total * (1 + margin) if any(bits) else total
        if best is None or score < best[0]:
            best = (score, frozenset(g for g in q if not q[g]))
    return best[1]


@pytest.mark.parametrize("shape", [(16, 16, 16), (4096, 4096, 4096), (4096, 64, 4096), (256, 1024, 1024),
                                   (3000, 700, 5000)])
def test_policy_follows_table(tmp_path, shape):
    path = _synthetic_table(tmp_path / "t.json")
    d = P.decide(te.GemmPolicy(table=path), R.Float8CurrentScaling(), torch.device("cpu"), *shape, True, {})
    assert d.high_precision == _expected(path, *shape)
    assert d.predicted_ms <= min(d.bf16_ms, d.recipe_ms) + 1e-12


def test_policy_extremes(tmp_path):
    path = _synthetic_table(tmp_path / "t.json")
    policy = te.GemmPolicy(table=path)
    small = P.decide(policy, R.Float8CurrentScaling(), torch.device("cpu"), 16, 16, 16, True, {})
    large = P.decide(policy, R.Float8CurrentScaling(), torch.device("cpu"), 4096, 4096, 4096, True, {})
    assert small.high_precision == {"fprop", "dgrad", "wgrad"}
    assert large.high_precision == frozenset()
    # pins win over the table both ways
    pinned = P.decide(policy, R.Float8CurrentScaling(), torch.device("cpu"), 4096, 4096, 4096, True,
                      {"dgrad": P.HIGH})
    assert "dgrad" in pinned.high_precision and "fprop" not in pinned.high_precision
    pinned = P.decide(policy, R.Float8CurrentScaling(), torch.device("cpu"), 16, 16, 16, True, {"wgrad": P.RECIPE})
    assert "wgrad" not in pinned.high_precision


def test_cost_table_grid_interpolation(tmp_path):
    t = CostTable.load(_synthetic_table(tmp_path / "t.json"))
    assert t.gemm_ms("bf16", "fprop", 256, 256, 256) == pytest.approx(5e-3 + 2 * 256 ** 3 / 1e9)
    # between grid points: between the neighbours' times
    mid = t.gemm_ms("bf16", "dgrad", 512, 256, 256)
    assert t.gemm_ms("bf16", "fprop", 256, 256, 256) < mid < t.gemm_ms("bf16", "fprop", 1024, 256, 256)
    # beyond the grid: grows with the flops
    twice = 2 * t.gemm_ms("bf16", "fprop", 4096, 4096, 4096)
    assert t.gemm_ms("bf16", "fprop", 8192, 4096, 4096) == pytest.approx(twice)
    assert t.gemm_ms("MXFP8BlockScaling", "fprop", 256, 256, 256) is None  # no grid for that kind
    q = t.quantize_ms("Float8CurrentScaling", "input", 2 ** 22, True, True)
    assert t.quantize_ms("Float8CurrentScaling", "input", 2 ** 20, True, True) < q < \
        t.quantize_ms("Float8CurrentScaling", "input", 2 ** 24, True, True)
    t.add_gemm("bf16", "wgrad", 7, 7, 7, 1.5)  # an exact point wins
    assert t.gemm_ms("bf16", "wgrad", 7, 7, 7) == 1.5 and not math.isclose(t.gemm_ms("bf16", "fprop", 7, 7, 7), 1.5)


def _policy_model(path):
    torch.manual_seed(0)
    return torch.nn.Sequential(te.Linear(1024, 4096, bias=False), te.Linear(4096, 64, bias=False),
                               te.Linear(64, 16, bias=False))


def _choices(model):
    return [P.decisions()[g._debug_uid].high_precision for g in (m.gemm for m in model)]


@pytest.mark.parametrize("backend", backend_params())
def test_policy_same_in_eager_compiled_and_another_process(tmp_path, backend):
    path = _synthetic_table(tmp_path / "t.json", fp8_speedup=4.0, fp8_overhead_ms=0.005)
    policy = te.GemmPolicy(table=path)
    recipe = R.Float8CurrentScaling()
    x = torch.randn(512, 1024, dtype=torch.float32, requires_grad=True)
    model = _policy_model(path)
    with te.autocast(recipe=recipe, gemm_policy=policy):
        model(x).sum().backward()
    eager = _choices(model)
    want = [_expected(path, 512, n, k) for n, k in ((4096, 1024), (64, 4096), (16, 64))]
    assert eager == want
    assert len(set(eager)) > 1, "the synthetic table should make the layers choose differently"
    report = te.precision_report(model)
    assert report.count("\n") == len(model) + 2 and "bf16" in report

    P.decisions().clear()
    fresh_dynamo()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with te.autocast(recipe=recipe, gemm_policy=policy):
        compiled(x).sum().backward()
    assert graph_breaks() == 0
    assert _choices(model) == eager

    code = (f"import torch, transformer_engine_proto as te; from transformer_engine_proto import recipe as R;"
            f"from transformer_engine_proto.precision import policy as P;"
            f"p = te.GemmPolicy(table={path!r});"
            f"print([sorted(P.decide(p, R.Float8CurrentScaling(), torch.device('cpu'), 512, n, k, True, {{}})"
            f".high_precision) for n, k in ((4096, 1024), (64, 4096), (16, 64))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.replace("'", '"')) == [sorted(c) for c in eager]


def test_policy_off_by_default_and_keys_unchanged():
    m = _fresh(te.Linear)
    x = torch.randn(M, K, dtype=torch.bfloat16)
    with te.autocast(recipe=R.Float8CurrentScaling()):
        from transformer_engine_proto.autocast import get_fp8_recipe_key
        assert m.gemm.op_key(get_fp8_recipe_key(), x, m.weight) == get_fp8_recipe_key()


def test_no_measurement_in_multi_process_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TE_PROTO_CACHE_DIR", str(tmp_path))
    P.cost_table.cache_clear()
    monkeypatch.setattr(P, "_multi_process", lambda: True)
    with pytest.raises(RuntimeError, match="multi-process run"):
        P.decide(te.GemmPolicy(), R.Float8CurrentScaling(), torch.device("cpu"), 32, 32, 32, True, {})
    with pytest.raises(RuntimeError, match="calibrate=False"):
        monkeypatch.setattr(P, "_multi_process", lambda: False)
        P.decide(te.GemmPolicy(calibrate=False), R.Float8CurrentScaling(), torch.device("cpu"), 32, 32, 32, True, {})
    P.cost_table.cache_clear()


def test_calibration_measures_once_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("TE_PROTO_CACHE_DIR", str(tmp_path))
    P.cost_table.cache_clear()
    calls = []
    from transformer_engine_proto.precision import calibrate

    monkeypatch.setattr(calibrate, "time_ms", lambda fn, device, **kw: calls.append(1) or 1.0)
    d = P.decide(te.GemmPolicy(), R.Float8CurrentScaling(), torch.device("cpu"), 32, 64, 32, True, {})
    n = len(calls)
    assert n > 0 and d.high_precision  # equal GEMM times: the margin keeps bf16
    P.cost_table.cache_clear()  # a new process: reads the cache file, measures nothing
    P.decide(te.GemmPolicy(), R.Float8CurrentScaling(), torch.device("cpu"), 32, 64, 32, True, {})
    assert len(calls) == n
    P.cost_table.cache_clear()


def test_gemm_policy_validates():
    with pytest.raises(ValueError, match="margin"):
        te.GemmPolicy(margin=1.5)
    with pytest.raises(FileNotFoundError, match="cost table"):
        te.GemmPolicy(table="/nonexistent.json")
    with pytest.raises(TypeError, match="GemmPolicy"):
        with te.autocast(recipe=R.Float8CurrentScaling(), gemm_policy="auto"):
            pass


@pytest.mark.parametrize("backend, recipe_id", backend_params(["current", "delayed", "mxfp8"]))
def test_pinned_compiled_matches_eager(backend, recipe_id):
    """Compiled == eager bitwise with GEMMs pinned to bf16."""
    recipe = RECIPES[recipe_id]
    x = torch.randn(M, K, dtype=torch.bfloat16)
    for hp in (frozenset({"fprop"}), frozenset({"dgrad", "wgrad"})):
        eager = _run(_fresh(te.Linear), x, recipe, pins=hp)
        fresh_dynamo()
        m = _fresh(te.Linear)
        te.pin_gemm_precision(m, **{g: "bf16" for g in hp})
        compiled = torch.compile(m, backend=backend, fullgraph=True)
        got = _run(compiled, x, recipe)
        assert graph_breaks() == 0
        for a, b in zip(got, eager):
            assert torch.equal(a, b), (recipe_id, sorted(hp))


@pytest.mark.parametrize("disable", [None, ["fprop"]])
def test_debug_path_keeps_pins_and_may_disable_more(tmp_path, disable):
    """A layer on the debug path (inspecting features, optionally DisableFp8Gemm) runs the pinned
    GEMMs in bf16 too: the same bits as the fast path with pins for the union of both."""
    from test_debug_common import debug_session

    features = {"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation", "gradient"]}}
    if disable:
        features["DisableFp8Gemm"] = {"enabled": True, "gemms": disable}
    cfg = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "lin"}, "transformer_engine": features}}
    x = torch.randn(M, K, dtype=torch.bfloat16)
    recipe = R.Float8CurrentScaling()
    want = _run(_fresh(te.Linear), x, recipe, pins={"wgrad", *(disable or ())})
    torch.manual_seed(0)
    dbg = te.Linear(K, N, bias=True, params_dtype=torch.bfloat16, name="lin")
    with debug_session(tmp_path, cfg):
        got = _run(dbg, x, recipe, pins={"wgrad"})
        from transformer_engine_proto.debug import state
        assert state.route(dbg.gemm, True) == "lin"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_pins_with_the_weight_cache_match_no_cache():
    """is_first_microbatch (the quantized-weight cache) with fprop pinned to bf16: the same bits
    as without the cache (dgrad reads the cached FP8 weight, fprop the bf16 weight)."""
    x = torch.randn(M, K, dtype=torch.bfloat16)
    recipe = R.Float8CurrentScaling()
    plain = _run(_fresh(te.Linear), x, recipe, pins={"fprop"})
    m = _fresh(te.Linear)
    te.pin_gemm_precision(m, fprop="bf16")
    for first in (True, False):
        m.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with te.autocast(recipe=recipe):
            y = m(xi, is_first_microbatch=first)
        y.backward(torch.linspace(-2, 2, y.numel()).reshape(y.shape).to(y.dtype))
        for a, b in zip((y.detach(), xi.grad, m.weight.grad), plain):
            assert torch.equal(a, b), first


def test_weights_stored_quantized_keep_fprop_and_dgrad_in_the_recipe(tmp_path):
    """quantized_model_init: the policy may move wgrad to bf16 but never fprop / dgrad (they read
    the stored FP8 weight, which in bf16 they would read dequantized)."""
    path = _synthetic_table(tmp_path / "t.json")  # small GEMMs: every GEMM bf16 if free to choose
    recipe = R.Float8CurrentScaling()
    with te.quantized_model_init(recipe=recipe):
        m = te.Linear(64, 64, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=recipe, gemm_policy=te.GemmPolicy(table=path)):
        m(x).float().sum().backward()
    assert P.decisions()[m.gemm._debug_uid].high_precision == {"wgrad"}


@pytest.mark.parametrize("recipe_id", ["current", "mxfp8", "block"])
@pytest.mark.parametrize("pins, override", [({"fprop"}, None), ((), "high_precision"),
                                            ({"fprop"}, "high_precision")], ids=["fprop", "backward", "all"])
def test_weights_stored_quantized_in_high_precision_read_them_dequantized(recipe_id, pins, override):
    """A GEMM pinned to bf16, or dgrad / wgrad by `backward_override="high_precision"`, on a weight
    stored quantized: the bf16 GEMM against `weight.dequantize()`, bit for bit (as TE's); the
    weight's gradient reaches the stored parameter."""
    recipe = type(RECIPES[recipe_id])(backward_override=override)
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe):
        m = te.Linear(K, N, bias=True, params_dtype=torch.bfloat16)
    ref = te.Linear(K, N, bias=True, params_dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(m.weight.dequantize())
    x = torch.randn(M, K, dtype=torch.bfloat16)
    got, want, quantized = _run(m, x, recipe, pins), _run(ref, x, None), _run(ref, x, recipe)
    hp = set(pins) | ({"dgrad", "wgrad"} if override else set())
    for i, gemm in enumerate(("fprop", "dgrad", "wgrad")):
        if gemm in hp:
            assert torch.equal(got[i], want[i]), gemm
    if "fprop" in hp:
        assert not torch.equal(got[0], quantized[0])  # the recipe's fprop would differ
    assert got[2] is not None and got[2].shape == (N, K)


def test_report_measures_when_asked(tmp_path, monkeypatch):
    """precision_report(measure=True) adds each GEMM's measured bf16 / recipe ms next to the
    prediction (the timer stubbed: 0.5 ms bf16, 0.25 ms recipe)."""
    from transformer_engine_proto.precision import calibrate

    path = _synthetic_table(tmp_path / "t.json")
    m = _fresh(te.Linear)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=R.Float8CurrentScaling(), gemm_policy=te.GemmPolicy(table=path)):
        m(x).float().sum().backward()
    monkeypatch.setattr(calibrate, "measure_gemm", lambda recipe, g, *a: 0.5 if recipe is None else 0.25)
    report = te.precision_report(m, measure=True)
    assert "measured" in report.splitlines()[0]
    assert report.count("-> 0.500/0.250") == 3, report


def test_calibrate_grid_fills_a_table_the_policy_can_use(monkeypatch, tmp_path):
    """The shipped-table measurement on a tiny grid: every recipe's GEMM and quantize calls run once
    (the timer stubbed), and the saved table predicts any shape for every kind."""
    from transformer_engine_proto.precision import calibrate

    def once(fn, device, **kw):
        fn()
        return 1.0

    monkeypatch.setattr(calibrate, "time_ms", once)
    monkeypatch.setattr(calibrate, "_QUANTIZE_ROWS", (32, 64))
    recipes = [R.Float8CurrentScaling(), R.DelayedScaling(), R.MXFP8BlockScaling(), R.Float8BlockScaling(),
               R.NVFP4BlockScaling()]
    table = calibrate.calibrate_grid(recipes, "cpu", CostTable("cpu"), grid=(128, 256), log=lambda *_: None,
                                     save=lambda t: t.save(str(tmp_path / "t.json")))
    loaded = CostTable.load(str(tmp_path / "t.json"))
    for kind in ["bf16"] + [type(r).__name__ for r in recipes]:
        assert len(loaded.gemm[kind]) == 8, kind
        assert loaded.gemm_ms(kind, "wgrad", 200, 300, 1000) is not None
        if kind != "bf16":
            assert loaded.quantize_ms(kind, "grad", 5000, True, True) is not None
    assert loaded.to_json() == table.to_json()
