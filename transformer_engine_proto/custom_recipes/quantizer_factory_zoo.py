"""Mixed-precision quantizer factories (TE's `custom_recipes.quantizer_factory_zoo`), those whose
roles each use one format or high precision, which the Linear op runs. TE's zoo also has
factories that quantize one role in two formats (MXFP8 forward with NVFP4 backward, ...); the op
takes one quantizer per role, so they are not here.
"""
from __future__ import annotations

from typing import Optional

from .. import recipe as R
from ..tensor import HybridQuantizer, IdentityQuantizer, NVFP4Quantizer
from .quantizer_factories import mxfp8_factory

__all__ = ["high_precision_fwd_mxfp8_bwd_factory", "mxfp8_fwd_high_precision_bwd_factory",
           "nvfp4_row_scaled_fwd_high_precision_bwd_factory"]


def _is_linear(role: Optional[R.QuantizerRole]) -> bool:
    return role is not None and role.module_type in ("linear", "grouped_linear")


def _forward_only(rowwise) -> HybridQuantizer:
    """Quantized for fprop; backward reads the forward's values dequantized."""
    return HybridQuantizer(rowwise_quantizer=rowwise, columnwise_quantizer=IdentityQuantizer(),
                           columnwise_source="rowwise_dequantized")


def high_precision_fwd_mxfp8_bwd_factory(role: Optional[R.QuantizerRole]):
    """fprop in high precision; dgrad and wgrad in MXFP8 (the gradient MXFP8, input and weight
    MXFP8 columnwise beside a high-precision rowwise copy)."""
    if _is_linear(role) and role.tensor_type == "grad_output":
        return mxfp8_factory(role)
    return HybridQuantizer(rowwise_quantizer=IdentityQuantizer(), columnwise_quantizer=mxfp8_factory(role))


def mxfp8_fwd_high_precision_bwd_factory(role: Optional[R.QuantizerRole]):
    """MXFP8 fprop; backward in high precision on the forward's dequantized input and weight and
    the unquantized gradient: `MXFP8BlockScaling(backward_override="dequantized")`, per role."""
    if _is_linear(role) and role.tensor_type in ("input", "weight"):
        return _forward_only(mxfp8_factory(role))
    if _is_linear(role) and role.tensor_type == "grad_output":
        return IdentityQuantizer()
    return mxfp8_factory(role)


def _plain_nvfp4(row_scaled: bool = False) -> NVFP4Quantizer:
    """NVFP4 without RHT, stochastic rounding or 2D blocks (row scaling is fprop-only)."""
    return NVFP4Quantizer(with_2d_quantization=False, with_rht=False, stochastic_rounding=False,
                          row_scaled_nvfp4=row_scaled)


def nvfp4_row_scaled_fwd_high_precision_bwd_factory(role: Optional[R.QuantizerRole]):
    """Row-scaled NVFP4 input and plain NVFP4 weight for fprop; backward in high precision on
    their dequantized values and the unquantized gradient: `NVFP4BlockScaling(disable_rht=True,
    disable_stochastic_rounding=True, disable_2d_quantization=True, row_scaled_activation=True,
    backward_override="dequantized")`, per role."""
    if _is_linear(role) and role.tensor_type == "input":
        return _forward_only(_plain_nvfp4(row_scaled=True))
    if _is_linear(role) and role.tensor_type == "weight":
        return _forward_only(_plain_nvfp4())
    if _is_linear(role) and role.tensor_type == "grad_output":
        return IdentityQuantizer()
    return _plain_nvfp4()
