"""The debug GEMM path: a Linear whose three GEMMs make TE's GEMM calls.

For every input tensor (activation, weight in forward; gradient in backward) and each GEMM that
uses it, the layer's plan (from the routing calls) says: `modify_tensor()` (a feature returns the
operand), FP8 quantization (the recipe's quantizer) or high precision. Then `inspect_tensor` sees
the high-precision tensor with the quantized one, and `inspect_tensor_postquantize` each processed
operand. Outputs (output, dgrad, wgrad) may be modified and inspected after their GEMM. The call
order and arguments follow TE's DebugQuantizer.

Forward and backward are custom ops (`te_proto_debug::linear_fwd/bwd`) whose bodies run in eager
Python at run time, also inside a torch.compile'd graph: features (stats, dumps, user features)
run unchanged and see the current iteration, with no graph break. The forward keeps the operands
that backward's GEMMs need (whatever the features returned) in a side table, keyed by an int64
token tensor that autograd saves; the entry is dropped when the token dies. The ops carry the
`cudagraph_unsafe` tag: their Python side effects must not be frozen into a CUDA graph.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from typing import Dict, List, Optional

import torch

from ..custom_ops.linear_call import LinearCall, call_flags
from ..custom_ops.linear_ends import backward_tail, fake_backward_grads, finish_backward, scales_for_backward
from ..custom_ops.recipe_key import RecipeKey
from ..gemm import gemm
from ..tensor import QuantizedTensor
from . import state
from .state import HIGH, MODIFY, QUANTIZE, TENSOR_GEMMS

__all__ = ["linear_for", "debug_linear", "clear_saved"]

_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()
_SAVED: Dict[int, dict] = {}
_tokens = itertools.count()


def clear_saved() -> None:
    _SAVED.clear()


state.on_session_reset(clear_saved)


def linear_for(gemm_module, recipe_on: bool):
    """The debug linear for `gemm_module` if its layer takes the debug path now, else None."""
    name = state.route(gemm_module, recipe_on)
    return None if name is None else functools.partial(debug_linear, layer_name=name)


def _bind(q, scale, amax):
    return q.with_scale_state(scale, amax)  # a stateless format returns itself


def _delayed(q) -> bool:
    """Whether the input quantizer takes its scale from module state (delayed scaling)."""
    return q is not None and q.has_scale_state()


def _operand(t, rowwise: bool):
    """`t` holding just the usage a GEMM reads (deriving it where the format allows)."""
    if not isinstance(t, QuantizedTensor):
        return t
    has = t.has_rowwise() if rowwise else t.has_columnwise()
    other = t.has_columnwise() if rowwise else t.has_rowwise()
    if has and not other:
        return t
    return t.detach().update_usage(rowwise_usage=rowwise, columnwise_usage=not rowwise)


def _backward_operand(ops, gemm: str, dequantized: bool):
    """What forward keeps for `gemm` (wgrad / dgrad): its own operand, or the fprop one (rowwise)
    for a dequantized GEMM."""
    return _operand(ops["fprop"], True) if dequantized else _operand(ops[gemm], False)


def _high(t, dtype: torch.dtype) -> torch.Tensor:
    """A dequantized GEMM's operand in high precision (as it is, where fprop did not quantize it)."""
    return t.dequantize(dtype=dtype) if isinstance(t, QuantizedTensor) else t


