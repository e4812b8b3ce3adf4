"""Which quantizer each GEMM operand role (input, weight, grad_output) gets under each recipe.

Quantizers come back stateless (frozen settings only): delayed scaling's scale/amax tensors are
module buffers that the ops bind at run time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import recipe as R
from .float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from .float8_blockwise import Float8BlockQuantizer
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer
from .quantizer import Quantizer

__all__ = ["RoleQuantizers", "quantizers_for_recipe", "ROLES"]

ROLES = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class RoleQuantizers:
    input: Optional[Quantizer]
    weight: Optional[Quantizer]
    grad_output: Optional[Quantizer]

    @property
    def enabled(self) -> bool:
        return self.input is not None


HIGH_PRECISION = RoleQuantizers(None, None, None)


def quantizers_for_recipe(recipe: Optional[R.Recipe]) -> RoleQuantizers:
    """Quantizers for a Linear's three operands; all None for high precision (recipe None)."""
    if recipe is None:
        return HIGH_PRECISION
    if isinstance(recipe, R.DelayedScaling):
        fmt = recipe.fp8_format
        return RoleQuantizers(
            Float8Quantizer(None, None, fmt.fwd_dtype),
            Float8Quantizer(None, None, fmt.fwd_dtype),
            Float8Quantizer(None, None, fmt.bwd_dtype),
        )
    if isinstance(recipe, R.Float8CurrentScaling):
        fmt = recipe.fp8_format

        def cs(dtype, qp: R.QParams):
            return Float8CurrentScalingQuantizer(
                dtype, force_pow_2_scales=qp.power_2_scale, amax_epsilon=qp.amax_epsilon, margin=recipe.margin
            )

        return RoleQuantizers(cs(fmt.fwd_dtype, recipe.fp8_quant_fwd_inp),
                              cs(fmt.fwd_dtype, recipe.fp8_quant_fwd_weight),
                              cs(fmt.bwd_dtype, recipe.fp8_quant_bwd_grad))
    if isinstance(recipe, R.MXFP8BlockScaling):
        fmt = recipe.fp8_format
        return RoleQuantizers(MXFP8Quantizer(fmt.fwd_dtype), MXFP8Quantizer(fmt.fwd_dtype),
                              MXFP8Quantizer(fmt.bwd_dtype))
    if isinstance(recipe, R.Float8BlockScaling):
        fmt = recipe.fp8_format

        def bq(dtype, dim, qp: R.QParams):
            return Float8BlockQuantizer(dtype, block_scaling_dim=dim, force_pow_2_scales=qp.power_2_scale,
                                        amax_epsilon=qp.amax_epsilon)

        return RoleQuantizers(bq(fmt.fwd_dtype, recipe.x_block_scaling_dim, recipe.fp8_quant_fwd_inp),
                              bq(fmt.fwd_dtype, recipe.w_block_scaling_dim, recipe.fp8_quant_fwd_weight),
                              bq(fmt.bwd_dtype, recipe.grad_block_scaling_dim, recipe.fp8_quant_bwd_grad))
    if isinstance(recipe, R.NVFP4BlockScaling):
        rht = not recipe.disable_rht
        return RoleQuantizers(
            NVFP4Quantizer(with_rht=rht),
            NVFP4Quantizer(with_2d_quantization=not recipe.disable_2d_quantization),
            NVFP4Quantizer(with_rht=rht, stochastic_rounding=not recipe.disable_stochastic_rounding),
        )
    raise TypeError(f"unknown recipe {type(recipe).__name__}; expected one of the transformer_engine_proto.recipe classes")
