"""`LayerNormLinear`: normalization followed by a quantized Linear (TE's fused module)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .gemm_state import QuantizedGemm
from .linear import _init_weight
from .normalization import NormFusedModule, NormParams

__all__ = ["LayerNormLinear"]


class LayerNormLinear(NormFusedModule):
    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device=None, init_method=None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, name: Optional[str] = None):
        super().__init__(name)
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.norm = NormParams(in_features, normalization, eps, zero_centered_gamma, dtype, device)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        _init_weight(self.weight, init_method)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.gemm = QuantizedGemm(device)

    def _gemms(self):
        return [(self.gemm, self.weight)]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check_input(inp, self.in_features)
        ln_out, ln_q = self.norm.forward_quantized(inp, self.gemm.wants_quantized_input(self.weight))
        bias = None if self.return_bias else self.bias
        out = self.gemm(ln_out, self.weight, bias, is_first_microbatch=is_first_microbatch,
                        fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, inp_quantized=ln_q)
        return self._pack_outputs(out, self.bias, ln_out)
