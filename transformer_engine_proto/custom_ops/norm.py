"""LayerNorm / RMSNorm as custom ops (`te_proto::norm_fwd` / `norm_bwd`).

Forward returns the normalized output plus the statistics backward needs (mu, rsigma), computed
in float32 whatever the input dtype, like TE's kernels. The math is in the kernel dispatcher:
`kernels/reference/norm.py` (the spec, and the CPU path) and `kernels/triton/norm.py` (CUDA, one
kernel per direction). Keeping the norm an opaque op gives the fast path one place to fuse
normalization with the following quantization (current scaling: the norm kernel takes the amax).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ..kernels import kernel
from ..kernels.reference.norm import NORMALIZATIONS
from .eager_path import eager_function
from .inductor_lowering import inline_in_inductor
from .recompute_tags import recompute_saved_input, recomputed_in_backward
from .row_padding import gemm_rows, pad_rows

__all__ = ["norm", "NORMALIZATIONS"]


@torch.library.custom_op("te_proto::norm_fwd", mutates_args=())
def norm_fwd(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
             normalization: str, zero_centered_gamma: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with recomputed_in_backward(recompute_saved_input()):  # the next Linear's input: rebuilt, not saved
        return kernel("norm_fwd", inp.device)(inp, weight, bias, eps, normalization, zero_centered_gamma)


@norm_fwd.register_fake
def _norm_fwd_fake(inp, weight, bias, eps, normalization, zero_centered_gamma):
    stat = inp.new_empty(inp.shape[:-1], dtype=torch.float32)
    return torch.empty_like(inp), stat, stat.clone()


@torch.library.custom_op("te_proto::norm_bwd", mutates_args=())
def norm_bwd(grad_out: torch.Tensor, inp: torch.Tensor, mu: torch.Tensor, rsigma: torch.Tensor,
             weight: torch.Tensor, normalization: str, zero_centered_gamma: bool, has_bias: bool) -> List[torch.Tensor]:
    """[dx, dgamma] (+ [dbeta] with a bias)."""
    return kernel("norm_bwd", inp.device)(grad_out, inp, mu, rsigma, weight, normalization, zero_centered_gamma,
                                          has_bias)


@norm_bwd.register_fake
def _norm_bwd_fake(grad_out, inp, mu, rsigma, weight, normalization, zero_centered_gamma, has_bias):
    grads = [torch.empty_like(inp), torch.empty_like(weight)]
    if has_bias:
        grads.append(torch.empty_like(weight))
    return grads


def _setup_context(ctx, inputs, output):
    inp, weight, bias, _eps, normalization, zero_centered_gamma = inputs
    _, mu, rsigma = output
    ctx.save_for_backward(inp, mu, rsigma, weight)
    ctx.normalization, ctx.zero_centered_gamma, ctx.has_bias = normalization, zero_centered_gamma, bias is not None


def _backward(ctx, grad_out, _grad_mu, _grad_rsigma):
    inp, mu, rsigma, weight = ctx.saved_tensors
    backward_op = getattr(ctx, "backward_op", norm_bwd)
    grads = backward_op(grad_out.contiguous(), inp, mu, rsigma, weight, ctx.normalization, ctx.zero_centered_gamma,
                        ctx.has_bias)
    dbias = grads[2] if ctx.has_bias else None
    return grads[0], grads[1], dbias, None, None, None


norm_fwd.register_autograd(_backward, setup_context=_setup_context)
inline_in_inductor(torch.ops.te_proto.norm_fwd.default, norm_fwd._init_fn)
inline_in_inductor(torch.ops.te_proto.norm_bwd.default, norm_bwd._init_fn)
_norm_fwd_call = eager_function(norm_fwd, _setup_context, _backward, norm_bwd._init_fn, non_differentiable=(1, 2))


def norm(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float, normalization: str,
         zero_centered_gamma: bool = False) -> torch.Tensor:
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if normalization == "RMSNorm" and bias is not None:
        raise ValueError("RMSNorm has no bias")
    if inp.dim() == 1:  # the kernels reduce over rows for the weight gradient: a 1-D input is one row
        return norm(inp.unsqueeze(0), weight, bias, eps, normalization, zero_centered_gamma).squeeze(0)
    out, _, _ = _norm_fwd_call(inp, weight, bias, float(eps), normalization, zero_centered_gamma)
    return out


# ---- norm fused with the quantization of its output ---------------------------------------------
@torch.library.custom_op("te_proto::norm_quantize_fwd", mutates_args=())
def norm_quantize_fwd(inp: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], eps: float,
                      normalization: str, zero_centered_gamma: bool, key: str, columnwise: bool
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """The norm plus its output quantized for the following GEMM (rowwise, and columnwise for
    wgrad): the buffers `te_proto::linear_fwd` takes as `inp_quantized`. One op, so a fused kernel
    can write both from one read of the input. With `columnwise` the rows are zero-padded to the
    recipe's row block, as linear_fwd expects (custom_ops/row_padding.py)."""
    q = _input_quantizer(key, columnwise)
    with recomputed_in_backward(columnwise and recompute_saved_input()):  # saved columnwise: rebuilt instead
        # the format's own kernel
        fused = q.fused_norm_quantize(inp, weight, bias, eps, normalization, zero_centered_gamma)
        if fused is not None:
            return fused
        out, mu, rsigma = kernel("norm_fwd", inp.device)(inp, weight, bias, eps, normalization, zero_centered_gamma)
        out2d = out.reshape(-1, out.shape[-1])
        out2d = pad_rows(out2d, gemm_rows(out2d.shape[0], key, columnwise))
        return out, mu, rsigma, list(q.quantize(out2d, internal=True).get_buffers().values())


