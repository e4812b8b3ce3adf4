"""`Quantize`: TE's op that casts a tensor (and its gradient) to the recipe's format, here an identity."""
from __future__ import annotations

from .shape_ops import Identity

__all__ = ["Quantize"]


class Quantize(Identity):
    """An identity that stands where TE's `ops.Quantize` casts to the `autocast` recipe's format.

    In this package every GEMM quantizes its own input, weight and output gradient with the active
    recipe, so a `Quantize` before a `BasicLinear` / `Linear` has nothing to do: the GEMM reads the
    values TE's would. Elsewhere the difference is that the values are not rounded to the format
    at this point (a following activation or norm sees them in high precision, where TE's would
    see the dequantized values), and under `DelayedScaling` no separate scale is kept for it.
    Outside `autocast` TE's op is an identity too.

    Parameters
    ----------
    forward : bool, default = True
        TE: quantize the output. Accepted; the next GEMM quantizes it.
    backward : bool, default = False
        TE: quantize the input's gradient. Accepted; the GEMM before quantizes its gradient.
    """

    def __init__(self, forward: bool = True, backward: bool = False) -> None:
        super().__init__()
        if not isinstance(forward, bool) or not isinstance(backward, bool):
            raise TypeError(f"Quantize: forward and backward must be bools, got {forward!r}, {backward!r}")
        self.quantize_forward, self.quantize_backward = forward, backward

    def extra_repr(self) -> str:
        return f"forward={self.quantize_forward}, backward={self.quantize_backward}"
