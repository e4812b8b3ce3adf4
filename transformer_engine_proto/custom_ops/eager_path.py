"""Eager calls skip the custom-op dispatcher.

A `torch.library` custom op pays, per eager call, for the dispatcher's argument handling (schema
defaults, pytree flattening of the arguments, a redispatch below autograd). For plain tensors
outside any compile, tracing or dispatch mode the library runs the same op body and the same
autograd wiring (`setup_context` / `backward`) through an `autograd.Function` instead; everything
else (torch.compile, make_fx, fake tensors, tensor subclasses such as FSDP2's quantized weights,
whose handlers are registered on the op) goes through the op.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..kernels import zeroed
from . import shared_input

__all__ = ["takes_eager_path", "eager_function"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


def takes_eager_path(*args) -> bool:
    """Whether a call with these arguments (tensors, lists of tensors, anything else) may skip the
    op: no compile, dispatch mode or functorch transform active, and every tensor a plain one (not
    a subclass, nor a functorch wrapper left over from a transform)."""
    if (torch.compiler.is_dynamo_compiling() or _get_current_dispatch_mode() is not None
            or torch._C._are_functorch_transforms_active()):
        return False
    for a in args:
        if type(a) in _PLAIN:
            if _wrapped(a):
                return False
        elif isinstance(a, list):
            for t in a:
                if isinstance(t, torch.Tensor) and (type(t) not in _PLAIN or _wrapped(t)):
                    return False
        elif isinstance(a, torch.Tensor):
            return False
    return True


def eager_function(op, setup_context: Callable, backward: Callable, backward_body: Callable,
                   non_differentiable=()) -> Callable:
    """A callable with `op`'s signature: an autograd.Function running `op`'s body where
    `takes_eager_path` allows, `op` itself otherwise. `backward` is the op's registered
    backward; it finds the body of the backward op in `ctx.backward_op` (the op itself when the
    custom op's own autograd runs). `non_differentiable`: indices of tensor outputs."""
    body = op._init_fn
    n_outputs = len(op._opoverload._schema.returns)

    def forward(ctx, *inputs):
        # Linears reading one tensor share its quantized copy; amax outputs are slots of a zeroed block
        with shared_input.scope(), zeroed.slots():
            output = body(*inputs)
        setup_context(ctx, inputs, output)
        ctx.backward_op = backward_body
        ctx.mark_non_differentiable(*(output[i] for i in non_differentiable))
        # the backward wirings read only the first output's gradient: no zeros are made for the
        # others (an allocation and a fill launch each: a norm's mu / rsigma, delayed scaling's amaxes)
        ctx.set_materialize_grads(False)
        return output

    def backward_(ctx, *grads):
        # one grad per op output (None where autograd tracked none: lists); list inputs get None
        grads = (list(grads) + [None] * n_outputs)[:n_outputs]
        with zeroed.slots():
            out = list(backward(ctx, *grads))
        for i, g in enumerate(out):
            if isinstance(g, list):
                out[i] = None
        return tuple(out)

    name = "Eager_" + op._name.split("::")[-1]  # autograd nodes show as Eager_<op>Backward
    cls = type(name, (torch.autograd.Function,),
               {"forward": staticmethod(forward), "backward": staticmethod(backward_)})

    overload = op._opoverload  # the op itself: dynamo inlines a CustomOpDef's __call__, at a cost per call
    # autograd.Function.apply's own C entry: its Python wrapper binds default arguments (there are
    # none) and unwraps functorch tensors (`takes_eager_path` sends those to the op)
    apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)

    def call(*args):
        return (apply if takes_eager_path(*args) else overload)(*args)

    return call
