"""`Linear`: TE's quantized linear layer (y = x W^T + b) on the `te_proto` custom ops."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from .base import TransformerEngineBaseModule
from .gemm_state import QuantizedGemm

__all__ = ["Linear"]


def _init_weight(weight: torch.Tensor, init_method: Optional[Callable]) -> None:
    if init_method is not None:
        init_method(weight)
    else:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


class Linear(TransformerEngineBaseModule):
    """Drop-in for `transformer_engine.pytorch.Linear` (single GPU arguments)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 fuse_wgrad_accumulation: bool = False, save_original_input: bool = False,
                 return_bias: bool = False, name: Optional[str] = None, **unsupported):
        super().__init__(name)
        if unsupported:
            raise TypeError(f"Linear: unsupported arguments {sorted(unsupported)}")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: features must be positive, got ({in_features}, {out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self.return_bias = return_bias
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        _init_weight(self.weight, init_method)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.gemm = QuantizedGemm(device)

    def _gemms(self):
        return [(self.gemm, self.weight)]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check_input(inp, self.in_features)
        bias = None if self.return_bias else self.bias
        out = self.gemm(inp, self.weight, bias, is_first_microbatch=is_first_microbatch,
                        save_original_input=self.save_original_input,
                        fuse_wgrad_accumulation=self.fuse_wgrad_accumulation)
        if self.return_bias:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, name={self.name!r}"
