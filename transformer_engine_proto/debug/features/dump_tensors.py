"""DumpTensors: save high-precision and quantized tensors (and their decoded internals) to files."""
from typing import Dict

from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug import dump, state
from transformer_engine_proto.debug.features import loaded_by_nvdlfw
from transformer_engine_proto.debug.features.api import ScheduledInspectFeature


class DumpTensors(ScheduledInspectFeature):
    """
    Saves tensors with `torch.save`, one dict per layer, tensor and iteration:
    `{log_dir}/tensor_dumps/rank_{rank}/{layer}_{tensor}_iter_{iteration:06d}.pt`.

    Keys: `high_precision` (the tensor before quantization), `quantized` (float32 values of the
    quantized tensor the GEMM used, or of a modify_tensor() result), `quantized_internals`
    (decoded buffers: FP8 data and scale_inv; blockwise data and scales; MXFP8 scales as
    float8_e8m0fnu; NVFP4 data as float32 E2M1 values, scales as float8_e4m3fn, amax; all scales in
    plain row-major layout -- `scale_layout` says so), plus layer_name, tensor_name, iteration,
    format. Everything loads with `torch.load(path, weights_only=True)`;
    `transformer_engine_proto.debug.quant_view.reconstruct(d["quantized_internals"])` rebuilds the
    dequantized tensor exactly, and `python -m transformer_engine_proto.debug.inspect_dump DIR`
    tabulates quantization errors.

    Parameters
    ----------
    tensors/tensors_struct: List[str]
        activation, gradient, weight, output, wgrad, dgrad
    dump_hp: bool, default True (TE alias: high_precision_tensor)
    dump_quant: bool, default True (TE alias: quantized_tensor)
    dump_quantized_internals: bool, default False
    freq, start_step, end_step, start_end_list: as in LogTensorStats

    Example
    -------
    .. code-block:: yaml

        dump_tensors_example:
            enabled: True
            layers:
                layer_name_regex_pattern: .*(fc1|self_attention).*
            transformer_engine:
                DumpTensors:
                    enabled: True
                    tensors_struct:
                        - tensor: activation
                          dump_hp: True
                          dump_quant: True
                          dump_quantized_internals: True
                          freq: 100
                        - tensor: weight
                          dump_quant: False
                          freq: 500
    """

    @api_method
    def inspect_tensor(self, config: Dict, layer_name: str, tensor_name: str, iteration: int, tensor=None,
                       rowwise_quantized_tensor=None, columnwise_quantized_tensor=None, **kwargs):
        dump_hp = bool(config.get("dump_hp", config.get("high_precision_tensor", True)))
        dump_quant = bool(config.get("dump_quant", config.get("quantized_tensor", True)))
        internals = bool(config.get("dump_quantized_internals", False))
        quantized = rowwise_quantized_tensor if rowwise_quantized_tensor is not None else columnwise_quantized_tensor
        path = dump.dump_tensor(layer_name, tensor_name, iteration, tensor, quantized, dump_hp, dump_quant, internals)
        if path is not None:
            state.log_message(f"Feature={self.__class__.__name__}, API=inspect_tensor: dumped {tensor_name} at "
                              f"iteration {iteration} to {path}", layer_name)
        return None


if loaded_by_nvdlfw(__name__):
    Registry.register_feature(namespace="transformer_engine")(DumpTensors)
