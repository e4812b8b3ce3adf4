"""Activation operations with TE's definitions: element-wise `GELU` (tanh approximation), `QGELU`,
`ReLU`, `SReLU`, `SiLU`, and the gated `GLU`, `GEGLU`, `QGEGLU`, `ReGLU`, `SReGLU`, `SwiGLU`, with
SwiGLU's clamped (GPT-OSS) and soft-capped (Kimi K3) forms `ClampedSwiGLU` and `SiTUGLU`; and the
row-scaled forms of grouped (MoE) MLPs, `ScaledSReLU`, `ScaledSwiGLU`, `ScaledSiTUGLU` and
`ScaledClampedQGeGLU`, whose output rows are multiplied by an extra input (the routing weights).

A gated op splits its input's last dim into halves (a, b) and returns act(a) * b: TE gates the
first half, where `torch.nn.functional.glu` gates the second. Each op computes in float32 and
rounds once to the input's dtype (torch.autocast's under it), as TE's kernels do; autograd derives
the backward.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import raise_error
from ..module.layernorm_mlp import clamped_swiglu
from .fp8_saved_input import activation_with_fp8_saved_input
from .op import BasicOperation, compute_dtype

__all__ = ["ClampedSwiGLU", "GELU", "GEGLU", "GLU", "QGELU", "QGEGLU", "ReLU", "ReGLU", "SReLU", "SReGLU", "SiLU",
           "SiTUGLU", "SwiGLU", "ScaledClampedQGeGLU", "ScaledSReLU", "ScaledSiTUGLU", "ScaledSwiGLU"]


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.square(F.relu(x))


class _Activation(BasicOperation):
    """An element-wise activation (`_GATED`: of the first half, times the second half)."""

    _FN: Callable = staticmethod(lambda x: x)
    _GATED = False

    def __init__(self, *, cache_quantized_input: bool = False) -> None:
        super().__init__()
        self.cache_quantized_input = bool(cache_quantized_input)

    def _gate_layout(self, x: torch.Tensor) -> torch.Tensor:
        """The input as [gates | values] along the last dim (SwiGLU's interleaved layout overrides)."""
        return x

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The activation, in the input's dtype.

        Parameters
        ----------
        input : torch.Tensor
            Any shape; gated ops halve the last dim, which must be even.
        """
        dtype = compute_dtype(input, input.dtype)
        if self.cache_quantized_input:
            return activation_with_fp8_saved_input(lambda x: self._activate(x.float()).to(dtype), input.to(dtype))
        return self._activate(input.float()).to(dtype)

    def _activate(self, x: torch.Tensor) -> torch.Tensor:
        """The activation of float32 `x`, in float32."""
        if not self._GATED:
            return type(self)._FN(x)
        if x.dim() < 1 or x.shape[-1] % 2:
            raise_error(ValueError, f"{type(self).__name__}: a gated activation needs an even last dim")
        a, b = self._gate_layout(x).chunk(2, dim=-1)
        return self._glu(a, b)

    def _glu(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The gated op on float32 halves: act(a) * b."""
        return type(self)._FN(a) * b


_ARGS_DOC = """
    Parameters
    ----------
    cache_quantized_input : bool, default = False
        Save the input for backward in FP8 (E4M3, current scaling) instead of its own precision:
        less memory; the input gradient is taken at the dequantized copy.
    """


def _activation(name: str, fn, gated: bool, what: str):
    cls = type(name, (_Activation,), {"_FN": staticmethod(fn), "_GATED": gated, "__module__": __name__,
                                      "__qualname__": name})
    cls.__doc__ = what + "\n" + _ARGS_DOC
    return cls


GELU = _activation("GELU", _gelu, False, "GELU, tanh approximation (TE's `ops.GELU`).")
QGELU = _activation("QGELU", _qgelu, False, "Quick GELU, x * sigmoid(1.702 x) (TE's `ops.QGELU`).")
ReLU = _activation("ReLU", F.relu, False, "max(x, 0) (TE's `ops.ReLU`).")
SReLU = _activation("SReLU", _srelu, False, "Squared ReLU, max(x, 0)^2 (TE's `ops.SReLU`).")
SiLU = _activation("SiLU", F.silu, False, "x * sigmoid(x) (TE's `ops.SiLU`).")
GLU = _activation("GLU", torch.sigmoid, True, "sigmoid(a) * b for input halves (a, b) (TE's `ops.GLU`; "
                                              "`torch.nn.functional.glu` gates the other half).")
GEGLU = _activation("GEGLU", _gelu, True, "GELU(a) * b for input halves (a, b), tanh GELU (TE's `ops.GEGLU`).")
QGEGLU = _activation("QGEGLU", _qgelu, True, "QGELU(a) * b for input halves (a, b) (TE's `ops.QGEGLU`).")
ReGLU = _activation("ReGLU", F.relu, True, "max(a, 0) * b for input halves (a, b) (TE's `ops.ReGLU`).")
SReGLU = _activation("SReGLU", _srelu, True, "max(a, 0)^2 * b for input halves (a, b) (TE's `ops.SReGLU`).")


class SwiGLU(_Activation):
    """SiLU(a) * b for input halves (a, b), TE's `ops.SwiGLU` (the first half is gated).

    Parameters
    ----------
    cache_quantized_input : bool, default = False
        Save the input for backward in FP8 (E4M3, current scaling) instead of its own precision:
        less memory; the input gradient is taken at the dequantized copy.
    glu_interleave_size : int, default = None
        TE's block-interleaved layout: the last dim alternates blocks of this many gates and
        values ([a1 a2 b1 b2 a3 a4 b3 b4] for 2) instead of all gates then all values.
    """

    _FN = staticmethod(F.silu)
    _GATED = True

    def __init__(self, *, cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input)
        if glu_interleave_size is not None and (not isinstance(glu_interleave_size, int) or glu_interleave_size <= 0):
            raise ValueError(f"{type(self).__name__}: glu_interleave_size must be a positive int or None, "
                             f"got {glu_interleave_size!r}")
        self.glu_interleave_size = glu_interleave_size

    def _gate_layout(self, x: torch.Tensor) -> torch.Tensor:
        s = self.glu_interleave_size
        if s is None:
            return x
        n = x.shape[-1]
        if n % (2 * s):
            raise_error(ValueError, f"{type(self).__name__}: the last dim must be a multiple of 2 * "
                                    f"glu_interleave_size ({2 * s})")
        blocks = x.reshape(*x.shape[:-1], n // (2 * s), 2, s)
        return blocks.transpose(-3, -2).reshape(x.shape)


def _positive(owner: str, name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{owner}: {name} must be finite and positive, got {value!r}")
    return value


class ClampedSwiGLU(SwiGLU):
    """GPT-OSS's SwiGLU, TE's `ops.ClampedSwiGLU`: min(a, limit) * sigmoid(alpha * min(a, limit)) *
    (clamp(b, -limit, limit) + glu_linear_offset) for input halves (a, b). The halves are TE's
    (gates first), not GPT-OSS's interleaved pairs; `glu_interleave_size` gives blocks.

    Parameters
    ----------
    limit : float, default = 7.0
        Clamp of the gate from above and of the linear half on both sides.
    alpha : float, default = 1.702
        Slope inside the gate's sigmoid.
    glu_linear_offset : float, default = 1.0
        Added to the clamped linear half (0 disables it).
    cache_quantized_input : bool, default = False
        Save the input for backward in FP8, as in `SwiGLU`.
    glu_interleave_size : int, default = None
        TE's block-interleaved layout, as in `SwiGLU`.
    """

    def __init__(self, *, limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0,
                 cache_quantized_input: bool = False, glu_interleave_size: Optional[int] = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size)
        self.limit = _positive("ClampedSwiGLU", "limit", limit)
        self.alpha, self.glu_linear_offset = float(alpha), float(glu_linear_offset)

    def _glu(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return clamped_swiglu(a, b, self.limit, self.alpha, self.glu_linear_offset)



class SiTUGLU(SwiGLU):
    """Kimi K3's soft-capped SiLU GLU, TE's `ops.SiTUGLU`: beta1 tanh(a / beta1) sigmoid(a) *
    beta2 tanh(b / beta2) for input halves (a, b).

    Parameters
    ----------
    beta1 : float, default = 4.0
        Soft cap of the gate (finite, positive).
    beta2 : float, default = 25.0
        Soft cap of the linear half (finite, positive).
    cache_quantized_input : bool, default = False
        Save the input for backward in FP8, as in `SwiGLU`.
    glu_interleave_size : int, default = None
        TE's block-interleaved layout, as in `SwiGLU`.
    """

    def __init__(self, *, beta1: float = 4.0, beta2: float = 25.0, cache_quantized_input: bool = False,
                 glu_interleave_size: Optional[int] = None) -> None:
        super().__init__(cache_quantized_input=cache_quantized_input, glu_interleave_size=glu_interleave_size)
        self.beta1, self.beta2 = _positive("SiTUGLU", "beta1", beta1), _positive("SiTUGLU", "beta2", beta2)

    def _glu(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.beta1 * torch.tanh(a / self.beta1) * torch.sigmoid(a) * (self.beta2 * torch.tanh(b / self.beta2))


class _RowScaled:
    """The activation times a scale per output row: the extra input, of the input's shape without
    its last dim (TE's grouped-MLP middle ops). One rounding to the input's dtype, after the scale."""

    num_extra_inputs = 1
    _RECOMPUTE = False  # whether TE offers activation_recompute_in_mlp for this op

    def _recompute_flag(self, activation_recompute_in_mlp: bool) -> bool:
        if activation_recompute_in_mlp and not self._RECOMPUTE:
            raise ValueError(f"{type(self).__name__} does not support activation recomputation in the fused "
                             "grouped MLP")
        return bool(activation_recompute_in_mlp)

    def forward(self, input: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """activation(input) * scales[..., None], in the input's dtype.

        Parameters
        ----------
        input : torch.Tensor
            As for the unscaled op.
        scales : torch.Tensor
            One scale per row: shape `input.shape[:-1]`; its gradient is computed when it requires one.
        """
        if tuple(scales.shape) != tuple(input.shape[:-1]):
            raise_error(ValueError, f"{type(self).__name__}: scales must have the input's shape without its last "
                                    f"dim, {tuple(input.shape[:-1])}; got {tuple(scales.shape)}")
        return (self._activate(input.float()) * scales.float().unsqueeze(-1)).to(compute_dtype(input, input.dtype))


class ScaledSReLU(_RowScaled, SReLU):
    """Squared ReLU times a per-row scale, TE's `ops.ScaledSReLU`: max(x, 0)^2 * scales[..., None],
    called as `op(x, scales)` (or with the scales as an extra input of a `Sequential`).

    Parameters
    ----------
    activation_recompute_in_mlp : bool, default = False
        TE's fused grouped-MLP recomputation of the activation in backward: accepted and kept;
        there is no fused grouped-MLP kernel here, and autograd saves the input either way.
    """

    _RECOMPUTE = True

    def __init__(self, *, activation_recompute_in_mlp: bool = False) -> None:
        super().__init__()
        self.activation_recompute_in_mlp = self._recompute_flag(activation_recompute_in_mlp)


class ScaledSwiGLU(_RowScaled, SwiGLU):
    """`SwiGLU` times a per-row scale, TE's `ops.ScaledSwiGLU`: SiLU(a) * b * scales[..., None].

    Parameters
    ----------
    glu_interleave_size : int, default = None
        As in `SwiGLU`.
    activation_recompute_in_mlp : bool, default = False
        Must be False, as in TE (True is a ValueError).
    """

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False
                 ) -> None:
        super().__init__(glu_interleave_size=glu_interleave_size)
        self.activation_recompute_in_mlp = self._recompute_flag(activation_recompute_in_mlp)


class ScaledSiTUGLU(_RowScaled, SiTUGLU):
    """`SiTUGLU` times a per-row scale, TE's `ops.ScaledSiTUGLU`.

    Parameters
    ----------
    glu_interleave_size : int, default = None
        As in `SwiGLU`.
    activation_recompute_in_mlp : bool, default = False
        Must be False, as in TE (True is a ValueError).
    beta1, beta2 : float, default = 4.0, 25.0
        As in `SiTUGLU`.
    """

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False,
                 beta1: float = 4.0, beta2: float = 25.0) -> None:
        super().__init__(beta1=beta1, beta2=beta2, glu_interleave_size=glu_interleave_size)
        self.activation_recompute_in_mlp = self._recompute_flag(activation_recompute_in_mlp)


class ScaledClampedQGeGLU(_RowScaled, ClampedSwiGLU):
    """`ClampedSwiGLU` times a per-row scale, TE's `ops.ScaledClampedQGeGLU` (cuDNN grouped GEMM's
    `geglu`).

    Parameters
    ----------
    glu_interleave_size : int, default = None
        As in `SwiGLU`.
    activation_recompute_in_mlp : bool, default = False
        Must be False, as in TE (True is a ValueError).
    limit, alpha, glu_linear_offset : float, default = 7.0, 1.702, 1.0
        As in `ClampedSwiGLU`.
    """

    def __init__(self, glu_interleave_size: Optional[int] = None, *, activation_recompute_in_mlp: bool = False,
                 limit: float = 7.0, alpha: float = 1.702, glu_linear_offset: float = 1.0) -> None:
        super().__init__(limit=limit, alpha=alpha, glu_linear_offset=glu_linear_offset,
                         glu_interleave_size=glu_interleave_size)
        self.activation_recompute_in_mlp = self._recompute_flag(activation_recompute_in_mlp)
