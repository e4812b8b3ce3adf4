"""`LinearPlan`: which buffers one Linear op call creates, saves and reads, from the recipe key,
the shapes, the dtypes and the call's flags only (never from live `requires_grad`), so the real
op and its fake impl agree. Plans are cached per call signature (`make_plan`): eager calls skip
rebuilding protos and quantizers, the host time on the hot path.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch

from ..tensor import TensorProto
from .linear_call import CACHE_FILL, CACHE_OFF, CACHE_USE, LinearCall
from .recipe_key import RecipeKey
from .row_padding import gemm_rows

__all__ = ["LinearPlan", "make_plan", "plan_of"]


@dataclass(frozen=True)
class LinearPlan:
    """Which buffers exist for one call, from shapes and call-time flags only. Every derived value
    is a cached property: computed on first read, then an attribute (no call on the eager hot path);
    callers must not mutate what they read."""

    key: str
    in_shape: tuple
    weight_shape: tuple
    act_dtype: torch.dtype
    weight_dtype: torch.dtype
    call: LinearCall
    prequantized: bool = False  # the input arrives already quantized (a fused norm + quantize)

    @functools.cached_property
    def quantizers(self):
        return RecipeKey.quantizers(self.key)

    @functools.cached_property
    def quantized(self) -> bool:
        return self.quantizers.enabled

    # ---- which GEMMs run in the recipe's format (the others read the high-precision operands) ----
    @functools.cached_property
    def fprop_q(self) -> bool:
        return self.quantizers.quantizes("fprop")

    @functools.cached_property
    def dgrad_q(self) -> bool:
        return self.quantizers.quantizes("dgrad") and self.call.input_requires_grad

    @functools.cached_property
    def wgrad_q(self) -> bool:
        return self.quantizers.quantizes("wgrad") and self.call.weight_requires_grad

    # ---- which backward GEMMs read the forward's quantized operand, dequantized -------------------
    @functools.cached_property
    def dgrad_deq(self) -> bool:
        return self.quantizers.dequantizes("dgrad") and self.call.input_requires_grad

    @functools.cached_property
    def wgrad_deq(self) -> bool:
        return self.quantizers.dequantizes("wgrad") and self.call.weight_requires_grad

    @functools.cached_property
    def input_columnwise(self) -> bool:
        """Whether forward quantizes the input's columnwise copy (saved for a quantized wgrad)."""
        return self.wgrad_q and not self.call.save_original_input

    @functools.cached_property
    def delayed(self) -> bool:
        q = self.quantizers.input  # scale from module state: delayed scaling
        return q is not None and q.has_scale_state()

    @functools.cached_property
    def m(self) -> int:
        m = 1
        for s in self.in_shape[:-1]:
            m *= s
        return m

    @functools.cached_property
    def rows(self):
        """Rows of the quantized input and grad_output: `m` zero-padded to the recipe's row block
        when wgrad runs (custom_ops/row_padding.py)."""
        return gemm_rows(self.m, self.key, self.wgrad_q)

    @functools.cached_property
    def input_rows(self):
        """Rows of the input as the forward quantizes it: padded only with its columnwise copy
        (with save_original_input, backward pads the raw input)."""
        return self.rows if self.input_columnwise else self.m

    def _proto(self, role, shape, dtype, rowwise, columnwise):
        q = getattr(self.quantizers, role).with_usage(rowwise=rowwise, columnwise=columnwise)
        return TensorProto(shape, dtype, q)

    @functools.cached_property
    def saved_input(self) -> Optional[TensorProto]:
        """The columnwise input for a quantized wgrad, or the forward's rowwise input for a
        dequantized one (TE saves it whatever save_original_input says); None where backward
        reads the raw input."""
        if self.input_columnwise:
            return self._proto("input", (self.rows, self.in_shape[-1]), self.act_dtype, False, True)
        if self.wgrad_deq:
            return self._proto("input", (self.m, self.in_shape[-1]), self.act_dtype, True, False)
        return None

    @functools.cached_property
    def saved_weight(self) -> Optional[TensorProto]:
        """The weight dgrad reads (`dgrad_weight`), saved from forward's quantize with
        `keep_quantized_weight`; otherwise None: backward quantizes it again from the weight."""
        if self.call.keep_quantized_weight and self.fprop_q and self.call.cache_mode == CACHE_OFF:
            return self.dgrad_weight
        return None

    @functools.cached_property
    def dgrad_weight(self) -> Optional[TensorProto]:
        """The quantized weight dgrad reads: saved from forward (`saved_weight`), quantized in
        backward from the weight, or read from the weight cache (CACHE_USE). Columnwise for a
        quantized dgrad; rowwise, the forward's bytes, for a dequantized one."""
        if self.dgrad_q or self.dgrad_deq:
            return self._proto("weight", self.weight_shape, self.weight_dtype, self.dgrad_deq, self.dgrad_q)
        return None

    @functools.cached_property
    def reuses_weight_amax(self) -> bool:
        """Whether backward quantizes the weight again with the amax forward took of it (a format
        whose scale comes from one per-tensor amax: current scaling): the forward op returns that
        amax, backward skips a pass over the weight. The weight has not changed in between."""
        if not (self.fprop_q and self.saved_weight is None and self.call.cache_mode == CACHE_OFF
                and self.dgrad_weight is not None):
            return False
        return self.quantizers.weight.takes_existing_amax()

    @functools.cached_property
    def cached_weight(self) -> Optional[TensorProto]:
        """Both usages, as stored in (or refreshed into) the module's weight cache."""
        if self.quantized and self.call.cache_mode != CACHE_OFF:
            return self._proto("weight", self.weight_shape, self.weight_dtype, True, True)
        return None

    @functools.cached_property
    def saved_protos(self) -> List[TensorProto]:
        """What backward receives, in order: the saved input, then the saved weight."""
        return [p for p in (self.saved_input, self.saved_weight) if p is not None]

    @functools.cached_property
    def saved_layout(self) -> List[tuple]:
        """(proto, its inner buffer names) of each of `saved_protos`: what backward rebuilds."""
        return [(p, p.inner_names()) for p in self.saved_protos]

    @functools.cached_property
    def output_saved_protos(self) -> List[TensorProto]:
        """The part of `saved_protos` the forward op returns (a prequantized input is saved from
        the op's inputs instead: returning an input would alias it)."""
        return [p for p in (None if self.prequantized else self.saved_input, self.saved_weight)
                if p is not None]

    @functools.cached_property
    def prequantized_input(self) -> TensorProto:
        """The layout a fused norm + quantize produces for this call's input."""
        return self._proto("input", (self.input_rows, self.in_shape[-1]), self.act_dtype, True,
                           self.input_columnwise)

    # ---- the quantizers with this call's usages (memoized: no dataclass copy per call) ---------
    @functools.cached_property
    def input_quantizer(self):
        """None when no GEMM reads a quantized input in forward and none is saved."""
        rowwise = self.fprop_q or self.wgrad_deq
        if not (rowwise or self.input_columnwise):
            return None
        return self.quantizers.input.with_usage(rowwise=rowwise, columnwise=self.input_columnwise)

    @functools.cached_property
    def weight_quantizer(self):
        """None when forward needs no quantized weight (fprop in high precision, no cache to fill)."""
        fill = self.call.cache_mode == CACHE_FILL
        if not (self.fprop_q or fill):
            return None
        keep_columnwise = self.dgrad_q and self.saved_weight is not None
        return self.quantizers.weight.with_usage(rowwise=True, columnwise=fill or keep_columnwise)

    @functools.cached_property
    def grad_quantizer(self):
        """None when neither backward GEMM this call runs (`computes_dgrad` / `computes_wgrad`)
        reads a quantized grad_output."""
        rowwise, columnwise = self.dgrad_q and self.call.computes_dgrad, self.wgrad_q and self.call.computes_wgrad
        if not (rowwise or columnwise):
            return None
        return self.quantizers.grad_output.with_usage(rowwise=rowwise, columnwise=columnwise)

    def forward_amax_roles(self) -> tuple:
        """Delayed scaling: the roles ("input", "weight") that backward quantizes but forward does
        not (their GEMM in forward runs in high precision): forward records their amax with a
        plain reduction, so the scale history still follows them."""
        roles = ()
        if self.wgrad_q and self.call.save_original_input and not self.fprop_q:
            roles += ("input",)
        if self.dgrad_q and not self.fprop_q and self.call.cache_mode == CACHE_OFF:
            roles += ("weight",)
        return roles

    # ---- what the autograd context keeps from the op's inputs (never op outputs) ----------
    def saves_raw_input(self) -> bool:
        return self.call.weight_requires_grad and self.saved_input is None

    def saves_raw_weight(self) -> bool:
        return self.call.input_requires_grad and (
            self.dgrad_weight is None or (self.call.cache_mode != CACHE_USE and self.saved_weight is None))


