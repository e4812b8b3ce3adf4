"""`QuantizedGemm`: the per-GEMM state a TE module keeps, and the call into the linear ops.

State lives in buffers so torch.compile sees it as graph inputs it may mutate (no host sync):
the delayed-scaling scales and amax history (updated in-graph at each first micro-batch) and
the quantized weight cache for `is_first_microbatch`. Buffers whose shape depends on the recipe
are allocated eagerly by `prepare_for_recipe`, which `autocast` calls on entry.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch
from torch import nn

from .. import recipe as R
from ..autocast import (get_fp8_recipe, get_fp8_recipe_key, get_gemm_policy_key, in_activation_recompute_phase,
                        in_training_autocast)
from ..debug import debug_gemm as _debug_gemm  # precision debug tools: the debug GEMM path
from ..distributed import amax_reduction as _amax_reduction
from ..distributed import fsdp as _fsdp
from ..distributed import sp_gather as _sp_gather
from ..distributed import tp as _tp
from ..errors import raise_error
from ..kernels.reference.common import true_div
from ..custom_ops import linear_ops
from ..custom_ops.saved_state import saved_state
from ..custom_ops.recipe_registry import HIGH_PRECISION_KEY, high_precision_gemms, quantizers_from_key, recipe_key
from ..precision import policy as _policy
from ..tensor import QuantizedTensor, TensorProto

__all__ = ["QuantizedGemm", "DEFAULT_HISTORY_LEN"]

DEFAULT_HISTORY_LEN = 1024
_NONFINITE_ROLES = ("input", "weight", "grad")
_nonfinite_warned = False  # one warning per process (the counters keep counting)


def _role_maxes(recipe: R.DelayedScaling):
    fwd = 448.0 if recipe.fp8_format.fwd_dtype == torch.float8_e4m3fn else 57344.0
    bwd = 448.0 if recipe.fp8_format.bwd_dtype == torch.float8_e4m3fn else 57344.0
    return (fwd, fwd, bwd)


def _update_from_history(scale, amax_history, recipe: R.DelayedScaling, fp8_max: float) -> None:
    """TE's rule: scale from the max (or most recent) amax of the history, kept where that amax
    is 0 or non-finite; then roll the history so slot 0 is free for this step's amax."""
    history = amax_history[: recipe.amax_history_len]
    amax = history.amax(0) if recipe.amax_compute_algo == "max" else history[0]
    # the correctly rounded quotient, as TE; then the margin as an exact power-of-two product (the
    # same bits as TE's division by 2**margin, and no fp32 division for inductor to approximate)
    new = true_div(fp8_max, amax)
    if recipe.margin:
        new = new * (2.0 ** -recipe.margin)
    # kept where amax <= 0, amax is inf/NaN or new is not finite; where amax is positive and
    # finite, new lies in [0, inf], so `new < inf` is its finiteness test
    ok = (amax > 0) & (amax < math.inf) & (new < math.inf)
    scale.copy_(saved_state(torch.where(ok, new, scale)))  # backward reads this step's scale
    history.copy_(torch.roll(history, -1, 0))
    history[0].zero_()


def _keep_finite(slot: torch.Tensor, new: torch.Tensor, fallback: torch.Tensor, count: torch.Tensor) -> None:
    """slot = new where new is finite, else fallback, and count += 1 there. An inf/NaN amax never
    enters the history: one would make `max` of the history non-finite, and the scale would stay
    frozen (silently) until it rolled out, amax_history_len steps later. In-graph, no host sync."""
    ok = _finite(new)
    slot.copy_(torch.where(ok, new, fallback))
    count.add_((~ok).to(count.dtype))


def _longer(history: torch.Tensor, rows: int) -> torch.Tensor:
    """`history` extended with zero rows to `rows` (the recorded amaxes kept)."""
    out = history.new_zeros(rows, history.shape[1])
    out[: history.shape[0]] = history
    return out


def _finite(x: torch.Tensor) -> torch.Tensor:
    """`torch.isfinite(x)` in two elementwise ops (eager runs isfinite as four): NaN and +-inf
    compare False."""
    return x.abs() < math.inf


