"""GEMM weights stored quantized (`quantization.quantized_model_init`), as TE's FP8 parameters.

A module built inside `quantized_model_init` replaces each GEMM weight by a Parameter that is a
QuantizedTensor. The Linear op takes it as is, as it takes an FSDP2 quantized all-gather (its
buffers enter as the weight cache). Formats whose two usages are exact relayouts of each other
(per-tensor FP8, 128x128 blockwise, 2D NVFP4) store one usage and build the other per step;
MXFP8 stores both, unless the module is built without grad (`torch.no_grad()` /
`inference_mode()`): then, as in TE, only the rowwise usage is stored, for inference, and
training it (dgrad) is an error naming the cause. An optimizer step on the parameter
re-quantizes the updated value into it (`QuantizedTensor` in-place write-back); keep fp32 master
weights in the optimizer for training that needs updates below the format's resolution
(`preserve_high_precision_init_val` seeds them).
"""
from __future__ import annotations

import torch
from torch import nn

from .. import recipe as R
from ..custom_ops.recipe_key import RecipeKey
from ..quantization import param_init_state
from ..tensor import Float8CurrentScalingQuantizer, Quantizer
from ..tensor.recipe_quantizers import quantizers_for_recipe

__all__ = ["quantize_new_weights", "weight_param_quantizer", "dequantized_weight"]


def weight_param_quantizer(recipe: R.Recipe) -> Quantizer:
    """The quantizer a stored weight uses. Delayed scaling's weight scale is per-module state the
    parameter cannot carry, so a stored FP8 weight is scaled from its own amax (current scaling)
    each time it is written; the GEMM reads the same Float8Tensor layout either way."""
    if isinstance(recipe, R.DelayedScaling):
        return Float8CurrentScalingQuantizer(recipe.fp8_format.fwd_dtype)
    q = quantizers_for_recipe(recipe).weight
    if q is None and isinstance(recipe, R.CustomRecipe):  # every weight GEMM in high precision: as TE,
        q = recipe.qfactory(R.QuantizerRole(module_type="linear", tensor_type="weight"))  # the factory's own
    return q.with_usage(rowwise=True, columnwise=True)


def _quantized_parameter(weight: torch.Tensor, recipe: R.Recipe, keep_init_val: bool, owner: str) -> nn.Parameter:
    q = weight_param_quantizer(recipe)
    if not torch.is_grad_enabled():  # built for inference, as TE: no columnwise usage (what dgrad reads)
        q = q.with_usage(rowwise=True, columnwise=False)
    try:
        q.check_shape(tuple(weight.shape))
    except ValueError as e:
        raise ValueError(f"{owner}: quantized_model_init with {type(recipe).__name__} cannot store this "
                         f"weight quantized: {e}") from None
    with torch.no_grad():
        stored = q(weight.detach())
    if stored.derives_usages():
        stored.update_usage(columnwise_usage=False)
    param = nn.Parameter(stored, requires_grad=weight.requires_grad)
    if keep_init_val:
        init_val = weight.detach().to("cpu", copy=True)

        def get_high_precision_init_val():
            return param._high_precision_init_val

        def clear_high_precision_init_val():
            param._high_precision_init_val = None

        param._high_precision_init_val = init_val
        param.get_high_precision_init_val = get_high_precision_init_val
        param.clear_high_precision_init_val = clear_high_precision_init_val
    return param


def quantize_new_weights(module: nn.Module) -> None:
    """Inside `quantized_model_init`: store each GEMM weight of `module` quantized."""
    state = param_init_state()
    if not state.enabled:
        return
    for _, weight in module.gemm_weights():
        name = next((n for n, p in module._parameters.items() if p is weight), None)
        if name is None:
            raise RuntimeError(f"{module.name}: quantized_model_init cannot store a weight split into several "
                               f"parameters ({', '.join(module.weight_names)}) quantized, as in TE: build it with "
                               "parameters_split=None (fuse_qkv_params=True for attention)")
        setattr(module, name, _quantized_parameter(weight, state.recipe, state.preserve_high_precision_init_val,
                                                   module.name))
    module.quantized_weights_key = RecipeKey.of(state.recipe)  # what a forward compares (base.py)


def dequantized_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight stored quantized, in high precision for a GEMM run without a recipe (TE's
    behaviour outside autocast); its gradient reaches the parameter unchanged (dequantize is
    straight-through: tensor/straight_through.py)."""
    return weight.dequantize()
