"""TE's `transformer_engine.debug.pytorch.debug_state.TEDebugState` on our debug tools: a view
of the live session (debug_enabled, the iteration, the weight-stats TP switch), `_reset()`
dropping pending stats, and the TE import path through the `as_te` alias (in a subprocess, so
this session never holds a `transformer_engine` module)."""
import importlib.util
import subprocess
import sys
import textwrap

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from subprocess_env import package_env
from test_debug_common import debug_session, max_stats_config

import transformer_engine_proto as te
from transformer_engine_proto.debug import last_logged_stats
from transformer_engine_proto.debug.pytorch.debug_state import TEDebugState, set_weight_tensor_tp_group_reduce


@pytest.fixture(autouse=True)
def no_session():
    debug_api.end_debug()
    yield
    debug_api.end_debug()
    set_weight_tensor_tp_group_reduce(True)


def test_debug_enabled_follows_the_session(tmp_path):
    assert TEDebugState.debug_enabled is False
    m = te.Linear(16, 16, name="lin")  # built before the session: it takes part all the same
    with debug_session(tmp_path, max_stats_config("lin")):
        assert TEDebugState.debug_enabled is True and TEDebugState.initialize() is True
        m(torch.randn(4, 16)).sum().backward()
        debug_api.step()
        assert list(last_logged_stats()) == ["lin_activation_max"]
    assert TEDebugState.debug_enabled is False


def test_get_iteration_follows_step(tmp_path):
    assert TEDebugState.get_iteration() == 0
    with debug_session(tmp_path, max_stats_config("lin")):
        debug_api.step()
        debug_api.step()
        assert TEDebugState.get_iteration() == 2
        debug_api.initialize_training_step(7)
        assert TEDebugState.get_iteration() == 7


def test_reset_drops_pending_stats(tmp_path):
    m = te.Linear(16, 16, name="lin")
    TEDebugState.layers_initialized["lin"] = True
    with debug_session(tmp_path, max_stats_config("lin")):
        m(torch.randn(4, 16)).sum().backward()
        TEDebugState._reset()  # before the step that would log them
        debug_api.step()
        assert last_logged_stats() == {}
        m(torch.randn(4, 16)).sum().backward()  # the session goes on
        debug_api.step()
        assert list(last_logged_stats()) == ["lin_activation_max"]
    assert TEDebugState.layers_initialized == {}


def test_weight_tp_group_reduce_switch():
    from transformer_engine_proto import debug

    assert TEDebugState.weight_tensor_tp_group_reduce is True
    TEDebugState.set_weight_tensor_tp_group_reduce(False)
    assert TEDebugState.weight_tensor_tp_group_reduce is False
    debug.set_weight_tensor_tp_group_reduce(True)  # one switch, whichever name sets it
    assert TEDebugState.weight_tensor_tp_group_reduce is True
    set_weight_tensor_tp_group_reduce(False)
    assert TEDebugState.weight_tensor_tp_group_reduce is False


def test_layer_counter():
    first = TEDebugState.get_layer_count()
    assert TEDebugState.get_layer_count() == first + 1 and TEDebugState.layer_count == first + 2


# TE's test flow (tests/pytorch/debug/test_perf.py): import paths, a session, `_reset()` after it
TE_SCRIPT = r"""
import os, sys, torch
import nvdlfw_inspect.api as debug_api
import transformer_engine.debug
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.debug.pytorch.debug_state import TEDebugState
from transformer_engine.debug.features.log_nvfp4_tensor_stats import LogNvfp4TensorStats
import transformer_engine_proto as proto

assert TEDebugState is proto.debug.pytorch.debug_state.TEDebugState
assert transformer_engine.debug.pytorch.debug_state.TEDebugState is TEDebugState
assert LogNvfp4TensorStats is proto.debug.features.log_nvfp4_tensor_stats.LogNvfp4TensorStats

config, log_dir = sys.argv[1], sys.argv[2]
try:
    debug_api.initialize(config_file=config, log_dir=log_dir,
                         feature_dirs=os.path.dirname(transformer_engine.debug.features.__file__))
    model = te.Linear(64, 64, name="test_linear")
    assert TEDebugState.debug_enabled, "Debug mode should be active"
    for _ in range(2):
        with te.autocast(recipe=recipe.NVFP4BlockScaling(disable_stochastic_rounding=True)):
            y = model(torch.randn(32, 64))
        y.sum().backward()
        debug_api.step()
    assert TEDebugState.get_iteration() == 2
    from transformer_engine_proto.debug import last_logged_stats
    assert sorted(last_logged_stats()) == ["test_linear_activation_nvfp4_mse",
                                           "test_linear_activation_nvfp4_underflows%"]
finally:
    debug_api.end_debug()
    TEDebugState._reset()
assert not TEDebugState.debug_enabled
print("ok")
"""

TE_CONFIG = """
log:
  enabled: True
  layers:
    layer_types: [linear]
  transformer_engine:
    LogNvfp4TensorStats:
      enabled: True
      tensors: [activation]
      stats: [underflows%, mse]
"""


@pytest.mark.skipif(any(importlib.util.find_spec(n) for n in ("transformer_engine", "transformer_engine_torch")),
                    reason="a real Transformer Engine is installed: the alias refuses")
def test_te_import_paths_through_the_alias(tmp_path):
    script, config = tmp_path / "te_debug_script.py", tmp_path / "config.yaml"
    script.write_text(TE_SCRIPT)
    config.write_text(textwrap.dedent(TE_CONFIG))
    res = subprocess.run([sys.executable, "-m", "transformer_engine_proto.as_te", str(script), str(config),
                          str(tmp_path / "log")], cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
                         env=package_env())
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
