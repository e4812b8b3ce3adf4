"""`make_graphed_callables`: TE's CUDA graphs for eager users, on `torch.cuda.make_graphed_callables`.

The forward and backward of each callable are captured inside `autocast(recipe=...)`, and each
call of the graphed callable enters the same autocast (so a fallback to the module's own forward,
e.g. in eval mode, runs the recipe too). Delayed scaling's state (amax history, scales, the
gradient-amax handoff) lives in module buffers that the captured kernels read and record amaxes
into; the autocast around each call updates them at its exit and entry, so every call advances
the state exactly as an eager step would. The warm-up iterations that
torch runs before capturing also advance it: the state is saved before and put back after, as TE
does (`restore_fp8_tensors`), so step 1 of the graphed run starts where an eager run would.
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import torch

from .autocast import autocast
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
                    out += [m.fp8_scale, m.amax_history, m.grad_fp8_scale, m.grad_amax_history,
                            m.grad_amax_pending, m.grad_amax_seen]
    return out


def make_graphed_callables(modules, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False,
                           sample_kwargs=None, fp8_enabled: Optional[bool] = None,
                           fp8_calibrating: Optional[bool] = None, fp8_recipe=None, fp8_group=None,
                           fp8_weight_caching: Optional[bool] = None, enabled: Optional[bool] = None,
                           calibrating: Optional[bool] = None, recipe=None, amax_reduction_group=None,
                           cache_quantized_params: Optional[bool] = None, pool=None, **unsupported: Any):
    """TE's signature (both the `fp8_*` names and the newer ones). Returns the graphed callable(s)
    as `torch.cuda.make_graphed_callables` does: modules get a graphed `forward`, functions are
    wrapped. Each has TE's `reset()`, which drops its CUDA graphs (their memory is freed once
    nothing else holds them): a module runs its own forward again, a function refuses further
    calls. Needs CUDA. Not supported (an error names them): `sample_kwargs`, calibration,
    weight caching (`fp8_weight_caching` / `cache_quantized_params`, i.e. `is_first_microbatch`
    inside the graph), and TE's pipeline-schedule arguments (`_order`, ...)."""
    given = sorted(k for k, v in unsupported.items() if v not in (None, False))
    if given:
        raise NotImplementedError(f"make_graphed_callables: arguments not supported: {given}")
    enabled = bool(_pick(enabled, fp8_enabled, False, "enabled / fp8_enabled"))
    recipe = _pick(recipe, fp8_recipe, None, "recipe / fp8_recipe")
    group = _pick(amax_reduction_group, fp8_group, None, "amax_reduction_group / fp8_group")
    if _pick(calibrating, fp8_calibrating, False, "calibrating / fp8_calibrating"):
        raise NotImplementedError("make_graphed_callables: calibrating=True is not supported")
    if _pick(cache_quantized_params, fp8_weight_caching, False, "cache_quantized_params / fp8_weight_caching"):
        raise NotImplementedError("make_graphed_callables: weight caching (is_first_microbatch in the graph) "
                                  "is not supported")
    if sample_kwargs:
        raise NotImplementedError("make_graphed_callables: sample_kwargs is not supported (torch's capture takes "
                                  "positional arguments only)")
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables captures CUDA graphs and needs a CUDA device; none is "
                           "available (on CPU, run the modules eagerly or under torch.compile)")
    single = not isinstance(modules, tuple)
    callables = (modules,) if single else modules
    args = (sample_args,) if single else sample_args
    ctx = functools.partial(autocast, enabled=enabled, recipe=recipe, amax_reduction_group=group)
    # each module's own instance `forward` (usually none) before torch replaces it: what reset() restores
    own_forwards = [c.__dict__.get("forward") if isinstance(c, torch.nn.Module) else None for c in callables]

    with ctx():  # allocates the recipe's state buffers before they are captured
        state = _state_buffers(callables)
        saved = [b.clone() for b in state]
        graphed = torch.cuda.make_graphed_callables(callables, args, num_warmup_iters=num_warmup_iters,
                                                    allow_unused_input=allow_unused_input, pool=pool)
    torch.cuda.synchronize()
    with torch.no_grad():
        for b, s in zip(state, saved):
            b.copy_(s)  # undo the warm-up iterations' updates (the graphs hold these same buffers)

    wrapped = []
    for original, g, own_forward in zip(callables, graphed, own_forwards):
        if isinstance(original, torch.nn.Module):
            inner = g.forward

            def forward(*a, _inner=inner, **k):
                with ctx():
                    return _inner(*a, **k)

            g.forward = forward
            g.reset = functools.partial(_restore_forward, g, own_forward)
            wrapped.append(g)
        else:
            held = [g]

            def call(*a, _held=held, **k):
                if _held[0] is None:
                    raise RuntimeError("make_graphed_callables: this graphed callable was reset (its CUDA graphs "
                                       "were dropped); make it again to replay")
                with ctx():
                    return _held[0](*a, **k)

            call.reset = functools.partial(held.__setitem__, 0, None)
            wrapped.append(call)
    return wrapped[0] if single else tuple(wrapped)


def _restore_forward(module: torch.nn.Module, own_forward) -> None:
    """A graphed module's `reset()`: its forward as before graphing, so nothing holds the graphs."""
    if own_forward is not None:
        module.forward = own_forward
    else:
        module.__dict__.pop("forward", None)
