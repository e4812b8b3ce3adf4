"""Recipes cross custom-op boundaries as string keys.

A custom op's schema cannot carry a Python object, so `autocast` registers the recipe under its
repr (deterministic: recipes are frozen dataclasses of plain values) and modules pass the string,
which torch.compile bakes into the graph as a constant (and guards on).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, Iterable, Optional

from ..recipe import Recipe
from ..tensor.recipe_quantizers import GEMMS, RoleQuantizers, quantizers_for_recipe

__all__ = ["recipe_key", "recipe_from_key", "quantizers_from_key", "HIGH_PRECISION_KEY",
           "with_high_precision_gemms", "base_key", "high_precision_gemms"]

HIGH_PRECISION_KEY = "high_precision"
_HP_MARK = "|high_precision_gemms="  # a Linear op key with some GEMMs kept in high precision
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


def with_high_precision_gemms(key: str, gemms: Iterable[str]) -> str:
    """The key of `key`'s recipe with `gemms` (of "fprop", "dgrad", "wgrad") run in high
    precision: what a Linear op gets when a per-GEMM precision choice keeps some of its GEMMs
    out of the recipe's format. `key` itself when there are none (or the recipe is off)."""
    gemms = set(gemms)
    unknown = gemms - set(GEMMS)
    if unknown:
        raise ValueError(f"high-precision GEMMs {sorted(unknown)}: expected names among {GEMMS}")
    if not gemms or key == HIGH_PRECISION_KEY:
        return key
    derived = base_key(key) + _HP_MARK + "+".join(g for g in GEMMS if g in gemms)
    _RECIPES.setdefault(derived, recipe_from_key(key))
    return derived


def high_precision_gemms(key: str) -> frozenset:
    """The GEMMs `key` keeps in high precision: string work only, so dynamo folds it to a constant
    (no quantizer is built while tracing)."""
    return frozenset(key.split(_HP_MARK, 1)[1].split("+")) if _HP_MARK in key else frozenset()


def base_key(key: str) -> str:
    """`key` without its high-precision GEMMs (the recipe's own key)."""
    return key.split(_HP_MARK, 1)[0]


@functools.lru_cache(maxsize=None)
def quantizers_from_key(key: str) -> RoleQuantizers:
    if _HP_MARK in key:
        return dataclasses.replace(quantizers_from_key(base_key(key)), high_precision_gemms=high_precision_gemms(key))
    recipe = recipe_from_key(key)
    custom = getattr(recipe, "role_quantizers", None)  # a derived recipe (distributed/amax_reduction.py)
    roles = custom() if custom is not None else quantizers_for_recipe(recipe)
    for q in (roles.input, roles.weight, roles.grad_output):  # cached and shared: no in-place changes
        if q is not None:
            q.seal()
    return roles
