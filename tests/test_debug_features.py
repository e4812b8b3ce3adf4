"""Precision debug tools in eager mode: TE's documented YAML examples on our layers, stat values,
the TE call sequence for user features, routing to the fast path, config errors."""
import os

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from linear_cases import fold_last_grad_amaxes
from test_debug_common import assert_close, debug_session, direct_stats, main_log, max_stats_config, stat_lines

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.debug import last_logged_stats, state
from transformer_engine_proto.debug.config_check import DebugConfigError, validate_config
from transformer_engine_proto.gemm import emulated_gemm
from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer


def _train(model, x, steps, recipe=None, micro_batches=1):
    for _ in range(steps):
        for _ in range(micro_batches):
            with te.autocast(recipe=recipe or R.DelayedScaling()):
                y = model(x)
            y.float().sum().backward()
        debug_api.step()


# ---- TE's documented examples -------------------------------------------------------------------
GETTING_STARTED = """
    fc1_fprop_to_fp8:
      enabled: True
      layers:
        layer_types: [fc1, fc2] # contains fc1 or fc2 in name
      transformer_engine:
        DisableFp8Gemm:
          enabled: True
          gemms: [fprop]

    log_tensor_stats:
      enabled: True
      layers:
        layer_types: [layernorm_linear] # contains layernorm_linear in name
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats: [max, min, mean, std, l1_norm]
          tensors: [activation]
          freq: 1
          start_step: 2
          end_step: 5
"""


def test_getting_started_example(tmp_path):
    torch.manual_seed(0)
    with debug_session(tmp_path, GETTING_STARTED) as log_dir:
        qkv = te.LayerNormLinear(64, 64)  # default name layernorm_linear_<n>
        mlp = te.LayerNormMLP(64, 128)  # GEMMs layernorm_mlp_<n>.fc1 / .fc2
        model = torch.nn.Sequential(qkv, mlp)
        x = torch.randn(8, 4, 64)
        ln_out = qkv.apply_norm(x).detach()
        _train(model, x, 7)
        log = main_log(log_dir)
    for gemm in ("fc1", "fc2"):
        assert f"LAYER={mlp.name}.{gemm}: Tensor: activation, gemm fprop - High precision" in log
        assert f"LAYER={mlp.name}.{gemm}: Tensor: weight, gemm fprop - High precision" in log
        assert f"LAYER={mlp.name}.{gemm}: Tensor: gradient, gemm dgrad - FP8 quantization" in log
    assert f"LAYER={qkv.name}: Tensor: activation, gemm fprop - FP8 quantization" in log
    lines = stat_lines(log_dir)
    assert {it for _, it, _ in lines} == {2, 3, 4, 5}
    assert {n for n, _, _ in lines} == {f"{qkv.name}_activation_{s}" for s in ("max", "min", "mean", "std", "l1_norm")}
    want = direct_stats(ln_out)
    for name, _it, value in lines:
        stat = name[len(f"{qkv.name}_activation_"):]
        assert_close(value, want[stat], name, rel=1e-4, abs_=1e-4)  # the log keeps 4 decimals


CONFIG_STRUCTURE = """
    # Disables wgrad in all 4 GEMMs
    section1:
      enabled: True
      layers:
        layer_types: [transformer_layer]
      transformer_engine:
        DisableFp8Gemm:
          enabled: True
          gemms: [wgrad]

    # Disables all GEMMs in layernorm_mlp layer
    section2:
      enabled: True
      layers:
        layer_types: [layernorm_mlp]
      transformer_engine:
        DisableFp8Layer:
          enabled: True

    # Logs wgrad stats in fc1
    section3:
      enabled: True
      layers:
        layer_types: [fc1]
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats: [min]
          tensors: [wgrad]
          freq: 1
          start_step: 0
          end_step: 50
"""


def test_config_structure_example(tmp_path):
    torch.manual_seed(1)
    with debug_session(tmp_path, CONFIG_STRUCTURE) as log_dir:
        a = te.Linear(64, 64, name="transformer_layer.proj")
        b = te.Linear(64, 64, name="layernorm_mlp.proj")
        c = te.Linear(64, 64, name="fc1")
        model = torch.nn.Sequential(a, b, c)
        for _ in range(2):
            model.zero_grad()
            _train(model, torch.randn(16, 64), 1)
            assert last_logged_stats() == {"fc1_wgrad_min": c.weight.grad.min().item()}
        log = main_log(log_dir)
    assert "LAYER=transformer_layer.proj: Tensor: activation, gemm wgrad - High precision" in log
    assert "LAYER=transformer_layer.proj: Tensor: activation, gemm fprop - FP8 quantization" in log
    for t, g in (("activation", "fprop"), ("weight", "dgrad"), ("gradient", "wgrad")):
        assert f"LAYER=layernorm_mlp.proj: Tensor: {t}, gemm {g} - High precision" in log
    assert [(it, n) for n, it, _ in stat_lines(log_dir)] == [(0, "fc1_wgrad_min"), (1, "fc1_wgrad_min")]


