"""`QuantizedGemm`: the per-GEMM state a TE module keeps, and the call into the linear ops.

State lives in buffers so torch.compile sees it as graph inputs it may mutate (no host sync): the
delayed-scaling state (`custom_ops/delayed_scaling.py`) and the quantized weight cache for
`is_first_microbatch`. Buffers whose shape depends on the recipe are allocated eagerly by
`prepare_for_recipe`, which `autocast` calls on entry.
"""
from __future__ import annotations

import collections
from typing import Optional

import torch
from torch import nn

from .. import recipe as R
from ..autocast import (
    FP8GlobalState,
    checkpoint_scales,
    get_fp8_recipe,
    get_fp8_recipe_key,
    get_gemm_policy_key,
    in_activation_recompute_phase,
)
from ..capabilities import default_device
from ..custom_ops import linear_ops
from ..custom_ops.delayed_scaling import DEFAULT_HISTORY_LEN, DelayedScalingState
from ..custom_ops.recipe_key import RecipeKey
from ..debug import debug_gemm as _debug_gemm  # precision debug tools: the debug GEMM path
from ..debug import state as _debug_state
from ..distributed import amax_reduction as _amax_reduction
from ..distributed import fsdp as _fsdp
from ..distributed import sp_gather as _sp_gather
from ..distributed import tp as _tp
from ..precision import policy as _policy
from ..tensor import QuantizedTensor, TensorProto
from .base import autocast_operands, check_recipe_shapes
from .quantized_params import dequantized_weight

__all__ = ["QuantizedGemm", "DEFAULT_HISTORY_LEN"]


