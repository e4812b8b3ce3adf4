"""Recipes: what low-precision format each tensor role uses, with TE's names and defaults.

Recipes are frozen dataclasses so they hash and compare by value: torch.compile treats a recipe
as a constant and guards on it, and `autocast` can detect a recipe changed mid-run.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum

import torch

__all__ = [
    "Format",
    "QParams",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
]


class Format(Enum):
    """FP8 format per pass: (forward dtype, backward dtype). HYBRID = E4M3 forward, E5M2 grads."""

    E4M3 = (torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = (torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = (torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def fwd_dtype(self) -> torch.dtype:
        return self.value[0]

    @property
    def bwd_dtype(self) -> torch.dtype:
        return self.value[1]


@dataclass(frozen=True)
class QParams:
    """Per-tensor-role knobs of current/blockwise scaling (TE's `QParams`)."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0


class Recipe:
    """Base of all recipes; the predicates mirror TE's `Recipe.delayed()` etc."""

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return self.delayed() or self.float8_current_scaling()


def _check_format(fmt) -> None:
    if not isinstance(fmt, Format):
        raise TypeError(f"fp8_format must be a recipe.Format, got {fmt!r}")


def _check_margin(recipe) -> None:
    """margin scales by 2**-margin: a negative one would push amax past the format's max."""
    m = recipe.margin
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0 <= m < float("inf")):
        raise ValueError(f"{type(recipe).__name__}.margin must be a finite number >= 0, got {m!r}")


def _check_qparams(recipe) -> None:
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        q = getattr(recipe, name)
        if not isinstance(q, QParams):
            raise TypeError(f"{type(recipe).__name__}.{name} must be a recipe.QParams, got {q!r}")
        eps = q.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < float("inf")):
            raise ValueError(f"{type(recipe).__name__}.{name}.amax_epsilon must be a finite number >= 0 "
                             f"(the amax is clamped to at least it), got {eps!r}")


@dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Scale from a history of amaxes recorded in earlier steps (TE's default FP8 recipe)."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        _check_margin(self)


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scale from the amax of the tensor being quantized, computed just in time."""

    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = field(default_factory=QParams)
    margin: int = 0
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_margin(self)
        _check_qparams(self)


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """OCP MX: E8M0 power-of-two scale per 32 values along the reduction dimension."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        if self.margin != 0:  # kept for TE's signature; a nonzero margin would otherwise be ignored silently
            raise ValueError(f"MXFP8BlockScaling.margin is not used (MXFP8 block scales are powers of two "
                             f"rounded up from each block's amax, so blocks never overflow); got margin="
                             f"{self.margin!r}, leave it at 0")


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """DeepSeek-style blockwise FP8: 1x128 tiles for activations/grads, 128x128 for weights."""

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_fwd_weight: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_bwd_grad: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        _check_format(self.fp8_format)
        _check_qparams(self)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"{name} must be 1 (1x128 tiles) or 2 (128x128), got {getattr(self, name)}")


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, an E4M3 scale per 16 values and one FP32 global amax per tensor.

    Defaults follow TE: weights use 2D 16x16 blocks, gradients use stochastic rounding, and the
    columnwise (wgrad) operands of activations and gradients get a random Hadamard transform.
    """

    fp4_format: str = "E2M1"
    fp8_format: Format = Format.E4M3
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self):
        if self.fp4_format != "E2M1":
            raise ValueError(f"NVFP4 supports fp4_format='E2M1' only, got {self.fp4_format!r}")
        _check_format(self.fp8_format)


def replace(recipe: Recipe, **changes) -> Recipe:
    """Copy of a recipe with some fields changed (recipes are immutable)."""
    return dataclasses.replace(recipe, **changes)
