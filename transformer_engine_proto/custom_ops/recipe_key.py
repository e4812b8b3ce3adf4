"""`RecipeKey`: the string a recipe crosses custom-op boundaries as, and its one owner.

A custom op's schema cannot carry a Python object, so a recipe travels as a string key that
torch.compile bakes into the graph as a constant (and guards on). The grammar:

    high_precision                                      no recipe: every GEMM in high precision
    <repr(recipe)>                                      a registered recipe (its dataclass repr)
    <repr(recipe)>|dequantized_gemms=dgrad+wgrad        a recipe with backward_override="dequantized":
                                                        the named GEMMs run in high precision on the
                                                        forward's quantized operands, dequantized
    <recipe key>|high_precision_gemms=<g>[+<g>...]      one of the keys above, the named GEMMs (of
                                                        fprop, dgrad, wgrad) kept in high precision on
                                                        the original operands (by the recipe's
                                                        backward_override or a per-GEMM precision
                                                        choice, which wins over dequantized)

Every key is built here (`of`, `with_high_precision_gemms`) and read here (`recipe`, `quantizers`,
`base`, `high_precision_gemms`, `dequantized_gemms`, `split_accumulator`). A derived recipe (e.g. TP amax reduction's)
is a recipe of its own, registered by `of`.

Recipes are mutable (recipe.py), so a key is the repr of the recipe's fields now, computed on
every `of` (a few microseconds; autocast asks once per entry), and it names a private copy taken
when the key was first registered, never the user's object: a later edit of that object gives a
new key and cannot change what an existing key means. Nothing here hashes a recipe object.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Dict, FrozenSet, Iterable, Optional

from ..recipe import CustomRecipe, Recipe, uses_split_accumulator
from ..tensor.recipe_quantizers import GEMMS, RoleQuantizers, quantizers_for_recipe

__all__ = ["RecipeKey"]

_HIGH_PRECISION = "high_precision"
_HP_MARK = "|high_precision_gemms="
_DQ_MARK = "|dequantized_gemms="
_RECIPES: Dict[str, Optional[Recipe]] = {_HIGH_PRECISION: None}  # key -> a private copy of its recipe


class RecipeKey:
    """Build and read recipe keys (plain `str`s; this class holds no instances)."""

    HIGH_PRECISION = _HIGH_PRECISION

    @staticmethod
    def of(recipe: Optional[Recipe]) -> str:
        """The key of `recipe`'s current field values (registered with a copy of them on first
        use), or HIGH_PRECISION for None."""
        if recipe is None:
            return _HIGH_PRECISION
        key = repr(recipe)
        if key not in _RECIPES:
            _RECIPES[key] = copy.copy(recipe)  # QParams are frozen: a shallow copy is the values
        # TE's backward_override, and the GEMMs a CustomRecipe's identity quantizers keep in high
        # precision, spelled out for string readers
        implied = RecipeKey.quantizers(key) if isinstance(recipe, CustomRecipe) else None
        dequantized = recipe.dequantized_gemms() | (implied.dequantized_gemms if implied else frozenset())
        if dequantized:
            recipe_key, key = key, key + _DQ_MARK + "+".join(g for g in GEMMS if g in dequantized)
            _RECIPES.setdefault(key, _RECIPES[recipe_key])
        gemms = recipe.high_precision_gemms() | (implied.high_precision_gemms if implied else frozenset())
        return RecipeKey.with_high_precision_gemms(key, gemms) if gemms else key

    @staticmethod
    def recipe(key: str) -> Optional[Recipe]:
        """The recipe a key names (None for HIGH_PRECISION): a copy registered with the key, equal
        to the recipe it was built from; not to be edited."""
        try:
            return _RECIPES[key]
        except KeyError:
            raise KeyError(f"recipe key {key!r} was never registered (RecipeKey.of(recipe) first)") from None

    @staticmethod
    def with_high_precision_gemms(key: str, gemms: Iterable[str]) -> str:
        """The key of `key`'s recipe with `gemms` (of "fprop", "dgrad", "wgrad") run in high
        precision: what a Linear op gets when a per-GEMM precision choice keeps some of its GEMMs
        out of the recipe's format, besides those `key` keeps already. `key` itself when there are
        none (or the recipe is off)."""
        gemms = set(gemms) | RecipeKey.high_precision_gemms(key)  # the recipe's own stay
        unknown = gemms - set(GEMMS)
        if unknown:
            raise ValueError(f"high-precision GEMMs {sorted(unknown)}: expected names among {GEMMS}")
        if not gemms or key == _HIGH_PRECISION:
            return key
        derived = RecipeKey.base(key) + _HP_MARK + "+".join(g for g in GEMMS if g in gemms)
        _RECIPES.setdefault(derived, RecipeKey.recipe(key))
        return derived

    @staticmethod
    def high_precision_gemms(key: str) -> FrozenSet[str]:
        """The GEMMs `key` keeps in high precision: string work only, so dynamo folds it to a
        constant (no quantizer is built while tracing)."""
        return frozenset(key.split(_HP_MARK, 1)[1].split("+")) if _HP_MARK in key else frozenset()

    @staticmethod
    def dequantized_gemms(key: str) -> FrozenSet[str]:
        """The GEMMs `key` runs on the forward's quantized operands, dequantized (those kept in
        high precision excepted): string work only, as `high_precision_gemms`."""
        base = RecipeKey.base(key)
        if _DQ_MARK not in base:
            return frozenset()
        return frozenset(base.split(_DQ_MARK, 1)[1].split("+")) - RecipeKey.high_precision_gemms(key)

    @staticmethod
    def base(key: str) -> str:
        """`key` without its high-precision GEMMs (the recipe's own key)."""
        return key.split(_HP_MARK, 1)[0]

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def split_accumulator(key: str, gemm: str) -> bool:
        """Whether the key's `gemm` (fprop / dgrad / wgrad) accumulates at full precision
        (`recipe.uses_split_accumulator`; the gemm's fast mode only exists for per-tensor FP8)."""
        return uses_split_accumulator(RecipeKey.recipe(key), gemm)

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def quantizers(key: str) -> RoleQuantizers:
        """The role quantizers of a key's recipe (sealed: cached and shared), with its
        high-precision and dequantized GEMMs."""
        if _HP_MARK in key:
            return dataclasses.replace(RecipeKey.quantizers(RecipeKey.base(key)),
                                       high_precision_gemms=RecipeKey.high_precision_gemms(key))
        if _DQ_MARK in key:
            return dataclasses.replace(RecipeKey.quantizers(key.split(_DQ_MARK, 1)[0]),
                                       dequantized_gemms=RecipeKey.dequantized_gemms(key))
        recipe = RecipeKey.recipe(key)
        custom = getattr(recipe, "role_quantizers", None)  # a derived recipe (distributed/amax_reduction.py)
        roles = custom() if custom is not None else quantizers_for_recipe(recipe)
        for q in (roles.input, roles.weight, roles.grad_output):  # cached and shared: no in-place changes
            if q is not None:
                q.seal()
        return roles
