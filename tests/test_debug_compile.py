"""Precision debug tools under torch.compile(fullgraph=True): no graph breaks, the same stats, dumps
and numbers as eager, the fast path untouched, and one recompile per distinct routing decision."""
import copy
import math

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from compile_cases import ULPS, assert_matches_eager, compile_for
from linear_cases import backend_params
from test_debug_common import debug_session, max_stats_config
from test_debug_features import CUSTOM_CONFIG, write_custom_features
from torch._dynamo.utils import counters

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.debug import last_logged_stats


def _fresh():
    torch._dynamo.reset()
    counters.clear()


def _graph_breaks():
    return sum(counters["graph_break"].values())


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = te.Linear(64, 64, name="fc1")
        self.b = te.LayerNormMLP(64, 64, name="mlp")
        self.c = te.Linear(64, 64, name="other")

    def forward(self, x):
        return self.c(self.b(self.a(x)))


WINDOWED = {
    "stats": {"enabled": True, "layers": {"layer_types": ["fc1"]},
              "transformer_engine": {"LogTensorStats": {"enabled": True,
                                                        "stats": ["max", "std", "l2_norm", "dynamic_range"],
                                                        "tensors": ["activation", "gradient", "weight", "output"],
                                                        "start_end_list": [[2, 3], [6, 6]]},
                                     "LogFp8TensorStats": {"enabled": True, "tensors": ["activation", "gradient"],
                                                           "stats": ["underflows%", "mse", "mxfp8_mse"],
                                                           "start_end_list": [[2, 3], [6, 6]]}}},
    "disable": {"enabled": True, "layers": {"layer_types": ["mlp.fc2"]},
                "transformer_engine": {"DisableFp8Gemm": {"enabled": True, "gemms": ["fprop", "wgrad"]}}},
}


def _run(model, cfg, tmp_path, name, steps, recipe, feature_dirs=()):
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    logs, outs = [], []
    with debug_session(tmp_path, cfg, feature_dirs=feature_dirs, name=name):
        for _ in range(steps):
            xi = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                y = model(xi)
            y.sum().backward()
            outs.append((y.detach(), xi.grad))
            debug_api.step()
            logs.append(last_logged_stats())
    return logs, outs


def _assert_logs_match(comp_logs, eager_logs, backend):
    """Equal; under inductor the stats of tensors it computes a few float32 ulps apart (see
    compile_cases) agree to 1e-5 relative, and dynamic_range (log2 of the largest over the smallest
    nonzero magnitude, which is off by as much as the largest) to log2(1 + ULPS eps 2**range)."""
    if backend != "inductor":
        assert comp_logs == eager_logs
        return
    assert len(comp_logs) == len(eager_logs)
    eps = ULPS[torch.float32] * torch.finfo(torch.float32).eps
    for i, (c, e) in enumerate(zip(comp_logs, eager_logs)):
        assert c.keys() == e.keys(), i
        for k, v in e.items():
            tol = math.log2(1 + eps * 2**v) if k.endswith("dynamic_range") else 1e-5 * abs(v)
            assert abs(c[k] - v) <= tol, (i, k, c[k], v)


@pytest.mark.parametrize("backend", backend_params())
def test_compiled_matches_eager_and_recompiles_once_per_decision(tmp_path, backend):
    _fresh()
    torch.manual_seed(1)
    m = Net()
    mc = copy.deepcopy(m)
    cm = compile_for(mc, backend)
    recipe = R.Float8CurrentScaling()
    eager_logs, eager_outs = _run(m, WINDOWED, tmp_path, "eager", 8, recipe)
    comp_logs, comp_outs = _run(cm, WINDOWED, tmp_path, "compiled", 8, recipe)
    assert _graph_breaks() == 0
    # fc1 switches fast -> debug -> fast -> debug -> fast: two distinct decisions, two graphs
    assert counters["stats"]["unique_graphs"] == 2
    assert [sorted(s) != [] for s in comp_logs] == [False, False, True, True, False, False, True, False]
    _assert_logs_match(comp_logs, eager_logs, backend)
    for i, ((ye, ge), (yc, gc)) in enumerate(zip(eager_outs, comp_outs)):
        assert_matches_eager(yc, ye, backend, f"step {i} output")
        assert_matches_eager(gc, ge, backend, f"step {i} input grad")
    for (name, pe), pc in zip(m.named_parameters(), mc.parameters()):
        assert_matches_eager(pc.grad, pe.grad, backend, name)


