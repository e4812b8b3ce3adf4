"""`make_graphed_callables`: TE's CUDA graphs for eager users, on `torch.cuda.make_graphed_callables`.

The forward and backward of each callable are captured inside `autocast(recipe=...)`, and each
call of the graphed callable enters the same autocast (so a fallback to the module's own forward,
e.g. in eval mode, runs the recipe too). Delayed scaling's state (amax history, scales, the
gradient-amax handoff) lives in module buffers that the captured kernels read and record amaxes
into; the autocast around each call updates them at its exit and entry, so every call advances
the state exactly as an eager step would. The warm-up iterations that
torch runs before capturing also advance it: the state is saved before and put back after, as TE
does (`restore_fp8_tensors`), so step 1 of the graphed run starts where an eager run would.

torch captures positional tensor arguments only. Keyword arguments (TE's `sample_kwargs`) and
weight caching (`is_first_microbatch`) go through `_Captured`, a module that torch captures in
the callable's place: it takes the keyword tensors as trailing positional arguments and fixes
the rest.
"""
from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Optional

import torch

from .autocast import autocast, first_microbatch_default
from .module.quantized_gemm import QuantizedGemm

__all__ = ["make_graphed_callables"]


def _pick(new, old, default, name: str):
    if new is not None and old is not None and new != old:
        raise ValueError(f"make_graphed_callables: {name} given twice with different values ({new!r}, {old!r})")
    return new if new is not None else old if old is not None else default


def _state_buffers(callables):
    """The delayed-scaling state buffers of every QuantizedGemm in `callables` (modules only)."""
    out, seen = [], set()
    for c in callables:
        if isinstance(c, torch.nn.Module):
            for m in c.modules():
                if isinstance(m, QuantizedGemm) and id(m) not in seen:
                    seen.add(id(m))
                    out += list(m.update_state())
    return out


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           sample_kwargs=None, fp8_enabled: Optional[bool] = None,
                           fp8_calibrating: Optional[bool] = None, fp8_recipe=None, fp8_group=None,
                           fp8_weight_caching: Optional[bool] = None, enabled: Optional[bool] = None,
                           calibrating: Optional[bool] = None, recipe=None, amax_reduction_group=None,
                           cache_quantized_params: Optional[bool] = None, pool=None,
                           clone_param_grads_on_return: bool = True, **unsupported: Any):
    """TE's signature (both the `fp8_*` names and the newer ones). Returns the graphed callable(s)
    as `torch.cuda.make_graphed_callables` does: modules get a graphed `forward`, functions are
    wrapped. Each has TE's `reset()`, which drops its CUDA graphs (their memory is freed once
    nothing else holds them): a module runs its own forward again, a function refuses further
    calls. Needs CUDA.

    `sample_kwargs` (a dict, or one per callable): the keyword arguments of the capture. A call
    passes the same names; tensors are the graph's inputs, other values are fixed at capture
    (a call with another value is refused).

    Weight caching (`cache_quantized_params` / `fp8_weight_caching`, modules only): each module is
    captured twice, with `is_first_microbatch=True` (quantize the weight, fill the module's
    quantized-weight cache) and `False` (read the cache); a call picks the graph by its
    `is_first_microbatch` keyword (None: the first). The cache is the module's own buffers, so
    both graphs see the same memory, as eager calls do.

    `clone_param_grads_on_return` (TE's, default True): a parameter's gradient from a replay is
    a copy, not the graph's static buffer, which the next replay rewrites (autograd would keep
    that buffer as `.grad`). Parameters marked `skip_backward_post_hook` when graphed keep the
    buffer, as in TE.

    Not supported (an error names them): calibration, weight caching for plain functions, and
    TE's pipeline-schedule arguments (`_order`, ...)."""
    given = sorted(k for k, v in unsupported.items() if v not in (None, False))
    if given:
        raise NotImplementedError(f"make_graphed_callables: arguments not supported: {given}")
    enabled = bool(_pick(enabled, fp8_enabled, False, "enabled / fp8_enabled"))
    recipe = _pick(recipe, fp8_recipe, None, "recipe / fp8_recipe")
    group = _pick(amax_reduction_group, fp8_group, None, "amax_reduction_group / fp8_group")
    if _pick(calibrating, fp8_calibrating, False, "calibrating / fp8_calibrating"):
        raise NotImplementedError("make_graphed_callables: calibrating=True is not supported")
    weight_caching = bool(_pick(cache_quantized_params, fp8_weight_caching, False,
                                "cache_quantized_params / fp8_weight_caching"))
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    kwargs = _per_callable_kwargs(sample_kwargs, single, len(callables))
    if weight_caching and not all(isinstance(c, torch.nn.Module) for c in callables):
        raise NotImplementedError("make_graphed_callables: weight caching (cache_quantized_params) needs modules "
                                  "(it passes is_first_microbatch to their forward); a plain function was given")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables captures CUDA graphs and needs a CUDA device; none is "
                           "available (on CPU, run the modules eagerly or under torch.compile)")
    ctx = functools.partial(autocast, enabled=enabled, recipe=recipe, amax_reduction_group=group)
    # each module's own instance `forward` (usually none) before torch replaces it: what reset() restores
    own_forwards = [c.__dict__.get("forward") if isinstance(c, torch.nn.Module) else None for c in callables]

    # what torch captures: the callables themselves, or their `_Captured` stand-ins; under weight
    # caching two sets, first and later micro-batch, each in its own memory pool (torch's graphs of
    # one pool must replay in capture order; a step replays one set, then the other)
    wrapping = weight_caching or any(kwargs)
    flags = (True, False) if weight_caching else (None,)
    sets = [(callables, args)]
    if wrapping:
        sets = []
        for n, first in enumerate(flags):
            ws = tuple(_Captured(c, own, a, kw, first) for c, own, a, kw in zip(callables, own_forwards, args, kwargs))
            sets.append((ws, tuple(w.sample_args(fresh=n > 0) for w in ws)))
    with ctx(), _no_garbage_collection():  # ctx allocates the recipe's state buffers before the capture
        state = _state_buffers(callables)
        saved = [b.clone() for b in state]
        try:
            graphed = [torch.cuda.make_graphed_callables(cs, cargs, num_warmup_iters=num_warmup_iters,
                                                         allow_unused_input=allow_unused_input,
                                                         pool=pool if n == 0 else None)
                       for n, (cs, cargs) in enumerate(sets)]
        except BaseException:
            _release_generator_capture()
            raise
    torch.cuda.synchronize()
    with torch.no_grad():
        for b, s in zip(state, saved):
            b.copy_(s)  # undo the warm-up iterations' updates (the graphs hold these same buffers)
    grad_hooks = _clone_grads_hooks(callables) if clone_param_grads_on_return else [[] for _ in callables]

    wrapped = []
    for i, (original, own_forward) in enumerate(zip(callables, own_forwards)):
        if wrapping:
            wrapped.append(_graphed_with_kwargs(original, [per_set[i] for per_set in graphed], own_forward, ctx,
                                                grad_hooks[i]))
        elif isinstance(original, torch.nn.Module):
            g = graphed[0][i]
            g.forward = _within(ctx, g.forward)
            g.reset = functools.partial(_restore_forward, g, own_forward, grad_hooks[i])
            wrapped.append(g)
        else:
            wrapped.append(_resettable(graphed[0][i], ctx))
    return wrapped[0] if single else tuple(wrapped)


