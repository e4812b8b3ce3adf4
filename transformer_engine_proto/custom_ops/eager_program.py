"""The eager Linear of one call signature, decided once (TE's per-signature path).

An eager FP8 Linear step is host-bound, and most of a te.Linear's host time is the generality of
the op (`linear.py`): its plan and protos, bare storages and their usage views, the GEMM dispatch,
the autograd wiring of every call flag. For the common call -- per-tensor FP8 with current or
delayed scaling, every GEMM in FP8 on CUDA, the input quantized here or by a fused norm, the wgrad
returned or added into main_grad, a token count that is a multiple of 16; no weight cache, row
padding, deferred wgrad or saved high-precision input -- `program_for` builds once per signature
(not per token count) a `LinearProgram` that makes the op's kernel calls with the op's arguments
in the op's order (the quantize kernels, the shared-input lookups, the `torch._scaled_mm` GEMMs,
the gradient amax record, the main_grad accumulation), without those layers.

The op stays the definition. The first eager call of a signature runs it (its input checks and
their errors), every call a program cannot serve runs it, torch.compile traces it, and
tests/test_eager_program.py checks that training with and without programs gives the same bits,
main_grad and scale state (on the GPU, and on CPU with the op's GEMM on `torch._scaled_mm`).
`set_enabled(False)` (or `TE_PROTO_EAGER_PROGRAM=0`) sends every call to the op.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from ..gemm import tensorwise_mm
from ..kernels import zeroed
from ..kernels.zeroed import zeros
from ..tensor.float8 import Float8CurrentScalingQuantizer, Float8Quantizer
from . import shared_input
from .linear_call import CACHE_OFF, LinearCall
from .linear_ends import backward_tail, finish_backward, scales_for_backward
from .linear_plan import LinearPlan, make_plan
from .recipe_key import RecipeKey

__all__ = ["program_for", "set_enabled", "enabled", "LinearProgram"]

_enabled = None  # None: not decided yet, take TE_PROTO_EAGER_PROGRAM at the next call
_PROGRAMS = {}  # call signature -> LinearProgram, or None: the op serves it
_LIMIT = 4096  # signatures kept: beyond it (shapes that keep changing) the cache starts over
# devices whose op GEMMs are the programs' `torch._scaled_mm` (on CPU the op emulates the GEMM in
# float32, so a program there would differ from it: the CPU tests add "cpu" and give the op that call)
SERVED_DEVICES = {"cuda"}
stats = {"calls": 0}  # calls the programs served, for tests and tools


def set_enabled(on: Optional[bool]) -> None:
    """Whether eager calls may take a program (False: every call runs the op); None follows
    `TE_PROTO_EAGER_PROGRAM` again (unset or anything but "0": on)."""
    global _enabled
    _enabled = None if on is None else bool(on)
    _PROGRAMS.clear()


def enabled() -> bool:
    """Whether eager calls may take a program now."""
    global _enabled
    if _enabled is None:
        _enabled = os.environ.get("TE_PROTO_EAGER_PROGRAM", "1") != "0"
    return _enabled


def program_for(key: str, flags: int, inp: torch.Tensor, weight: torch.Tensor,
                prequantized: bool = False) -> Optional["LinearProgram"]:
    """The program of this eager call's signature, or None: the op runs (the signature's first
    call, a call no program serves, or programs switched off). `prequantized`: the input comes
    with its quantized buffers (a fused norm + quantize)."""
    if not (_enabled if _enabled is not None else enabled()):
        return None
    # the token count is not part of the signature (a program serves any count cuBLAS takes), so a
    # varying batch or MoE split builds one program, not one per count
    k = inp.shape[-1]
    m = inp.numel() // k if k else 0
    if m == 0 or m % 16:
        return None
    sig = (key, flags, k, weight.shape, inp.dtype, weight.dtype, inp.get_device(), weight.get_device(), prequantized)
    program = _PROGRAMS.get(sig, _FIRST)
    if program is _FIRST:  # the op runs this first call; the next ones take what is built here
        if len(_PROGRAMS) >= _LIMIT:
            _PROGRAMS.clear()
        plan = make_plan(key, tuple(inp.shape), tuple(weight.shape), inp.dtype, weight.dtype, LinearCall.of(flags),
                         prequantized)
        served = inp.device.type in SERVED_DEVICES and weight.device == inp.device
        _PROGRAMS[sig] = LinearProgram(plan) if served and serves(plan) else None
        return None
    return program


_FIRST = object()


def serves(plan: LinearPlan) -> bool:
    """Whether a program makes exactly the op's kernel calls for this plan, whatever its token
    count (a multiple of 16, which `program_for` checks per call): per-tensor FP8 (every role
    current scaling, or every role delayed), each GEMM that runs in FP8 through `torch._scaled_mm`
    (features multiples of 16, no e5m2 x e5m2 product), nothing padded (per-tensor FP8 has no row
    block), cached, deferred or saved in high precision, a prequantized input in the layout a
    fused norm gives."""
    call, q = plan.call, plan.quantizers
    if not plan.quantized or call.cache_mode != CACHE_OFF or not call.keep_quantized_weight:
        return False
    if call.save_original_input or call.delay_wgrad or call.wgrad_only:
        return False
    if plan.prequantized and (plan.delayed or plan.prequantized_input.quantizer != plan.input_quantizer):
        return False  # the fused norm's buffers are not the ones the input quantizer would make
    kinds = {type(q.input), type(q.weight), type(q.grad_output)}
    if kinds != {Float8CurrentScalingQuantizer} and kinds != {Float8Quantizer}:
        return False
    if not plan.fprop_q or plan.dgrad_q != call.input_requires_grad or plan.wgrad_q != call.weight_requires_grad:
        return False
    if plan.dgrad_deq or plan.wgrad_deq or plan.reuses_weight_amax or plan.forward_amax_roles():
        return False
    if plan.rows != plan.m or plan.in_shape[-1] % 16 or plan.weight_shape[0] % 16:
        return False
    e5m2 = torch.float8_e5m2
    x, w, g = q.input.fp8_dtype, q.weight.fp8_dtype, q.grad_output.fp8_dtype
    return not (x == w == e5m2 or (plan.dgrad_q and g == w == e5m2) or (plan.wgrad_q and g == x == e5m2))


class EagerLinearProgram(torch.autograd.Function):
    """A program's call: its forward and backward (the program is the first argument); autograd
    shows its node as `EagerLinearProgramBackward`."""

    @staticmethod
    def forward(ctx, program, *args):
        ctx.program = program
        return program.forward(ctx, *args)

    @staticmethod
    def backward(ctx, grad_out, _grad_amaxes):
        return (None, *ctx.program.backward(ctx, grad_out))


_run = torch._C._FunctionBase.__dict__["apply"].__get__(None, EagerLinearProgram)  # Function.apply's C entry


class LinearProgram:
    """`linear_fwd` and `linear_bwd` of one plan the program `serves`, for any token count;
    `__call__` takes `linear`'s arguments (those a served call can have)."""

    def __init__(self, plan: LinearPlan):
        self.call = call = plan.call
        self.delayed = plan.delayed
        self.in_features, self.out_features = plan.in_shape[-1], plan.weight_shape[0]
        self.weight_dtype = plan.weight_dtype
        self.dgrad, self.wgrad = call.input_requires_grad, call.weight_requires_grad
        self.dbias, self.fuse_wgrad = call.bias_requires_grad, call.fuse_wgrad_accumulation
        self.prequantized = plan.prequantized
        # each role's quantizer with this call's usages: `cast` is its kernel call
        self.input_q, self.weight_q, self.grad_q = plan.input_quantizer, plan.weight_quantizer, plan.grad_quantizer
        self.shared_key = (RecipeKey.base(plan.key), self.input_q)  # the op's shared-input key for it
        self.fast_accum = tuple(not RecipeKey.split_accumulator(plan.key, g) for g in ("fprop", "dgrad", "wgrad"))

    def __call__(self, inp, weight, bias, fp8_scale, grad_amax_state, main_grad, inp_quantized):
        stats["calls"] += 1
        return _run(self, inp, weight, bias, fp8_scale, grad_amax_state, main_grad, inp_quantized)

    def _quantize(self, q, x, fp8_scale, amaxes, slot):
        """x's buffers quantized by q, in q's flattening order (its `_pack`); delayed scaling reads
        scale[slot] and records into amaxes[slot]."""
        made = q.cast(x, fp8_scale, amaxes, slot) if self.delayed else q.cast(x)[:3]
        return list(q._pack(*made).values())

    def forward(self, ctx, inp, weight, bias, fp8_scale, grad_amax_state, main_grad, inp_quantized):
        with shared_input.scope(), zeroed.slots():
            amaxes = zeros(2, inp) if self.delayed else inp.new_empty(0, dtype=torch.float32)
            x = list(inp_quantized) if self.prequantized else shared_input.lookup(inp, self.shared_key)
            if x is None:
                x2d = inp.reshape(-1, self.in_features).contiguous()
                x = self._quantize(self.input_q, x2d, fp8_scale, amaxes, 0)
                shared_input.store(inp, self.shared_key, x + [amaxes[:1]] if self.delayed else x)
            elif self.delayed:  # another Linear quantized this input: its amax is this one's too
                amaxes[:1].copy_(x.pop())
            w = self._quantize(self.weight_q, weight.contiguous(), fp8_scale, amaxes, 1)
            x_rows = x[0].reshape(-1, self.in_features)
            out = tensorwise_mm(x_rows, w[0], x[-1], w[-1], inp.dtype, bias, self.fast_accum[0])
        saved = []
        if self.wgrad:  # the input's columnwise bytes and scale
            saved += x[-2:]
        if self.dgrad:  # the weight's
            saved += w[-2:]
        if self.delayed:  # autocast's exit rewrites the state before backward reads the scales
            saved.append(scales_for_backward(fp8_scale))
        ctx.save_for_backward(*saved)
        # kept by reference, as the op does (backward writes them)
        ctx.grad_amax_state, ctx.main_grad, ctx.in_shape = grad_amax_state, main_grad, inp.shape
        ctx.mark_non_differentiable(amaxes)
        # no zero gradient made for `amaxes` before backward (delayed scaling's would be an
        # allocation and a fill launch per Linear)
        ctx.set_materialize_grads(False)
        return out.view(*inp.shape[:-1], self.out_features), amaxes

    def backward(self, ctx, grad_out):
        """linear_bwd's kernel calls and output list (`backward_tail`), then `finish_backward`:
        the gradient amax record, the main_grad accumulation."""
        if grad_out is None:  # no gradient reached the output (grads are not materialized)
            return (None,) * 7
        saved = list(ctx.saved_tensors)
        x_t, x_si = saved[:2] if self.wgrad else (None, None)
        w_t, w_si = saved[-3:-1] if self.delayed and self.dgrad else saved[-2:] if self.dgrad else (None, None)
        dy = grad_out.contiguous().reshape(-1, self.out_features)
        grads = []
        with zeroed.slots():
            grad_amax = zeros(1, dy) if self.delayed else None
            g = None  # no GEMM reads a quantized dy (only dbias is computed): none is made, as in the op
            if self.grad_q is not None:
                g = self._quantize(self.grad_q, dy.contiguous(), saved[-1] if self.delayed else None, grad_amax, 2)
            if self.dgrad:
                dgrad = tensorwise_mm(g[0], w_t, g[-1], w_si, grad_out.dtype, None, self.fast_accum[1])
                grads.append(dgrad.view(ctx.in_shape))
            if self.wgrad:
                wgrad_dtype = torch.float32 if self.fuse_wgrad else self.weight_dtype
                grads.append(tensorwise_mm(g[-2], x_t, g[-1], x_si, wgrad_dtype, None, self.fast_accum[2]))
        grads = backward_tail(grads, dy, self.dbias, self.weight_dtype, grad_amax)
        return (*finish_backward(self.call, grads, ctx.grad_amax_state, ctx.main_grad), None, None, None, None)
