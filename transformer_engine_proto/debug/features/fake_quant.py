"""FakeQuant: quantize-dequantize chosen tensors and run those GEMMs in high precision."""
from typing import Optional

import torch
from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import ModifyTensorFeature
from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer, MXFP8Quantizer

FORMATS = {"FP8E4M3": torch.float8_e4m3fn, "FP8E5M2": torch.float8_e5m2,
           "MXFP8E4M3": torch.float8_e4m3fn, "MXFP8E5M2": torch.float8_e5m2}


class FakeQuant(ModifyTensorFeature):
    """
    Disables the quantized GEMM: the chosen tensors are fake-quantized (quantized, then
    dequantized) -- FP8 with a per-tensor current scale (never delayed), or MXFP8 -- and the GEMM
    runs in high precision on them.

    Parameters
    ----------
    gemms/gemms_struct: List[str]
        fprop, dgrad, wgrad
    tensors/tensors_struct: List[str]
        activation, gradient, weight, output, wgrad, dgrad
    quant_format: str
        FP8E4M3, FP8E5M2, MXFP8E4M3, MXFP8E5M2
    margin: Optional[int], default = 0 (FP8 formats)

    Example
    -------
    .. code-block:: yaml

        example_fake_quant_fp8:
            enabled: True
            layers:
                layer_types: [transformer_layer.layernorm_mlp.fc1]
            transformer_engine:
                FakeQuant:
                    enabled: True
                    quant_format: FP8E5M2
                    gemms_struct:
                    - gemm: fprop
                      tensors: [activation, weight]
                    - gemm: dgrad
                      tensors: [gradient]
    """

    CONFIG_KEYS = ("gemm", "tensor", "quant_format", "margin")

    @api_method
    def fp8_gemm_enabled(self, config, layer_name: str, gemm: str, iteration: int):
        return False, iteration + 1  # asked again every iteration: the layer stays on the debug path

    @api_method
    def modify_tensor(self, config, layer_name: str, gemm: str, tensor_name: str, tensor, iteration: int,
                      default_quantizer=None, out: Optional[object] = None, dtype=None):
        self._check_keys(config)
        fmt = config.get("quant_format")
        if fmt not in FORMATS:
            raise ValueError(f"FakeQuant ({layer_name}, {tensor_name}, {gemm}): quant_format {fmt!r} is not one of "
                             f"{sorted(FORMATS)}")
        self._log_modify(layer_name, gemm, tensor_name)
        x = tensor.detach()
        if fmt.startswith("MXFP8"):
            # blocks of 32 along the GEMM's reduction dim: K for fprop-style use, M for the transposed use
            columnwise = (tensor_name, gemm) in (("activation", "wgrad"), ("weight", "dgrad"), ("gradient", "wgrad"))
            q = MXFP8Quantizer(FORMATS[fmt]).with_usage(rowwise=not columnwise, columnwise=columnwise)
        else:
            q = Float8CurrentScalingQuantizer(FORMATS[fmt], margin=int(config.get("margin", 0))).with_usage(
                rowwise=True, columnwise=False)
        return q.quantize(x).dequantize(dtype=x.dtype)


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(FakeQuant)
