"""LayerNorm / RMSNorm as custom ops (`te_proto::norm_fwd` / `norm_bwd`).

Forward returns the normalized output plus the statistics backward needs (mu, rsigma), computed
in float32 whatever the input dtype, like TE's kernels. Keeping the norm an opaque op gives the
fast path one place to fuse normalization with the following quantization.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

__all__ = ["norm", "NORMALIZATIONS"]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _stats(x: torch.Tensor, kind: str, eps: float):
    if kind == "LayerNorm":
        mu = x.mean(-1)
        var = (x - mu.unsqueeze(-1)).square().mean(-1)
    else:
        mu = torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
        var = x.square().mean(-1)
    return mu, torch.rsqrt(var + eps)


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool) -> torch.Tensor:
    g = weight.float()
    return g + 1 if zero_centered_gamma else g


@torch.library.custom_op("te_proto::norm_fwd", mutates_args=())
def norm_fwd(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
             kind: str, zero_centered_gamma: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = inp.float()
    mu, rsigma = _stats(x, kind, eps)
    y = (x - mu.unsqueeze(-1)) * rsigma.unsqueeze(-1) * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    return y.to(inp.dtype), mu, rsigma


@norm_fwd.register_fake
def _norm_fwd_fake(inp, weight, bias, eps, kind, zero_centered_gamma):
    stat = inp.new_empty(inp.shape[:-1], dtype=torch.float32)
    return torch.empty_like(inp), stat, stat.clone()


@torch.library.custom_op("te_proto::norm_bwd", mutates_args=())
def norm_bwd(grad_out: torch.Tensor, inp: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor,
             weight: torch.Tensor, kind: str, zero_centered_gamma: bool, has_bias: bool) -> List[torch.Tensor]:
    """[dx, dgamma] (+ [dbeta] with a bias)."""
    dy = grad_out.float()
    xhat = (inp.float() - mu.unsqueeze(-1)) * rsigma.unsqueeze(-1)
    dxhat = dy * _gamma(weight, zero_centered_gamma)
    proj = (dxhat * xhat).mean(-1, keepdim=True)
    if kind == "LayerNorm":
        dx = dxhat - dxhat.mean(-1, keepdim=True) - xhat * proj
    else:
        dx = dxhat - xhat * proj
    dx = dx * rsigma.unsqueeze(-1)
    reduce_dims = tuple(range(dy.dim() - 1))
    grads = [dx.to(inp.dtype), (dy * xhat).sum(reduce_dims).to(weight.dtype)]
    if has_bias:
        grads.append(dy.sum(reduce_dims).to(weight.dtype))
    return grads


@norm_bwd.register_fake
def _norm_bwd_fake(grad_out, inp, mu, rsigma, weight, kind, zero_centered_gamma, has_bias):
    grads = [torch.empty_like(inp), torch.empty_like(weight)]
    if has_bias:
        grads.append(torch.empty_like(weight))
    return grads


def _setup_context(ctx, inputs, output):
    inp, weight, bias, _eps, kind, zero_centered_gamma = inputs
    _, mu, rsigma = output
    ctx.save_for_backward(inp, mu, rsigma, weight)
    ctx.kind, ctx.zero_centered_gamma, ctx.has_bias = kind, zero_centered_gamma, bias is not None


def _backward(ctx, grad_out, _grad_mu, _grad_rsigma):
    inp, mu, rsigma, weight = ctx.saved_tensors
    grads = norm_bwd(grad_out.contiguous(), inp, mu, rsigma, weight, ctx.kind, ctx.zero_centered_gamma,
                     ctx.has_bias)
    dbias = grads[2] if ctx.has_bias else None
    return grads[0], grads[1], dbias, None, None, None


norm_fwd.register_autograd(_backward, setup_context=_setup_context)


def norm(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, kind: str,
         zero_centered_gamma: bool = False) -> torch.Tensor:
    if kind not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {kind!r}")
    if kind == "RMSNorm" and bias is not None:
        raise ValueError("RMSNorm has no bias")
    out, _, _ = norm_fwd(inp, weight, bias, float(eps), kind, zero_centered_gamma)
    return out


# ---- norm fused with the quantization of its output ---------------------------------------------
@torch.library.custom_op("te_proto::norm_quantize_fwd", mutates_args=())
def norm_quantize_fwd(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                      kind: str, zero_centered_gamma: bool, key: str, columnwise: bool
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """The norm plus its output quantized for the following GEMM (rowwise, and columnwise for
    wgrad): the buffers `te_proto::linear_fwd` takes as `inp_quantized`. One op, so a fused kernel
    can write both from one read of the input."""
    out, mu, rsigma = norm_fwd(inp, weight, bias, eps, kind, zero_centered_gamma)
    q = _input_quantizer(key, columnwise)
    return out, mu, rsigma, list(q.quantize(out.reshape(-1, out.shape[-1])).get_buffers().values())


def _input_quantizer(key: str, columnwise: bool):
    from .recipe_registry import quantizers_from_key

    q = quantizers_from_key(key).input
    if q is None or q.__class__.__name__ == "Float8Quantizer":
        raise ValueError("norm_quantize_fwd needs a recipe whose input quantizer is stateless "
                         "(not high precision, not DelayedScaling)")
    return q.with_usage(rowwise=True, columnwise=columnwise)


@norm_quantize_fwd.register_fake
def _norm_quantize_fwd_fake(inp, weight, bias, eps, kind, zero_centered_gamma, key, columnwise):
    from ..tensor import TensorProto

    out, mu, rsigma = _norm_fwd_fake(inp, weight, bias, eps, kind, zero_centered_gamma)
    m = inp.numel() // inp.shape[-1]
    proto = TensorProto((m, inp.shape[-1]), inp.dtype, _input_quantizer(key, columnwise), device=inp.device)
    return out, mu, rsigma, list(proto.create_buffers().values())


def _setup_quantize_context(ctx, inputs, output):
    _setup_context(ctx, inputs[:6], output[:3])


def _quantize_backward(ctx, grad_out, grad_mu, grad_rsigma, _grad_buffers):
    return _backward(ctx, grad_out, grad_mu, grad_rsigma) + (None, None)


norm_quantize_fwd.register_autograd(_quantize_backward, setup_context=_setup_quantize_context)


def norm_quantize(inp, weight, bias, eps: float, kind: str, zero_centered_gamma: bool, key: str,
                  columnwise: bool):
    """(normalized output, its quantized buffers) -- see `norm_quantize_fwd`."""
    out, _, _, buffers = norm_quantize_fwd(inp, weight, bias, float(eps), kind, zero_centered_gamma, key,
                                           columnwise)
    return out, buffers
