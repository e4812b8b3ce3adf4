"""LogFp8TensorStats: statistics of quantized tensors, for every format."""
from typing import Dict

from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug import quant_view, state, stats
from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import ScheduledInspectFeature
from transformer_engine_proto.tensor import QuantizedTensor


def _matches(q, recipe: str) -> bool:
    family = quant_view.tensor_recipe_name(q)
    return family == recipe or (family == "fp8_per_tensor" and recipe in ("fp8_delayed_scaling", "fp8_current_scaling"))


class LogFp8TensorStats(ScheduledInspectFeature):
    """
    Logs statistics of quantized tensors.

    Each stat is `[<recipe>_]<stat>[_columnwise]`. Without a recipe the training recipe's
    quantization (the one the GEMM used) is measured; with one, the tensor is also quantized with
    that recipe to see what it would do (fp8_delayed_scaling only when it is the training recipe).
    `_columnwise` measures the columnwise (transposed-GEMM) quantization, which differs from the
    rowwise one for the block formats.

    recipes: fp8_delayed_scaling, fp8_current_scaling, mxfp8, fp8_block_scaling, nvfp4
    stats:
        - underflows%: share of non-zero elements quantized to 0
        - overflows%: share of elements beyond the largest value their block can represent
        - scale_inv_min, scale_inv_max: extreme effective scale_inv (per tensor or per block)
        - mse: mean squared quantization error

    Other parameters (tensors/tensors_struct: activation, gradient, weight; freq, start_step,
    end_step, start_end_list), accumulation over micro-batches and logging at `debug_api.step()`
    are as in LogTensorStats.

    Example
    -------
    .. code-block:: yaml

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

    @api_method
    def inspect_tensor(self, config: Dict, layer_name: str, tensor_name: str, iteration: int, tensor=None,
                       rowwise_quantized_tensor=None, columnwise_quantized_tensor=None, quantizer=None,
                       tp_group=None, **kwargs):
        current = quant_view.recipe_name(quantizer)
        parsed = []
        for s in config.get("stats", []):
            try:
                parsed.append((s,) + stats.parse_fp8_stat(s, current))
            except ValueError as e:
                raise ValueError(f"LogFp8TensorStats ({layer_name}, {tensor_name}): {e}") from None
        if tensor is None:
            return None
        fp8_dtype = getattr(quantizer, "fp8_dtype", None)
        variants, index, out = [], {}, []
        for name, recipe, base, col in parsed:
            if (recipe, col) not in index:
                index[(recipe, col)] = len(variants)
                variants.append((self._quantized(recipe, col, tensor, tensor_name, quantizer, fp8_dtype,
                                                 rowwise_quantized_tensor, columnwise_quantized_tensor), col))
            out.append((name, base, index[(recipe, col)]))
        stats.feed_quantized(layer_name, tensor_name, out, tensor, variants, iteration, tp_group)
        state.log_message(f"Feature={self.__class__.__name__}, API=inspect_tensor: {tensor_name}", layer_name)
        return None

    @staticmethod
    def _quantized(recipe, columnwise, tensor, tensor_name, quantizer, fp8_dtype, row_q, col_q):
        """The quantized tensor holding the usage a stat measures: the GEMM's one when it is of
        the recipe, else a fresh quantization."""
        if recipe == quant_view.recipe_name(quantizer):
            for q in (col_q, row_q) if columnwise else (row_q, col_q):
                if isinstance(q, QuantizedTensor) and _matches(q, recipe) and \
                        (q.has_columnwise() if columnwise else q.has_rowwise()):
                    return q
            fresh = quantizer
        else:
            fresh = quant_view.new_quantizer(recipe, fp8_dtype, tensor_name)
        return fresh.with_usage(rowwise=not columnwise, columnwise=columnwise).quantize(tensor.detach())


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(LogFp8TensorStats)