def _per_callable_kwargs(sample_kwargs, single: bool, n: int) -> list:
    if sample_kwargs is None:
        return [{}] * n
    per = [sample_kwargs] if single else list(sample_kwargs)
    if len(per) != n or not all(isinstance(k, dict) for k in per):
        raise ValueError("make_graphed_callables: sample_kwargs must be a dict (one callable) or a tuple of "
                         f"dicts, one per callable ({n}); got {type(sample_kwargs).__name__}")
    return [dict(k or {}) for k in per]


class _Captured(torch.nn.Module):
    """What torch captures in a callable's place when it takes keyword arguments: a module (so
    torch captures the parameters' gradients too) whose positional arguments are the callable's
    own followed by its keyword tensors; other keyword values are fixed. Under weight caching
    (`first` not None) every GEMM module inside runs with that `is_first_microbatch` unless its
    caller passes one (`first_microbatch_default`)."""

    def __init__(self, target, own_forward, sample_args, sample_kwargs: dict, first: Optional[bool]):
        super().__init__()
        if isinstance(target, torch.nn.Module) and (target._forward_hooks or target._forward_pre_hooks
                                                    or target._backward_hooks):
            # torch refuses them on a module it captures itself; called through here they would not run
            raise ValueError("make_graphed_callables: modules must not have hooks registered when they are "
                             f"graphed ({type(target).__name__} has some); register them afterwards")
        self.target = target if isinstance(target, torch.nn.Module) else None  # a child: its parameters
        self._call = own_forward or (type(target).forward.__get__(target) if self.target is not None else target)
        self.training = target.training if self.target is not None else True
        self._args = tuple(sample_args)
        self.tensor_names = [k for k, v in sample_kwargs.items() if isinstance(v, torch.Tensor)]
        self.fixed = {k: v for k, v in sample_kwargs.items() if not isinstance(v, torch.Tensor)}
        self._kw_tensors = [sample_kwargs[k] for k in self.tensor_names]
        self.first = first

    def sample_args(self, fresh: bool) -> tuple:
        """The capture's positional sample; `fresh`: copies (a second graph of the same callable
        needs static inputs of its own)."""
        sample = self._args + tuple(self._kw_tensors)
        if fresh:
            sample = torch.utils._pytree.tree_map_only(
                torch.Tensor, lambda a: a.detach().clone().requires_grad_(a.requires_grad), sample)
        return sample

    def positional(self, args: tuple, kwargs: dict) -> tuple:
        """A call's arguments in the capture's order (refusing keywords the capture did not have)."""
        extra = sorted(set(kwargs) - set(self.tensor_names) - set(self.fixed))
        missing = [k for k in self.tensor_names if k not in kwargs]
        changed = [k for k, v in self.fixed.items() if k in kwargs and kwargs[k] != v]
        if extra or missing or changed:
            raise ValueError(f"make_graphed_callables: a call's keyword arguments must match the capture's "
                             f"sample_kwargs (not captured: {extra}, missing: {missing}, other value than "
                             f"captured: {changed})")
        return tuple(args) + tuple(kwargs[k] for k in self.tensor_names)

    def forward(self, *flat):
        n = len(flat) - len(self.tensor_names)
        with first_microbatch_default(self.first):
            return self._call(*flat[:n], **dict(zip(self.tensor_names, flat[n:])), **self.fixed)


