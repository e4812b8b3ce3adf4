"""DisableFp8Gemm (aliases DisableFP8GEMM, DisableQuantizationGEMM): chosen GEMMs in high precision."""
from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import TEConfigAPIMapper


class DisableFp8Gemm(TEConfigAPIMapper):
    """
    GEMM operations run in high precision, even inside a low-precision autocast.

    Parameters
    ----------
    gemms: List[str]
        gemms to run in high precision: fprop, dgrad, wgrad

    Example
    -------
    .. code-block:: yaml

        example_disable_fp8_gemm:
            enabled: True
            layers:
                layer_types: [fc1]
            transformer_engine:
                DisableFp8Gemm:
                    enabled: True
                    gemms: [dgrad, wgrad]
    """

    @api_method
    def fp8_gemm_enabled(self, config, layer_name: str, gemm: str, iteration: int):
        for key in config:
            if key != "gemm":
                raise ValueError(f'[transformer_engine_proto debug] {type(self).__name__}: unexpected key "{key}" '
                                 "in config (only `gemms`)")
        return False, iteration + 1  # asked again every iteration: the layer stays on the debug path


class DisableFP8GEMM(DisableFp8Gemm):
    """Alias of DisableFp8Gemm (TE's newer name)."""


class DisableQuantizationGEMM(DisableFp8Gemm):
    """Alias of DisableFp8Gemm: any recipe (FP8, MXFP8, NVFP4)."""


if loaded_by_nvdlfw(__name__):
    for _cls in (DisableFp8Gemm, DisableFP8GEMM, DisableQuantizationGEMM):
        Registry.register_feature(namespace="transformer_engine")(_cls)
