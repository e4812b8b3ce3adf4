"""Debug config forms TE accepts pass our check, from YAML files: a disabled section is not
looked into, and features of the user's `feature_dirs` are known (TE's decorator form and the
call form our own features use), through `transformer_engine_proto.debug.initialize` (checked
before nvdlfw_inspect loads anything) and through the raw `debug_api.initialize` (checked at
the first forward)."""
import os
import textwrap

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from test_debug_common import stat_lines

import transformer_engine_proto as te
from transformer_engine_proto.debug import FEATURE_DIR, initialize, last_logged_stats, validate_config
from transformer_engine_proto.debug.config_check import DebugConfigError


@pytest.fixture(autouse=True)
def no_session():
    debug_api.end_debug()
    yield
    debug_api.end_debug()


def _yaml(tmp_path, text, name="config.yaml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def _step(model):
    model(torch.randn(4, 16)).sum().backward()
    debug_api.step()


# ---- a disabled section -------------------------------------------------------------------------
WITH_DISABLED_SECTION = """
    stats:
      enabled: True
      layers:
        layer_types: [lin]
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats: [max]
          tensors: [activation]
    later:
      enabled: False
      layers:
        layer_types: [lin]
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats: [max]
        NotAFeatureYet:
          whatever: 1
    """


def test_a_disabled_section_is_not_checked(tmp_path):
    path = _yaml(tmp_path, WITH_DISABLED_SECTION)
    validate_config(path)
    initialize(path, log_dir=str(tmp_path / "log"))
    m = te.Linear(16, 16, name="lin")
    _step(m)
    assert list(last_logged_stats()) == ["lin_activation_max"]


def test_a_disabled_section_through_the_raw_api(tmp_path):
    path = _yaml(tmp_path, WITH_DISABLED_SECTION)
    debug_api.initialize(config_file=path, feature_dirs=[FEATURE_DIR], log_dir=str(tmp_path / "log"))
    _step(te.Linear(16, 16, name="lin"))  # the session's config is checked here
    assert list(last_logged_stats()) == ["lin_activation_max"]


def test_a_disabled_section_needs_no_layers(tmp_path):
    validate_config(_yaml(tmp_path, """
        off_for_now:
          enabled: False
          transformer_engine:
            LogTensorStats: {enabled: True}
        """))


def test_a_disabled_section_is_still_a_mapping_with_enabled(tmp_path):
    with pytest.raises(DebugConfigError, match=r"section 'sec' > enabled: required, true or false"):
        validate_config(_yaml(tmp_path, "sec:\n  enabled: maybe\n"))
    with pytest.raises(DebugConfigError, match=r"section 'sec': must be a mapping"):
        validate_config(_yaml(tmp_path, "sec: [1, 2]\n"))


def test_an_enabled_section_is_still_checked(tmp_path):
    path = _yaml(tmp_path, WITH_DISABLED_SECTION.replace("enabled: False", "enabled: True"))
    with pytest.raises(DebugConfigError, match=r"section 'later' > transformer_engine > LogTensorStats: "
                                               r"missing `tensors` or `tensors_struct`"):
        validate_config(path)


# ---- features of the user's feature_dirs --------------------------------------------------------
# TE's custom-feature example shape: a decorated TEConfigAPIMapper that logs through MetricLogger
DECORATED = '''
import torch
from nvdlfw_inspect.logging import MetricLogger
from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug.features.api import TEConfigAPIMapper


@Registry.register_feature(namespace="transformer_engine")
class PercentageGreaterThanThreshold(TEConfigAPIMapper):
    @api_method
    def inspect_tensor(self, config, layer_name, tensor_name, iteration, tp_group, tensor,
                       rowwise_quantized_tensor=None, columnwise_quantized_tensor=None, quantizer=None):
        share = (tensor.abs() > config["threshold"]).float().mean()
        MetricLogger.log_scalar(f"{layer_name}_{tensor_name}_percentage_greater_than_threshold", share, iteration)

    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        run = iteration % config["freq"] == 0
        return run, iteration + (config["freq"] - iteration % config["freq"])
'''

# the form of this package's own feature files: registered by a call, only when nvdlfw loads the file
CALL_FORM = '''
from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import TEConfigAPIMapper


class NeverEnabled(TEConfigAPIMapper):
    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return False, None


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(NeverEnabled)
'''

# a name bound to the registrar, used as a decorator
BOUND_REGISTRAR = '''
from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug.features.api import TEConfigAPIMapper

register = Registry.register_feature(namespace="transformer_engine")


@register
class AlsoNeverEnabled(TEConfigAPIMapper):
    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        return False, None
'''

WITH_CUSTOM = """
    stats:
      enabled: True
      layers:
        layer_name_regex_pattern: .*
      transformer_engine:
        PercentageGreaterThanThreshold:
          enabled: True
          tensors: [activation]
          threshold: 0.1
          freq: 1
        NeverEnabled:
          enabled: True
          tensors: [activation]
        AlsoNeverEnabled:
          enabled: True
          tensors: [weight]
        LogTensorStats:
          enabled: True
          tensors: [activation]
          stats: [min]
    """


@pytest.fixture
def feature_dir(tmp_path):
    d = tmp_path / "custom_feature_dir"
    (d / "more").mkdir(parents=True)
    (d / "percentage_greater_than_threshold.py").write_text(DECORATED)
    (d / "never_enabled.py").write_text(CALL_FORM)
    (d / "more" / "also_never_enabled.py").write_text(BOUND_REGISTRAR)  # found in subdirectories too
    return str(d)


def _check_custom_session(log_dir, x):
    assert list(last_logged_stats()) == ["lin_activation_min"]
    logged = {name: value for name, _, value in stat_lines(log_dir)}
    want = (x.abs() > 0.1).float().mean().item()
    assert logged["lin_activation_percentage_greater_than_threshold"] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("dirs_as", ["list", "str"])
def test_user_features_pass_through_initialize(tmp_path, feature_dir, dirs_as):
    path = _yaml(tmp_path, WITH_CUSTOM)
    validate_config(path, feature_dirs=[feature_dir])
    log_dir = str(tmp_path / "log")
    initialize(path, log_dir=log_dir, feature_dirs=[feature_dir] if dirs_as == "list" else feature_dir)
    m, x = te.Linear(16, 16, name="lin"), torch.randn(4, 16)
    m(x).sum().backward()
    debug_api.step()
    _check_custom_session(log_dir, x)


def test_user_features_pass_through_the_raw_api(tmp_path, feature_dir):
    log_dir = str(tmp_path / "log")
    debug_api.initialize(config_file=_yaml(tmp_path, WITH_CUSTOM), feature_dirs=[FEATURE_DIR, feature_dir],
                         log_dir=log_dir)
    m, x = te.Linear(16, 16, name="lin"), torch.randn(4, 16)
    m(x).sum().backward()  # the session's config is checked here, with the features nvdlfw loaded
    debug_api.step()
    _check_custom_session(log_dir, x)


def test_user_features_are_unknown_without_their_dir(tmp_path):
    with pytest.raises(DebugConfigError, match=r"PercentageGreaterThanThreshold: unknown feature.*feature_dirs"):
        validate_config(_yaml(tmp_path, WITH_CUSTOM))


def test_features_of_other_namespaces_do_not_count(tmp_path):
    d = tmp_path / "other"
    d.mkdir()
    (d / "f.py").write_text(DECORATED.replace('namespace="transformer_engine"', 'namespace="base"'))
    with pytest.raises(DebugConfigError, match=r"PercentageGreaterThanThreshold: unknown feature"):
        validate_config(_yaml(tmp_path, WITH_CUSTOM), feature_dirs=[str(d)])


def test_a_feature_file_that_does_not_parse_is_left_to_nvdlfw(tmp_path, feature_dir):
    with open(os.path.join(feature_dir, "broken.py"), "w") as f:
        f.write("def (:\n")
    validate_config(_yaml(tmp_path, WITH_CUSTOM), feature_dirs=[feature_dir])
