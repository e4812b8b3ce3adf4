"""LogNvfp4TensorStats: statistics of the NVFP4 quantization of layers trained with NVFP4."""
import warnings
from typing import Dict

from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug import quant_view, state, stats
from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import ScheduledInspectFeature
from transformer_engine_proto.tensor import QuantizedTensor

_RECIPE = "nvfp4"


class LogNvfp4TensorStats(ScheduledInspectFeature):
    """
    Logs statistics of NVFP4-quantized tensors, as `{layer}_{tensor}_nvfp4_<stat>`.

    Measures the rowwise NVFP4 quantization the GEMM used. A layer that does not run NVFP4 for the
    tensor (no recipe, or another one) is skipped with a warning; to see what NVFP4 would do to
    it, use LogFp8TensorStats' `nvfp4_` stats.

    Parameters
    ----------
    stats: List[str]
        - underflows%: share of elements, in percent, that are non-zero but quantized to 0
        - mse: mean squared quantization error
    tensors/tensors_struct: List[str]
        activation, gradient, weight
    freq, start_step, end_step, start_end_list
        as in LogTensorStats; so are the accumulation over micro-batches and the logging at
        `debug_api.step()`.

    Example
    -------
    .. code-block:: yaml

        example_nvfp4_tensor_stat_collection:
            enabled: True
            layers:
                layer_types: [layernorm_linear]
            transformer_engine:
                LogNvfp4TensorStats:
                    enabled: True
                    tensors_struct:
                    - tensor: activation
                      stats: [underflows%, mse]
                      freq: 1
                    - tensor: gradient
                      stats: [mse]
                      freq: 5
                      start_step: 0
                      end_step: 80
    """

    @api_method
    def inspect_tensor(self, config: Dict, layer_name: str, tensor_name: str, iteration: int, tensor=None,
                       rowwise_quantized_tensor=None, columnwise_quantized_tensor=None, quantizer=None,
                       tp_group=None, **kwargs):
        requested = config.get("stats", [])
        bad = [s for s in requested if s not in stats.NVFP4_STATS]
        if bad:
            raise ValueError(f"LogNvfp4TensorStats ({layer_name}, {tensor_name}): unsupported stats {bad}; "
                             f"supported: {list(stats.NVFP4_STATS)}")
        current = quant_view.recipe_name(quantizer)
        if current != _RECIPE:
            why = "it runs in high precision" if not current else f"it runs {current}, not nvfp4"
            warnings.warn(f"LogNvfp4TensorStats: no stats for layer {layer_name!r}, tensor {tensor_name!r}: {why}",
                          stacklevel=2)
            return None
        if tensor is None:
            return None
        q = next((t for t in (rowwise_quantized_tensor, columnwise_quantized_tensor)
                  if isinstance(t, QuantizedTensor) and quant_view.tensor_recipe_name(t) == _RECIPE
                  and t.has_rowwise()), None)
        if q is None:  # the GEMMs read only the columnwise data: quantize the rowwise one as they would
            q = quantizer.with_usage(rowwise=True, columnwise=False).quantize(tensor.detach())
        out = [(f"{_RECIPE}_{s}", s, 0) for s in requested]
        stats.feed_quantized(layer_name, tensor_name, out, tensor, [(q, False)], iteration, tp_group, kind=_RECIPE)
        state.log_message(f"Feature={self.__class__.__name__}, API=inspect_tensor: {tensor_name}", layer_name)
        return None


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(LogNvfp4TensorStats)
