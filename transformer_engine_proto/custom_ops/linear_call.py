"""`LinearCall`: the flags of one Linear op call, by name, crossing the op boundary as one int.

A custom op's schema carries tensors and plain values, and torch's custom-op autograd wrapper
re-reads the schema per argument (`fill_defaults`, quadratic in the argument count: host time per
eager call). So the Linear ops (and the debug tools' pair) take their flags as one `flags: int`,
built by `LinearCall.flags` and read back by `LinearCall.of(flags)`. Adding a flag touches this
file and the code that reads it, nothing in between.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["LinearCall", "call_flags", "CACHE_OFF", "CACHE_FILL", "CACHE_USE"]

CACHE_OFF, CACHE_FILL, CACHE_USE = 0, 1, 2  # weight quantization cache modes (is_first_microbatch)
_CACHE_MODES = (CACHE_OFF, CACHE_FILL, CACHE_USE)
_BOOLS = ("input_requires_grad", "weight_requires_grad", "bias_requires_grad", "save_original_input",
          "fuse_wgrad_accumulation", "keep_quantized_weight", "delay_wgrad", "wgrad_only")
_CACHE_SHIFT = len(_BOOLS)


@dataclass(frozen=True)
class LinearCall:
    """What a Linear call computes besides its tensors: which gradients, how the weight cache is
    used, what is saved for backward."""

    input_requires_grad: bool = False
    weight_requires_grad: bool = False
    bias_requires_grad: bool = False
    save_original_input: bool = False  # save the high-precision input; backward quantizes it
    fuse_wgrad_accumulation: bool = False  # wgrad is added into weight.main_grad (fp32)
    cache_mode: int = CACHE_OFF
    # forward saves its quantized weight in the usage dgrad reads (quantizing both usages where that
    # is the columnwise one); else backward quantizes it again from the weight (no copy kept)
    keep_quantized_weight: bool = False
    # TE's delay_wgrad_compute: backward computes no wgrad, and the autograd wrapper queues the call
    # that does (`wgrad_only`: the wgrad and the deferred bias gradient, nothing else) for the
    # module's `backward_dw()`. Neither changes what forward saves.
    delay_wgrad: bool = False
    wgrad_only: bool = False

    def __post_init__(self):
        _check_cache_mode(self.cache_mode)

    @property
    def computes_dgrad(self) -> bool:
        return self.input_requires_grad and not self.wgrad_only

    @property
    def computes_wgrad(self) -> bool:
        return self.weight_requires_grad and not self.delay_wgrad

    @functools.cached_property
    def flags(self) -> int:
        """The op's `flags` argument."""
        return _pack([getattr(self, name) for name in _BOOLS], self.cache_mode)


def call_flags(inp: torch.Tensor, weight: torch.Tensor, bias, cache_mode: int = CACHE_OFF,
               save_original_input: bool = False, fuse_wgrad_accumulation: bool = False,
               keep_quantized_weight: bool = False, delay_wgrad: bool = False) -> int:
    """The `flags` of a call on these tensors under the current grad mode: integer arithmetic
    only, which dynamo folds to a constant (`LinearCall(...).flags` gives the same)."""
    _check_cache_mode(cache_mode)
    grad_on = torch.is_grad_enabled()
    weight_rg = grad_on and weight.requires_grad
    return _pack((grad_on and inp.requires_grad, weight_rg, grad_on and bias is not None and bias.requires_grad,
                  save_original_input, fuse_wgrad_accumulation and weight_rg, keep_quantized_weight,
                  delay_wgrad and weight_rg, False), cache_mode)


@torch._dynamo.assume_constant_result
def _pack(bools, cache_mode: int) -> int:
    """`_BOOLS`' values as bits 0.., the cache mode above them. Dynamo calls it on its constant
    arguments instead of tracing the loop (the values come from guarded grad mode and flags)."""
    flags = cache_mode << _CACHE_SHIFT
    for i, b in enumerate(bools):
        flags |= bool(b) << i
    return flags


@functools.lru_cache(maxsize=None)
def _from_flags(flags: int) -> LinearCall:
    """The call an op's `flags` argument describes. Cached: one LinearCall per flag combination
    (a few dozen), and a cache hit runs no Python (host time per eager call)."""
    bools = [bool(flags >> i & 1) for i in range(len(_BOOLS))]
    return LinearCall(**dict(zip(_BOOLS, bools)), cache_mode=flags >> _CACHE_SHIFT)


LinearCall.of = staticmethod(_from_flags)


def _check_cache_mode(mode) -> None:
    if mode not in _CACHE_MODES:
        raise ValueError(f"linear: cache_mode={mode!r}: expected CACHE_OFF, CACHE_FILL or CACHE_USE (0, 1, 2)")
