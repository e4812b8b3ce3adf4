"""Linear forward/backward as `torch.library` custom ops (namespace `te_proto`).

Both ops return plain tensors only. The quantized tensor that backward needs from forward (the
columnwise input for wgrad; the rowwise one for TE's backward_override="dequantized") leaves the
forward op as its flattened buffers; the fake impls build the same lists from `TensorProto`s,
which `LinearPlan` (linear_plan.py) derives from the call's flags (never from live `requires_grad`). The weight
dgrad reads: an eager call keeps it from forward's quantize and saves it (`keep_quantized_weight`,
as TE: an eager step is host-bound, and this saves a quantize per Linear); under torch.compile
backward quantizes it again from the weight (a parameter, alive anyway), with the forward's scale
under delayed scaling, so its bytes equal the forward's and no quantized copy of every weight is
kept from forward to backward (with the weight cache, backward reads the cache). Both ops are functional: the forward
returns the amaxes and the backward the gradient amax, and the autograd wrapper (`_backward`)
writes the latter into the module's pending buffer (delayed_scaling.record_grad_amax) and accumulates `main_grad`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import List, Optional, Sequence

import torch

from ..gemm import gemm
from ..kernels import fused_into_producer, kernel
from ..kernels.zeroed import zeros
from ..tensor import TensorProto
from ..tensor.storage import QuantizedTensorStorage
from . import eager_path, eager_program, shared_input
from .eager_path import eager_function
from .inductor_lowering import inline_in_inductor
from .linear_call import CACHE_FILL, CACHE_OFF, CACHE_USE, LinearCall, call_flags
from .linear_ends import backward_tail, fake_backward_grads, finish_backward, scales_for_backward
from .linear_plan import LinearPlan, make_plan, plan_of
from .recipe_key import RecipeKey
from .recompute_tags import recomputable_read, recompute_saved_input, recomputed_in_backward, traced_for_inductor
from .row_padding import pad_rows, unpad_rows

__all__ = ["linear", "LinearCall", "CACHE_OFF", "CACHE_FILL", "CACHE_USE"]

# Delayed scaling: `fp8_scale` holds the scales in slots 0 input, 1 weight, 2 gradient (the GEMM's
# packed state, pinned, or any tensor of at least three); backward records the gradient amax into
# `grad_amax_state` (delayed_scaling.py).


def _split(buffers: Sequence[torch.Tensor], named_protos):
    """Bare storages from the flattened `buffers` of `named_protos` ((proto, its inner names) pairs)."""
    out, i = [], 0
    for p, names in named_protos:
        n = len(names)
        out.append(rebuild(p, buffers[i:i + n], names))
        i += n
    return out


def rebuild(proto: TensorProto, buffers: Sequence[torch.Tensor], names=None) -> QuantizedTensorStorage:
    """A bare quantized storage from its flattened buffers (the inverse of `get_buffers`);
    `names`: the proto's inner names, where the caller has them already."""
    names = proto.inner_names() if names is None else names
    return proto.quantizer.make_tensor(dict(zip(names, buffers)), proto.shape, proto.dtype, internal=True)


def _quantize_shared(plan: LinearPlan, inp: torch.Tensor, quantizers, quantize,
                     amax: Optional[torch.Tensor] = None) -> List[QuantizedTensorStorage]:
    """The input quantized by `quantizers` (one storage each, `quantize()` makes them), shared with
    the other Linears that read the same tensor with the same quantizers (custom_ops/shared_input.py).
    `amax` (delayed scaling): where `quantize()` records the input's amax; a Linear that reuses
    another's quantize gets that amax written there."""
    keys = [(RecipeKey.base(plan.key), q) for q in quantizers]
    found = [shared_input.lookup(inp, k) for k in keys]
    if all(b is not None for b in found):
        if amax is not None:
            amax.copy_(found[0][-1])
            found[0] = found[0][:-1]
        shape = (plan.input_rows, plan.in_shape[-1])
        return [rebuild(TensorProto(shape, plan.act_dtype, q), b) for q, b in zip(quantizers, found)]
    made = quantize()
    for i, (k, xq) in enumerate(zip(keys, made)):
        extra = [amax] if amax is not None and i == 0 else []
        shared_input.store(inp, k, list(xq.get_buffers().values()) + extra)
    return made