def test_disable_fp8_layer_runs_high_precision(tmp_path):
    cfg = {"s": {"enabled": True, "layers": {"layer_types": ["fc1"]},
                 "transformer_engine": {"DisableFp8Layer": {"enabled": True}}}}
    torch.manual_seed(2)
    m = te.Linear(64, 32, name="fc1")
    x = torch.randn(16, 64)
    ref_x, ref_y = x.clone().requires_grad_(), None
    ref_y = m(ref_x)  # no recipe: high precision
    ref_y.sum().backward()
    ref_grads = (ref_x.grad.clone(), m.weight.grad.clone(), m.bias.grad.clone())
    m.zero_grad()
    with debug_session(tmp_path, cfg):
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=R.MXFP8BlockScaling()):
            y = m(xi)
        y.sum().backward()
    assert torch.equal(y, ref_y)
    for got, want in zip((xi.grad, m.weight.grad, m.bias.grad), ref_grads):
        assert torch.equal(got, want)


FAKE_QUANT = """
    example_fake_quant_fp8:
        enabled: True
        layers:
            layer_types: [transformer_layer.layernorm_mlp.fc1]
        transformer_engine:
            FakeQuant:
                enabled: True
                quant_format: FP8E5M2
                gemms_struct:
                - gemm: fprop
                  tensors: [activation, weight]
                - gemm: dgrad
                  tensors: [gradient]
"""


def test_fake_quant_example(tmp_path):
    torch.manual_seed(3)
    m = te.Linear(64, 32, name="transformer_layer.layernorm_mlp.fc1")
    other = te.Linear(32, 32, name="transformer_layer.layernorm_mlp.fc2")
    x = torch.randn(16, 64, requires_grad=True)
    fq = lambda t: Float8CurrentScalingQuantizer(torch.float8_e5m2).quantize(t.detach()).dequantize()  # noqa: E731
    with debug_session(tmp_path, FAKE_QUANT) as log_dir:
        with te.autocast(recipe=R.DelayedScaling()):
            y = m(x)
            z = other(y)
        g = torch.randn_like(y)
        y.backward(g, retain_graph=True)
        log = main_log(log_dir)
        assert state.route(other.gemm, True) is None  # fc2 has no feature: fast path
    assert torch.equal(y, emulated_gemm(fq(x), fq(m.weight), trans_b=True, bias=m.bias, out_dtype=y.dtype))
    # dgrad: fake-quantized gradient, weight in high precision (FakeQuant disables the FP8 GEMM)
    assert torch.equal(x.grad, emulated_gemm(fq(g), m.weight.detach(), out_dtype=y.dtype))
    assert "Tensor: activation, gemm fprop - modify_tensor()" in log
    assert "Tensor: weight, gemm dgrad - High precision" in log
    assert "Tensor: activation, gemm wgrad - FP8 quantization" in log
    assert z.shape == (16, 32)


PER_TENSOR_SCALING = """
    example_per_tensor_scaling:
        enabled: True
        layers:
            layer_types: [transformer_layer.self_attn.layernorm_q]
        transformer_engine:
            PerTensorScaling:
                enabled: True
                gemms: [dgrad]
                tensors: [weight, activation]
"""


def test_per_tensor_scaling_example(tmp_path):
    torch.manual_seed(4)
    m = te.Linear(64, 32, name="transformer_layer.self_attn.layernorm_q")
    x = torch.randn(16, 64, requires_grad=True)
    with debug_session(tmp_path, PER_TENSOR_SCALING) as log_dir:
        with te.autocast(recipe=R.DelayedScaling()):
            y = m(x)
        grad_scale = m.gemm.grad_fp8_scale.clone()
        g = torch.randn_like(y)
        y.backward(g)
        log = main_log(log_dir)
    assert "Tensor: weight, gemm dgrad - modify_tensor()" in log
    assert "Tensor: weight, gemm fprop - FP8 quantization" in log
    dy = Float8Quantizer(grad_scale, torch.zeros(1), torch.float8_e5m2).quantize(g)
    w = Float8CurrentScalingQuantizer(torch.float8_e4m3fn).quantize(m.weight.detach())
    assert torch.equal(x.grad, emulated_gemm(dy, w, out_dtype=x.dtype))


