"""Base classes of the fusible operations: `FusibleOperation`, `BasicOperation`, `FusedOperation`.

An operation here is an `nn.Module` whose `forward` is ordinary differentiable torch code (our
custom ops included): autograd derives the backward and torch.compile traces it like any module.
TE's ops instead hand-write `op_forward` / `op_backward` and pass quantizers between neighbours
through its fuser; in this package every GEMM quantizes its own input and gradient with the
active recipe, so there is nothing to hand over and no fuser is needed.

`num_extra_inputs` / `num_extra_outputs` have TE's meaning: an op called on its own takes
`(input, *extra_inputs)` and returns `output`, or `(output, *extra_outputs)` when it makes any;
`Sequential` feeds its own extra inputs to its ops in order and collects their extra outputs.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from ..errors import raise_error

__all__ = ["FusibleOperation", "BasicOperation", "FusedOperation", "split_extra_outputs", "check_extra_inputs",
           "compute_dtype"]


class FusibleOperation(nn.Module):
    """An operation `Sequential` runs with TE's extra-input / extra-output convention."""

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0

    @property
    def is_fused_op(self) -> bool:
        """Whether this op stands for a run of basic ops."""
        raise NotImplementedError


def split_extra_outputs(op: FusibleOperation, result):
    """(output, tuple of extra outputs) of a call of `op`."""
    if op.num_extra_outputs == 0:
        return result, ()
    return result[0], tuple(result[1:])


def compute_dtype(input: torch.Tensor, default: torch.dtype) -> torch.dtype:  # noqa: A002 (TE's name)
    """The dtype an op computes in, as TE's ops choose it: torch.autocast's dtype where it is on
    for the input's device, else `default` (a linear op's weight dtype, an activation's input
    dtype). The op casts its input to it; autograd casts the gradient back."""
    if torch.is_autocast_enabled(input.device.type):
        return torch.get_autocast_dtype(input.device.type)
    return default


def check_extra_inputs(op: nn.Module, extra_inputs: tuple) -> None:
    """An op called with the wrong number of extra inputs: a clear error, also under compile."""
    want = getattr(op, "num_extra_inputs", 0)
    if len(extra_inputs) != want:
        raise_error(ValueError, f"{type(op).__name__} takes {want} extra input(s), got {len(extra_inputs)}")


class BasicOperation(FusibleOperation):
    """One tensor operation, holding its own parameters and state.

    A subclass implements `forward(input, *extra_inputs)` with torch operations; backward comes
    from autograd. TE's hand-written `op_forward` / `op_backward` / `fuser_forward` contract is
    not supported: a subclass that defines only those is a `NotImplementedError` when built.
    """

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        if cls.forward is BasicOperation.forward:
            hand_written = [n for n in ("op_forward", "op_backward", "fuser_forward") if hasattr(cls, n)]
            hint = (f" (it defines TE's {', '.join(hand_written)}: that hand-written contract is not "
                    "supported here)" if hand_written else "")
            raise NotImplementedError(
                f"{cls.__name__}: a BasicOperation implements forward(input, *extra_inputs) with torch "
                f"operations; autograd makes the backward{hint}")

    @property
    def is_fused_op(self) -> bool:
        return False

    def get_extra_state(self) -> torch.Tensor:
        """No quantization state by default: an empty byte tensor, as TE writes for such ops, so
        TE's op state dicts (an `_extra_state` per basic op) load with `strict=True`."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Accepts the empty state above; a non-empty one (TE's delayed-scaling state of an op
        that keeps none here) is ignored."""

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor):  # noqa: A002 (TE's name)
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")


class FusedOperation(FusibleOperation):
    """A run of basic ops acting as one (`basic_ops`, an `nn.ModuleList`). Calling it runs them in
    order; extra inputs go to the basic ops that take them, in order, and their extra outputs
    follow the output. Subclasses may compute the run in one step (`Linear` adds its bias in the
    GEMM).

    Parameters
    ----------
    basic_ops : iterable of BasicOperation
        The operations this one stands for, in order (at least one).
    """

    def __init__(self, basic_ops: Iterable[BasicOperation]) -> None:
        super().__init__()
        self.basic_ops = nn.ModuleList(basic_ops)
        if len(self.basic_ops) == 0:
            raise ValueError(f"{type(self).__name__}: a fused operation needs at least one basic operation")
        for op in self.basic_ops:
            if not isinstance(op, BasicOperation):
                raise TypeError(f"{type(self).__name__}: basic_ops must be BasicOperation instances, "
                                f"got {type(op).__name__}")

    @property
    def is_fused_op(self) -> bool:
        return True

    @property
    def num_extra_inputs(self) -> int:  # type: ignore[override]
        return sum(op.num_extra_inputs for op in self.basic_ops)

    @property
    def num_extra_outputs(self) -> int:  # type: ignore[override]
        return sum(op.num_extra_outputs for op in self.basic_ops)

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor):  # noqa: A002 (TE's name)
        """The basic ops in order.

        Parameters
        ----------
        input : torch.Tensor
            The main input; `extra_inputs` (positional) feed the basic ops that take them.
        """
        check_extra_inputs(self, extra_inputs)
        x, pending, extra_outputs = input, list(extra_inputs), []
        for op in self.basic_ops:
            taken, pending = pending[:op.num_extra_inputs], pending[op.num_extra_inputs:]
            x, extra = split_extra_outputs(op, op(x, *taken))
            extra_outputs.extend(extra)
        return (x, *extra_outputs) if extra_outputs else x