class QuantizedGemm(nn.Module):
    """State and dispatch for one GEMM (input @ weight.T) of a module."""

    def __init__(self, device=None):
        super().__init__()
        # columns: input, weight (forward); the gradient has its own buffers because backward
        # reads them after forward has already recorded this step's amaxes
        self.register_buffer("fp8_scale", torch.ones(2, device=device))
        self.register_buffer("amax_history", torch.zeros(DEFAULT_HISTORY_LEN, 2, device=device))
        self.register_buffer("grad_fp8_scale", torch.ones(1, device=device))
        self.register_buffer("grad_amax_history", torch.zeros(DEFAULT_HISTORY_LEN, 1, device=device))
        # backward's gradient amax waits here until the next forward folds it into the history
        # (custom_ops/linear.py record_grad_amax): [amax, generation], and the generation last folded
        self.register_buffer("grad_amax_pending", torch.zeros(2, device=device))
        self.register_buffer("grad_amax_seen", torch.zeros(1, device=device))
        # inf/NaN amaxes skipped per role (input, weight, grad): counted in-graph, reported once by
        # `poll_nonfinite` at autocast entry
        self.register_buffer("nonfinite_amax_count", torch.zeros(3, dtype=torch.int64, device=device))
        self._nonfinite_poll = None  # CUDA: (host copy, event) of a count copy in flight
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

    def _apply(self, fn, recurse=True):
        """`model.to(torch.bfloat16)` / `.half()` move these buffers but keep their dtypes: the
        scaling state is float32 (a bf16 generation counter stops at 256) and the weight cache
        is in the recipe's format."""
        def same_dtype(t):
            new = fn(t)
            return new if new.dtype == t.dtype else t.to(device=new.device)

        return super()._apply(same_dtype, recurse)

    def _op_key(self, key: str) -> str:
        """The recipe key the Linear op gets (derived when TP amax reduction is on)."""
        if self.tp_amax_reduction is None:
            return key
        return _amax_reduction.tp_amax_key(key, *self.tp_amax_reduction)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints written before the counter existed load with a zero count
        state_dict.setdefault(prefix + "nonfinite_amax_count", torch.zeros_like(self.nonfinite_amax_count))
        # a checkpoint written with a longer or shorter amax history: take its length
        for name in ("amax_history", "grad_amax_history"):
            saved, mine = state_dict.get(prefix + name), getattr(self, name)
            if isinstance(saved, torch.Tensor) and saved.dim() == 2 and saved.shape[1:] == mine.shape[1:] \
                    and saved.shape[0] != mine.shape[0]:
                with torch.inference_mode(False):
                    setattr(self, name, mine.new_zeros(saved.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def __getstate__(self):
        # a copy in flight (a CUDA event) belongs to this process and this object: deepcopy and
        # pickling start without one
        state = self.__dict__.copy()
        state["_nonfinite_poll"] = None
        return state

    # ---- non-finite amax report -------------------------------------------------------------
    def poll_nonfinite(self, name: str) -> None:
        """Warn once (per process) when delayed scaling has skipped an inf/NaN amax.

        Called at autocast entry, in eager Python, never in the step itself. No host sync: on
        CPU the counter is read directly (no device to wait for); on CUDA each call reads the
        host copy started by an earlier call if its event has completed (`Event.query()` does
        not block) and starts the next copy (`non_blocking` into pinned memory). The warning
        comes one or two autocast entries after the step, which is enough to say the run has
        seen a NaN/inf; `nonfinite_amax_count` (state dict) has the counts."""
        global _nonfinite_warned
        if _nonfinite_warned:
            return
        count = self.nonfinite_amax_count
        if count.device.type == "cpu":
            host = count
        elif count.device.type != "cuda":
            return  # meta / other devices: nothing to read without a sync
        else:
            host = None
            if self._nonfinite_poll is not None and self._nonfinite_poll[1].query():
                host, self._nonfinite_poll = self._nonfinite_poll[0], None
            if self._nonfinite_poll is None:
                copy = torch.empty(count.shape, dtype=count.dtype, device="cpu", pin_memory=True)
                copy.copy_(count, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._nonfinite_poll = (copy, event)
        if host is not None and any(host.tolist()):  # a host read of 3 ints, no tensor op
            _nonfinite_warned = True
            counts = ", ".join(f"{r} {int(n)}" for r, n in zip(_NONFINITE_ROLES, host.tolist()) if n)
            warnings.warn(
                f"{name}: delayed scaling skipped non-finite (inf/NaN) amaxes ({counts}); those steps "
                f"are left out of the amax history, so the scales keep following the finite amaxes. "
                f"Check the loss / inputs for overflow. Counts per GEMM are in the buffers "
                f"`*.nonfinite_amax_count` (input, weight, grad); this warning is shown once.",
                RuntimeWarning, stacklevel=5)

    # ---- eager preparation ----------------------------------------------------------------
    def prepare_for_recipe(self, recipe: R.Recipe, weight: torch.Tensor) -> None:
        if isinstance(recipe, R.DelayedScaling) and recipe.amax_history_len > self.amax_history.shape[0]:
            with torch.inference_mode(False):  # state, not an inference tensor: training updates it in place
                self.amax_history = _longer(self.amax_history, recipe.amax_history_len)
                self.grad_amax_history = _longer(self.grad_amax_history, recipe.amax_history_len)
        if self.uses_weight_cache:
            try:
                self._alloc_weight_cache(self._op_key(recipe_key(recipe)), weight)
            except ValueError:
                pass  # a shape the recipe cannot quantize: forward raises the error, naming the module

    def _alloc_weight_cache(self, key: str, weight: torch.Tensor) -> None:
        want = (key, tuple(weight.shape), weight.dtype)
        if self._cache_for == want:
            return
        for name in self._cache_names:
            delattr(self, name)
        self._cache_names = []
        q = quantizers_from_key(key).weight
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

    # ---- in-graph delayed scaling -----------------------------------------------------------
    def _update_delayed_scales(self, recipe: R.DelayedScaling) -> None:
        fwd_max, _, bwd_max = _role_maxes(recipe)
        _update_from_history(self.fp8_scale, self.amax_history, recipe, fwd_max)
        slot = self.grad_amax_history[0]
        before = slot.clone()
        linear_ops.fold_pending_grad_amax(self.grad_amax_history, self.grad_amax_state())
        _keep_finite(slot, slot, before, self.nonfinite_amax_count[2:3])
        _update_from_history(self.grad_fp8_scale, self.grad_amax_history, recipe, bwd_max)

    def record_amax(self, amax: torch.Tensor, first: int = 0) -> None:
        """History slot 0, columns first.. (0 input, 1 weight), takes the max with `amax`, except
        where `amax` is inf/NaN: that one is counted instead (`_keep_finite`)."""
        cols = slice(first, first + amax.shape[0])
        slot = self.amax_history[0, cols]
        _keep_finite(slot, torch.maximum(slot, amax), slot, self.nonfinite_amax_count[cols])

    def grad_amax_state(self):
        return [self.grad_amax_pending, self.grad_amax_seen]

    def _gather_input(self, inp, weight, key: str, delayed: bool, sequence_gather, quantized_ok: bool):
        """(gathered input, its quantized buffers or (), all-reduced input amax for delayed scaling
        or None): quantize the shard then gather the bytes where the recipe allows, else gather
        in high precision (the Linear op quantizes the full tensor)."""
        group, world = sequence_gather
        kind = _sp_gather.HP
        columnwise = torch.is_grad_enabled() and weight.requires_grad
        if self.quantized_sp_gather and quantized_ok:
            kind, _ = _sp_gather.input_gather_format(key, tuple(inp.shape), world, columnwise)
        if kind == _sp_gather.HP:
            return _tp.all_gather_first_dim(inp, group, world), (), None
        scale = self.fp8_scale[0:1] if delayed else None
        full, amax, buffers = _sp_gather.all_gather_quantized(inp, scale, group, world, key, kind, columnwise)
        return full, buffers, (amax if delayed else None)

    # ---- the call ---------------------------------------------------------------------------
    def precision_key(self, key: str, inp: torch.Tensor, weight: torch.Tensor) -> str:
        """The Linear op's key: `key` with the GEMMs that the active GemmPolicy or this GEMM's pins
        keep in high precision (a trace-time constant, precision/policy.py)."""
        policy = get_gemm_policy_key()
        if not (policy or self.pinned_precision) or key == HIGH_PRECISION_KEY:
            return key
        pins = self.pinned_precision
        if isinstance(weight, QuantizedTensor):  # stored quantized: fprop and dgrad read it as it is
            pins = _policy.with_default_pins(pins, fprop=_policy.RECIPE, dgrad=_policy.RECIPE)
        return _policy.op_key(key, policy, pins, self._debug_uid, str(inp.device),
                              inp.numel() // inp.shape[-1], weight.shape[0], weight.shape[1],
                              torch.is_grad_enabled())

    def wants_quantized_input(self, weight: torch.Tensor, save_original_input: bool = False,
                              inp: Optional[torch.Tensor] = None):
        """None, or the `columnwise` flag for a fused norm + quantize of this GEMM's input `inp`:
        only stateless recipes (delayed scaling's input scale lives in this module's buffers), not
        when the input's amax is TP-reduced (the fused op quantizes with the plain recipe), and not
        when fprop runs in high precision (precision_key)."""
        recipe = get_fp8_recipe()
        if recipe is None or isinstance(recipe, R.DelayedScaling):
            return None
        if self.tp_amax_reduction is not None and "input" in self.tp_amax_reduction[1]:
            return None
        wgrad = True
        if inp is not None:
            high = high_precision_gemms(self.precision_key(self._op_key(get_fp8_recipe_key()), inp, weight))
            if "fprop" in high:
                return None
            wgrad = "wgrad" not in high
        return torch.is_grad_enabled() and weight.requires_grad and not save_original_input and wgrad

    def forward(self, inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                is_first_microbatch: Optional[bool] = None, save_original_input: bool = False,
                fuse_wgrad_accumulation: bool = False, inp_quantized=(), sequence_gather=None) -> torch.Tensor:
        """`inp_quantized`: the input's buffers from a fused norm + quantize (`wants_quantized_input`).
        `sequence_gather`: (TP group name, tp size) when `inp` is a sequence-parallel dim-0 shard
        to all-gather before the GEMM (column parallel + SP)."""
        recipe = get_fp8_recipe()
        key = self._op_key(get_fp8_recipe_key())
        delayed = isinstance(recipe, R.DelayedScaling)
        cache_mode, cache = linear_ops.CACHE_OFF, []
        # FSDP2 gathered the weight already quantized (distributed/fsdp.py): it enters as the weight
        # cache; its delayed-scaling update and weight amax were done in the pre-all-gather hook
        fsdp_quantized = isinstance(weight, QuantizedTensor)
        if fsdp_quantized:
            cache_mode, cache = linear_ops.CACHE_USE, _fsdp.gathered_weight_cache(
                type(self).__name__, weight, key, is_first_microbatch)
        elif recipe is not None and is_first_microbatch is not None:
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
            cache_mode = linear_ops.CACHE_FILL if is_first_microbatch else linear_ops.CACHE_USE
        # te.checkpoint's recompute: the first forward's scales, no history update, no amax recorded
        record = delayed and not in_activation_recompute_phase()
        if record and cache_mode != linear_ops.CACHE_USE:
            if recipe.amax_history_len > self.amax_history.shape[0]:
                if torch.compiler.is_dynamo_compiling():
                    raise RuntimeError(
                        f"amax_history_len={recipe.amax_history_len} exceeds the allocated history "
                        f"({self.amax_history.shape[0]}); enter autocast outside torch.compile first"
                    )
                self.prepare_for_recipe(recipe, weight)
            if in_training_autocast():  # an evaluation block records its amaxes, moves no scale
                self._update_delayed_scales(recipe)
        main_grad = None
        if fuse_wgrad_accumulation and weight.requires_grad:
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is None:
                raise RuntimeError("fuse_wgrad_accumulation=True needs weight.main_grad (an fp32 buffer) to be set")
        # ---- precision debug tools: a layer with an active debug feature takes the debug GEMM path
        debug_linear = _debug_gemm.linear_for(self, recipe is not None)
        # ---- end debug
        if fsdp_quantized and debug_linear is not None:
            raise NotImplementedError("precision debug features do not support FSDP2 quantized all-gather weights")
        linear = debug_linear or linear_ops.linear
        sp_amax = None
        if sequence_gather is not None:
            inp, inp_quantized, sp_amax = self._gather_input(
                inp, weight, key, delayed, sequence_gather, debug_linear is None and not save_original_input)
        extra = {"inp_quantized": inp_quantized} if inp_quantized and debug_linear is None else {}
        op_key = self.precision_key(key, inp, weight)
        if fsdp_quantized and high_precision_gemms(op_key) & {"fprop", "dgrad"}:
            raise_error(NotImplementedError,
                        "fprop / dgrad pinned to bf16 (pin_gemm_precision) on a weight stored quantized "
                        "(quantized_model_init or an FSDP2 quantized all-gather): the weight exists only "
                        "quantized; unpin them for this layer")
        out, amaxes, new_cache = linear(
            inp, weight, bias, key=op_key,
            fp8_scales=self.fp8_scale if delayed else None,
            grad_scale=self.grad_fp8_scale if delayed else None,
            grad_amax_state=self.grad_amax_state() if delayed else (),
            weight_cache=cache, main_grad=main_grad, cache_mode=cache_mode,
            save_original_input=save_original_input, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            **extra,
        )
        if record:
            self.record_amax(amaxes.detach())
            if sp_amax is not None:  # the input was quantized before its gather: record its amax
                self.record_amax(sp_amax.detach())
        for buf, new in zip(cache, new_cache):
            buf.copy_(new.detach())
        return out