FP8_STATS = """
    example_fp8_tensor_stat_collection:
        enabled: True
        layers:
            layer_types: [layernorm_linear]
        transformer_engine:
            LogFp8TensorStats:
                enabled: True
                tensors_struct:
                - tensor: activation
                  stats: [mxfp8_underflows%]
                  freq: 1
                - tensor: gradient
                  stats: [underflows%]
                  freq: 5
                  start_step: 0
                  end_step: 80
"""


def test_log_fp8_tensor_stats_example(tmp_path):
    torch.manual_seed(5)
    with debug_session(tmp_path, FP8_STATS) as log_dir:
        m = te.LayerNormLinear(64, 64)
        x = torch.randn(32, 64) * 1e-3
        x[0, :4] = 10.0  # a wide range, so MXFP8 blocks underflow
        ln_out = m.apply_norm(x).detach()
        _train(m, x, 6, recipe=R.DelayedScaling())
    lines = stat_lines(log_dir)
    act = [(it, v) for n, it, v in lines if n == f"{m.name}_activation_mxfp8_underflows%"]
    grad = [it for n, it, _ in lines if n == f"{m.name}_gradient_underflows%"]
    assert [it for it, _ in act] == list(range(6)) and grad == [0, 5]
    q = MXFP8Quantizer(torch.float8_e4m3fn).with_usage(rowwise=True, columnwise=False).quantize(ln_out)
    deq = q.dequantize(dtype=torch.float32)
    want = 100.0 * ((ln_out != 0) & (deq == 0)).sum().item() / ln_out.numel()
    assert_close(act[0][1], want, "mxfp8_underflows%", abs_=1e-4)


# ---- stat values --------------------------------------------------------------------------------
ALL_STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]


def test_stats_equal_direct_computation_with_micro_batches(tmp_path):
    cfg = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "^lin$"},
                 "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": ALL_STATS,
                                                           "tensors": ["activation", "weight", "gradient", "output",
                                                                       "wgrad", "dgrad"]}}}}
    torch.manual_seed(6)
    m = te.Linear(64, 48, name="lin")
    xs = [torch.randn(16, 64), torch.randn(16, 64) * 3 + 1]
    gs = [torch.randn(16, 48), torch.randn(16, 48) * 0.1]
    outs, dgrads, wgrads = [], [], []
    with debug_session(tmp_path, cfg):
        for x, g in zip(xs, gs):  # two micro-batches, one step
            xi = x.clone().requires_grad_()
            y = m(xi)  # high precision: the tensors are exactly what the GEMMs see
            y.backward(g)
            outs.append(y.detach())
            dgrads.append(xi.grad)
        wgrads = [gs[0].t() @ xs[0], gs[1].t() @ xs[1]]
        debug_api.step()
        logged = last_logged_stats()
    want = {"activation": torch.cat(xs), "gradient": torch.cat(gs), "output": torch.cat(outs),
            "dgrad": torch.cat(dgrads), "wgrad": torch.cat(wgrads), "weight": m.weight}
    for tensor, value in want.items():
        ref = direct_stats(value)
        for stat in ALL_STATS:
            assert_close(logged[f"lin_{tensor}_{stat}"], ref[stat], f"{tensor} {stat}", rel=1e-5, abs_=1e-6)


