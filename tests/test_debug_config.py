"""Debug configs: a missing or empty file is an error naming it, before the first step; configs
written as TE accepts them (one tensor name as a string, a disabled feature alone, the user's
own features) pass."""
import os

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from test_debug_common import debug_session

import transformer_engine_proto as te
from transformer_engine_proto.debug import FEATURE_DIR, initialize, last_logged_stats, validate_config
from transformer_engine_proto.debug.config_check import DebugConfigError


@pytest.fixture(autouse=True)
def no_session():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


def _section(features):
    return {"sec": {"enabled": True, "layers": {"layer_types": ["lin"]}, "transformer_engine": features}}


@pytest.mark.parametrize("content", ["", "# nothing configured yet\n"])
def test_empty_yaml_is_an_error_naming_the_file(tmp_path, content):
    path = tmp_path / "empty.yaml"
    path.write_text(content)
    with pytest.raises(DebugConfigError, match=f"debug config {path}: the file is empty"):
        initialize(str(path), log_dir=str(tmp_path))
    assert debug_api.DEBUG_MANAGER is None


def test_missing_config_is_an_error_naming_the_file(tmp_path):
    path = str(tmp_path / "no_such.yaml")
    with pytest.raises(DebugConfigError, match=f"debug config {path}: file not found"):
        initialize(path, log_dir=str(tmp_path))


def test_missing_config_through_the_raw_api_fails_at_the_first_forward(tmp_path):
    path = str(tmp_path / "no_such.yaml")
    debug_api.initialize(config_file=path, feature_dirs=[FEATURE_DIR], log_dir=str(tmp_path))  # only warns
    with pytest.raises(DebugConfigError, match=f"debug config {path}: file not found"):
        te.Linear(16, 16, name="lin")(torch.randn(2, 16))


def test_one_tensor_name_as_a_string(tmp_path):
    cfg = _section({"LogTensorStats": {"enabled": True, "stats": ["max"], "tensors": "activation"},
                    "DisableFp8Gemm": {"enabled": True, "gemms": "wgrad"}})
    validate_config(cfg)
    m = te.Linear(16, 16, name="lin")
    with debug_session(tmp_path, cfg):
        m(torch.randn(4, 16)).sum().backward()
        debug_api.step()
        assert list(last_logged_stats()) == ["lin_activation_max"]


def test_a_disabled_feature_needs_nothing_else(tmp_path):
    cfg = _section({"LogTensorStats": {"enabled": False},
                    "LogFp8TensorStats": {"enabled": True, "stats": ["underflows%"], "tensors": ["weight"]}})
    validate_config(cfg)
    m = te.Linear(16, 16, name="lin")
    with debug_session(tmp_path, cfg):
        with te.autocast(recipe=te.recipe.Float8CurrentScaling()):
            m(torch.randn(4, 16)).sum().backward()
        debug_api.step()
        assert list(last_logged_stats()) == ["lin_weight_underflows%"]


USER_FEATURE = '''
from nvdlfw_inspect.registry import Registry, api_method
from transformer_engine_proto.debug.features.api import TEConfigAPIMapper


@Registry.register_feature(namespace="transformer_engine")
class SafetyProbeFeature(TEConfigAPIMapper):
    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return False
'''


def test_features_from_the_users_feature_dirs_pass_validation(tmp_path):
    d = tmp_path / "my_features"
    d.mkdir()
    (d / "probe.py").write_text(USER_FEATURE)
    cfg = _section({"SafetyProbeFeature": {"enabled": True, "tensors": ["activation"]}})
    with pytest.raises(DebugConfigError, match=r"OtherFeature: unknown feature.*custom \[.SafetyProbeFeature.\]"):
        validate_config({"sec": {**cfg["sec"], "transformer_engine": {"OtherFeature": {"enabled": True}}}},
                        feature_dirs=[str(d)])
    initialize(cfg, log_dir=os.path.join(str(tmp_path), "log"), feature_dirs=[str(d)])
    assert debug_api.DEBUG_MANAGER is not None
