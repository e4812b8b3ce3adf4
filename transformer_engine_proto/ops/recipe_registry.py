"""Recipes cross custom-op boundaries as string keys.

A custom op's schema cannot carry a Python object, so `autocast` registers the recipe under its
repr (deterministic: recipes are frozen dataclasses of plain values) and modules pass the string,
which torch.compile bakes into the graph as a constant (and guards on).
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

from ..recipe import Recipe
from ..tensor.recipe_quantizers import RoleQuantizers, quantizers_for_recipe

__all__ = ["recipe_key", "recipe_from_key", "quantizers_from_key", "HIGH_PRECISION_KEY"]

HIGH_PRECISION_KEY = "high_precision"
_RECIPES: Dict[str, Optional[Recipe]] = {HIGH_PRECISION_KEY: None}


_LAST = [None, None]  # (recipe, its key) of the last call: autocast asks once per entry


def recipe_key(recipe: Optional[Recipe]) -> str:
    if recipe is None:
        return HIGH_PRECISION_KEY
    last, key = _LAST
    if recipe is last and _RECIPES.get(key) is recipe:
        return key
    key = repr(recipe)
    _RECIPES[key] = recipe
    _LAST[:] = recipe, key
    return key


def recipe_from_key(key: str) -> Optional[Recipe]:
    try:
        return _RECIPES[key]
    except KeyError:
        raise KeyError(f"recipe key {key!r} was never registered (call recipe_key(recipe) first)") from None


@functools.lru_cache(maxsize=None)
def quantizers_from_key(key: str) -> RoleQuantizers:
    recipe = recipe_from_key(key)
    custom = getattr(recipe, "role_quantizers", None)  # a derived recipe (distributed/amax_reduction.py)
    roles = custom() if custom is not None else quantizers_for_recipe(recipe)
    for q in (roles.input, roles.weight, roles.grad_output):  # cached and shared: no in-place changes
        if q is not None:
            q.seal()
    return roles