@pytest.mark.parametrize("rid", ["delayed", "current", "mxfp8", "block", "nvfp4"])
def test_fp8_stats_every_format(tmp_path, rid):
    recipe = {"delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling(), "mxfp8": R.MXFP8BlockScaling(),
              "block": R.Float8BlockScaling(), "nvfp4": R.NVFP4BlockScaling(disable_stochastic_rounding=True)}[rid]
    stats = ["underflows%", "overflows%", "scale_inv_min", "scale_inv_max", "mse"]
    cfg = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "lin"},
                 "transformer_engine": {"LogFp8TensorStats": {"enabled": True, "tensors": ["activation"],
                                                              "stats": stats + [s + "_columnwise" for s in stats]}}}}
    torch.manual_seed(7)
    m = te.Linear(128, 64, name="lin")
    x = torch.randn(128, 128) * torch.logspace(-4, 3, 128)[:, None]  # huge range: underflows and overflows
    with debug_session(tmp_path, cfg):
        xi = x.clone().requires_grad_()
        with te.autocast(recipe=recipe):
            m(xi).sum().backward()
        debug_api.step()
        logged = last_logged_stats()
    # delayed scaling's first step quantizes with scale 1: everything above 448 overflows
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    q = RecipeKey.quantizers(RecipeKey.of(recipe)).input
    if rid == "delayed":
        q = Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn)
    for col in (False, True):
        qt = q.with_usage(rowwise=not col, columnwise=col).quantize(x)
        deq = qt.dequantize(dtype=torch.float32)
        sfx = "_columnwise" if col else ""
        n = x.numel()
        if not (rid == "nvfp4" and col):  # NVFP4 columnwise data is measured after its Hadamard transform
            assert_close(logged[f"lin_activation_underflows%{sfx}"],
                         100.0 * ((x != 0) & (deq == 0)).sum().item() / n, f"underflows {col}")
        assert_close(logged[f"lin_activation_mse{sfx}"], ((x.double() - deq.double()) ** 2).mean().item(),
                     f"mse {col}", rel=1e-6)
        if rid == "delayed":
            assert_close(logged["lin_activation_overflows%"], 100.0 * (x.abs() > 448).sum().item() / n, "overflows")
            assert logged["lin_activation_scale_inv_min"] == logged["lin_activation_scale_inv_max"] == 1.0
        elif rid in ("current", "mxfp8", "block"):
            assert logged[f"lin_activation_overflows%{sfx}"] == 0.0  # scales never clip these formats
        if rid in ("current", "block"):
            si = qt._scale_inv if rid == "current" else (qt._columnwise_scale_inv if col else qt._rowwise_scale_inv)
            assert_close(logged[f"lin_activation_scale_inv_min{sfx}"], si.min().item(), "scale_inv_min")
            assert_close(logged[f"lin_activation_scale_inv_max{sfx}"], si.max().item(), "scale_inv_max")


# ---- call sequence, custom features ------------------------------------------------------------
CUSTOM_FEATURE = '''
import torch
import nvdlfw_inspect.api as debug_api
from nvdlfw_inspect.logging import MetricLogger
from nvdlfw_inspect.registry import Registry, api_method
from transformer_engine_proto.debug.features.api import TEConfigAPIMapper

CALLS = []


@Registry.register_feature(namespace="transformer_engine")
class PercentageGreaterThanThreshold(TEConfigAPIMapper):
    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, tp_group, tensor):
        CALLS.append(("inspect_tensor", layer_name, tensor_name, iteration))
        pct = (tensor > config["threshold"]).float().mean()
        MetricLogger.log_scalar(f"{layer_name}_{tensor_name}_percentage_greater_than_threshold", pct, iteration)

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return iteration % config["freq"] == 0, iteration + (config["freq"] - iteration % config["freq"])


@Registry.register_feature(namespace="transformer_engine")
class ScaleWeight(TEConfigAPIMapper):
    @api_method
    def modify_tensor_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return True

    @api_method
    def modify_tensor(self, config, layer_name, gemm, tensor_name, tensor, default_quantizer, iteration, out=None):
        CALLS.append(("modify_tensor", layer_name, gemm, tensor_name, default_quantizer is not None))
        return tensor * config["factor"]

    @api_method
    def inspect_tensor_postquantize_enabled(self, config, layer_name, gemm, tensor_name, iteration):
        return True

    @api_method
    def inspect_tensor_postquantize(self, config, layer_name, tensor_name, gemm, tensor, rowwise, iteration, tp_group):
        CALLS.append(("inspect_tensor_postquantize", layer_name, gemm, tensor_name, rowwise))
'''

CUSTOM_CONFIG = {
    "stats": {"enabled": True, "layers": {"layer_types": ["probe"]},
              "transformer_engine": {"PercentageGreaterThanThreshold": {"enabled": True, "tensors": ["activation"],
                                                                        "threshold": 0.5, "freq": 2}}},
    "scale": {"enabled": True, "layers": {"layer_types": ["scaled"]},
              "transformer_engine": {"ScaleWeight": {"enabled": True, "gemms": ["fprop"], "tensors": ["weight"],
                                                     "factor": 2.0}}},
}