class QuantizedGemm(DelayedScalingState, nn.Module):
    """State and dispatch for one GEMM (input @ weight.T) of a module. Modules call its `forward`
    directly: an internal module with no hooks to run, whose call through `nn.Module.__call__`
    would cost dynamo the hook checks on every trace."""

    def __init__(self, device=None):
        super().__init__()
        self._register_delayed_state(default_device(device))
        self._cache_names = []
        self._cache_for = None  # (recipe key, weight shape, dtype) the cache was allocated for
        self.uses_weight_cache = False  # set by the first is_first_microbatch call (eager)
        self._debug_uid = _debug_gemm.state.new_uid()  # precision debug tools: name registry key
        # (TP group name, roles) whose current-scaling amax is all-reduced (distributed/amax_reduction.py)
        self.tp_amax_reduction = None
        # sequence parallel: all-gather this GEMM's input shard quantized where the recipe allows
        # (distributed/sp_gather.py); False gathers in high precision
        self.quantized_sp_gather = True
        # GEMMs pinned to a precision (`pin_gemm_precision`), as the string the policy reads
        self.pinned_precision = ""
        # delayed scaling's update runs at training-autocast exit and entry, except where FSDP2's
        # pre-all-gather must reduce the amaxes first (distributed/fsdp.py updates there)
        self.scales_updated_by_autocast = True
        # delay_wgrad_compute: backward queues the weight gradient here for the module's backward_dw
        self.delay_wgrad = False
        self.pending_wgrads = collections.deque()

    def _apply(self, fn, recurse=True):
        """`model.to(torch.bfloat16)` / `.half()` move these buffers but keep their dtypes: the
        scaling state is float32 (a bf16 generation counter stops at 256) and the weight cache
        is in the recipe's format."""
        def same_dtype(t):
            new = fn(t)
            return new if new.dtype == t.dtype else t.to(device=new.device)

        return super()._apply(same_dtype, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._load_buffer_checkpoint(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    # ---- the keys the Linear op gets ---------------------------------------------------------
    def recipe_key(self, key: Optional[str] = None) -> str:
        """The key of the active recipe (or of `key`) for this GEMM: derived when its TP amax
        reduction is on (distributed/amax_reduction.py)."""
        key = get_fp8_recipe_key() if key is None else key
        if self.tp_amax_reduction is None:
            return key
        return _amax_reduction.tp_amax_key(key, *self.tp_amax_reduction)

    def op_key(self, key: str, inp: torch.Tensor, weight: torch.Tensor, policy: Optional[str] = None) -> str:
        """The Linear op's key: `key` with the GEMMs that the active GemmPolicy (`policy`, its
        registry key; None reads it) or this GEMM's pins keep in high precision (a trace-time
        constant, precision/policy.py)."""
        policy = get_gemm_policy_key() if policy is None else policy
        if not (policy or self.pinned_precision) or key == RecipeKey.HIGH_PRECISION:
            return key
        pins = self.pinned_precision
        if isinstance(weight, QuantizedTensor):
            # stored quantized: the policy keeps fprop / dgrad on its bytes (in high precision they
            # read it dequantized, a cost its table does not price); explicit pins still apply
            pins = _policy.with_default_pins(pins, fprop=_policy.RECIPE, dgrad=_policy.RECIPE)
        return _policy.key_with_policy_precision(key, policy, pins, self._debug_uid, str(inp.device),
                                                 inp.numel() // inp.shape[-1], weight.shape[0], weight.shape[1],
                                                 torch.is_grad_enabled())

    # ---- eager preparation ----------------------------------------------------------------
    def prepare_for_recipe(self, recipe: R.Recipe, weight: torch.Tensor, key: str) -> None:
        """`recipe`: the settings of `key` (`RecipeKey.recipe(key)`)."""
        if isinstance(recipe, R.DelayedScaling):
            self.ensure_history_len(recipe)
        if self.uses_weight_cache:
            try:
                self._alloc_weight_cache(self.recipe_key(key), weight)
            except ValueError:
                pass  # a shape the recipe cannot quantize: forward raises the error, naming the module

    def _alloc_weight_cache(self, key: str, weight: torch.Tensor) -> None:
        want = (key, tuple(weight.shape), weight.dtype)
        if self._cache_for == want:
            return
        for name in self._cache_names:
            delattr(self, name)
        self._cache_names = []
        q = RecipeKey.quantizers(key).weight
        if q is not None:
            proto = TensorProto(weight.shape, weight.dtype, q.with_usage(rowwise=True, columnwise=True),
                                device=weight.device)
            with torch.inference_mode(False):  # state, not inference tensors: training fills the cache
                buffers = proto.create_buffers().values()
            for i, buf in enumerate(buffers):
                name = f"weight_cache_{i}"
                self.register_buffer(name, buf, persistent=False)
                self._cache_names.append(name)
        self._cache_for = want

    def wants_quantized_input(self, weight: torch.Tensor, save_original_input: bool = False,
                              inp: Optional[torch.Tensor] = None):
        """None, or the `columnwise` flag for a fused norm + quantize of this GEMM's input `inp`:
        only stateless recipes (delayed scaling's input scale lives in this module's buffers), not
        when the input's amax is TP-reduced (the fused op quantizes with the plain recipe), and not
        when fprop runs in high precision (op_key). No columnwise copy where wgrad does not run in
        the recipe's format (kept in high precision, or dequantized from the rowwise input)."""
        recipe = get_fp8_recipe()
        if recipe is None or isinstance(recipe, R.DelayedScaling):
            return None
        if self.tp_amax_reduction is not None and "input" in self.tp_amax_reduction[1]:
            return None
        wgrad = True
        if inp is not None:
            op_key = self.op_key(self.recipe_key(), inp, weight)
            high = RecipeKey.high_precision_gemms(op_key)
            if "fprop" in high:
                return None
            wgrad = "wgrad" not in high | RecipeKey.dequantized_gemms(op_key)
        return torch.is_grad_enabled() and weight.requires_grad and not save_original_input and wgrad

    # ---- the call: named steps ----------------------------------------------------------------
    def forward(self, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                is_first_microbatch: Optional[bool] = None, save_original_input: bool = False,
                fuse_wgrad_accumulation: bool = False, inp_quantized=(), sequence_gather=None,
                main_grad: Optional[torch.Tensor] = None, owner=None) -> torch.Tensor:
        """`owner`: the module that runs this GEMM, named by the errors; given, this call checks what
        the module would at its entry (`_check_gemm_module`) for `weight`: modules that quantize
        before the GEMM check there and pass None.
        `inp_quantized`: the input's buffers from a fused norm + quantize (`wants_quantized_input`).
        `sequence_gather`: (TP group name, tp size) when `inp` is a sequence-parallel dim-0 shard
        to all-gather before the GEMM (column parallel + SP). `main_grad`: where the fused wgrad
        accumulates when `weight` is a view of the parameter holding it (None: `weight.main_grad`)."""
        # Dynamo traces every line of this forward for every GEMM of a model, and each attribute
        # read and helper call is work for it: the common path reads each setting once (the
        # block's state in one read) and the rare features sit behind one test each.
        block = FP8GlobalState.state
        recipe, base_key = block.entered, block.key  # the settings this autocast block entered with
        key = self.recipe_key(base_key)
        if owner is not None and recipe is not None:
            check_recipe_shapes(owner, base_key, (tuple(weight.shape),))
        if is_first_microbatch is None:
            is_first_microbatch = FP8GlobalState.first_microbatch  # make_graphed_callables's weight caching
        stored = isinstance(weight, QuantizedTensor)  # FSDP2's quantized all-gather
        if stored and (recipe is None or RecipeKey.quantizers(key).weight is None):
            # a high-precision GEMM (no recipe, or one quantizing no weight)
            weight, stored = dequantized_weight(weight), False
        cache_mode, cache = linear_ops.CACHE_OFF, []
        if is_first_microbatch is not None or stored:
            dgrad = torch.is_grad_enabled() and inp.requires_grad
            cache_mode, cache = self._weight_cache(recipe, key, weight, is_first_microbatch, dgrad)
        delayed = isinstance(recipe, R.DelayedScaling)
        # te.checkpoint's recompute: the first forward's scales, no history update, no amax recorded
        record = delayed and not FP8GlobalState.recompute_phase
        fused_wgrad = fuse_wgrad_accumulation and weight.requires_grad
        main_grad = (_main_grad(weight) if main_grad is None else main_grad) if fused_wgrad else None
        # under torch.autocast the GEMM computes in its dtype, as TE's activation dtype (a weight
        # stored quantized keeps its format)
        if stored:
            inp, bias = autocast_operands(inp, bias)
        else:
            inp, weight, bias = autocast_operands(inp, weight, bias)
        # precision debug tools: a layer with an active debug feature takes the debug GEMM path
        debug_linear = _debug_gemm.linear_for(self, recipe is not None) if _debug_state.SESSION.active else None
        debugging = debug_linear is not None
        if debugging and stored:
            raise NotImplementedError("precision debug features do not support FSDP2 quantized all-gather weights")
        wgrad_store = None
        if self.delay_wgrad and torch.is_grad_enabled() and weight.requires_grad:
            if owner is not None:
                owner.check_delay_wgrad_traceable()
            if debugging:
                raise NotImplementedError("delay_wgrad_compute is not supported with the precision debug features "
                                          "(as in TE)")
            wgrad_store = self.pending_wgrads
        sp_amax = None
        if sequence_gather is not None:
            inp, inp_quantized, sp_amax = self._gather_input(
                inp, weight, key, delayed, sequence_gather, not debugging and not save_original_input)
        op_key = self.op_key(key, inp, weight, block.policy)
        scales = self._forward_scale() if delayed else None
        if stored and RecipeKey.high_precision_gemms(op_key) & {"fprop", "dgrad"}:
            weight = dequantized_weight(weight)  # what a high-precision fprop / dgrad reads, as in TE
        out, amaxes, new_cache = (debug_linear or linear_ops.linear)(
            inp, weight, bias, key=op_key,
            fp8_scale=scales,
            grad_amax_state=self.grad_amax_state() if delayed else (),
            weight_cache=cache, main_grad=main_grad, cache_mode=cache_mode,
            save_original_input=save_original_input, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            **({"inp_quantized": inp_quantized} if inp_quantized and not debugging else {}),
            **({"wgrad_store": wgrad_store} if wgrad_store is not None else {}),
        )
        if record:
            self.record_amax(amaxes.detach(), scales=scales)
            if sp_amax is not None:  # the input was quantized before its gather: record its amax
                self.record_amax(sp_amax.detach(), scales=scales)
        if cache:
            for buf, new in zip(cache, new_cache):
                buf.copy_(new.detach())
        if fused_wgrad:
            mark_grad_added_to_main_grad([weight], out)
        return out

    def _forward_scale(self) -> torch.Tensor:
        """The scales of this forward (slots 0 input, 1 weight, 2 gradient: `forward_scales`):
        pinned when traced; in an eager `te.checkpoint`, the first forward keeps a copy and the
        recompute takes it back."""
        scales = None if torch.compiler.is_compiling() else checkpoint_scales()
        if scales is None:
            return self.forward_scales()
        if in_activation_recompute_phase():
            return scales.popleft()
        scales.append(self.delayed_state[:3].clone())
        return self.delayed_state

    def _weight_cache(self, recipe, key: str, weight, is_first_microbatch, dgrad: bool = True):
        """(cache mode, cache buffers) of this call. A weight FSDP2 gathered already quantized
        (distributed/fsdp.py) enters as the cache: its delayed-scaling update and weight amax were
        done in the pre-all-gather hook. `dgrad`: whether backward may read the weight's columnwise usage."""
        if isinstance(weight, QuantizedTensor):
            return linear_ops.CACHE_USE, _fsdp.gathered_weight_cache(type(self).__name__, weight, key, dgrad)
        if recipe is None:
            return linear_ops.CACHE_OFF, []
        if self._cache_for != (key, tuple(weight.shape), weight.dtype):
            if torch.compiler.is_dynamo_compiling():
                raise RuntimeError(
                    "is_first_microbatch needs the quantized-weight cache, allocated eagerly: run one "
                    "micro-batch eagerly (or set `uses_weight_cache = True` on the module's "
                    "QuantizedGemm before entering autocast) before compiling"
                )
            self.uses_weight_cache = True
            self._alloc_weight_cache(key, weight)
        cache = [getattr(self, n) for n in self._cache_names]
        return (linear_ops.CACHE_FILL if is_first_microbatch else linear_ops.CACHE_USE), cache

    def _gather_input(self, inp, weight, key: str, delayed: bool, sequence_gather, quantized_ok: bool):
        """(gathered input, its quantized buffers or (), all-reduced input amax for delayed scaling
        or None): quantize the shard then gather the bytes where the recipe allows, else gather
        in high precision (the Linear op quantizes the full tensor)."""
        group, world = sequence_gather
        layout = _sp_gather.HP
        wgrad = torch.is_grad_enabled() and weight.requires_grad
        # a high-precision wgrad reads the gathered input itself: gathered in high precision
        quantized_ok = quantized_ok and not (wgrad and "wgrad" in RecipeKey.high_precision_gemms(key))
        # the columnwise copy only for a wgrad in the recipe's format (the Linear op's plan)
        columnwise = wgrad and "wgrad" not in RecipeKey.dequantized_gemms(key)
        if self.quantized_sp_gather and quantized_ok:
            layout, _ = _sp_gather.input_gather_format(key, tuple(inp.shape), world, columnwise)
        if layout == _sp_gather.HP:
            return _tp.all_gather_first_dim(inp, group, world), (), None
        scale = self.fp8_scale[0:1] if delayed else None
        full, amax, buffers = _sp_gather.all_gather_quantized(inp, scale, group, world, key, layout, columnwise)
        return full, buffers, (amax if delayed else None)


def mark_grad_added_to_main_grad(params, out: torch.Tensor) -> None:
    """Megatron-LM's DDP adds a parameter's `.grad` into its `main_grad` unless the parameter's
    `grad_added_to_main_grad` is True; TE sets it, on parameters that have the attribute, once
    backward has added the weight gradient into `main_grad`. Eager: a hook on `out`'s backward
    node (the one that accumulates) sets it after that node ran. A compiled backward runs no
    Python, so under torch.compile it is set in forward instead, a side effect dynamo replays on
    every call. Nothing is set when no backward will run (grad mode off)."""
    params = [p for p in params if hasattr(p, "grad_added_to_main_grad")]
    if not params or not torch.is_grad_enabled():
        return

    def set_flags(*_):
        for p in params:
            p.grad_added_to_main_grad = True

    if torch.compiler.is_compiling():
        set_flags()
    elif out.grad_fn is not None:
        out.grad_fn.register_hook(set_flags)


def _main_grad(weight):
    """The fp32 buffer wgrad accumulates into (fuse_wgrad_accumulation)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        raise RuntimeError("fuse_wgrad_accumulation=True needs weight.main_grad (an fp32 buffer) to be set")
    return main_grad
