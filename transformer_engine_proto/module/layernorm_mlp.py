"""`LayerNormMLP`: norm -> fc1 -> activation -> fc2, both GEMMs quantized (TE's fused MLP)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .gemm_state import QuantizedGemm
from .linear import _init_weight
from .normalization import NormFusedModule, NormParams

__all__ = ["LayerNormMLP", "ACTIVATIONS"]


def _glu(act):
    def glu(x):
        a, b = x.chunk(2, dim=-1)
        return act(a) * b

    return glu


def _gelu(x):
    return F.gelu(x, approximate="tanh")


# name -> (function, fc1 width multiplier); gated activations take both halves of fc1's output
ACTIVATIONS = {
    "gelu": (_gelu, 1),
    "relu": (F.relu, 1),
    "silu": (F.silu, 1),
    "swiglu": (_glu(F.silu), 2),
    "geglu": (_glu(_gelu), 2),
    "reglu": (_glu(F.relu), 2),
}


class LayerNormMLP(NormFusedModule):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", activation: str = "gelu",
                 return_layernorm_output: bool = False, zero_centered_gamma: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, name: Optional[str] = None):
        super().__init__(name)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        fc1_out = ffn_hidden_size * ACTIVATIONS[activation][1]
        self.norm = NormParams(hidden_size, normalization, eps, zero_centered_gamma, dtype, device)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, dtype=dtype, device=device))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_hidden_size, dtype=dtype, device=device))
        _init_weight(self.fc1_weight, init_method)
        _init_weight(self.fc2_weight, output_layer_init_method or init_method)
        self.fc1_bias = nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device)) if bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        self.fc1 = QuantizedGemm(device)
        self.fc2 = QuantizedGemm(device)

    def _gemms(self):
        return [(self.fc1, self.fc1_weight), (self.fc2, self.fc2_weight)]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check_input(inp, self.hidden_size)
        ln_out, ln_q = self.norm.forward_quantized(inp, self.fc1.wants_quantized_input(self.fc1_weight))
        kw = dict(is_first_microbatch=is_first_microbatch, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation)
        h = self.fc1(ln_out, self.fc1_weight, self.fc1_bias, inp_quantized=ln_q, **kw)
        h = ACTIVATIONS[self.activation][0](h)
        fc2_bias = None if self.return_bias else self.fc2_bias
        out = self.fc2(h, self.fc2_weight, fc2_bias, **kw)
        return self._pack_outputs(out, self.fc2_bias, ln_out)
