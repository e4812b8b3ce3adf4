"""LogNvfp4TensorStats (TE's feature): underflows% and mse of the NVFP4 quantization a layer's
GEMMs use, logged as `<layer>_<tensor>_nvfp4_<stat>`; layers not running NVFP4 are skipped with
a warning; its config checks."""
import warnings

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from test_debug_common import assert_close, debug_session

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
from transformer_engine_proto.debug import last_logged_stats, validate_config
from transformer_engine_proto.debug.config_check import DebugConfigError

NVFP4 = R.NVFP4BlockScaling(disable_stochastic_rounding=True)

TE_CONFIG = """
    log:
      layers:
        layer_name_regex_pattern: .*
      enabled:
        True
      transformer_engine:
        LogNvfp4TensorStats:
          enabled: True
          stats: [
            underflows%, mse
          ]
          tensors: [activation, gradient, weight]
          freq: 2
          start_step: 0
          end_step: 10
    """


def _roles(recipe=NVFP4):
    return RecipeKey.quantizers(RecipeKey.of(recipe))


def _expected(x, q):
    """(underflows%, mse) of x against its rowwise quantization by q."""
    deq = q.with_usage(rowwise=True, columnwise=False).quantize(x).dequantize(dtype=torch.float32)
    under = 100.0 * ((x != 0) & (deq == 0)).sum().item() / x.numel()
    return under, ((x.double() - deq.double()) ** 2).mean().item()


def test_te_numeric_example(tmp_path):
    """TE's check: a tensor with a run of tiny values, quantized by an NVFP4 quantizer, handed to
    inspect_tensor directly."""
    torch.manual_seed(42)
    x = torch.randn(128, 128, dtype=torch.bfloat16)
    x[0, :16] = 0.0001  # a whole block of tiny values: the block scale keeps them
    x[1, :15] = 0.0001  # tiny values beside a large one: they underflow
    x[1, 15] = 100.0
    q = _roles().input
    qt = q.quantize(x)
    with debug_session(tmp_path, TE_CONFIG):
        debug_api.transformer_engine.inspect_tensor(
            layer_name="test_layer", tensor_name="activation", iteration=0, tp_group=None, tensor=x,
            quantizer=q, rowwise_quantized_tensor=qt, columnwise_quantized_tensor=qt)
        debug_api.step()
        logged = last_logged_stats()
    deq = qt.dequantize(dtype=torch.float32)
    want_under = 100.0 * ((x != 0) & (deq == 0)).sum().item() / x.numel()
    assert want_under > 0
    assert set(logged) == {"test_layer_activation_nvfp4_underflows%", "test_layer_activation_nvfp4_mse"}
    assert_close(logged["test_layer_activation_nvfp4_underflows%"], want_under, "underflows%")
    assert_close(logged["test_layer_activation_nvfp4_mse"], ((x.double() - deq.double()) ** 2).mean().item(),
                 "mse", rel=1e-6)


def test_on_a_linear(tmp_path):
    torch.manual_seed(3)
    m = te.Linear(64, 32, name="lin")
    x = torch.randn(32, 64) * torch.logspace(-3, 2, 64)  # wide range: some underflows
    g = torch.randn(32, 32)
    with debug_session(tmp_path, TE_CONFIG):
        with te.autocast(recipe=NVFP4):
            y = m(x)
        y.backward(g)
        debug_api.step()
        logged = last_logged_stats()
    roles = _roles()
    for tensor, value, q in (("activation", x, roles.input), ("weight", m.weight.detach(), roles.weight),
                             ("gradient", g, roles.grad_output)):
        under, mse = _expected(value, q)
        assert_close(logged[f"lin_{tensor}_nvfp4_underflows%"], under, f"{tensor} underflows%")
        assert_close(logged[f"lin_{tensor}_nvfp4_mse"], mse, f"{tensor} mse", rel=1e-6)
    assert logged["lin_activation_nvfp4_underflows%"] > 0


def test_beside_log_fp8_tensor_stats_on_the_same_tensor(tmp_path):
    cfg = {"s": {"enabled": True, "layers": {"layer_types": ["lin"]},
                 "transformer_engine": {
                     "LogNvfp4TensorStats": {"enabled": True, "stats": ["mse"], "tensors": ["activation"]},
                     "LogFp8TensorStats": {"enabled": True, "stats": ["mxfp8_mse"], "tensors": ["activation"]}}}}
    torch.manual_seed(4)
    m, x = te.Linear(64, 32, name="lin"), torch.randn(32, 64)
    with debug_session(tmp_path, cfg):
        with te.autocast(recipe=NVFP4):
            m(x).sum().backward()
        debug_api.step()
        logged = last_logged_stats()
    assert set(logged) == {"lin_activation_nvfp4_mse", "lin_activation_mxfp8_mse"}
    assert_close(logged["lin_activation_nvfp4_mse"], _expected(x, _roles().input)[1], "mse", rel=1e-6)
    assert logged["lin_activation_mxfp8_mse"] != logged["lin_activation_nvfp4_mse"]


@pytest.mark.parametrize("recipe", [None, R.Float8CurrentScaling()], ids=["high_precision", "fp8"])
def test_layers_not_running_nvfp4_are_skipped_with_a_warning(tmp_path, recipe):
    m, x = te.Linear(64, 32, name="lin"), torch.randn(32, 64)
    with debug_session(tmp_path, TE_CONFIG):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                m(x).sum().backward()
        debug_api.step()
        assert last_logged_stats() == {}
    why = "high precision" if recipe is None else "fp8_current_scaling, not nvfp4"
    assert any("LogNvfp4TensorStats: no stats for layer 'lin', tensor 'activation'" in str(w.message)
               and why in str(w.message) for w in caught)


def test_the_te_config_passes_the_check(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(TE_CONFIG)
    validate_config(str(path))


@pytest.mark.parametrize("entry, message", [
    ({"stats": ["overflows%"], "tensors": ["activation"]}, r"stats: unsupported stats \['overflows%'\]"),
    ({"stats": ["mse_columnwise"], "tensors": ["activation"]}, r"stats: unsupported stats \['mse_columnwise'\]"),
    ({"stats": ["mse"], "tensors": ["output"]}, r"tensors: unknown tensor \['output'\]"),
    ({"stats": ["mse"]}, "missing `tensors` or `tensors_struct`"),
])
def test_bad_entries_name_the_entry(entry, message):
    cfg = {"s": {"enabled": True, "layers": {"layer_types": ["lin"]},
                 "transformer_engine": {"LogNvfp4TensorStats": {"enabled": True, **entry}}}}
    with pytest.raises(DebugConfigError, match=r"section 's' > transformer_engine > LogNvfp4TensorStats.*" + message):
        validate_config(cfg)