class _Calls:
    """The GEMM calls of one layer in one op invocation."""

    def __init__(self, layer: str, key: str, plan=None):
        self.layer = layer
        self.recipe_on = key != RecipeKey.HIGH_PRECISION
        # GEMMs a per-GEMM precision choice keeps in high precision (te.gemm_policy / pins): a
        # debug feature may disable more, never re-enable these
        self.high_precision_gemms = RecipeKey.high_precision_gemms(key)
        # backward GEMMs on the forward's operands, dequantized (backward_override="dequantized"):
        # their gradient is not quantized either
        self.dequantized_gemms = RecipeKey.dequantized_gemms(key)
        self.live = state.SESSION.active and state.debug_manager() is not None
        self.iteration = state.current_iteration()
        if plan is None:
            plan = (state.layer_plan(layer, self.recipe_on) if self.live
                    else state.LayerPlan.default(layer, self.recipe_on, self.iteration))
        self.plan = plan
        self.tp_group = state.tp_group_of(layer) if self.live else None  # weights TP-sharded over it

    def _modify(self, tensor_name, gemm_name, x, quantizer):
        out = state.te_api().modify_tensor(layer_name=self.layer, gemm=gemm_name, tensor_name=tensor_name, tensor=x,
                                           default_quantizer=quantizer, iteration=self.iteration, out=None,
                                           dtype=x.dtype)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
            raise TypeError(f"{self.layer}: modify_tensor(tensor_name={tensor_name!r}, gemm={gemm_name!r}) must return "
                            f"a tensor of shape {tuple(x.shape)}, got {type(out).__name__} "
                            f"{tuple(getattr(out, 'shape', ()))}")
        return out

    def input_tensor(self, name: str, x: torch.Tensor, quantizer, need_row: bool, need_col: bool,
                     amax_slot=None) -> Dict[str, torch.Tensor]:
        """Operands for the GEMMs that need `x` (name -> tensor or QuantizedTensor)."""
        row_g, col_g = TENSOR_GEMMS[name]
        tp = self.plan.tensor(name)
        plans = {g: tp.plan(g) for g, need in ((row_g, need_row), (col_g, need_col)) if need}
        # no recipe, or the GEMM kept in high precision by the precision choice: nothing to quantize
        high = self.high_precision_gemms | self.dequantized_gemms
        plans = {g: (HIGH if p == QUANTIZE and (quantizer is None or g in high) else p) for g, p in plans.items()}
        quantized = None
        if QUANTIZE in plans.values():
            quantized = quantizer.with_usage(rowwise=plans.get(row_g) == QUANTIZE,
                                             columnwise=plans.get(col_g) == QUANTIZE).quantize(x)
        elif amax_slot is not None:  # delayed scaling keeps recording the amax of unquantized tensors
            amaxes, i = amax_slot
            amaxes[i] = torch.maximum(amaxes[i], x.detach().abs().amax().float())
        ops = {}
        for g in (col_g, row_g):
            if plans.get(g) == MODIFY:
                ops[g] = self._modify(name, g, x, quantizer)
        for g, p in plans.items():
            if p != MODIFY:
                ops[g] = quantized if p == QUANTIZE else x
        if not self.live:
            return ops
        if tp.inspect:
            # the processed operands (quantized or modify_tensor() results); None where high precision
            row_q = ops.get(row_g) if plans.get(row_g) in (MODIFY, QUANTIZE) else None
            col_q = ops.get(col_g) if plans.get(col_g) in (MODIFY, QUANTIZE) else None
            stats_q = None if quantizer is None else _bind(quantizer, getattr(quantizer, "scale", None),
                                                           torch.zeros(1, device=x.device))
            state.te_api().inspect_tensor(layer_name=self.layer, tensor_name=name, tensor=x, iteration=self.iteration,
                                          tp_group=self.tp_group,
                                          rowwise_quantized_tensor=row_q if row_q is not None else col_q,
                                          columnwise_quantized_tensor=col_q if col_q is not None else row_q,
                                          quantizer=stats_q)
        for g, p in plans.items():
            if p in (MODIFY, QUANTIZE) and tp.post(g):
                state.te_api().inspect_tensor_postquantize(layer_name=self.layer, tensor_name=name, gemm=g,
                                                           tensor=ops[g], rowwise=g == row_g,
                                                           iteration=self.iteration, tp_group=self.tp_group)
        return ops

    def output_tensor(self, name: str, y: torch.Tensor) -> torch.Tensor:
        if not self.live:
            return y
        tp = self.plan.tensor(name)
        gemm_name = TENSOR_GEMMS[name][0]
        if tp.plan(gemm_name) == MODIFY:
            y2 = self._modify(name, gemm_name, y, None)
            y = y2.dequantize(dtype=y.dtype) if isinstance(y2, QuantizedTensor) else y2.to(y.dtype)
        if tp.inspect:
            state.te_api().inspect_tensor(layer_name=self.layer, tensor_name=name, tensor=y, iteration=self.iteration,
                                          tp_group=self.tp_group, rowwise_quantized_tensor=None,
                                          columnwise_quantized_tensor=None, quantizer=None)
        return y


def _fresh(t: torch.Tensor, inputs) -> torch.Tensor:
    """Custom ops must not return their inputs' storage (a feature may hand one back)."""
    ptr = t.untyped_storage().data_ptr()
    if any(i is not None and i.untyped_storage().data_ptr() == ptr for i in inputs):
        return t.clone()
    return t