def _graph_code(model, x, recipe):
    codes = []

    def backend(gm, example_inputs):
        codes.append(gm.code)
        return gm.forward

    _fresh()
    cm = torch.compile(model, fullgraph=True, backend=backend)
    with te.autocast(recipe=recipe):
        cm(x)
    assert _graph_breaks() == 0
    return codes[-1]


def test_fast_path_graph_is_unchanged(tmp_path):
    torch.manual_seed(2)
    m = Net()
    x = torch.randn(16, 64)
    recipe = R.DelayedScaling()
    plain = _graph_code(m, x, recipe)
    other = max_stats_config("not_a_layer")
    with debug_session(tmp_path, other):
        assert _graph_code(m, x, recipe) == plain  # session active, no feature for these layers
    with debug_session(tmp_path, WINDOWED, name="w"):
        for _ in range(2):
            debug_api.step()
        code = _graph_code(m, x, recipe)
    # fc1 and mlp.fc1 (layer_types [fc1]: stats), mlp.fc2 (DisableFp8Gemm); `other` keeps the fast path
    assert code.count("te_proto_debug.linear_fwd") == 3 and code.count("te_proto.linear_fwd") == 1
    assert _graph_code(m, x, recipe) == plain  # session over


@pytest.mark.parametrize("backend", backend_params(ci=()))  # MXFP8: inductor compiles for minutes
def test_compiled_dumps_equal_eager(tmp_path, backend):
    cfg = {"d": {"enabled": True, "layers": {"layer_name_regex_pattern": "^fc1$"},
                 "transformer_engine": {"DumpTensors": {"enabled": True,
                                                        "tensors": ["activation", "gradient", "weight"],
                                                        "dump_quantized_internals": True, "freq": 2}}}}
    _fresh()
    torch.manual_seed(3)
    m = Net()
    mc = copy.deepcopy(m)
    cm = compile_for(mc, backend)
    recipe = R.MXFP8BlockScaling()
    _run(m, cfg, tmp_path, "eager", 3, recipe)
    _run(cm, cfg, tmp_path, "compiled", 3, recipe)
    assert _graph_breaks() == 0
    import glob
    import os

    eager = sorted(glob.glob(os.path.join(str(tmp_path), "eager", "tensor_dumps", "rank_0", "*.pt")))
    assert [os.path.basename(p) for p in eager] == [f"fc1_{t}_iter_{i:06d}.pt"
                                                    for t in ("activation", "gradient", "weight") for i in (0, 2)]
    for pe in eager:
        de = torch.load(pe, weights_only=True)
        dc = torch.load(pe.replace(os.sep + "eager" + os.sep, os.sep + "compiled" + os.sep), weights_only=True)
        assert de.keys() == dc.keys()
        for k in ("high_precision", "quantized"):
            assert_matches_eager(dc[k], de[k], backend, f"{pe} {k}")
        for k, v in de["quantized_internals"].items():
            assert torch.equal(v.view(torch.uint8), dc["quantized_internals"][k].view(torch.uint8)) \
                if isinstance(v, torch.Tensor) else v == dc["quantized_internals"][k]


@pytest.mark.parametrize("backend", backend_params())
def test_compiled_custom_modify_feature(tmp_path, backend):
    _fresh()
    torch.manual_seed(4)
    m = torch.nn.Sequential(te.Linear(32, 32, name="probe"), te.Linear(32, 32, name="scaled", bias=False))
    mc = copy.deepcopy(m)
    cm = compile_for(mc, backend)
    dirs = [write_custom_features(tmp_path)]
    x = torch.randn(8, 32)
    with debug_session(tmp_path, CUSTOM_CONFIG, feature_dirs=dirs, name="c"):
        for _ in range(3):
            ye, yc = m(x), cm(x)
            assert_matches_eager(yc, ye, backend, "output")
            debug_api.step()
    assert torch.allclose(ye, m[0](x) @ (2 * m[1].weight).t())
    assert _graph_breaks() == 0


