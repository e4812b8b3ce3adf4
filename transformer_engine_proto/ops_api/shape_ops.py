"""Operations without parameters: `Identity`, `Reshape`, `ConstantScale`, `Dropout` (TE's `ops`)."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from .op import BasicOperation

__all__ = ["Identity", "Reshape", "ConstantScale", "Dropout"]


class Identity(BasicOperation):
    """Returns its input (the same tensor), TE's `ops.Identity`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The input itself.

        Parameters
        ----------
        input : torch.Tensor
            Any tensor.
        """
        return input


class Reshape(BasicOperation):
    """`input.reshape(shape)`, TE's `ops.Reshape`.

    Parameters
    ----------
    shape : iterable of int
        The output's shape; one dim may be -1 (inferred from the input's size).
    """

    def __init__(self, shape: Iterable[int]) -> None:
        super().__init__()
        self.shape = tuple(shape)
        if not all(isinstance(d, int) and d >= -1 for d in self.shape) or self.shape.count(-1) > 1:
            raise ValueError(f"Reshape: shape must be ints >= 0 with at most one -1, got {shape!r}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The input reshaped.

        Parameters
        ----------
        input : torch.Tensor
            Any tensor with as many elements as `shape`.
        """
        return input.reshape(self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


class ConstantScale(BasicOperation):
    """y = scale * x (and dx = scale * dy), TE's `ops.ConstantScale`.

    Parameters
    ----------
    scale : float
        The constant factor.
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"ConstantScale: scale must be a number, got {type(scale).__name__}")
        self.scale = float(scale)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The input times `scale`, in its dtype.

        Parameters
        ----------
        input : torch.Tensor
            Any tensor.
        """
        return input * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


class Dropout(BasicOperation):
    """In training, zero each element with probability `p` and scale the rest by 1 / (1 - p); in
    eval mode the identity. TE's `ops.Dropout`, on `torch.nn.functional.dropout` (torch's
    generator: `torch.manual_seed` makes it repeatable).

    Parameters
    ----------
    p : float
        The probability of zeroing an element, in [0, 1].
    """

    def __init__(self, p: float) -> None:
        super().__init__()
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be a probability in [0, 1], got {p!r}")
        self.dropout_probability = float(p)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The input with dropout in training mode, unchanged in eval mode.

        Parameters
        ----------
        input : torch.Tensor
            Any floating-point tensor.
        """
        return F.dropout(input, self.dropout_probability, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.dropout_probability}"
