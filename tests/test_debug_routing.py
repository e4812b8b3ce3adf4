"""Debug routing follows TE's "ask again at" rule: a routing call answering `(b, n)` is asked
again at iteration n, `(b, None)` never, a bare bool at the next iteration; in between the layer
takes the fast path. Features that change a GEMM ask again every iteration."""
import nvdlfw_inspect.api as debug_api
import pytest
import torch
from test_debug_common import debug_session

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.debug import state

DISABLE_FPROP = """
    fc1_fprop_in_high_precision:
      enabled: True
      layers:
        layer_types: [fc1]
      transformer_engine:
        DisableFp8Gemm:
          enabled: True
          gemms: [fprop]
"""

COUNTING_FEATURE = '''
from nvdlfw_inspect.registry import Registry, api_method
from transformer_engine_proto.debug.features.api import TEConfigAPIMapper

ASKED = []


@Registry.register_feature(namespace="transformer_engine")
class CountingInspect(TEConfigAPIMapper):
    @api_method
    def inspect_tensor_enabled(self, config, layer_name, tensor_name, iteration):
        ASKED.append((tensor_name, iteration))
        return (False, None) if config["answer"] == "never" else False

    @api_method
    def inspect_tensor(self, config, layer_name, **kwargs):
        raise AssertionError("inspect_tensor runs only where inspect_tensor_enabled said so")
'''


@pytest.mark.parametrize("answer", ["never", "bare_bool"])
def test_routing_calls_are_not_repeated_before_the_iteration_they_name(tmp_path, answer):
    """TE's rule: an answer `(False, None)` is never asked again and the layer takes the fast path
    from then on; a bare `False` names no later iteration, so it is asked again at each one."""
    d = tmp_path / "counting"
    d.mkdir()
    (d / "counting_feature.py").write_text(COUNTING_FEATURE)
    tensors = ["activation", "weight", "gradient", "output", "wgrad", "dgrad"]
    cfg = {"count": {"enabled": True, "layers": {"layer_types": ["lin"]},
                     "transformer_engine": {"CountingInspect": {"enabled": True, "tensors": tensors,
                                                                "answer": answer}}}}
    m = te.Linear(32, 32, name="lin")
    x = torch.randn(8, 32)
    with debug_session(tmp_path, cfg, feature_dirs=[str(d)], name="count"):
        from nvdlfw_inspect.registry import Registry

        feature = Registry.data["transformer_engine"].features["CountingInspect"]
        asked = type(feature).inspect_tensor.__globals__["ASKED"]
        for _ in range(4):
            for _microbatch in range(2):
                m(x).sum().backward()
            assert state.route(m.gemm, False) is None
            debug_api.step()
    per_iteration = sorted(tensors)
    if answer == "never":
        assert sorted(t for t, _ in asked) == per_iteration and {it for _, it in asked} == {0}
    else:
        # debug_api.step() asks for the new iteration at once (compiled code reads the decision)
        assert sorted(asked) == sorted((t, it) for t in tensors for it in range(5))


@pytest.mark.parametrize("microbatching", [False, True])
@pytest.mark.parametrize("only_once", [True, False])
def test_te_dummy_feature_counts_and_the_layer_leaves_the_debug_path(tmp_path, only_once, microbatching):
    """TE's TestDummyFeature (shipped in the features directory, as TE ships it): with
    inspect_only_once each of the six tensors is asked once in 20 iterations and never inspected;
    without, every tensor is inspected every iteration."""
    from transformer_engine_proto.debug.features import _test_dummy_feature as dummy

    tensors = ["weight", "activation", "gradient", "output", "wgrad", "dgrad"]
    cfg = {"dummy": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                     "transformer_engine": {"TestDummyFeature": {"enabled": True, "inspect_only_once": only_once,
                                                                 "tensors": tensors,
                                                                 "gemms": ["wgrad", "dgrad", "fprop"]}}}}
    dummy._inspect_tensor_enabled_call_count = dummy._inspect_tensor_call_count = 0
    m = te.Linear(64, 64, name="test_linear")
    x = torch.randn(4, 8, 64, requires_grad=True)  # dgrad runs: all six tensors exist
    with debug_session(tmp_path, cfg, name="dummy"):
        for i in range(20):
            y = m(x, is_first_microbatch=(i % 2 == 0)) if microbatching else m(x)
            y.sum().backward()
            debug_api.step()
        route = state.route(m.gemm, False)
    if only_once:
        assert (dummy._inspect_tensor_enabled_call_count, dummy._inspect_tensor_call_count) == (6, 0)
        assert route is None
    else:
        assert dummy._inspect_tensor_call_count == 6 * 20 and route == "test_linear"


def test_a_gemm_kept_in_high_precision_stays_there_every_iteration(tmp_path):
    m = te.Linear(32, 32, name="fc1_probe")
    x = torch.randn(8, 32)
    with debug_session(tmp_path, DISABLE_FPROP):
        for _ in range(3):
            with te.autocast(recipe=R.Float8CurrentScaling()):
                y = m(x)
            y.sum().backward()
            assert state.route(m.gemm, True) == "fc1_probe"  # the debug path: fprop in high precision
            assert state.layer_plan("fc1_probe", True).tensor("activation").plan("fprop") == state.HIGH
            debug_api.step()
