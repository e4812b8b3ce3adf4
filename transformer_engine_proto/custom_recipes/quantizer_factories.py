"""Base quantizer factories (TE's `custom_recipes.quantizer_factories`): each returns, for a role,
the quantizer the matching built-in recipe uses for it, so `CustomRecipe(qfactory=mxfp8_factory)`
quantizes as `MXFP8BlockScaling()` does. The defaults live in the recipes
(`tensor/recipe_quantizers.py`); these only pick the role.

Not here: TE's `delayed_scaling_factory` (delayed-scaling quantizers from a factory are not
supported: use `DelayedScaling`).
"""
from __future__ import annotations

from typing import Optional

from .. import recipe as R
from ..tensor import IdentityQuantizer
from ..tensor.recipe_quantizers import quantizers_for_recipe

__all__ = ["high_precision_factory", "current_scaling_factory", "float8_block_scaling_factory",
           "mxfp8_factory", "nvfp4_factory"]


def _role_quantizer(recipe: R.Recipe, role: Optional[R.QuantizerRole]):
    """The built-in `recipe`'s quantizer for `role` (a copy: the caller owns it). A role that is
    not a Linear's weight or gradient takes the input's, as TE's factories do."""
    q = quantizers_for_recipe(recipe)
    kind = role.tensor_type if role is not None else ""
    return {"weight": q.weight, "grad_output": q.grad_output}.get(kind, q.input).copy()


def high_precision_factory(role: Optional[R.QuantizerRole]) -> IdentityQuantizer:
    """Every role in high precision: the recipe off, bit for bit."""
    return IdentityQuantizer()


def current_scaling_factory(role: Optional[R.QuantizerRole]):
    """`Float8CurrentScaling()`'s: E4M3 input and weight, E5M2 gradient."""
    return _role_quantizer(R.Float8CurrentScaling(), role)


def float8_block_scaling_factory(role: Optional[R.QuantizerRole]):
    """`Float8BlockScaling()`'s: 128x128 blocks for the weight, 1x128 otherwise, power-of-2 scales."""
    return _role_quantizer(R.Float8BlockScaling(), role)


def mxfp8_factory(role: Optional[R.QuantizerRole]):
    """`MXFP8BlockScaling()`'s: E4M3, 32-element blocks, E8M0 scales."""
    return _role_quantizer(R.MXFP8BlockScaling(), role)


def nvfp4_factory(role: Optional[R.QuantizerRole]):
    """`NVFP4BlockScaling()`'s: 16x16 weight blocks; 1D input with RHT; 1D gradient with RHT and
    stochastic rounding."""
    return _role_quantizer(R.NVFP4BlockScaling(), role)
