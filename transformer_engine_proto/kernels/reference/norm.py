"""LayerNorm / RMSNorm: the pure-torch spec (any device) of the norm kernels.

All math in float32 whatever the input dtype, like TE's kernels: forward returns the output in
the input dtype plus the statistics backward needs (mu, rsigma; mu is 0 for RMSNorm). Op order
(which the Triton kernels follow): y = ((x - mu) * rsigma) * gamma + beta, gamma = weight (+ 1
when zero-centered), rsigma = 1 / sqrt(var + eps).

`norm_fwd_amax` / `norm_fp8_current_quantize` are the spec of the fused fast path: the same as
the norm followed by `amax` / `fp8_quantize_current` of its output.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import register_kernel
from .float8 import amax as _amax
from .float8 import fp8_quantize_current as _fp8_quantize_current

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_norm_args(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], normalization: str) -> None:
    """ValueError naming what is wrong: the kernels support fp32 / bf16 / fp16 and (K,) params."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if inp.dim() == 0:
        raise ValueError("norm input must have at least one dimension")
    k = inp.shape[-1]
    for name, t in (("input", inp), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.dtype not in NORM_DTYPES:
            raise ValueError(f"norm {name} dtype must be one of {NORM_DTYPES}, got {t.dtype}")
        if t is not inp and tuple(t.shape) != (k,):
            raise ValueError(f"norm {name} must have shape ({k},) for input {tuple(inp.shape)}, "
                             f"got {tuple(t.shape)}")
    if normalization == "RMSNorm" and bias is not None:
        raise ValueError("RMSNorm has no bias")


def gamma_f32(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    g = weight.float()
    return g + 1 if zero_centered_gamma else g


def _stats(x: torch.Tensor, normalization: str, eps: float):
    if normalization == "LayerNorm":
        mu = x.mean(-1)
        var = (x - mu.unsqueeze(-1)).square().mean(-1)
    else:
        mu = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        var = x.square().mean(-1)
    return mu, torch.rsqrt(var + eps)


@register_kernel("norm_fwd")
def norm_fwd(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool):
    """(y in inp.dtype, mu fp32, rsigma fp32); mu and rsigma have shape inp.shape[:-1]."""
    check_norm_args(inp, weight, bias, normalization)
    x = inp.float()
    mu, rsigma = _stats(x, normalization, eps)
    y = (x - mu.unsqueeze(-1)) * rsigma.unsqueeze(-1) * gamma_f32(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return y.to(inp.dtype), mu, rsigma


@register_kernel("norm_bwd")
def norm_bwd(grad_out, inp, mu, rsigma, weight, normalization: str, zero_centered_gamma: bool,
             has_bias: bool) -> List[torch.Tensor]:
    """[dx, dgamma] (+ [dbeta] with a bias); dgamma / dbeta in weight.dtype."""
    check_norm_args(inp, weight, None, normalization)
    dy = grad_out.float()
    xhat = (inp.float() - mu.unsqueeze(-1)) * rsigma.unsqueeze(-1)
    dxhat = dy * gamma_f32(weight, zero_centered_gamma)
    proj = (dxhat * xhat).mean(-1, keepdim=True)
    if normalization == "LayerNorm":
        dx = dxhat - dxhat.mean(-1, keepdim=True) - xhat * proj
    else:
        dx = dxhat - xhat * proj
    dx = dx * rsigma.unsqueeze(-1)
    reduce_dims = tuple(range(dy.dim() - 1))
    grads = [dx.to(inp.dtype), (dy * xhat).sum(reduce_dims).to(weight.dtype)]
    if has_bias:
        grads.append(dy.sum(reduce_dims).to(weight.dtype))
    return grads


@register_kernel("norm_fwd_amax")
def norm_fwd_amax(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool):
    """(y, mu, rsigma, amax): the norm plus max |y| over the finite values of y as stored (fp32
    (1,)): the `amax` kernel of y, what current scaling of y takes its scale from."""
    y, mu, rsigma = norm_fwd(inp, weight, bias, eps, normalization, zero_centered_gamma)
    return y, mu, rsigma, _amax(y)


@register_kernel("norm_fp8_current_quantize")
def norm_fp8_current_quantize(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool,
                              fp8_dtype, rowwise: bool, columnwise: bool, margin: int = 0,
                              power_2: bool = False, epsilon: float = 0.0):
    """(y, mu, rsigma, data, transpose, scale_inv, amax): the norm, then per-tensor current
    scaling of y seen as (M, K) -- `fp8_quantize_current(y.reshape(-1, K), ...)`."""
    y, mu, rsigma = norm_fwd(inp, weight, bias, eps, normalization, zero_centered_gamma)
    data, transpose, scale_inv, amax = _fp8_quantize_current(
        y.reshape(-1, y.shape[-1]), fp8_dtype, rowwise, columnwise, margin, power_2, epsilon)
    return y, mu, rsigma, data, transpose, scale_inv, amax
