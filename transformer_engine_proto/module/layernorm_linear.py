"""`LayerNormLinear`: normalization followed by a quantized Linear (TE's fused module)."""
from __future__ import annotations

from typing import Optional

import torch

from .gemm_state import QuantizedGemm
from .quantized_params import quantize_new_weights
from .linear import ParallelLinearMixin, init_parallel_linear
from .normalization import NormFusedModule, NormParams

__all__ = ["LayerNormLinear"]


class LayerNormLinear(ParallelLinearMixin, NormFusedModule):
    """Drop-in for `transformer_engine.pytorch.LayerNormLinear`.

    Tensor parallelism (TE's arguments, as `Linear`; `in_features` / `out_features` are full sizes):
      * `parallel_mode="column"` (QKV, fc1): the norm runs on the full hidden size, the weight
        shard is [out/tp_size, in]. Without `sequence_parallel` the norm output enters the TP
        region (identity forward, gradient all-reduced before the norm's backward, so the norm's
        parameter grads are complete and replicated). With `sequence_parallel` the input is this
        rank's dim-0 (sequence) shard: the norm runs on the shard, its output shard is
        all-gathered before the GEMM (norm -> quantize the shard -> all-gather the bytes -> GEMM
        where the recipe allows, else a high-precision gather; `distributed/sp_gather.py`),
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
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        init_parallel_linear(self, in_features, out_features, bias, tp_group, tp_size, parallel_mode,
                             sequence_parallel, dtype, device, init_method)
        self.norm = NormParams(self._local_in, normalization, eps, zero_centered_gamma, dtype, device)
        if self.sequence_parallel and parallel_mode == "column":
            # the norm sees this rank's tokens only: its grads are partial (all-reduced by the loop)
            for p in self.norm.parameters():
                p.sequence_parallel = True
        self.gemm = QuantizedGemm(device)
        quantize_new_weights(self)  # inside quantized_model_init: weights stored quantized

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check_input(inp, self._local_in)
        group, row, bias = self._tp_plan()
        column = group if self.parallel_mode == "column" else None
        ln_out, gemm_in, ln_q, seq = self._norm_into_gemm(inp, self.gemm, self.weight, column)
        out = self.gemm(gemm_in, self.weight, bias, is_first_microbatch=is_first_microbatch,
                        fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, inp_quantized=ln_q,
                        sequence_gather=seq)
        out = self._reduce_row_output(out, group, row)
        return self._pack_outputs(out, self.bias, ln_out)
