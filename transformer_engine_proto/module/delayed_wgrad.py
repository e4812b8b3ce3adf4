"""TE's split backward (`delay_wgrad_compute=True`), eager only.

Backward computes the input's gradient and leaves each GEMM's weight gradient queued: the user
runs it with the module's `backward_dw()`, so a pipeline schedule can fill bubbles with it
(zero-bubble pipelining). A Linear op's backward (custom_ops/linear.py) queues the same op call
restricted to the wgrad GEMM, on the tensors forward saved and the same gradient (quantized again
for the wgrad's usage: the bytes backward would have used), so the result equals the undelayed
backward's bit for bit. The bias gradient goes with the wgrad where the gradient is not
quantized, as in TE.

Under torch.compile the module refuses (`check_delay_wgrad_traceable`): the compiled backward is
one graph, and splitting the weight gradient out of it is not expressible there.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..errors import raise_error

__all__ = ["DelayedWgrad", "defer_param_grads"]


class DelayedWgrad:
    """What TE's base module gives every module: `backward_dw`, `need_backward_dw` and the wgrad
    hooks. A module with GEMMs lists them with `_wgrad_queues()`."""

    delay_wgrad_compute = False

    def _init_delay_wgrad(self, delay_wgrad_compute: bool) -> None:
        """Turn the split on for every GEMM of the module; call once its GEMMs and parameters exist."""
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        for gemm, _ in self.gemm_weights():
            gemm.delay_wgrad = self.delay_wgrad_compute
        if self.delay_wgrad_compute:  # Megatron's DDP: reduced by the wgrad hooks, not after backward
            for _, weight_names, bias_names in self._wgrad_queues():
                for p in self._params(weight_names + bias_names):
                    p.skip_backward_post_hook = True

    def _wgrad_queues(self) -> list:
        """(queue, weight names, bias names) per GEMM. A queue entry is a callable giving (weight
        gradients, bias gradients), each None (nothing computed there), a tensor for the named
        parameters concatenated (split by their rows) or a list with one per name."""
        return []

    def _params(self, names: Sequence[str]) -> list:
        return [p for p in (getattr(self, n) for n in names) if p is not None]

    def check_delay_wgrad_traceable(self) -> None:
        """At trace time, naming the module: a compiled backward would compute the weight
        gradients itself, so backward_dw() would find nothing queued."""
        if self.delay_wgrad_compute and torch.is_grad_enabled() and torch.compiler.is_compiling():
            raise_error(RuntimeError, f"{self.name}: delay_wgrad_compute=True is not supported under torch.compile "
                                      "(backward_dw() runs the weight gradients outside the compiled backward); "
                                      "run this module eagerly or build it with delay_wgrad_compute=False")

    def need_backward_dw(self) -> bool:
        """Whether backward leaves weight gradients for `backward_dw()`."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Callable[[], None]) -> None:
        """`hook()` runs at the end of each `backward_dw()` that computed something (Megatron
        reduces the weight gradients there)."""
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def backward_dw(self) -> None:
        """Run each GEMM's oldest queued weight gradient (one per backward, first in first out):
        added into `main_grad` with fuse_wgrad_accumulation, else into `.grad` (accumulated in place,
        as autograd does; TE assigns), the bias gradients queued with it into the biases' `.grad`;
        then the wgrad hooks. Nothing queued: nothing runs."""
        if not self.need_backward_dw():
            return
        ran = False
        for queue, weight_names, bias_names in self._wgrad_queues():
            if queue:
                wgrad, dbias = queue.popleft()()
                self._add_grads(weight_names, wgrad, getattr(self, "fuse_wgrad_accumulation", False))
                self._add_grads(bias_names, dbias, False)
                ran = True
        if ran:
            for hook in self.wgrad_accumulation_and_reduce_hooks:
                hook()

    def _add_grads(self, names: Sequence[str], grads, into_main_grad: bool) -> None:
        """`grads` added into the named parameters' `.grad`, or their `main_grad` (a Linear op adds
        its own there and returns None)."""
        if grads is None:
            return
        params = [getattr(self, n) for n in names]
        if isinstance(grads, torch.Tensor):
            grads = [grads] if len(params) == 1 else grads.split([p.shape[0] for p in params])
        for name, p, g in zip(names, params, grads):
            if p is None or g is None or not p.requires_grad:
                continue
            if tuple(g.shape) != tuple(p.shape):
                raise RuntimeError(f"{self.name}: backward_dw: the gradient of {name} has shape {tuple(g.shape)}, "
                                   f"the parameter {tuple(p.shape)} (a sharded parameter, e.g. FSDP2, is not "
                                   "supported with delay_wgrad_compute)")
            if into_main_grad:
                p.main_grad.add_(g)
            elif p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)


class _DeferParamGrads(torch.autograd.Function):
    """fn(x, weights, biases), whose backward gives x's gradient and queues the parameters'."""

    @staticmethod
    def forward(ctx, queue, fn, n_weights: int, x, *params):
        with torch.enable_grad():  # fn's own graph: backward and the queued call take torch's derivatives
            x_ = x.detach().requires_grad_(x.requires_grad)
            params_ = [p.detach().requires_grad_(p.requires_grad) for p in params]
            out = fn(x_, params_[:n_weights], params_[n_weights:])
        ctx.inner, ctx.queue, ctx.n_weights = (out, x_, params_), queue, n_weights
        return out.detach()

    @staticmethod
    def backward(ctx, dy):
        out, x_, params_ = ctx.inner
        del ctx.inner
        wanted = [p for p in params_ if p.requires_grad]
        dx = torch.autograd.grad(out, x_, dy, retain_graph=bool(wanted))[0] if x_.requires_grad else None
        if wanted:
            ctx.queue.append(functools.partial(_grads_of, out, params_, wanted, dy, ctx.n_weights))
        return (None, None, None, dx) + (None,) * len(params_)


def _grads_of(out, params_, wanted, dy, n_weights: int):
    grads = iter(torch.autograd.grad(out, wanted, dy))
    grads = [next(grads) if p.requires_grad else None for p in params_]
    return grads[:n_weights], grads[n_weights:]


def defer_param_grads(queue, fn: Callable, x: torch.Tensor, weights: Sequence[torch.Tensor],
                      biases: Sequence[torch.Tensor]) -> torch.Tensor:
    """fn(x, weights, biases) for a computation that is not a Linear op (GroupedLinear's grouped
    GEMM): backward computes x's gradient and appends to `queue` a callable giving (weight
    gradients, bias gradients), None for a parameter that needs none. Both come from fn's
    autograd graph, so they equal the gradients of fn called directly."""
    return _DeferParamGrads.apply(queue, fn, len(weights), x, *weights, *biases)
