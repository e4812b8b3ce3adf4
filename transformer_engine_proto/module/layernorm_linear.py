"""`LayerNormLinear`: normalization followed by a quantized Linear (TE's fused module)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..distributed import tp as _tp
from .gemm_state import QuantizedGemm
from .linear import _init_weight
from .normalization import NormFusedModule, NormParams

__all__ = ["LayerNormLinear"]


class LayerNormLinear(NormFusedModule):
    """Drop-in for `transformer_engine.pytorch.LayerNormLinear`.

    Tensor parallelism (TE's arguments, as `Linear`; `in_features` / `out_features` are full sizes):
      * `parallel_mode="column"` (QKV, fc1): the norm runs on the full hidden size, the weight
        shard is [out/tp_size, in]. Without `sequence_parallel` the norm output enters the TP
        region (identity forward, gradient all-reduced before the norm's backward, so the norm's
        parameter grads are complete and replicated). With `sequence_parallel` the input is this
        rank's dim-0 (sequence) shard: the norm runs on the shard, its output is all-gathered
        before the GEMM (the fused norm + quantize path is skipped: norm -> all-gather -> GEMM),
        and the norm's parameter grads are partial (marked `sequence_parallel`, to be all-reduced
        by the training loop as in Megatron / TE).
      * `parallel_mode="row"`: as TE, the input is the local shard of the last dim and the norm
        (over `in_features / tp_size`) runs on that shard; the output is all-reduced (or
        reduce-scattered along dim 0 with `sequence_parallel`) and the bias added once after.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device=None, init_method=None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, name: Optional[str] = None,
                 tp_group=None, tp_size: Optional[int] = None, parallel_mode: Optional[str] = None,
                 sequence_parallel: bool = False):
        super().__init__(name)
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.tp_size, self._tp_group_name = _tp.resolve_tp(
            self.name, in_features, out_features, tp_group, tp_size, parallel_mode, sequence_parallel)
        self.parallel_mode = parallel_mode
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1
        local_out = out_features // self.tp_size if parallel_mode == "column" else out_features
        local_in = in_features // self.tp_size if parallel_mode == "row" else in_features
        self._local_in = local_in
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.norm = NormParams(local_in, normalization, eps, zero_centered_gamma, dtype, device)
        self.weight = nn.Parameter(torch.empty(local_out, local_in, dtype=dtype, device=device))
        _init_weight(self.weight, init_method)
        self.bias = nn.Parameter(torch.zeros(local_out, dtype=dtype, device=device)) if bias else None
        if self.sequence_parallel and parallel_mode == "column":
            # the norm sees this rank's tokens only: its grads are partial (all-reduced by the loop)
            for p in self.norm.parameters():
                p.sequence_parallel = True
        if self.sequence_parallel and parallel_mode == "row" and self.bias is not None:
            self.bias.sequence_parallel = True  # added to this rank's output tokens only
        self.gemm = QuantizedGemm(device)

    @property
    def tp_group(self):
        return None if self._tp_group_name is None else _tp._group(self._tp_group_name)

    def _gemms(self):
        return [(self.gemm, self.weight)]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check_input(inp, self._local_in)
        group = self._tp_group_name if self.parallel_mode is not None and self.tp_size > 1 else None
        row = self.parallel_mode == "row" and group is not None
        gather = group is not None and self.parallel_mode == "column" and self.sequence_parallel
        if gather:
            # norm -> all-gather -> GEMM: the fused quantized input would be of the local shard only
            ln_out, ln_q = self.norm(inp), ()
            gemm_in = _tp.all_gather_first_dim(ln_out, group, self.tp_size)
        else:
            ln_out, ln_q = self.norm.forward_quantized(inp, self.gemm.wants_quantized_input(self.weight))
            gemm_in = ln_out
            if group is not None and self.parallel_mode == "column":
                # identity forward (the quantized buffers stay valid); backward all-reduces dgrad
                gemm_in = _tp.copy_to_tp_region(ln_out, group)
        bias = None if (self.return_bias or row) else self.bias
        out = self.gemm(gemm_in, self.weight, bias, is_first_microbatch=is_first_microbatch,
                        fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, inp_quantized=ln_q)
        if row:
            if self.sequence_parallel:
                out = _tp.reduce_scatter_first_dim(out, group, self.tp_size)
            else:
                out = _tp.all_reduce_sum(out, group)
            if self.bias is not None and not self.return_bias:
                out = out + self.bias
        return self._pack_outputs(out, self.bias, ln_out)