def _kept(t, source: torch.Tensor):
    """`t` safe to keep past the op: a copy where it is a plain tensor on `source`'s storage."""
    if isinstance(t, QuantizedTensor):
        return t
    return _fresh(t, (source,))


# ---- forward ----------------------------------------------------------------------------------------
@torch.library.custom_op("te_proto_debug::linear_fwd", mutates_args=(), tags=_TAGS)
def linear_fwd(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               fp8_scale: Optional[torch.Tensor],
               grad_amax_state: List[torch.Tensor], main_grad: Optional[torch.Tensor], layer_name: str, key: str,
               flags: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    call = LinearCall.of(flags)
    input_requires_grad, weight_requires_grad = call.input_requires_grad, call.weight_requires_grad
    calls = _Calls(layer_name, key)
    q = RecipeKey.quantizers(key)
    delayed = _delayed(q.input)
    amaxes = torch.zeros(2 if delayed else 0, dtype=torch.float32, device=inp.device)
    iq = _bind(q.input, fp8_scale[0:1], amaxes[0:1]) if delayed else q.input
    wq = _bind(q.weight, fp8_scale[1:2], amaxes[1:2]) if delayed else q.weight
    x2d = inp.reshape(-1, inp.shape[-1])
    deq_x, deq_w = "wgrad" in calls.dequantized_gemms, "dgrad" in calls.dequantized_gemms
    xs = calls.input_tensor("activation", x2d, iq, True, weight_requires_grad and not deq_x,
                            (amaxes, 0) if delayed else None)
    ws = calls.input_tensor("weight", weight, wq, True, input_requires_grad and not deq_w,
                            (amaxes, 1) if delayed else None)
    out = gemm(_operand(xs["fprop"], True), _operand(ws["fprop"], True), trans_b=True, bias=bias, out_dtype=inp.dtype,
               use_split_accumulator=RecipeKey.split_accumulator(key, "fprop"))
    out = calls.output_tensor("output", out).reshape(tuple(inp.shape[:-1]) + (weight.shape[0],))
    i = next(_tokens)
    token = torch.tensor([i], dtype=torch.int64)
    if input_requires_grad or weight_requires_grad:
        # the side table outlives the op: a high-precision operand that views an input is copied,
        # since the compiled graph does not see this reference and may reuse the input's buffer
        # a dequantized GEMM keeps the fprop operand (dequantized in backward)
        _SAVED[i] = {"x": _kept(_backward_operand(xs, "wgrad", deq_x), inp) if weight_requires_grad else None,
                     "w": _kept(_backward_operand(ws, "dgrad", deq_w), weight) if input_requires_grad else None,
                     "plan": calls.plan}
        weakref.finalize(token, _SAVED.pop, i, None)
    return _fresh(out, (inp, weight, bias)), amaxes, token


@linear_fwd.register_fake
def _linear_fwd_fake(inp, weight, bias, fp8_scale, grad_amax_state, main_grad, layer_name, key, flags):
    delayed = _delayed(RecipeKey.quantizers(key).input)
    return (inp.new_empty(tuple(inp.shape[:-1]) + (weight.shape[0],)),
            inp.new_empty(2 if delayed else 0, dtype=torch.float32), torch.empty(1, dtype=torch.int64, device="cpu"))


# ---- backward ---------------------------------------------------------------------------------------
@torch.library.custom_op("te_proto_debug::linear_bwd", mutates_args=(), tags=_TAGS)
def linear_bwd(grad_out: torch.Tensor, token: torch.Tensor, grad_fp8_scale: Optional[torch.Tensor], layer_name: str,
               key: str, in_shape: List[int], weight_shape: List[int], weight_dtype: torch.dtype,
               flags: int) -> List[torch.Tensor]:
    """[dgrad] [wgrad] [dbias] [grad amax (delayed scaling)]."""
    call = LinearCall.of(flags)
    input_requires_grad, weight_requires_grad = call.input_requires_grad, call.weight_requires_grad
    saved = _SAVED.get(int(token.reshape(-1)[0]))
    if saved is None and (input_requires_grad or weight_requires_grad):
        raise RuntimeError(f"{layer_name}: the debug GEMM path lost the operands saved by forward "
                           "(was the debug session re-initialised between forward and backward?)")
    calls = _Calls(layer_name, key, plan=saved["plan"] if saved else None)
    q = RecipeKey.quantizers(key)
    delayed = _delayed(q.input)
    grad_amax = torch.zeros(1, dtype=torch.float32, device=grad_out.device)
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    grads = []
    if input_requires_grad or weight_requires_grad:
        gq = _bind(q.grad_output, grad_fp8_scale, grad_amax) if delayed else q.grad_output
        gs = calls.input_tensor("gradient", dy, gq, input_requires_grad, weight_requires_grad,
                                (grad_amax, 0) if delayed else None)
        if input_requires_grad:
            w = _high(saved["w"], grad_out.dtype) if "dgrad" in calls.dequantized_gemms else saved["w"]
            dgrad = gemm(_operand(gs["dgrad"], True), w, out_dtype=grad_out.dtype,
                         use_split_accumulator=RecipeKey.split_accumulator(key, "dgrad"))
            grads.append(_fresh(calls.output_tensor("dgrad", dgrad).reshape(tuple(in_shape)), (grad_out,)))
        if weight_requires_grad:
            wdtype = torch.float32 if call.fuse_wgrad_accumulation else weight_dtype
            x = _high(saved["x"], grad_out.dtype) if "wgrad" in calls.dequantized_gemms else saved["x"]
            wgrad = gemm(_operand(gs["wgrad"], False), x, trans_a=True, out_dtype=wdtype,
                         use_split_accumulator=RecipeKey.split_accumulator(key, "wgrad"))
            grads.append(_fresh(calls.output_tensor("wgrad", wgrad), (grad_out,)))
    return backward_tail(grads, dy, call.bias_requires_grad, weight_dtype, grad_amax if delayed else None)


@linear_bwd.register_fake
def _linear_bwd_fake(grad_out, token, grad_fp8_scale, layer_name, key, in_shape, weight_shape, weight_dtype, flags):
    return fake_backward_grads(grad_out, LinearCall.of(flags), in_shape, weight_shape, weight_dtype,
                               _delayed(RecipeKey.quantizers(key).input))


_FWD_ARGS = ("inp", "weight", "bias", "fp8_scale", "grad_amax_state", "main_grad", "layer_name", "key", "flags")


def _setup_context(ctx, inputs, output):
    a = dict(zip(_FWD_ARGS, inputs))
    scales = scales_for_backward(a["fp8_scale"])  # slot 2: the gradient's
    state_tensors = (None if scales is None else scales[2:3], a["main_grad"])
    ctx.has = tuple(t is not None for t in state_tensors)
    ctx.grad_amax_state = list(a["grad_amax_state"])  # written by backward: by reference (custom_ops/linear.py)
    ctx.save_for_backward(output[2], *[t for t in state_tensors if t is not None])
    ctx.call = LinearCall.of(a["flags"])
    ctx.args = dict(layer_name=a["layer_name"], key=a["key"], in_shape=list(a["inp"].shape),
                    weight_shape=list(a["weight"].shape), weight_dtype=a["weight"].dtype, flags=a["flags"])


def _backward(ctx, grad_out, _grad_amaxes, _grad_token):
    token, *rest = ctx.saved_tensors
    it = iter(rest)
    grad_fp8_scale, main_grad = (next(it) if h else None for h in ctx.has)
    args = ctx.args
    grads = linear_bwd(grad_out.contiguous(), token, grad_fp8_scale, **args)
    dgrad, wgrad, dbias = finish_backward(ctx.call, grads, ctx.grad_amax_state, main_grad)
    return (dgrad, wgrad, dbias, None, [None] * len(ctx.grad_amax_state)) + (None,) * (len(_FWD_ARGS) - 5)


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


def debug_linear(inp, weight, bias=None, *, layer_name: str, key: str, fp8_scale=None, grad_amax_state=(),
                 weight_cache=(), main_grad=None, cache_mode: int = 0, save_original_input: bool = False,
                 fuse_wgrad_accumulation: bool = False):
    """`custom_ops.linear.linear`'s signature and results (y, amaxes, new weight cache) on the debug path.
    The quantized-weight cache is neither read nor filled: the weight is quantized every call."""
    flags = call_flags(inp, weight, bias, fuse_wgrad_accumulation=fuse_wgrad_accumulation)
    out, amaxes, _ = linear_fwd(inp, weight, bias, fp8_scale, list(grad_amax_state), main_grad, layer_name, key,
                                flags)
    return out, amaxes, []
