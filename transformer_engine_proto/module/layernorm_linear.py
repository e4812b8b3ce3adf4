"""`LayerNormLinear`: normalization followed by a quantized Linear (TE's fused module)."""
from __future__ import annotations

from typing import Optional

import torch

from .linear import ParallelLinearMixin, check_split_args, init_parallel_linear
from .normalization import NormFusedModule
from .quantized_gemm import QuantizedGemm
from .quantized_params import quantize_new_weights

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

    With a stateless recipe (any but delayed scaling) the norm and the quantize of its output run
    as one op, so the GEMM's input is not read again to be quantized.

    Parameters in TE's names and order: `layer_norm_weight`, `layer_norm_bias` (None for
    RMSNorm), `weight`, `bias` (with `parameters_split`: `<name>_weight`s, then `<name>_bias`es).

    Parameters
    ----------
    in_features : int
        Size of the input's last dimension, which the norm normalizes (the full size).
    out_features : int
        Size of the output's last dimension (the full size).
    eps : float, default = 1e-5
        Added to the variance (mean square for RMSNorm) for numerical stability.
    bias : bool, default = True
        Learn an additive bias for the GEMM, initialized to zero.
    normalization : {"LayerNorm", "RMSNorm"}, default = "LayerNorm"
        The norm; RMSNorm has no bias (`layer_norm_bias` is None).
    return_layernorm_output : bool, default = False
        Also return the norm's output (last in the returned tuple), e.g. for a residual taken
        after the norm.
    zero_centered_gamma : bool, default = False
        Initialize gamma to zero and scale by `1 + gamma` (TE's formulation).
    params_dtype : torch.dtype, default = None
        dtype of all parameters; None is `torch.get_default_dtype()`.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    init_method : Callable, default = None
        Called as `init_method(weight)` on the GEMM weight. None is `nn.Linear`'s Kaiming-uniform
        init (TE's: a normal with std 0.023). The norm starts at gamma = 1 (0 when zero-centered),
        beta = 0.
    fuse_wgrad_accumulation : bool, default = False
        Add the weight gradient into `weight.main_grad` (an fp32 buffer the caller sets; forward
        raises a RuntimeError without it) instead of producing `weight.grad`; sets
        `weight.grad_added_to_main_grad`, where present, as `Linear`.
    return_bias : bool, default = False
        Leave the bias out of the output and return it after the output, so the caller can fuse
        the add.
    name : str, default = None
        The layer's name in the debug tools' configs; None gives `layernorm_linear_<n>`.
    tp_group : torch.distributed.ProcessGroup, default = None
        The tensor-parallel group, as `Linear`'s.
    tp_size : int, default = None
        The tensor-parallel size; None is the size of `tp_group`, or 1 without one.
    parallel_mode : {None, "column", "row"}, default = None
        How the weight is split over `tp_group` (above); None: not split, no communication.
    sequence_parallel : bool, default = False
        Shard dim 0 of the input / output too (above).
    parameters_split : dict or tuple of str, default = None
        Separate parameters for parts of the output rows (`query_weight`, ...), as `Linear`'s.
    delay_wgrad_compute : bool, default = False
        The GEMM's weight (and, unquantized, bias) gradient waits for `backward_dw()`, as
        `Linear`'s; the norm's gradients are computed in backward.

    TE's other keywords (`return_layernorm_output_gathered`, `ub_*`, ...) are a `TypeError`.
    """

    def __init__(self, in_features: int, out_features: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", return_layernorm_output: bool = False,
                 zero_centered_gamma: bool = False, params_dtype: Optional[torch.dtype] = None,
                 device=None, init_method=None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, name: Optional[str] = None,
                 tp_group=None, tp_size: Optional[int] = None, parallel_mode: Optional[str] = None,
                 sequence_parallel: bool = False, parameters_split=None, delay_wgrad_compute: bool = False):
        super().__init__(name)
        dtype = params_dtype or torch.get_default_dtype()
        self.in_features, self.out_features = in_features, out_features
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation

        def norm_first():  # TE's order: layer_norm_weight, layer_norm_bias, weight, bias
            self._init_norm(self._local_in, normalization, eps, zero_centered_gamma, dtype, device)

        check_split_args(self.name, parameters_split, fuse_wgrad_accumulation)
        init_parallel_linear(self, in_features, out_features, bias, tp_group, tp_size, parallel_mode,
                             sequence_parallel, dtype, device, init_method, before_params=norm_first,
                             parameters_split=parameters_split)
        if self.sequence_parallel and parallel_mode == "column":
            # the norm sees this rank's tokens only: its grads are partial (all-reduced by the loop)
            for p in self._norm_params():
                p.sequence_parallel = True
        self.gemm = QuantizedGemm(device)
        quantize_new_weights(self)  # inside quantized_model_init: weights stored quantized
        self._init_delay_wgrad(delay_wgrad_compute)

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """norm(x) W^T + b; `out`, then the bias with `return_bias`, then the norm output with
        `return_layernorm_output` (a tuple when more than `out`).

        Parameters
        ----------
        inp : torch.Tensor
            [..., in_features] (row parallel: `in_features / tp_size`; column parallel with
            `sequence_parallel`: this rank's dim-0 shard), float32, bfloat16 or float16.
        is_first_microbatch : {None, True, False}, default = None
            Weight caching over gradient-accumulation micro-batches, as in `Linear.forward`.
        """
        self._check_input(inp, self._local_in)
        self._check_gemm_module()
        weight, bias = self.gemm_params()
        group, row, gemm_bias = self._tp_plan(bias)
        column = group if group is not None and self.parallel_mode == "column" else None
        gemm = self.gemm
        ln_out, gemm_in, ln_q, seq = self._norm_into_gemm(inp, gemm, weight, column)
        out = gemm.forward(gemm_in, weight, gemm_bias, is_first_microbatch=is_first_microbatch,
                           fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, inp_quantized=ln_q,
                           sequence_gather=seq)
        if row:
            out = self._reduce_row_output(out, group, bias)
        return self._pack_outputs(out, bias, ln_out)
