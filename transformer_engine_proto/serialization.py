"""`torch.load(path)` (default `weights_only=True`) of quantized tensors, bare quantized storages,
their quantizers and recipes.

The weights-only unpickler rebuilds only allow-listed globals. Ours are plain data holders (the
storage classes rebuild from their buffers and metadata, quantizers and recipes are dataclasses,
`Format` an enum of dtypes, `FSDPWeight` a tensor and its GEMM's name): none runs
code on load beyond setting attributes, so they are registered with
`torch.serialization.add_safe_globals` at package import. Only classes
defined in this package are registered (a user's subclass must be registered by its owner).
"""
from __future__ import annotations

import torch

from . import recipe as _recipe
from .distributed.fsdp import FSDPWeight
from .tensor.quantizer import Quantizer
from .tensor.storage import QuantizedTensorStorage

__all__ = ["safe_globals", "register_safe_globals"]


def _subclasses(cls: type):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def safe_globals() -> list:
    """This package's storage / tensor classes, quantizers, recipes, `Format` (and its value type),
    `QParams`, `MMParams` and the FSDP2 weight wrapper (`enable_quantized_all_gather`'s
    parameters are in the state dict)."""
    classes = [_recipe.Format, _recipe._FormatHelper, _recipe.QParams, _recipe.MMParams, FSDPWeight]
    for base in (QuantizedTensorStorage, Quantizer, _recipe.Recipe):
        classes += [base, *_subclasses(base)]
    own = __name__.rsplit(".", 1)[0] + "."
    return sorted({c for c in classes if c.__module__.startswith(own)}, key=lambda c: c.__qualname__)


def register_safe_globals() -> None:
    """Allow `torch.load(..., weights_only=True)` to rebuild this package's objects."""
    torch.serialization.add_safe_globals(safe_globals())
