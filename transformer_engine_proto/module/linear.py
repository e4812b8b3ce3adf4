"""`Linear`: TE's quantized linear layer (y = x W^T + b) on the `te_proto` custom ops."""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from ..capabilities import default_device
from ..distributed import tp as _tp
from .base import TransformerEngineBaseModule
from .fp8_state import FP8StateCheckpoint
from .quantized_gemm import QuantizedGemm
from .quantized_params import quantize_new_weights

__all__ = ["Linear"]


def _init_weight(weight: torch.Tensor, init_method: Optional[Callable]) -> None:
    if init_method is not None:
        init_method(weight)
    else:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def init_parallel_linear(module, in_features, out_features, bias, tp_group, tp_size, parallel_mode,
                         sequence_parallel, dtype, device, init_method, before_params=None) -> None:
    """Validate the TP arguments and create this rank's weight/bias shards on `module` (sets
    tp_size, _tp_group_name, parallel_mode, sequence_parallel, _local_in, weight, bias).
    `before_params()` runs once `_local_in` is known, before the weight is registered (parameters
    that TE registers first)."""
    module.tp_size, module._tp_group_name = _tp.resolve_tp(
        module.name, in_features, out_features, tp_group, tp_size, parallel_mode, sequence_parallel)
    module.parallel_mode = parallel_mode
    module.sequence_parallel = bool(sequence_parallel) and module.tp_size > 1
    local_out = out_features // module.tp_size if parallel_mode == "column" else out_features
    module._local_in = in_features // module.tp_size if parallel_mode == "row" else in_features
    if before_params is not None:
        before_params()
    device = default_device(device)
    module.weight = nn.Parameter(torch.empty(local_out, module._local_in, dtype=dtype, device=device))
    _init_weight(module.weight, init_method)
    module.bias = nn.Parameter(torch.zeros(local_out, dtype=dtype, device=device)) if bias else None
    if module.bias is not None and module.sequence_parallel and parallel_mode == "row":
        # as TE / Megatron: added to this rank's tokens only, so its grad is partial and the
        # training loop all-reduces the grads of parameters marked `sequence_parallel`
        module.bias.sequence_parallel = True


class ParallelLinearMixin:
    """What Linear and LayerNormLinear share: one GEMM (`self.gemm`) on the weight shard that
    `init_parallel_linear` made; a row parallel output is reduced, then the bias added once."""

    def gemm_weights(self):
        return [(self.gemm, self.weight)]

    def _tp_plan(self):
        """(TP group name or None when nothing is communicated, row parallel?, bias the GEMM adds)."""
        group = self._tp_group_name if self.parallel_mode is not None and self.tp_size > 1 else None
        row = self.parallel_mode == "row" and group is not None
        return group, row, None if (self.return_bias or row) else self.bias

    def _reduce_row_output(self, out, group, row: bool):
        if not row:
            return out
        return _tp.reduce_row_parallel_output(out, group, self.tp_size, self.sequence_parallel,
                                              None if self.return_bias else self.bias)