def plan_of(key, inp, weight, call: LinearCall, prequantized=False) -> LinearPlan:
    """The plan of a call on these tensors (`make_plan` with their shapes and dtypes)."""
    return make_plan(key, tuple(inp.shape), tuple(weight.shape), inp.dtype, weight.dtype, call, bool(prequantized))


@functools.lru_cache(maxsize=1024)
def _cached_plan(key, in_shape, weight_shape, act_dtype, weight_dtype, flags: int, prequantized) -> LinearPlan:
    return LinearPlan(key, in_shape, weight_shape, act_dtype, weight_dtype, LinearCall.of(flags), prequantized)


def make_plan(key, in_shape, weight_shape, act_dtype, weight_dtype, call: LinearCall, prequantized) -> LinearPlan:
    """One plan per call signature when the shapes are plain ints (eager calls: keyed by the call's
    flags, an int, which hashes faster than the LinearCall); a fresh one when they are symbolic
    (tracing), since SymInts cannot be cache keys."""
    for d in in_shape + weight_shape:
        if type(d) is not int:
            return LinearPlan(key, in_shape, weight_shape, act_dtype, weight_dtype, call, prequantized)
    return _cached_plan(key, in_shape, weight_shape, act_dtype, weight_dtype, call.flags, prequantized)