def _quantize_input(plan: LinearPlan, inp: torch.Tensor, x2d: torch.Tensor, fp8_scale, amaxes):
    """The forward's input quantize: (the storage fprop reads, the one whose usage backward reads).

    While inductor traces the body with `recompute_saved_input` on, the two usages are quantized
    apart, scaled alike (current scaling: one amax, taken first and saved; delayed: the pinned
    scale): the partitioner then rebuilds in backward only the columnwise bytes, without a second
    amax pass, and the forward writes only the rowwise ones. That per-tensor FP8 cast is traced as
    its aten reference (`fused_into_producer`): inductor writes it from the kernel that
    recomputes `x` (SwiGLU, the attention output's copy, the read below), which our Triton cast
    would read back from memory. The rowwise quantize is tagged too (forward reads it only): an op
    on `x` it shares with the other, which AOT's CSE merges, is then never saved."""
    iq = plan.input_quantizer
    x = pad_rows(x2d, plan.input_rows)
    rebuilt = plan.saved_input is not None and recompute_saved_input()
    split = (rebuilt and traced_for_inductor() and plan.input_columnwise
             and iq.rowwise_usage and iq.columnwise_usage)
    usages = [iq.with_usage(columnwise=False), iq.with_usage(rowwise=False)] if split else [iq]

    def quantize():
        bound = usages
        if plan.delayed:  # the first quantize records the amax; a Linear reusing it copies that amax
            bound = [q.with_scale_state(fp8_scale, amaxes if i == 0 else None, 0) for i, q in enumerate(usages)]
        elif split and iq.takes_existing_amax():
            amax = kernel("amax", x.device)(x)
            bound = [q.with_existing_amax(amax) for q in usages]
        with recomputed_in_backward(rebuilt):
            made = [bound[0].quantize(x, internal=True)]
            if split:
                with fused_into_producer("fp8_quantize_delayed", "fp8_quantize_current"):
                    made.append(bound[1].quantize(recomputable_read(x), internal=True))
            return made

    made = _quantize_shared(plan, inp, usages, quantize, amax=amaxes[:1] if plan.delayed else None)
    return made[0], made[-1]