@pytest.mark.parametrize("recipe", [R.DelayedScaling(), R.NVFP4BlockScaling(disable_stochastic_rounding=True)],
                         ids=["delayed", "nvfp4"])
def test_inductor_stats_match_eager(tmp_path, recipe):
    cfg = {"s": {"enabled": True, "layers": {"layer_types": ["fc1"]},
                 "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": ["max", "mean", "cur_amax"],
                                                           "tensors": ["activation", "gradient"]},
                                        "LogFp8TensorStats": {"enabled": True, "tensors": ["activation"],
                                                              "stats": ["underflows%", "scale_inv_max", "mse"]}}}}
    _fresh()
    torch.manual_seed(5)
    m = te.Linear(64, 64, name="fc1")
    mc = copy.deepcopy(m)
    cm = torch.compile(mc, fullgraph=True)
    eager_logs, _ = _run(m, cfg, tmp_path, "eager", 2, recipe)
    comp_logs, _ = _run(cm, cfg, tmp_path, "compiled", 2, recipe)
    assert _graph_breaks() == 0
    assert eager_logs == comp_logs and len(eager_logs[0]) == 9


@pytest.mark.parametrize("backend", backend_params())
def test_session_end_and_reinit_under_compile(tmp_path, backend):
    _fresh()
    m = te.Linear(32, 32, name="fc1")
    cm = compile_for(copy.deepcopy(m), backend)
    cfg = max_stats_config("fc1")
    x = torch.randn(4, 32)
    for i in range(2):
        with debug_session(tmp_path, cfg, name=f"s{i}"):
            cm(x)
            debug_api.step()
            assert last_logged_stats() == {"fc1_activation_max": x.max().item()}
        cm(x)  # no session: back to the fast path
    assert _graph_breaks() == 0
    # the fast path (no session) is reused; a new session recomputes (and retraces) its decisions once
    assert counters["stats"]["unique_graphs"] == 3


@pytest.mark.parametrize("backend", backend_params())
def test_new_session_recomputes_compiled_decisions(tmp_path, backend):
    """A layer on the fast path in one session picks up the next session's features at once."""
    _fresh()
    m = te.Linear(32, 32, name="fc1")
    cm = compile_for(copy.deepcopy(m), backend)
    none = {"s": {"enabled": True, "layers": {"layer_types": ["other"]},
                  "transformer_engine": {"DisableFp8Layer": {"enabled": True}}}}
    stats = max_stats_config("fc1")
    x = torch.randn(4, 32)
    for i, cfg in enumerate((none, stats, none)):
        with debug_session(tmp_path, cfg, name=f"s{i}"):
            cm(x)
            debug_api.step()
            assert last_logged_stats() == ({"fc1_activation_max": x.max().item()} if cfg is stats else {})
    assert _graph_breaks() == 0


@pytest.mark.parametrize("rid", ["high_precision", "delayed", "mxfp8"])
def test_debug_op_opcheck(rid):
    """Real and fake impls of the debug forward op agree (the token output makes runs differ by
    design, so the AOT-dispatch comparison is covered by the compile tests above instead)."""
    from transformer_engine_proto.custom_ops.linear_call import LinearCall
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
    from transformer_engine_proto.debug.debug_gemm import linear_fwd

    recipe = {"high_precision": None, "delayed": R.DelayedScaling(amax_history_len=4),
              "mxfp8": R.MXFP8BlockScaling()}[rid]
    delayed = rid == "delayed"
    x, w, b = (torch.randn(32, 64, requires_grad=True), torch.randn(32, 64, requires_grad=True),
               torch.randn(32, requires_grad=True))
    args = (x, w, b, torch.ones(3) if delayed else None, [torch.zeros(3)] if delayed else [], None, "lin",
            RecipeKey.of(recipe), LinearCall(True, True, True).flags)
    torch.library.opcheck(linear_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
