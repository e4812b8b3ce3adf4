"""The helpers of Transformer Engine's `transformer_engine.pytorch.utils` that user code calls:
Megatron-style weight initialisers, the unfused-attention mask function, `divide`, and the device
checks. (TE's other names there are its internals: NVTX ranges, cuDNN versions, tensor plumbing.)"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .capabilities import get_device_compute_capability, is_bf16_available  # noqa: F401

__all__ = ["init_method_normal", "scaled_init_method_normal", "init_method_constant", "get_default_init_method",
           "attention_mask_func", "divide", "is_non_tn_fp8_gemm_supported", "get_device_compute_capability",
           "is_bf16_available"]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An in-place initialiser drawing from N(0, sigma)."""
    return lambda tensor: torch.nn.init.normal_(tensor, mean=0.0, std=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, sigma / sqrt(2 * num_layers)): the output-projection initialiser of a `num_layers` model."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def init_method_constant(val: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An in-place initialiser filling with `val`."""
    return lambda tensor: torch.nn.init.constant_(tensor, val)


def get_default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    """TE's default weight initialiser, N(0, 0.023) (this package's modules given no `init_method`
    initialise as `nn.Linear` does)."""
    return init_method_normal(0.023)


def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Masks (in place) the scores where `attention_mask` is True with -10000, TE's unfused-softmax value."""
    return attention_scores.masked_fill_(attention_mask, -10000.0)


def divide(numerator: int, denominator: int) -> int:
    """`numerator // denominator`; a ValueError unless it divides exactly."""
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def is_non_tn_fp8_gemm_supported() -> bool:
    """Whether the device's FP8 GEMMs take operands in any layout, not only "TN" (Blackwell's 10.x and
    13.x on); False without a CUDA device."""
    cap = get_device_compute_capability()
    return (10, 0) <= cap < (12, 0) or cap >= (13, 0)
