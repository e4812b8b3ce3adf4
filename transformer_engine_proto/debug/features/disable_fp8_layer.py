"""DisableFp8Layer (aliases DisableFP8Layer, DisableQuantizationLayer): a whole layer in high precision."""
from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug import state
from transformer_engine_proto.debug.features import loaded_by_nvdlfw


class DisableFp8Layer:
    """
    Disables every quantized GEMM of the layer (fprop, dgrad, wgrad).

    Example
    -------
    .. code-block:: yaml

        example_disable_fp8_layer:
            enabled: True
            layers:
                layer_types: [fc1]
            transformer_engine:
                DisableFp8Layer:
                    enabled: True
    """

    @api_method
    def fp8_gemm_enabled(self, config, layer_name: str, gemm: str, iteration: int):
        for key in config:
            if key not in ("enabled", "gemm"):
                raise ValueError(f'[transformer_engine_proto debug] {type(self).__name__}: unexpected key "{key}" '
                                 "in config (it takes only `enabled`)")
        state.log_message("FP8 Disabled", layer_name)
        return False, iteration + 1  # asked again every iteration: the layer stays on the debug path

    def parse_config_and_api(self, config, **_kwargs):
        """No gemms/tensors to select: the feature applies to the whole layer."""
        return bool(config["enabled"]), None


class DisableFP8Layer(DisableFp8Layer):
    """Alias of DisableFp8Layer (TE's newer name)."""


class DisableQuantizationLayer(DisableFp8Layer):
    """Alias of DisableFp8Layer: any recipe (FP8, MXFP8, NVFP4)."""


if loaded_by_nvdlfw(__name__):
    for _cls in (DisableFp8Layer, DisableFP8Layer, DisableQuantizationLayer):
        Registry.register_feature(namespace="transformer_engine")(_cls)