def write_custom_features(tmp_path):
    d = tmp_path / "custom_features"
    d.mkdir(exist_ok=True)
    (d / "custom_feature_example.py").write_text(CUSTOM_FEATURE)
    return str(d)


def test_custom_user_features(tmp_path):
    torch.manual_seed(8)
    probe, scaled = te.Linear(32, 32, name="probe"), te.Linear(32, 32, name="scaled", bias=False)
    x = torch.randn(8, 32)
    calls = []
    with debug_session(tmp_path, CUSTOM_CONFIG, feature_dirs=[write_custom_features(tmp_path)], name="s2") as log_dir:
        from nvdlfw_inspect.registry import Registry as Reg

        feats = Reg.data["transformer_engine"].features
        calls = type(feats["ScaleWeight"]).modify_tensor.__globals__["CALLS"]
        for _ in range(3):
            y = scaled(probe(x))
            y.sum().backward()
            debug_api.step()
        lines = stat_lines(log_dir)
    assert [(n, it) for n, it, _ in lines] == [("probe_activation_percentage_greater_than_threshold", 0),
                                               ("probe_activation_percentage_greater_than_threshold", 2)]
    assert_close(lines[0][2], (x > 0.5).float().mean().item(), "percentage", abs_=1e-4)
    assert ("modify_tensor", "scaled", "fprop", "weight", False) in calls
    assert ("inspect_tensor_postquantize", "scaled", "fprop", "weight", True) in calls
    assert torch.allclose(y, probe(x) @ (2 * scaled.weight).t())


def test_no_feature_no_session_fast_path(tmp_path):
    m = te.Linear(32, 32, name="untouched")
    x = torch.randn(4, 32)
    assert not state.SESSION.active and state.route(m.gemm, True) is None
    cfg = max_stats_config("other")
    with debug_session(tmp_path, cfg) as log_dir:
        with te.autocast(recipe=R.Float8CurrentScaling()):
            m(x)
        assert state.route(m.gemm, True) is None
        assert "LAYER=untouched: Tensor: activation, gemm fprop - FP8 quantization" in main_log(log_dir)


def test_default_names_and_infer_and_assign(tmp_path):
    layer = te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0)
    assert layer.name.startswith("transformer_layer_")
    cfg = max_stats_config("fc2")
    with debug_session(tmp_path, cfg):
        debug_api.infer_and_assign_layer_names(layer)
        layer(torch.randn(8, 2, 64))
        debug_api.step()
        assert list(last_logged_stats()) == ["model.layernorm_mlp.fc2_activation_max"]


# ---- config errors ----------------------------------------------------------------------------
BAD = [
    ({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "frq": 2}},
     "LogTensorStats: unknown keys ['frq']"),
    ({"LogTensorStats": {"enabled": True, "stats": ["median"], "tensors": ["activation"]}},
     "LogTensorStats > stats: unsupported stats ['median']"),
    ({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["activation"], "freq": "10"}},
     "LogTensorStats > freq: must be a positive int, got '10'"),
    ({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": ["actvation"]}},
     "LogTensorStats > tensors: unknown tensor ['actvation']"),
    ({"LogTensorStats": {"enabled": True, "tensors_struct": [{"tensor": "gradient", "stats": ["max"],
                                                               "start_end_list": [[0, 20], [10, 30]]}]}},
     "LogTensorStats > tensors_struct[0] > start_end_list: windows [0, 20] and [10, 30] overlap"),
    ({"DisableFp8Gemm": {"enabled": True, "gemms": ["fwd"]}}, "DisableFp8Gemm > gemms: unknown gemm ['fwd']"),
    ({"DisableFp8Layer": {"enabled": "yes"}}, "DisableFp8Layer > enabled: must be true or false"),
    ({"FakeQuant": {"enabled": True, "gemms": ["fprop"], "tensors": ["activation"]}},
     "FakeQuant: missing `quant_format`"),
    ({"LogFp8TensorStats": {"enabled": True, "stats": ["fp9_underflows%"], "tensors": ["activation"]}},
     "LogFp8TensorStats > stats: unsupported stat 'fp9_underflows%'"),
    ({"NoSuchFeature": {"enabled": True}}, "transformer_engine > NoSuchFeature: unknown feature"),
]


