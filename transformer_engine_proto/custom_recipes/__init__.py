"""TE's `custom_recipes`: quantizer factories for `CustomRecipe(qfactory=...)`.

`quantizer_factories` mirrors the built-in recipes' defaults per role; `quantizer_factory_zoo`
holds the mixed-precision examples this package runs (each role in one format, or in high
precision through `IdentityQuantizer` / `HybridQuantizer`).
"""
from . import quantizer_factories, quantizer_factory_zoo

__all__ = ["quantizer_factories", "quantizer_factory_zoo"]
