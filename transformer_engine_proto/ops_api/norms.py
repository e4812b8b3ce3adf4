"""`LayerNorm` and `RMSNorm` operations on the `te_proto::norm_*` custom ops (as `te.LayerNorm` /
`te.RMSNorm`: statistics in float32, output in the input's dtype, or torch.autocast's), and the
parameter-free `L2Normalization` in torch operations.

A `normalized_shape` of several dims normalizes over the input's trailing dims together: the op
flattens them into one, which is the same computation.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Union

import torch
from torch import nn

from ..capabilities import default_device
from ..custom_ops.norm import norm
from ..errors import raise_error
from ..module.base import autocast_operands
from .linear import param_dtype
from .op import BasicOperation

__all__ = ["L2Normalization", "LayerNorm", "RMSNorm"]


def _shape(owner: str, normalized_shape) -> tuple:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ValueError(f"{owner}: normalized_shape must be a positive int or a non-empty sequence of them, "
                         f"got {normalized_shape!r}")
    return shape


def _sm_margin(owner: str, sm_margin) -> None:
    """TE's SM carve-out for its CUDA kernels: accepted (int or per-stage dict), without effect."""
    values = sm_margin.values() if isinstance(sm_margin, dict) else [sm_margin]
    if not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"{owner}: sm_margin must be a non-negative int or a dict of them, got {sm_margin!r}")


class _NormOp(BasicOperation):
    _KIND = ""

    def __init__(self, normalized_shape, eps: float, device, dtype, zero_centered_gamma: bool, sm_margin,
                 with_bias: bool) -> None:
        super().__init__()
        owner = type(self).__name__
        self.normalized_shape = _shape(owner, normalized_shape)
        _sm_margin(owner, sm_margin)
        if not eps >= 0:
            raise ValueError(f"{owner}: eps must be non-negative, got {eps!r}")
        self.eps, self.zero_centered_gamma = float(eps), bool(zero_centered_gamma)
        dtype, device = param_dtype(owner, dtype), default_device(device)
        self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        self.bias = (nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
                     if with_bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """gamma = 1 (0 with `zero_centered_gamma`), beta = 0."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The norm over the trailing `normalized_shape` dims.

        Parameters
        ----------
        input : torch.Tensor
            [..., *normalized_shape], float32, bfloat16 or float16.
        """
        k = len(self.normalized_shape)
        if input.dim() < k or tuple(input.shape[input.dim() - k:]) != self.normalized_shape:
            raise_error(ValueError, f"{type(self).__name__}: the input's trailing dims must be "
                                    f"{list(self.normalized_shape)}")
        x, weight, bias = autocast_operands(input, self.weight, self.bias)
        if k == 1:
            return norm(x, weight, bias, self.eps, self._KIND, self.zero_centered_gamma)
        flat = x.reshape(*x.shape[:x.dim() - k], math.prod(self.normalized_shape))
        bias = None if bias is None else bias.reshape(-1)
        out = norm(flat, weight.reshape(-1), bias, self.eps, self._KIND, self.zero_centered_gamma)
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={self.zero_centered_gamma}"


class LayerNorm(_NormOp):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the trailing dims, TE's `ops.LayerNorm`;
    parameters `weight` (gamma) and `bias` (beta).

    Parameters
    ----------
    normalized_shape : int or iterable of int
        The trailing dims normalized over.
    eps : float, default = 1e-5
        Added to the variance for numerical stability.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    dtype : torch.dtype, default = None
        The parameters' dtype; None is `torch.get_default_dtype()`.
    zero_centered_gamma : bool, default = False
        Initialize gamma to zero and scale by `1 + gamma` (TE's formulation).
    sm_margin : int or dict, default = 0
        TE's SM carve-out for its CUDA kernels: accepted and without effect.
    """

    _KIND = "LayerNorm"

    def __init__(self, normalized_shape: Union[int, Iterable[int]], *, eps: float = 1e-5, device=None,
                 dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 sm_margin: Union[int, dict] = 0) -> None:
        super().__init__(normalized_shape, eps, device, dtype, zero_centered_gamma, sm_margin, with_bias=True)


class RMSNorm(_NormOp):
    """x / sqrt(mean(x^2) + eps) * gamma over the trailing dims, TE's `ops.RMSNorm`; parameter
    `weight` (gamma), no bias.

    Parameters
    ----------
    normalized_shape : int or iterable of int
        The trailing dims normalized over.
    eps : float, default = 1e-5
        Added to the mean square for numerical stability.
    device : torch.device or str, default = None
        Where the parameter is created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    dtype : torch.dtype, default = None
        The parameter's dtype; None is `torch.get_default_dtype()`.
    zero_centered_gamma : bool, default = False
        Initialize gamma to zero and scale by `1 + gamma` (TE's formulation).
    sm_margin : int or dict, default = 0
        TE's SM carve-out for its CUDA kernels: accepted and without effect.
    """

    _KIND = "RMSNorm"

    def __init__(self, normalized_shape: Union[int, Iterable[int]], *, eps: float = 1e-5, device=None,
                 dtype: Optional[torch.dtype] = None, zero_centered_gamma: bool = False,
                 sm_margin: Union[int, dict] = 0) -> None:
        super().__init__(normalized_shape, eps, device, dtype, zero_centered_gamma, sm_margin, with_bias=False)


class L2Normalization(BasicOperation):
    """y = x / sqrt(sum(x^2) + eps) over the last dim, computed in float32 and rounded once to the
    input's dtype (TE's `ops.L2Normalization`, used for query / key normalization); no parameters.

    Parameters
    ----------
    eps : float, default = 1e-6
        Added to the sum of squares.
    seq_length : int, optional
        TE's size hint for warming up its JIT-fused kernels; no effect here (torch.compile
        specializes on the shapes it sees).
    micro_batch_size : int, optional
        The other half of that hint; no effect here.
    """

    def __init__(self, *, eps: float = 1e-6, seq_length: Optional[int] = None,
                 micro_batch_size: Optional[int] = None) -> None:
        super().__init__()
        if not eps >= 0:
            raise ValueError(f"L2Normalization: eps must be non-negative, got {eps!r}")
        self.eps = float(eps)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The input scaled to unit L2 norm along its last dim.

        Parameters
        ----------
        input : torch.Tensor
            Any floating-point tensor.
        """
        x = input.float()
        return (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + self.eps)).to(input.dtype)

    def extra_repr(self) -> str:
        return f"eps={self.eps}"
