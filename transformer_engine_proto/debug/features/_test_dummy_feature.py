"""`TestDummyFeature`, TE's feature for testing the switch to the fast path: it inspects nothing
and counts its calls.

By default it asks to inspect every configured tensor, which keeps its layers on the debug path;
with `inspect_only_once: True` it answers `(False, None)`, so each tensor is asked once and the
layer takes the fast path from then on. The counters live in this module under its package name,
`transformer_engine_proto.debug.features._test_dummy_feature` (what TE's tests read through the
`as_te` alias); nvdlfw_inspect executes the file as a separate standalone module, so the methods
count into the package module by name.
"""
import importlib

from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import TEConfigAPIMapper

_inspect_tensor_enabled_call_count = 0
_inspect_tensor_call_count = 0

_PACKAGE_MODULE = "transformer_engine_proto.debug.features._test_dummy_feature"


def _counters():
    return importlib.import_module(_PACKAGE_MODULE)


class TestDummyFeature(TEConfigAPIMapper):
    """Counts `inspect_tensor_enabled` and `inspect_tensor` calls; see the module docstring."""

    __test__ = False  # not a pytest test class, whatever its name

    @api_method
    def inspect_tensor_enabled(self, config, layer_name: str, tensor_name: str, iteration: int):
        _counters()._inspect_tensor_enabled_call_count += 1
        return (False, None) if config.get("inspect_only_once", False) else True

    @api_method
    def inspect_tensor(self, config, layer_name: str, **kwargs):
        _counters()._inspect_tensor_call_count += 1


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(TestDummyFeature)
