"""`Linear`: TE's quantized linear layer (y = x W^T + b) on the `te_proto` custom ops."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

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


def _split_sizes(owner: str, out_features: int, parameters_split) -> Tuple[List[str], List[int]]:
    """TE's `parameters_split`: (parameter name stems, output rows of each); one `weight` / `bias`
    for None."""
    if parameters_split is None:
        return [""], [out_features]
    if isinstance(parameters_split, dict):
        names, sizes = list(parameters_split), list(parameters_split.values())
    elif isinstance(parameters_split, (tuple, list)) and all(isinstance(n, str) for n in parameters_split):
        names = list(parameters_split)
        sizes = [out_features // max(len(names), 1)] * len(names)
    else:
        raise TypeError(f"{owner}: parameters_split must be None, a dict of name -> rows or a tuple of names, "
                        f"got {parameters_split!r}")
    if not names:
        raise ValueError(f"{owner}: parameters_split cannot split the weight into 0 parameters")
    if sum(sizes) != out_features:
        raise ValueError(f"{owner}: parameters_split sizes {sizes} do not add up to out_features={out_features}")
    return [n.rstrip("_") + "_" for n in names], sizes


def check_split_args(owner: str, parameters_split, fuse_wgrad_accumulation: bool) -> None:
    """The GEMM accumulates its wgrad into one weight's `main_grad`: split parameters have none."""
    if parameters_split is not None and fuse_wgrad_accumulation:
        raise ValueError(f"{owner}: fuse_wgrad_accumulation=True needs one weight parameter, not parameters_split "
                         f"{parameters_split!r} (attention: fuse_qkv_params=True)")


