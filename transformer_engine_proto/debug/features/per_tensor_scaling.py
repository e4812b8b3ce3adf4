"""PerTensorScaling: current (per-tensor) scaling for chosen GEMMs and tensors."""
from typing import Optional

from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import ModifyTensorFeature
from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer


class PerTensorScaling(ModifyTensorFeature):
    """
    Quantizes the chosen tensors of the chosen GEMMs with per-tensor current scaling
    (scale = fp8_max / amax / 2**margin), in the FP8 dtype the recipe gives that tensor. TE allows
    it under DelayedScaling only; here any FP8 recipe (delayed, current, MXFP8, blockwise) works.

    Parameters
    ----------
    gemms/gemms_struct: List[str]
        fprop, dgrad, wgrad
    tensors/tensors_struct: List[str]
        activation, gradient, weight
    margin: Optional[int], default = 0

    Example
    -------
    .. code-block:: yaml

        example_per_tensor_scaling:
            enabled: True
            layers:
                layer_types: [transformer_layer.self_attn.layernorm_q]
            transformer_engine:
                PerTensorScaling:
                    enabled: True
                    gemms: [dgrad]
                    tensors: [weight, activation]
    """

    CONFIG_KEYS = ("gemm", "tensor", "margin")

    @api_method
    def modify_tensor(self, config, layer_name: str, gemm: str, tensor_name: str, tensor, iteration: int,
                      default_quantizer=None, out: Optional[object] = None, dtype=None):
        self._check_keys(config)
        fp8_dtype = getattr(default_quantizer, "fp8_dtype", None)
        if fp8_dtype is None:
            raise ValueError(f"PerTensorScaling ({layer_name}, {tensor_name}, {gemm}) needs an FP8 recipe "
                             "(DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling or Float8BlockScaling) active")
        self._log_modify(layer_name, gemm, tensor_name)
        q = Float8CurrentScalingQuantizer(fp8_dtype, margin=int(config.get("margin", 0)))
        return q.quantize(tensor.detach())


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(PerTensorScaling)
