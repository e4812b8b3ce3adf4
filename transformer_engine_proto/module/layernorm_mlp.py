"""`LayerNormMLP`: norm -> fc1 -> activation -> fc2, both GEMMs quantized (TE's fused MLP)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import tp as _tp
from .gemm_state import QuantizedGemm
from .quantized_params import quantize_new_weights
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
    """Drop-in for `transformer_engine.pytorch.LayerNormMLP`.

    Tensor parallelism: with `tp_size > 1` (or a `tp_group` of size > 1) fc1 is column parallel
    and fc2 row parallel (TE's `set_parallel_mode=True`, implied). Each rank holds
    fc1 [ffn/tp_size * m, hidden] and fc2 [hidden, ffn/tp_size]; the norm runs on the full hidden
    size, fc2's output is all-reduced and its bias added once after. With `sequence_parallel`,
    the input is this rank's dim-0 (sequence) shard: norm on the shard -> all-gather -> fc1 ->
    activation -> fc2 -> reduce-scatter (the norm's and fc2's bias grads are then partial:
    marked `sequence_parallel`, all-reduced by the training loop as in Megatron / TE).

    Gated activations (swiglu, geglu, reglu): the activation splits fc1's local output into two
    halves, so each rank's fc1 shard must hold the matching rank-th chunk of *each* half of the
    full fc1 weight, i.e. `cat([W[:ffn].chunk(tp)[r], W[ffn:].chunk(tp)[r]])` (and likewise the
    bias), not a contiguous chunk of the full [2*ffn, hidden] weight (see `shard_fc1`)."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", activation: str = "gelu",
                 return_layernorm_output: bool = False, zero_centered_gamma: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, name: Optional[str] = None,
                 tp_group=None, tp_size: Optional[int] = None, set_parallel_mode: Optional[bool] = None,
                 sequence_parallel: bool = False):
        super().__init__(name)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        dtype = params_dtype or torch.get_default_dtype()
        self.hidden_size, self.ffn_hidden_size, self.activation = hidden_size, ffn_hidden_size, activation
        self.return_layernorm_output, self.return_bias = return_layernorm_output, return_bias
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        want = dist.get_world_size(tp_group) if tp_group is not None else tp_size
        if set_parallel_mode is False and isinstance(want, int) and want > 1:
            raise ValueError(f"{self.name}: set_parallel_mode=False with tp_size > 1 is not supported "
                             "(fc1 is always column parallel and fc2 row parallel)")
        if isinstance(want, int) and want > 1 and ffn_hidden_size % want:
            raise ValueError(f"{self.name}: ffn_hidden_size={ffn_hidden_size} is not divisible by tp_size={want}")
        # fc2 (row) is the check that matters: the ffn size is fc2's in_features
        self.tp_size, self._tp_group_name = _tp.resolve_tp(
            self.name, ffn_hidden_size, hidden_size, tp_group, tp_size, "row", sequence_parallel)
        if self.tp_size == 1:
            self._tp_group_name = None
        self.sequence_parallel = bool(sequence_parallel) and self.tp_size > 1
        ffn_local = ffn_hidden_size // self.tp_size
        fc1_out = ffn_local * ACTIVATIONS[activation][1]
        self.norm = NormParams(hidden_size, normalization, eps, zero_centered_gamma, dtype, device)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, dtype=dtype, device=device))
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_local, dtype=dtype, device=device))
        _init_weight(self.fc1_weight, init_method)
        _init_weight(self.fc2_weight, output_layer_init_method or init_method)
        self.fc1_bias = nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device)) if bias else None
        self.fc2_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        if self.sequence_parallel:
            for p in list(self.norm.parameters()) + ([self.fc2_bias] if bias else []):
                p.sequence_parallel = True
        self.fc1 = QuantizedGemm(device)
        self.fc2 = QuantizedGemm(device)
        quantize_new_weights(self)  # inside quantized_model_init: weights stored quantized


    @staticmethod
    def shard_fc1(full: torch.Tensor, activation: str, tp_size: int, rank: int) -> torch.Tensor:
        """This rank's fc1 weight (or bias) shard of the full one, gated halves sharded separately."""
        parts = full.chunk(ACTIVATIONS[activation][1], 0)
        return torch.cat([p.chunk(tp_size, 0)[rank] for p in parts], 0).contiguous()

    def gemm_weights(self):
        return [(self.fc1, self.fc1_weight), (self.fc2, self.fc2_weight)]

    def tp_sharded_gemms(self):
        if self._tp_group_name is None or self.tp_size < 2:
            return []
        return [(self.fc1, self._tp_group_name, "column"), (self.fc2, self._tp_group_name, "row")]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        self._check_input(inp, self.hidden_size)
        group = self._tp_group_name if self.tp_size > 1 else None
        ln_out, fc1_in, ln_q, seq = self._norm_into_gemm(inp, self.fc1, self.fc1_weight, group)
        kw = dict(is_first_microbatch=is_first_microbatch, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation)
        h = self.fc1(fc1_in, self.fc1_weight, self.fc1_bias, inp_quantized=ln_q, sequence_gather=seq, **kw)
        h = ACTIVATIONS[self.activation][0](h)
        fc2_bias = None if (self.return_bias or group is not None) else self.fc2_bias
        out = self.fc2(h, self.fc2_weight, fc2_bias, **kw)
        if group is not None:
            out = _tp.reduce_row_parallel_output(out, group, self.tp_size, self.sequence_parallel,
                                                 None if self.return_bias else self.fc2_bias)
        return self._pack_outputs(out, self.fc2_bias, ln_out)