# ---- forward ----------------------------------------------------------------------------------
@torch.library.custom_op("te_proto::linear_fwd", mutates_args=())
def linear_fwd(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               fp8_scale: Optional[torch.Tensor],
               grad_amax_state: List[torch.Tensor], weight_cache: List[torch.Tensor],
               main_grad: Optional[torch.Tensor], key: str, flags: int,
               inp_quantized: List[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, List[torch.Tensor], List[torch.Tensor]]:
    plan = plan_of(key, inp, weight, LinearCall.of(flags), inp_quantized)
    cache_mode = plan.call.cache_mode
    x2d = inp.reshape(-1, inp.shape[-1])
    out_shape = tuple(inp.shape[:-1]) + (weight.shape[0],)
    if not plan.quantized:
        out = gemm(x2d, weight, trans_b=True, bias=bias, out_dtype=inp.dtype)
        return out.view(out_shape), inp.new_empty(0, dtype=torch.float32), [], []
    # delayed scaling: the input's and the weight's quantizes read fp8_scale[0] / [1] and record their
    # amaxes into amaxes[0] / [1] (a tensor not quantized here records zero); with reuses_weight_amax,
    # the weight's amax, which backward quantizes the weight with again
    amaxes = zeros(2, inp) if plan.delayed else inp.new_empty(0, dtype=torch.float32)
    xq = xq_saved = None
    if plan.prequantized:
        xq = rebuild(plan.prequantized_input, inp_quantized)
    elif plan.input_quantizer is not None:  # its columnwise copy is saved for wgrad, or rebuilt in backward
        xq, xq_saved = _quantize_input(plan, inp, x2d, fp8_scale, amaxes)
    if cache_mode == CACHE_USE:
        wq = rebuild(plan.cached_weight, weight_cache)
    else:
        wq = plan.weight_quantizer  # None: forward reads the bf16 weight only
        if wq is not None:
            if plan.delayed:
                wq = wq.with_scale_state(fp8_scale, amaxes, 1)
            elif plan.reuses_weight_amax:
                amaxes = kernel("amax", weight.device)(weight)
                wq = wq.with_existing_amax(amaxes)
            wq = wq.quantize(weight, internal=True)
    if plan.delayed:  # a tensor only backward quantizes: record its amax here (forward_amax_roles)
        for role in plan.forward_amax_roles():
            slot, t = (0, x2d) if role == "input" else (1, weight)
            amaxes[slot:slot + 1].copy_(t.abs().amax().float().reshape(1))
    if plan.fprop_q:
        # an emulated GEMM dequantizes its operands as a dequantized backward GEMM does, and AOT's
        # CSE merges the two: tagged as backward's, or inductor's partitioner would save the input
        # dequantized in place of its quantized bytes
        tag = recomputed_in_backward if plan.wgrad_deq or plan.dgrad_deq else contextlib.nullcontext
        out = gemm(xq.only_usage(True), wq.only_usage(True), trans_b=True, bias=bias, out_dtype=inp.dtype,
                   dequantize_in=tag, use_split_accumulator=RecipeKey.split_accumulator(plan.key, "fprop"))
        out = unpad_rows(out, x2d.shape[0])
    else:  # the high-precision GEMM, exactly as with the recipe off
        out = gemm(x2d, weight, trans_b=True, bias=bias, out_dtype=inp.dtype)
    cache = list(wq.get_buffers().values()) if cache_mode == CACHE_FILL else []
    saved = []
    if plan.saved_input is not None and not plan.prequantized:  # the usage backward reads
        saved += list(xq_saved.only_usage(not plan.input_columnwise).get_buffers().values())
    if plan.saved_weight is not None:  # the usage dgrad reads
        saved += list(wq.only_usage(plan.dgrad_deq).get_buffers().values())
    return out.view(out_shape), amaxes, saved, cache


@linear_fwd.register_fake
def _linear_fwd_fake(inp, weight, bias, fp8_scale, grad_amax_state, weight_cache, main_grad, key, flags,
                     inp_quantized):
    plan = plan_of(key, inp, weight, LinearCall.of(flags), inp_quantized)
    cache_mode = plan.call.cache_mode
    out = inp.new_empty(tuple(inp.shape[:-1]) + (weight.shape[0],))
    amaxes = inp.new_empty(_amax_count(plan), dtype=torch.float32)
    saved = []
    for p in plan.output_saved_protos:
        saved += list(dataclasses.replace(p, device=inp.device).create_buffers().values())
    cache = []
    if cache_mode == CACHE_FILL and plan.quantized:
        p = dataclasses.replace(plan.cached_weight, device=inp.device)
        cache = list(p.create_buffers().values())
    return out, amaxes, saved, cache


def _amax_count(plan: LinearPlan) -> int:
    """Elements of the forward op's `amaxes` output: the input's and the weight's (delayed
    scaling), the weight's (`reuses_weight_amax`), or none."""
    if not plan.quantized:
        return 0
    return 2 if plan.delayed else 1 if plan.reuses_weight_amax else 0


# ---- backward ---------------------------------------------------------------------------------
@torch.library.custom_op("te_proto::linear_bwd", mutates_args=())
def linear_bwd(grad_out: torch.Tensor, saved: List[torch.Tensor], inp: Optional[torch.Tensor],
               weight: Optional[torch.Tensor], weight_cache: List[torch.Tensor],
               fp8_scale: Optional[torch.Tensor],
               weight_amax: Optional[torch.Tensor], main_grad: Optional[torch.Tensor], key: str,
               in_shape: List[int], weight_shape: List[int], weight_dtype: torch.dtype, flags: int
               ) -> List[torch.Tensor]:
    """[dgrad] [wgrad (fp32 when it is accumulated into main_grad)] [dbias] [grad amax (delayed)]; the
    GEMMs the call computes (`LinearCall.computes_dgrad` / `computes_wgrad`). `weight_amax`: the
    forward's amax of the weight (`LinearPlan.reuses_weight_amax`)."""
    call = LinearCall.of(flags)
    plan = make_plan(key, tuple(in_shape), tuple(weight_shape), grad_out.dtype, weight_dtype, call, False)
    input_requires_grad, weight_requires_grad, cache_mode = call.computes_dgrad, call.computes_wgrad, call.cache_mode
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    saved_q = iter(_split(saved, plan.saved_layout))
    if plan.saved_input is not None:
        x = next(saved_q)
    else:
        x = inp.reshape(-1, in_shape[-1]) if weight_requires_grad else None
    # dy first: its bf16 copy (the lm_head's: 512 MiB on the Llama) may die before the weight's
    # quantized copy is allocated
    rows = plan.rows  # dy and x zero-padded to the recipe's row block for wgrad
    dy_q = dy
    delayed = plan.quantized and plan.delayed
    grad_amax = zeros(1, dy) if delayed else None
    gq = plan.grad_quantizer  # None for bias-only or both GEMMs in high precision
    if gq is not None:
        if plan.delayed:
            gq = gq.with_scale_state(fp8_scale, grad_amax, 2)
        dy_q = gq.quantize(pad_rows(dy, rows), internal=True)
    elif delayed and call.delay_wgrad and plan.wgrad_q:  # only the deferred wgrad quantizes dy: its amax now
        grad_amax = dy.abs().amax().float().reshape(1)
    if not input_requires_grad:
        w = None
    elif cache_mode == CACHE_USE and plan.dgrad_weight is not None:
        w = rebuild(plan.cached_weight, weight_cache).only_usage(plan.dgrad_deq)
    elif plan.saved_weight is not None:
        w = next(saved_q)
    elif plan.dgrad_weight is not None:  # quantized again, from the weight: the forward's bytes
        wq = plan.dgrad_weight.quantizer
        with recomputed_in_backward():
            if plan.delayed:  # the forward's scale (pinned); its amax was recorded in forward
                wq = wq.with_scale_state(fp8_scale, None, 1)
            elif weight_amax is not None:  # the forward's amax: no second pass over the weight
                wq = wq.with_existing_amax(weight_amax)
            w = wq.quantize(weight, internal=True)
    else:
        w = weight
    if plan.dgrad_deq or plan.wgrad_deq:  # high-precision GEMMs on the forward's operands, dequantized
        with recomputed_in_backward():
            w = w.dequantize(dtype=grad_out.dtype) if plan.dgrad_deq and input_requires_grad else w
            x = x.dequantize(dtype=grad_out.dtype) if plan.wgrad_deq and weight_requires_grad else x
    dgrad_q, wgrad_q = plan.dgrad_q and input_requires_grad, plan.wgrad_q and weight_requires_grad
    if wgrad_q and call.save_original_input:  # kept in backward, as the weight's quantize
        iq = plan.quantizers.input.with_usage(rowwise=False, columnwise=True)
        with recomputed_in_backward():
            if plan.delayed:  # reuse the forward's scale; the amax was recorded in forward
                iq = iq.with_scale_state(fp8_scale, None, 0)
            x = iq.quantize(pad_rows(x, rows), internal=True)
    grads = []  # dy_q holds the usages of dgrad_q and wgrad_q
    if input_requires_grad:  # a GEMM in high precision reads dy: the bf16 path's own GEMM
        a = (dy_q.only_usage(True) if wgrad_q else dy_q) if dgrad_q else dy
        split = RecipeKey.split_accumulator(key, "dgrad")
        dgrad = unpad_rows(gemm(a, w, out_dtype=grad_out.dtype, use_split_accumulator=split), dy.shape[0])
        grads.append(dgrad.view(tuple(in_shape)))
    if weight_requires_grad:
        a = (dy_q.only_usage(False) if dgrad_q else dy_q) if wgrad_q else dy
        wgrad_dtype = torch.float32 if call.fuse_wgrad_accumulation else weight_dtype
        split = RecipeKey.split_accumulator(key, "wgrad")
        grads.append(gemm(a, x, trans_a=True, out_dtype=wgrad_dtype, use_split_accumulator=split))
    return backward_tail(grads, dy, call.bias_requires_grad, weight_dtype, grad_amax if delayed else None)


@linear_bwd.register_fake
def _linear_bwd_fake(grad_out, saved, inp, weight, weight_cache, fp8_scale, weight_amax, main_grad, key, in_shape,
                     weight_shape, weight_dtype, flags):
    call = LinearCall.of(flags)
    plan = make_plan(key, tuple(in_shape), tuple(weight_shape), grad_out.dtype, weight_dtype, call, False)
    return fake_backward_grads(grad_out, call, in_shape, weight_shape, weight_dtype, plan.quantized and plan.delayed)


# ---- autograd wiring ----------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    inp, weight, _, fp8_scale, grad_amax_state, weight_cache, main_grad, key, flags, inp_quantized = inputs
    call = LinearCall.of(flags)
    _, amaxes, saved, _ = output
    plan = plan_of(key, inp, weight, call, inp_quantized)
    if plan.prequantized and plan.saved_input is not None:  # its columnwise buffers, by name
        named = dict(zip(plan.prequantized_input.inner_names(), inp_quantized))
        saved = [named[n] for n in plan.saved_input.inner_names()] + list(saved)
    cache = list(weight_cache) if call.cache_mode == CACHE_USE and call.input_requires_grad else []
    ctx.n_saved, ctx.n_cache, ctx.n_cache_in = len(saved), len(cache), len(weight_cache)
    ctx.n_prequantized = len(inp_quantized)
    # The buffers backward writes into (grad amax state, main_grad) are kept by reference, not
    # saved, so a module applied twice before its backwards does not trip autograd's version check.
    state = (inp if plan.saves_raw_input() else None, weight if plan.saves_raw_weight() else None,
             scales_for_backward(fp8_scale),
             amaxes if plan.reuses_weight_amax else None)  # backward quantizes the weight with that amax
    kept = [t for t in state if t is not None]
    ctx.has = [t is not None for t in state]
    ctx.grad_amax_state, ctx.main_grad = list(grad_amax_state), main_grad
    ctx.save_for_backward(*saved, *cache, *kept)
    ctx.call = call
    # linear_bwd's arguments after weight_amax and main_grad
    ctx.shapes = (key, list(inp.shape), list(weight.shape), weight.dtype)


def _backward(ctx, grad_out, _grad_amaxes, _grad_saved, _grad_cache):
    tensors = ctx.saved_tensors
    saved, cache = list(tensors[:ctx.n_saved]), list(tensors[ctx.n_saved:ctx.n_saved + ctx.n_cache])
    kept = list(tensors[ctx.n_saved + ctx.n_cache:])
    raw_inp, raw_w, scales, weight_amax = [kept.pop(0) if h else None for h in ctx.has]
    main_grad = ctx.main_grad
    backward_op = getattr(ctx, "backward_op", linear_bwd)
    dy = grad_out.contiguous()
    call, deferred = ctx.call, None
    if call.delay_wgrad and call.weight_requires_grad:
        call, deferred = _split_backward(ctx, dy)
    grads = backward_op(dy, saved, raw_inp, raw_w, cache, scales, weight_amax, main_grad, *ctx.shapes, call.flags)
    dgrad, wgrad, dbias = finish_backward(call, grads, ctx.grad_amax_state, main_grad)
    if deferred is not None:  # the weight's inputs only: dgrad's weight and cache are not kept
        args = (saved, raw_inp, None, [], scales, weight_amax, main_grad, *ctx.shapes)
        ctx.wgrad_store.append(functools.partial(_deferred_wgrad, backward_op, deferred, dy, args))
    # one grad per linear_fwd argument (None for the others, a list of Nones for a list)
    return (dgrad, wgrad, dbias, None, [None] * len(ctx.grad_amax_state), [None] * ctx.n_cache_in, None, None, None,
            [None] * ctx.n_prequantized)


def _split_backward(ctx, dy):
    """(the call backward runs now, the call queued for `backward_dw`) of a delay_wgrad call. The
    bias gradient goes with the wgrad where the gradient is not quantized, as in TE (which fuses
    it into the wgrad GEMM there, and into the gradient's quantize otherwise)."""
    if getattr(ctx, "wgrad_store", None) is None:
        raise RuntimeError("linear: delay_wgrad is set but the call has no wgrad queue (a linear() called "
                           "without wgrad_store, or an autograd node other than the op's own)")
    call, (key, in_shape, weight_shape, weight_dtype) = ctx.call, ctx.shapes
    plan = make_plan(key, tuple(in_shape), tuple(weight_shape), dy.dtype, weight_dtype, call, False)
    bias_later = call.bias_requires_grad and not (plan.dgrad_q or plan.wgrad_q)
    now = dataclasses.replace(call, bias_requires_grad=call.bias_requires_grad and not bias_later)
    later = dataclasses.replace(call, delay_wgrad=False, wgrad_only=True, bias_requires_grad=bias_later)
    return now, later


def _deferred_wgrad(backward_op, call: LinearCall, dy, args):
    """(wgrad, dbias) of a delayed call, each None where not computed here; wgrad is None too when
    it was added into main_grad. The gradient amax was recorded by the backward that queued it.
    `args`: linear_bwd's arguments between grad_out and flags."""
    with torch.no_grad():  # as autograd runs a backward (the saved raw input may require grad)
        grads = backward_op(dy, *args, call.flags)
        _, wgrad, dbias = finish_backward(call, grads, (), args[6])
    return wgrad, dbias


# `_setup_context` unpacks and `_backward` answers the ops' arguments by position
assert [a.name for a in torch.ops.te_proto.linear_fwd.default._schema.arguments] == [
    "inp", "weight", "bias", "fp8_scale", "grad_amax_state", "weight_cache", "main_grad", "key", "flags",
    "inp_quantized"]
assert [a.name for a in torch.ops.te_proto.linear_bwd.default._schema.arguments][-5:] == [
    "key", "in_shape", "weight_shape", "weight_dtype", "flags"]
linear_fwd.register_autograd(_backward, setup_context=_setup_context)
inline_in_inductor(torch.ops.te_proto.linear_fwd.default, linear_fwd._init_fn)
inline_in_inductor(torch.ops.te_proto.linear_bwd.default, linear_bwd._init_fn)


_linear_fwd_call = eager_function(linear_fwd, _setup_context, _backward, linear_bwd._init_fn, non_differentiable=(1,))


def linear(inp, weight, bias=None, *, key: str, fp8_scale=None, grad_amax_state=(), weight_cache=(),
           main_grad=None, cache_mode: int = CACHE_OFF, save_original_input: bool = False,
           fuse_wgrad_accumulation: bool = False, inp_quantized=(), wgrad_store=None):
    """y = inp @ weight.T + bias through the custom ops (an eager call of a signature seen before
    through its eager program where one serves it: eager_program.py). Returns (y, amaxes,
    new_weight_cache).
    `wgrad_store`: a list (eager only) that backward appends the weight-gradient computation to
    instead of running it (TE's delay_wgrad_compute): a callable giving (wgrad, dbias)."""
    # eager keeps the weight dgrad reads from forward, as TE (one quantize of each weight per step: an
    # eager step is host-bound); compiled graphs quantize it again in backward (no copy kept)
    flags = call_flags(inp, weight, bias, cache_mode, save_original_input, fuse_wgrad_accumulation,
                       keep_quantized_weight=not torch.compiler.is_compiling(), delay_wgrad=wgrad_store is not None)
    args = (inp, weight, bias, fp8_scale, list(grad_amax_state), list(weight_cache), main_grad, key, flags,
            list(inp_quantized))
    program = None
    if not (weight_cache or wgrad_store is not None or torch.compiler.is_compiling()):
        program = eager_program.program_for(key, flags, inp, weight, bool(inp_quantized))
    if program is not None and eager_path.takes_eager_path(inp, weight, bias, fp8_scale, args[4], main_grad, args[9]):
        out, amaxes = program(inp, weight, bias, fp8_scale, args[4], main_grad, args[9])
        return out, amaxes, []
    out, amaxes, _, cache = _linear_fwd_call(*args)
    if wgrad_store is not None and out.grad_fn is not None:
        out.grad_fn.wgrad_store = wgrad_store  # the op's autograd node is its backward's ctx
    return out, amaxes, cache