def _graphed_with_kwargs(original, graphs, own_forward, ctx, grad_hooks):
    """The callable a user gets back when torch captured `_Captured` stand-ins (`graphs`: one,
    or first and later micro-batch)."""

    def replay(*a, is_first_microbatch=None, **k):
        g = graphs[-1] if len(graphs) == 2 and is_first_microbatch is False else graphs[0]
        if isinstance(original, torch.nn.Module):
            g.training = original.training  # torch replays only in the mode it captured, else runs forward
        if len(graphs) == 1 and is_first_microbatch is not None:
            k["is_first_microbatch"] = is_first_microbatch  # not captured: positional() refuses it
        return g(*g.positional(a, k))

    if isinstance(original, torch.nn.Module):
        original.forward = _within(ctx, replay)
        original.reset = functools.partial(_restore_forward, original, own_forward, grad_hooks)
        return original
    return _resettable(replay, ctx)


def _within(ctx, fn):
    """`fn`, each call inside a fresh `ctx()` (the recipe's autocast)."""

    def call(*a, **k):
        with ctx():
            return fn(*a, **k)

    return call


def _resettable(fn, ctx):
    """A graphed function (run inside `ctx()`) with TE's `reset()`: afterwards it refuses calls
    (nothing holds its graphs)."""
    held = [_within(ctx, fn)]

    def call(*a, **k):
        if held[0] is None:
            raise RuntimeError("make_graphed_callables: this graphed callable was reset (its CUDA graphs "
                               "were dropped); make it again to replay")
        return held[0](*a, **k)

    call.reset = functools.partial(held.__setitem__, 0, None)
    return call


@contextlib.contextmanager
def _no_garbage_collection():
    """Python's cyclic GC paused while torch warms up and captures. A collection during a
    capture can free CUDA objects of earlier graphs (their graphs and pools are held in
    reference cycles: torch's graphed autograd Functions are classes), and freeing them is not
    permitted while a stream captures: the capture is invalidated. Garbage from before is
    collected first."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _release_generator_capture() -> None:
    """After a failed capture torch leaves the default CUDA generator marked as capturing (its
    capture end never ran), so every later CUDA random op of the process raises "Offset increment
    outside graph capture". A small capture that succeeds ends that state."""
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            torch.empty(1, device="cuda").zero_()
    except Exception:  # noqa: BLE001 - the original error is the one to report
        pass


def _clone_grads_hooks(callables) -> list:
    """Per callable, gradient hooks that copy each of its graphed parameters' gradients
    (`clone_param_grads_on_return`; a parameter shared by two callables is hooked once)."""
    seen, out = set(), []
    for c in callables:
        params = [p for p in (c.parameters() if isinstance(c, torch.nn.Module) else ())
                  if p.requires_grad and not getattr(p, "skip_backward_post_hook", False) and id(p) not in seen]
        seen.update(id(p) for p in params)
        out.append([p.register_hook(torch.clone) for p in params])
    return out


def _restore_forward(module: torch.nn.Module, own_forward, grad_hooks=()) -> None:
    """A graphed module's `reset()`: its forward as before graphing, so nothing holds the graphs."""
    for h in grad_hooks:
        h.remove()
    if own_forward is not None:
        module.forward = own_forward
    else:
        module.__dict__.pop("forward", None)