class Linear(FP8StateCheckpoint, ParallelLinearMixin, TransformerEngineBaseModule):
    """Drop-in for `transformer_engine.pytorch.Linear`.

    Tensor parallelism (TE's arguments): `parallel_mode="column"` keeps the [out/tp_size, in] weight
    shard and returns the local output shard; `"row"` keeps the [out, in/tp_size] shard, takes the
    local shard of the input's last dim and all-reduces (sums) the output over `tp_group`, adding
    the bias once after the reduction. `sequence_parallel=True` additionally shards dim 0 of the
    column-parallel input (all-gathered) and of the row-parallel output (reduce-scattered).
    `in_features` / `out_features` are the full sizes.

    The GEMMs run in the format of the active `autocast` recipe, in the parameters' precision
    outside one.

    Parameters
    ----------
    in_features : int
        Size of the input's last dimension (the full size under tensor parallelism).
    out_features : int
        Size of the output's last dimension (the full size).
    bias : bool, default = True
        Learn an additive bias, initialized to zero.
    params_dtype : torch.dtype, default = None
        dtype of the weight and bias; None is `torch.get_default_dtype()`.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    init_method : Callable, default = None
        Called as `init_method(weight)`. None is `nn.Linear`'s Kaiming-uniform init (TE's: a
        normal with std 0.023).
    fuse_wgrad_accumulation : bool, default = False
        Add the weight gradient into `weight.main_grad`, an fp32 buffer the caller sets (forward
        raises a RuntimeError without it), instead of producing `weight.grad`. Not with FSDP2's
        quantized all-gather (`enable_quantized_all_gather` raises).
    save_original_input : bool, default = False
        Save the high-precision input for backward instead of its quantized copy; backward
        quantizes it again for wgrad.
    return_bias : bool, default = False
        Leave the bias out of the output and return `(out, bias)`, so the caller can fuse the add.
    name : str, default = None
        The layer's name in the debug tools' configs; None gives `linear_<n>`.
    tp_group : torch.distributed.ProcessGroup, default = None
        The tensor-parallel group. None with `tp_size > 1` uses the default process group, whose
        size must then be `tp_size`.
    tp_size : int, default = None
        The tensor-parallel size; None is the size of `tp_group`, or 1 without one.
    parallel_mode : {None, "column", "row"}, default = None
        How the weight is split over `tp_group` (above); None: not split, no communication.
    sequence_parallel : bool, default = False
        Shard dim 0 of the input / output too (above); needs `parallel_mode` when `tp_size > 1`.

    Other keywords of TE's (`parameters_split`, `ub_*`, `get_rng_state_tracker`, ...) are a
    `TypeError`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 fuse_wgrad_accumulation: bool = False, save_original_input: bool = False,
                 return_bias: bool = False, name: Optional[str] = None,
                 tp_group=None, tp_size: Optional[int] = None, parallel_mode: Optional[str] = None,
                 sequence_parallel: bool = False, **unsupported):
        super().__init__(name)
        if unsupported:
            raise TypeError(f"Linear: unsupported arguments {sorted(unsupported)}")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: features must be positive, got ({in_features}, {out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self.return_bias = return_bias
        init_parallel_linear(self, in_features, out_features, bias, tp_group, tp_size, parallel_mode,
                             sequence_parallel, params_dtype or torch.get_default_dtype(), device, init_method)
        self.gemm = QuantizedGemm(device)
        quantize_new_weights(self)  # inside quantized_model_init: weights stored quantized

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """y = x W^T + b; `out`, or `(out, bias)` with `return_bias`.

        Parameters
        ----------
        inp : torch.Tensor
            [..., in_features] (row parallel: this rank's `in_features / tp_size`), float32,
            bfloat16 or float16.
        is_first_microbatch : {None, True, False}, default = None
            Weight caching over gradient-accumulation micro-batches: True quantizes the weight and
            keeps the copy, False reuses it (the weight must not have changed since), None
            quantizes on every call. Ignored without a recipe. Under torch.compile run one
            micro-batch eagerly first (the cache is allocated eagerly); a `ValueError` with a
            weight stored quantized (`quantized_model_init`, FSDP2 quantized all-gather).
        """
        self._check_input(inp, self._local_in)
        group, row, bias = self._tp_plan()
        sequence_gather = None  # column + SP: the GEMM all-gathers the shard (quantized where it can)
        if group is not None and self.parallel_mode == "column":
            if self.sequence_parallel:
                sequence_gather = (group, self.tp_size)
            else:
                inp = _tp.copy_to_tp_region(inp, group)
        out = self.gemm(inp, self.weight, bias, is_first_microbatch=is_first_microbatch,
                        save_original_input=self.save_original_input,
                        fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, sequence_gather=sequence_gather)
        out = self._reduce_row_output(out, group, row)
        if self.return_bias:
            return out, self.bias
        return out

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.parallel_mode!r}, tp_size={self.tp_size}" if self.parallel_mode else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"name={self.name!r}{tp}")