@pytest.mark.parametrize("features,message", BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_config_errors_name_the_entry(tmp_path, features, message):
    cfg = {"my_section": {"enabled": True, "layers": {"layer_types": ["lin"]}, "transformer_engine": features}}
    with pytest.raises(DebugConfigError) as e:
        validate_config(cfg)
    assert "section 'my_section'" in str(e.value) and message in str(e.value), str(e.value)


def test_bad_config_in_a_session_fails_at_first_forward(tmp_path):
    cfg = {"sec": {"enabled": True, "layers": {"layer_types": ["lin"]},
                   "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": ["max"],
                                                             "tensors": ["activation"],
                                                             "start_end_list": [[5, 9], [0, 3]]}}}}
    m = te.Linear(16, 16, name="lin")
    with debug_session(tmp_path, cfg):
        with pytest.raises(DebugConfigError, match=r"section 'sec' > transformer_engine > LogTensorStats > "
                                                   r"start_end_list: windows \[5, 9\] and \[0, 3\] overlap"):
            m(torch.randn(2, 16))
    # unknown features are refused by nvdlfw_inspect itself, naming the feature
    bad = {"sec": {"enabled": True, "layers": {"layer_types": ["lin"]},
                   "transformer_engine": {"LogTensorStatz": {"enabled": True}}}}
    with pytest.raises(AssertionError, match="LogTensorStatz"):
        with debug_session(tmp_path, bad, name="bad"):
            pass
    debug_api.end_debug()
    # our initialize() validates before nvdlfw_inspect loads the file
    from transformer_engine_proto.debug import initialize

    with pytest.raises(DebugConfigError, match="LogTensorStatz: unknown feature"):
        initialize(bad, log_dir=os.path.join(str(tmp_path), "bad2"))
    assert debug_api.DEBUG_MANAGER is None


# ---- the debug path computes what the fast path computes --------------------------------------
@pytest.mark.parametrize("rid", ["delayed", "current", "mxfp8", "block", "nvfp4"])
def test_inspect_only_debug_path_matches_fast_path(tmp_path, rid):
    """With only inspecting features, the debug GEMMs give the fast path's numbers bit for bit
    (outputs, gradients, delayed-scaling state)."""
    import copy

    recipe = {"delayed": R.DelayedScaling(amax_history_len=4), "current": R.Float8CurrentScaling(),
              "mxfp8": R.MXFP8BlockScaling(), "block": R.Float8BlockScaling(),
              "nvfp4": R.NVFP4BlockScaling(disable_stochastic_rounding=True)}[rid]
    cfg = {"s": {"enabled": True, "layers": {"layer_types": ["mlp"]},
                 "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": ["max"],
                                                           "tensors": ["activation", "weight", "gradient", "output"]},
                                        "LogFp8TensorStats": {"enabled": True, "stats": ["mse"],
                                                              "tensors": ["activation", "weight", "gradient"]}}}}
    torch.manual_seed(9)
    fast = te.LayerNormMLP(128, 128, name="mlp", bias=True)
    dbg = copy.deepcopy(fast)
    xs = [torch.randn(64, 128) for _ in range(3)]

    def run(model):
        outs = []
        for x in xs:
            xi = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                y = model(xi)
            (y * y).sum().backward()
            outs.append((y.detach(), xi.grad))
            if debug_api.DEBUG_MANAGER is not None:
                debug_api.step()
        return outs

    want = run(fast)
    with debug_session(tmp_path, cfg):
        got = run(dbg)
        assert state.route(dbg.fc1, True) == "mlp.fc1"
        assert "mlp.fc2_gradient_mse" in last_logged_stats()
    for (yw, gw), (yg, gg) in zip(want, got):
        assert torch.equal(yw, yg) and torch.equal(gw, gg)
    fold_last_grad_amaxes(recipe)
    for (name, a), b in zip(fast.state_dict().items(), dbg.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(fast.parameters(), dbg.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_debug_path_fused_wgrad_accumulation(tmp_path):
    import copy

    torch.manual_seed(10)
    fast = te.Linear(64, 32, name="lin", fuse_wgrad_accumulation=True)
    dbg = copy.deepcopy(fast)
    for m in (fast, dbg):
        m.weight.main_grad = torch.zeros(32, 64)
    x = torch.randn(16, 64)

    def run(m):
        with te.autocast(recipe=R.Float8CurrentScaling()):
            m(x).sum().backward()

    run(fast)
    with debug_session(tmp_path, max_stats_config("lin")):
        run(dbg)
        debug_api.step()
        assert list(last_logged_stats()) == ["lin_activation_max"]
    assert dbg.weight.grad is None and torch.equal(fast.weight.main_grad, dbg.weight.main_grad)
    assert fast.weight.main_grad.abs().sum() > 0
