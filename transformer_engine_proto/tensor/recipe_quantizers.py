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
from .gemm_formats import gemm_formats
from .mxfp8 import MXFP8Quantizer
from .nvfp4 import NVFP4Quantizer
from .quantizer import Quantizer

__all__ = ["RoleQuantizers", "quantizers_for_recipe", "ROLES", "GEMMS"]

ROLES = ("input", "weight", "grad_output")
GEMMS = ("fprop", "dgrad", "wgrad")  # TE's names for a Linear's three GEMMs


@dataclass(frozen=True)
class RoleQuantizers:
    input: Optional[Quantizer]
    weight: Optional[Quantizer]
    grad_output: Optional[Quantizer]
    # GEMMs of a Linear that run in high precision although the recipe is on (a per-GEMM
    # precision choice: te.gemm_policy); their operands are not quantized
    high_precision_gemms: frozenset = frozenset()
    # backward GEMMs that run in high precision on the forward's quantized operands, dequantized
    # (TE's backward_override="dequantized"); their gradient operand is not quantized
    dequantized_gemms: frozenset = frozenset()

    @property
    def enabled(self) -> bool:
        return self.input is not None

    def quantizes(self, gemm: str) -> bool:
        """Whether `gemm` ("fprop", "dgrad" or "wgrad") runs in the recipe's format."""
        return self.input is not None and gemm not in self.high_precision_gemms | self.dequantized_gemms

    def dequantizes(self, gemm: str) -> bool:
        """Whether `gemm` runs in high precision on the forward's quantized operand, dequantized
        (a GEMM kept in high precision reads the original operand instead)."""
        return self.input is not None and gemm in self.dequantized_gemms - self.high_precision_gemms


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
                dtype, force_pow_2_scales=qp.power_2_scale or recipe.use_power_2_scales,
                amax_epsilon=qp.amax_epsilon, margin=recipe.margin,
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
            return Float8BlockQuantizer(dtype, block_scaling_dim=dim,
                                        force_pow_2_scales=qp.power_2_scale and not recipe.use_f32_scales,
                                        amax_epsilon=qp.amax_epsilon)

        return RoleQuantizers(bq(fmt.fwd_dtype, recipe.x_block_scaling_dim, recipe.fp8_quant_fwd_inp),
                              bq(fmt.fwd_dtype, recipe.w_block_scaling_dim, recipe.fp8_quant_fwd_weight),
                              bq(fmt.bwd_dtype, recipe.grad_block_scaling_dim, recipe.fp8_quant_bwd_grad))
    if isinstance(recipe, R.NVFP4BlockScaling):
        def fp4(qp: R.QParams, **options):
            return NVFP4Quantizer(with_rht=qp.random_hadamard_transform, stochastic_rounding=qp.stochastic_rounding,
                                  with_2d_quantization=qp.fp4_2d_quantization, **options)

        return RoleQuantizers(
            fp4(recipe.fp4_quant_fwd_inp, row_scaled_nvfp4=recipe.row_scaled_activation,
                **_nvfp4_4over6(recipe, "input")),
            fp4(recipe.fp4_quant_fwd_weight, **_nvfp4_4over6(recipe, "weight")),
            fp4(recipe.fp4_quant_bwd_grad, nvfp4_4over6_err_mode=recipe.nvfp4_4over6_err_mode),
        )
    if isinstance(recipe, R.CustomRecipe):
        return _custom_quantizers(recipe)
    R.require_recipe(recipe, "recipe quantizers")
    raise TypeError(f"unknown recipe {type(recipe).__name__}; "
                    "expected one of the transformer_engine_proto.recipe classes")


def _nvfp4_4over6(recipe: R.NVFP4BlockScaling, role: str) -> dict:
    """The 4over6 settings of the input or weight quantizer (TE: "activations" names the input,
    "weights" the weight; gradients never use it): on where `nvfp4_4over6` names the role, with
    S_enc bounded by 256 where `nvfp4_4over6_e4m3_use_256` names it too."""
    scope = "weights" if role == "weight" else "activations"
    on = recipe.nvfp4_4over6 in ("all", scope)
    use_256 = on and recipe.nvfp4_4over6_e4m3_use_256 in ("all", scope)
    return dict(nvfp4_use_4over6=on, nvfp4_e4m3_max=256 if use_256 else 448,
                nvfp4_4over6_err_mode=recipe.nvfp4_4over6_err_mode)


def _custom_quantizers(recipe: R.CustomRecipe) -> RoleQuantizers:
    """Ask the user's factory for each role's quantizer and check the roles can meet in each GEMM
    (identity and hybrid quantizers pick each GEMM's precision: `tensor/gemm_formats.py`)."""
    made = {}
    for role in ROLES:
        q = recipe.qfactory(R.QuantizerRole(module_type="linear", tensor_type=role))
        if not isinstance(q, Quantizer):
            raise TypeError(f"CustomRecipe: qfactory returned {type(q).__name__} for {role!r}; expected a "
                            "transformer_engine_proto.tensor quantizer")
        if q.has_scale_state():
            raise NotImplementedError(f"CustomRecipe: qfactory returned a delayed-scaling {type(q).__name__} for "
                                      f"{role!r}; delayed scaling keeps its state in the modules: use "
                                      "recipe.DelayedScaling")
        made[role] = q
    formats = gemm_formats(made)
    chosen = [q for q in formats.roles.values() if q is not None]
    if not chosen:  # every GEMM in high precision: no quantizer is ever used
        return RoleQuantizers(None, None, None, high_precision_gemms=formats.high_precision_gemms)
    names = {type(q).__name__ for q in chosen}
    if len({q.tensor_class for q in chosen}) != 1:
        raise ValueError(f"CustomRecipe: the roles' quantizers must be one format, got {sorted(names)}")
    # a role no GEMM quantizes gets another role's quantizer, which the plan never uses
    roles = {role: q if q is not None else chosen[0] for role, q in formats.roles.items()}
    return RoleQuantizers(**roles, high_precision_gemms=formats.high_precision_gemms,
                          dequantized_gemms=formats.dequantized_gemms)