def init_parallel_linear(module, in_features, out_features, bias, tp_group, tp_size, parallel_mode,
                         sequence_parallel, dtype, device, init_method, before_params=None,
                         parameters_split=None) -> None:
    """Validate the TP arguments and create this rank's weight/bias shards on `module` (sets
    tp_size, _tp_group_name, parallel_mode, sequence_parallel, _local_in, weight_names,
    bias_names and the parameters). `before_params()` runs once `_local_in` is known, before the
    weight is registered (parameters that TE registers first).

    With `parameters_split` the rows are TE's separate parameters `<name>_weight` /
    `<name>_bias` (views of one buffer, each initialized on its own, as TE's; column parallel:
    each the rank's shard of its part), concatenated for the GEMM by `gemm_weight()`."""
    module.tp_size, module._tp_group_name = _tp.resolve_tp(
        module.name, in_features, out_features, tp_group, tp_size, parallel_mode, sequence_parallel)
    module.parallel_mode = parallel_mode
    module.sequence_parallel = bool(sequence_parallel) and module.tp_size > 1
    module._local_in = in_features // module.tp_size if parallel_mode == "row" else in_features
    stems, sizes = _split_sizes(module.name, out_features, parameters_split)
    if parallel_mode == "column":
        if any(size % module.tp_size for size in sizes):
            raise ValueError(f"{module.name}: parameters_split sizes {sizes} are not divisible by "
                             f"tp_size={module.tp_size} (column parallel shards each part)")
        sizes = [size // module.tp_size for size in sizes]
    if before_params is not None:
        before_params()
    device = default_device(device)
    module.weight_names = [f"{stem}weight" for stem in stems]
    module.plain_params = stems == [""]  # the parameters are `weight` and `bias`
    module.bias_names = [f"{stem}bias" for stem in stems]
    weights = torch.empty(sum(sizes), module._local_in, dtype=dtype, device=device)
    biases = torch.zeros(sum(sizes), dtype=dtype, device=device) if bias else None
    if len(sizes) > 1:
        weights, biases = weights.split(sizes), biases.split(sizes) if bias else [None] * len(sizes)
    else:
        weights, biases = [weights], [biases]
    for name, w in zip(module.weight_names, weights):  # TE's order: every weight, then every bias
        setattr(module, name, nn.Parameter(w))
        _init_weight(getattr(module, name), init_method)
    for name, b in zip(module.bias_names, biases):
        setattr(module, name, nn.Parameter(b) if bias else None)
        if bias and module.sequence_parallel and parallel_mode == "row":
            # as TE / Megatron: added to this rank's tokens only, so its grad is partial and the
            # training loop all-reduces the grads of parameters marked `sequence_parallel`
            getattr(module, name).sequence_parallel = True
    module.parameter_split_sizes = sizes


class ParallelLinearMixin:
    """What Linear and LayerNormLinear share: one GEMM (`self.gemm`) on the weight shard that
    `init_parallel_linear` made; a row parallel output is reduced, then the bias added once."""

    def gemm_weights(self):
        return [(self.gemm, self.gemm_weight())]

    def _wgrad_queues(self):
        return [(self.gemm.pending_wgrads, self.weight_names, self.bias_names)]

    plain_params = False  # set by init_parallel_linear (False: the general path, for any module)

    def gemm_params(self) -> tuple:
        """(the GEMM's weight, its bias or None): `weight` / `bias`, or TE's split parameters
        concatenated (`parameters_split`)."""
        if self.plain_params:  # one read per parameter: dynamo traces this on every call
            return self.weight, self.bias
        return self.gemm_weight(), self.gemm_bias()

    def gemm_weight(self) -> torch.Tensor:
        """The GEMM's weight: the parameter, or the split parameters concatenated."""
        if len(self.weight_names) == 1:
            return getattr(self, self.weight_names[0])
        return torch.cat([getattr(self, n) for n in self.weight_names])

    def gemm_weight_shapes(self) -> tuple:
        names = self.weight_names
        if len(names) == 1:  # no list or generator: dynamo traces this on every call
            return (tuple(getattr(self, names[0]).shape),)
        parts = [getattr(self, n).shape for n in names]
        return ((sum(p[0] for p in parts), parts[0][1]),)

    def gemm_bias(self) -> Optional[torch.Tensor]:
        """The bias (None without one), the split parameters concatenated."""
        if len(self.bias_names) == 1 or getattr(self, self.bias_names[0]) is None:
            return getattr(self, self.bias_names[0])
        return torch.cat([getattr(self, n) for n in self.bias_names])

    def _tp_plan(self, bias):
        """(TP group name or None when nothing is communicated, row parallel?, bias the GEMM adds)."""
        if self.parallel_mode is None:  # the common case first: one attribute read for dynamo to trace
            return None, False, None if self.return_bias else bias
        group = self._tp_group_name if self.tp_size > 1 else None
        row = self.parallel_mode == "row" and group is not None
        return group, row, None if (self.return_bias or row) else bias

    def _reduce_row_output(self, out, group, bias):
        """A row-parallel output summed over the group (the bias added once, after the sum)."""
        return _tp.reduce_row_parallel_output(out, group, self.tp_size, self.sequence_parallel,
                                              None if self.return_bias else bias)


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
        raises a RuntimeError without it), instead of producing `weight.grad`; a
        `weight.grad_added_to_main_grad` attribute (Megatron-LM's) is set to True once backward has
        added into it, as TE does. Not with FSDP2's quantized all-gather
        (`enable_quantized_all_gather` raises).
    save_original_input : bool, default = False
        Save the high-precision input for backward instead of its quantized copy; backward
        quantizes it again for wgrad.
    delay_wgrad_compute : bool, default = False
        Backward computes no weight gradient: `backward_dw()` computes it later (once per
        backward, oldest first), bit for bit the one backward would have given, then runs the
        hooks of `register_wgrad_accumulation_and_reduce_hooks`. Where the gradient is not
        quantized the bias gradient waits for it too, as in TE. Eager only: under torch.compile
        a `RuntimeError`; not with the precision debug features (as in TE) or FSDP2.
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
    parameters_split : dict or tuple of str, default = None
        TE's: expose the weight's output rows as separate parameters, `{"query": rows, ...}` or
        names for equal parts: `query_weight`, ..., then `query_bias`, ... (no `weight` /
        `bias`); the GEMM runs on them concatenated (a copy of the weight per forward in eager).
        Not with `fuse_wgrad_accumulation`, `quantized_model_init` or FSDP2's quantized
        all-gather.

    Other keywords of TE's (`ub_*`, `get_rng_state_tracker`, ...) are a `TypeError`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 fuse_wgrad_accumulation: bool = False, save_original_input: bool = False,
                 delay_wgrad_compute: bool = False, return_bias: bool = False, name: Optional[str] = None,
                 tp_group=None, tp_size: Optional[int] = None, parallel_mode: Optional[str] = None,
                 sequence_parallel: bool = False, parameters_split=None, **unsupported):
        super().__init__(name)
        if unsupported:
            raise TypeError(f"Linear: unsupported arguments {sorted(unsupported)}")
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"Linear: features must be positive, got ({in_features}, {out_features})")
        self.in_features, self.out_features = in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.save_original_input = save_original_input
        self.return_bias = return_bias
        check_split_args(self.name, parameters_split, fuse_wgrad_accumulation)
        init_parallel_linear(self, in_features, out_features, bias, tp_group, tp_size, parallel_mode,
                             sequence_parallel, params_dtype or torch.get_default_dtype(), device, init_method,
                             parameters_split=parameters_split)
        self.gemm = QuantizedGemm(device)
        quantize_new_weights(self)  # inside quantized_model_init: weights stored quantized
        self._init_delay_wgrad(delay_wgrad_compute)

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
        weight, bias = self.gemm_params()
        group, row, gemm_bias = self._tp_plan(bias)
        sequence_gather = None  # column + SP: the GEMM all-gathers the shard (quantized where it can)
        if group is not None and self.parallel_mode == "column":
            if self.sequence_parallel:
                sequence_gather = (group, self.tp_size)
            else:
                inp = _tp.copy_to_tp_region(inp, group)
        out = self.gemm.forward(inp, weight, gemm_bias, is_first_microbatch=is_first_microbatch,
                                save_original_input=self.save_original_input,
                                fuse_wgrad_accumulation=self.fuse_wgrad_accumulation,
                                sequence_gather=sequence_gather, owner=self)
        if row:
            out = self._reduce_row_output(out, group, bias)
        return (out, bias) if self.return_bias else out

    def extra_repr(self) -> str:
        tp = f", parallel_mode={self.parallel_mode!r}, tp_size={self.tp_size}" if self.parallel_mode else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={getattr(self, self.bias_names[0]) is not None}, "
                f"name={self.name!r}{tp}")
