"""`GroupedLinear`: TE's grouped-GEMM operation, y_i = x_i W_i^T + b_i on consecutive row groups.

It is `te.GroupedLinear` (module/grouped_linear.py) with TE's operation arguments and calling
convention: the split sizes are the extra input, `op(x, split_sizes)`, so a `Sequential` of it,
an activation and another `GroupedLinear` is an MoE expert MLP. Every recipe runs per group, as in
the module; parameters are TE's `weight0..`, `bias0..` (or its single grouped `weight` / `bias`).
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from ..module.grouped_linear import GroupedLinear as _GroupedLinearModule
from .linear import param_dtype
from .op import BasicOperation

__all__ = ["GroupedLinear"]


class GroupedLinear(_GroupedLinearModule, BasicOperation):
    """`num_groups` linear maps, each on its own consecutive rows of the input, TE's
    `ops.GroupedLinear`: the input split along dim 0 by `split_sizes`, each split times its
    weight (plus its bias), the results concatenated.

    Parameters
    ----------
    num_groups : int
        Number of linear maps (experts).
    in_features : int
        Size of the input's last dimension.
    out_features : int
        Size of the output's last dimension.
    bias : bool, default = True
        A bias per group (`bias0..`), initialized to zero.
    device : torch.device or str, default = None
        None: CUDA when available (a default device the user set wins), else the CPU.
    dtype : torch.dtype, default = None
        The parameters' dtype (float32, float16 or bfloat16); None is torch's default.
    rng_state_tracker_function : Callable, default = None
        Only None (`NotImplementedError`): no model-parallel initialization here.
    accumulate_into_main_grad : bool, default = False
        Add each group's weight gradient into `weight{i}.main_grad` (an fp32 buffer the caller
        sets) instead of producing `.grad`.
    single_grouped_weight, single_grouped_bias : bool, default = False
        TE's experimental single grouped parameters, `weight` [num_groups, out, in] / `bias`
        [num_groups, out], as the module's (honoured with NVTE_GROUPED_LINEAR_SINGLE_PARAM=1,
        as in TE); `accumulate_into_main_grad` then reads `weight.main_grad`.
    delay_wgrad_compute : bool, default = False
        The weight (and, unquantized, bias) gradients wait for `backward_dw()`, as in
        `te.GroupedLinear`; eager only.
    scale_bias : bool, default = False
        TE's bias times per-row probabilities (a second extra input): only False
        (`NotImplementedError`).
    """

    num_extra_inputs = 1

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True, device=None,
                 dtype: Optional[torch.dtype] = None, rng_state_tracker_function=None,
                 accumulate_into_main_grad: bool = False, single_grouped_weight: bool = False,
                 single_grouped_bias: bool = False, delay_wgrad_compute: bool = False, scale_bias: bool = False
                 ) -> None:
        refused = [name for name, value in (("rng_state_tracker_function", rng_state_tracker_function),
                                            ("scale_bias", scale_bias and bias)) if value]
        if refused:
            raise NotImplementedError(f"te.ops.GroupedLinear: {', '.join(refused)} is not supported (leave the "
                                      "default)")
        super().__init__(num_groups, in_features, out_features, bias=bias,
                         params_dtype=param_dtype("te.ops.GroupedLinear", dtype), device=device,
                         fuse_wgrad_accumulation=accumulate_into_main_grad, delay_wgrad_compute=delay_wgrad_compute,
                         single_grouped_weight=single_grouped_weight, single_grouped_bias=single_grouped_bias)

    @property
    def num_groups(self) -> int:
        """TE's name for the module's `num_gemms`."""
        return self.num_gemms

    def forward(self, input: torch.Tensor, split_sizes: Union[Sequence[int], torch.Tensor]  # noqa: A002
                ) -> torch.Tensor:
        """The grouped product, [tokens, out_features].

        Parameters
        ----------
        input : torch.Tensor
            [tokens, in_features], the rows of group i after those of groups 0..i-1.
        split_sizes : torch.Tensor or list of int
            `num_groups` row counts summing to `tokens` (a 1-D integer tensor, as TE passes it,
            or a list); a wrong count or sum is a `ValueError`.
        """
        return super().forward(input, split_sizes)