def norm_fp8_current(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool, q):
    """The FP8 current-scaling fused norm + quantize (`tensor/float8.py`), for its tests."""
    from ..tensor.float8 import norm_quantize_current

    return norm_quantize_current(q, inp, weight, bias, eps, normalization, zero_centered_gamma)


def _input_quantizer(key: str, columnwise: bool):
    from .recipe_key import RecipeKey

    q = RecipeKey.quantizers(key).input
    if q is None or q.has_scale_state():
        raise ValueError("norm_quantize_fwd needs a recipe whose input quantizer is stateless "
                         "(not high precision, not DelayedScaling)")
    return q.with_usage(rowwise=True, columnwise=columnwise)


@norm_quantize_fwd.register_fake
def _norm_quantize_fwd_fake(inp, weight, bias, eps, normalization, zero_centered_gamma, key, columnwise):
    from ..tensor import TensorProto

    out, mu, rsigma = _norm_fwd_fake(inp, weight, bias, eps, normalization, zero_centered_gamma)
    m = gemm_rows(inp.numel() // inp.shape[-1], key, columnwise)
    proto = TensorProto((m, inp.shape[-1]), inp.dtype, _input_quantizer(key, columnwise), device=inp.device)
    return out, mu, rsigma, list(proto.create_buffers().values())


def _setup_quantize_context(ctx, inputs, output):
    _setup_context(ctx, inputs[:6], output[:3])


def _quantize_backward(ctx, grad_out, grad_mu, grad_rsigma, _grad_buffers):
    return _backward(ctx, grad_out, grad_mu, grad_rsigma) + (None, None)


norm_quantize_fwd.register_autograd(_quantize_backward, setup_context=_setup_quantize_context)
inline_in_inductor(torch.ops.te_proto.norm_quantize_fwd.default, norm_quantize_fwd._init_fn)
_norm_quantize_fwd_call = eager_function(norm_quantize_fwd, _setup_quantize_context, _quantize_backward,
                                         norm_bwd._init_fn, non_differentiable=(1, 2))


def norm_quantize(inp, weight, bias, eps: float, normalization: str, zero_centered_gamma: bool, key: str,
                  columnwise: bool):
    """(normalized output, its quantized buffers) -- see `norm_quantize_fwd`."""
    out, _, _, buffers = _norm_quantize_fwd_call(inp, weight, bias, float(eps), normalization, zero_centered_gamma,
                                                 key, columnwise)
    return out, buffers
