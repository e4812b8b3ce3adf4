"""`AddExtraInput` and `MakeExtraOutput`: the ops through which a `Sequential` takes more tensors
than its input and returns more than its output (a residual branch, for instance).

    block = te.ops.Sequential(te.ops.MakeExtraOutput(), body, te.ops.AddExtraInput())
    out, residual = block(x, residual_in)    # out = body(x) + residual_in, residual = x
"""
from __future__ import annotations

import torch

from .op import BasicOperation

__all__ = ["AddExtraInput", "MakeExtraOutput"]


class _AddIntoExtra(torch.autograd.Function):
    """extra += input in place (TE's in_place=True), returned; both get the output's gradient."""

    @staticmethod
    def forward(ctx, input, extra):  # noqa: A002
        out = extra.detach()
        out.add_(input)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


class AddExtraInput(BasicOperation):
    """output = input + extra input, TE's `ops.AddExtraInput` (one extra input).

    Parameters
    ----------
    in_place : bool, default = False
        Add the input into the extra input's storage and return that tensor (TE's memory-saving
        form: the caller's extra tensor changes). Under torch.compile the extra tensor is updated
        as well, but the output may be a separate tensor with the same values.
    """

    num_extra_inputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = bool(in_place)

    def forward(self, input: torch.Tensor, extra_input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """input + extra_input (in the extra input's dtype with `in_place`).

        Parameters
        ----------
        input : torch.Tensor
            The main input.
        extra_input : torch.Tensor
            The tensor added, of the input's shape (or broadcastable to it without `in_place`).
        """
        if self.in_place:
            return _AddIntoExtra.apply(input, extra_input)
        return extra_input + input

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"


class MakeExtraOutput(BasicOperation):
    """Returns its input twice: `(output, extra output)`, both the input tensor, TE's
    `ops.MakeExtraOutput`. The input's gradient is the sum of both outputs' gradients.

    Parameters
    ----------
    in_place : bool, default = False
        TE accumulates the two gradients into one of them in place; here autograd sums them either
        way: accepted, the same values.
    """

    num_extra_outputs = 1

    def __init__(self, *, in_place: bool = False) -> None:
        super().__init__()
        self.in_place = bool(in_place)

    def forward(self, input: torch.Tensor):  # noqa: A002 (TE's name)
        """(input, input).

        Parameters
        ----------
        input : torch.Tensor
            Any tensor.
        """
        return input, input

    def extra_repr(self) -> str:
        return f"in_place={self.in_place}"
