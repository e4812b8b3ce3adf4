"""`LayerNormMLP`: norm -> fc1 -> activation -> fc2, both GEMMs quantized (TE's fused MLP)."""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..capabilities import default_device
from ..distributed import tp as _tp
from ..recompute import checkpoint as _checkpoint
from .linear import _init_weight
from .normalization import NormFusedModule
from .quantized_gemm import QuantizedGemm
from .quantized_params import quantize_new_weights

__all__ = ["LayerNormMLP", "ACTIVATIONS"]


def _glu(act):
    def glu(x):
        a, b = x.chunk(2, dim=-1)
        return act(a) * b

    return glu


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _qgelu(x):
    return x * torch.sigmoid(1.702 * x)


def _srelu(x):
    return torch.square(F.relu(x))


# name -> (function, fc1 width multiplier); gated activations take both halves of fc1's output
# and gate the first (TE's definitions; `torch.nn.functional.glu` gates the second)
ACTIVATIONS = {
    "gelu": (_gelu, 1),
    "qgelu": (_qgelu, 1),
    "relu": (F.relu, 1),
    "srelu": (_srelu, 1),
    "silu": (F.silu, 1),
    "glu": (_glu(torch.sigmoid), 2),
    "swiglu": (_glu(F.silu), 2),
    "geglu": (_glu(_gelu), 2),
    "qgeglu": (_glu(_qgelu), 2),
    "reglu": (_glu(F.relu), 2),
    "sreglu": (_glu(_srelu), 2),
    "clamped_swiglu": (None, 2),  # its function takes `activation_params` (`_activation_fn`)
}
_CLAMPED_SWIGLU_PARAMS = {"limit": 7.0, "alpha": 1.702, "glu_linear_offset": 1.0}  # TE's defaults


def _activation_fn(owner: str, activation: str, params: Optional[dict]):
    """The activation as a function of fc1's output; `params` (TE's `activation_params`) are
    `clamped_swiglu`'s limit / alpha / glu_linear_offset, and only its."""
    if activation != "clamped_swiglu":
        if params:
            raise ValueError(f"LayerNormMLP {owner}: activation_params apply to activation='clamped_swiglu' "
                             f"only, got {params!r} with activation={activation!r}")
        return ACTIVATIONS[activation][0]
    unknown = sorted(set(params or {}) - set(_CLAMPED_SWIGLU_PARAMS))
    if unknown:
        raise ValueError(f"LayerNormMLP {owner}: unknown activation_params {unknown} for clamped_swiglu "
                         f"(known: {sorted(_CLAMPED_SWIGLU_PARAMS)})")
    p = {**_CLAMPED_SWIGLU_PARAMS, **(params or {})}
    return functools.partial(_clamped_swiglu, limit=float(p["limit"]), alpha=float(p["alpha"]),
                             glu_linear_offset=float(p["glu_linear_offset"]))  # a partial: modules stay picklable


def clamped_swiglu(a: torch.Tensor, b: torch.Tensor, limit: float, alpha: float, glu_linear_offset: float):
    """GPT-OSS's gated activation of the halves (a, b): `activation="clamped_swiglu"` here and
    `te.ops.ClampedSwiGLU` both compute it with this function."""
    a = a.clamp(max=limit)
    return a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + glu_linear_offset)


def _clamped_swiglu(x, limit: float, alpha: float, glu_linear_offset: float):
    a, b = x.chunk(2, -1)
    return clamped_swiglu(a, b, limit, alpha, glu_linear_offset)


class LayerNormMLP(NormFusedModule):
    """Drop-in for `transformer_engine.pytorch.LayerNormMLP`.

    Tensor parallelism: with `tp_size > 1` (or a `tp_group` of size > 1) fc1 is column parallel
    and fc2 row parallel (TE's `set_parallel_mode=True`, implied). Each rank holds
    fc1 [ffn/tp_size * m, hidden] and fc2 [hidden, ffn/tp_size]; the norm runs on the full hidden
    size, fc2's output is all-reduced and its bias added once after. With `sequence_parallel`,
    the input is this rank's dim-0 (sequence) shard: norm on the shard -> all-gather -> fc1 ->
    activation -> fc2 -> reduce-scatter (the norm's and fc2's bias grads are then partial:
    marked `sequence_parallel`, all-reduced by the training loop as in Megatron / TE).

    Gated activations (glu, swiglu, geglu, qgeglu, reglu, sreglu): the activation splits fc1's local output into two
    halves, so each rank's fc1 shard must hold the matching rank-th chunk of *each* half of the
    full fc1 weight, i.e. `cat([W[:ffn].chunk(tp)[r], W[ffn:].chunk(tp)[r]])` (and likewise the
    bias), not a contiguous chunk of the full [2*ffn, hidden] weight (see `shard_fc1`).

    Parameters, in TE's names and order: `layer_norm_weight`, `layer_norm_bias` (None for
    RMSNorm), `fc1_weight` [ffn * m, hidden] (m = 2 for gated activations), `fc1_bias`,
    `fc2_weight` [hidden, ffn], `fc2_bias`.

    Parameters
    ----------
    hidden_size : int
        Size of the input's and output's last dimension.
    ffn_hidden_size : int
        The MLP's inner size (the full size; each rank holds `ffn_hidden_size / tp_size`).
    eps : float, default = 1e-5
        Added to the variance (mean square for RMSNorm) for numerical stability.
    bias : bool, default = True
        Learn fc1's and fc2's biases, initialized to zero.
    normalization : {"LayerNorm", "RMSNorm"}, default = "LayerNorm"
        The norm before fc1; RMSNorm has no bias.
    activation : {"gelu", "qgelu", "relu", "srelu", "silu", "glu", "swiglu", "geglu", "qgeglu", "reglu", "sreglu",
        "clamped_swiglu"}, default = "gelu"
        Applied to fc1's output; gelu is the tanh approximation, as TE's. The gated ones split
        fc1's output in two halves and return act(first) * second; clamped_swiglu is GPT-OSS's
        (`ops.ClampedSwiGLU`). Any other name is a `ValueError`.
    activation_params : dict, default = None
        clamped_swiglu's `limit` (7.0), `alpha` (1.702) and `glu_linear_offset` (1.0), as TE's;
        with another activation, or with another key, a `ValueError`.
    return_layernorm_output : bool, default = False
        Also return the norm's output (last in the returned tuple).
    zero_centered_gamma : bool, default = False
        Initialize gamma to zero and scale by `1 + gamma` (TE's formulation).
    params_dtype : torch.dtype, default = None
        dtype of all parameters; None is `torch.get_default_dtype()`.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    init_method : Callable, default = None
        Called as `init_method(weight)` on fc1's weight (and fc2's without
        `output_layer_init_method`). None is `nn.Linear`'s Kaiming-uniform init (TE's: a normal
        with std 0.023).
    output_layer_init_method : Callable, default = None
        Initializes fc2's weight; None uses `init_method`.
    fuse_wgrad_accumulation : bool, default = False
        Add each weight gradient into its `main_grad` (fp32 buffers the caller sets; forward raises
        a RuntimeError without them) instead of producing `.grad`; sets each weight's
        `grad_added_to_main_grad`, where present, as `Linear`.
    return_bias : bool, default = False
        Leave fc2's bias out of the output and return it after the output, so the caller can fuse
        the add (fc1's bias is always added).
    name : str, default = None
        The layer's name in the debug tools' configs; None gives `layernorm_mlp_<n>`.
    tp_group : torch.distributed.ProcessGroup, default = None
        The tensor-parallel group. None with `tp_size > 1` uses the default process group.
    tp_size : int, default = None
        The tensor-parallel size; None is the size of `tp_group`, or 1 without one.
    set_parallel_mode : bool, default = None
        Accepted for TE's signature: with more than one rank fc1 is always column parallel and fc2
        row parallel. False with `tp_size > 1` is a `ValueError`.
    sequence_parallel : bool, default = False
        Shard dim 0 of the input and output too (above).
    checkpoint : bool, default = False
        Keep no activations for backward, only the input: backward recomputes the block first
        (with the forward's scales, as `te.checkpoint`), trading compute for memory; outputs and
        gradients equal those without it. TE's recompute skips fc2's forward, this one does not.
    delay_wgrad_compute : bool, default = False
        fc1's and fc2's weight (and, unquantized, bias) gradients wait for `backward_dw()`, as
        `Linear`'s; the norm's gradients are computed in backward.

    TE's other keywords (`ub_*`, ...) are a `TypeError`."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, eps: float = 1e-5, bias: bool = True, *,
                 normalization: str = "LayerNorm", activation: str = "gelu", activation_params: Optional[dict] = None,
                 return_layernorm_output: bool = False, zero_centered_gamma: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, init_method=None,
                 output_layer_init_method=None, fuse_wgrad_accumulation: bool = False,
                 return_bias: bool = False, name: Optional[str] = None,
                 tp_group=None, tp_size: Optional[int] = None, set_parallel_mode: Optional[bool] = None,
                 sequence_parallel: bool = False, checkpoint: bool = False, delay_wgrad_compute: bool = False):
        super().__init__(name)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP {self.name}: activation must be one of {sorted(ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.activation_params = activation_params
        self._act = _activation_fn(self.name, activation, activation_params)
        if not isinstance(checkpoint, bool):
            raise TypeError(f"LayerNormMLP {self.name}: checkpoint must be a bool, got {checkpoint!r}")
        self.checkpoint = checkpoint
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
        device = default_device(device)
        # TE's parameter order: layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias
        self._init_norm(hidden_size, normalization, eps, zero_centered_gamma, dtype, device)
        self.fc1_weight = nn.Parameter(torch.empty(fc1_out, hidden_size, dtype=dtype, device=device))
        self.fc1_bias = nn.Parameter(torch.zeros(fc1_out, dtype=dtype, device=device)) if bias else None
        self.fc2_weight = nn.Parameter(torch.empty(hidden_size, ffn_local, dtype=dtype, device=device))
        self.fc2_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device)) if bias else None
        _init_weight(self.fc1_weight, init_method)
        _init_weight(self.fc2_weight, output_layer_init_method or init_method)
        if self.sequence_parallel:
            for p in self._norm_params() + ([self.fc2_bias] if bias else []):
                p.sequence_parallel = True
        self.fc1 = QuantizedGemm(device)
        self.fc2 = QuantizedGemm(device)
        quantize_new_weights(self)  # inside quantized_model_init: weights stored quantized
        self._init_delay_wgrad(delay_wgrad_compute)


    @staticmethod
    def shard_fc1(full: torch.Tensor, activation: str, tp_size: int, rank: int) -> torch.Tensor:
        """This rank's fc1 weight (or bias) shard of the full one, gated halves sharded separately."""
        parts = full.chunk(ACTIVATIONS[activation][1], 0)
        return torch.cat([p.chunk(tp_size, 0)[rank] for p in parts], 0).contiguous()

    def gemm_weights(self):
        return [(self.fc1, self.fc1_weight), (self.fc2, self.fc2_weight)]

    def _wgrad_queues(self):
        return [(self.fc1.pending_wgrads, ["fc1_weight"], ["fc1_bias"]),
                (self.fc2.pending_wgrads, ["fc2_weight"], ["fc2_bias"])]

    def tp_sharded_gemms(self):
        if self._tp_group_name is None or self.tp_size < 2:
            return []
        return [(self.fc1, self._tp_group_name, "column"), (self.fc2, self._tp_group_name, "row")]

    def forward(self, inp: torch.Tensor, is_first_microbatch: Optional[bool] = None):
        """fc2(act(fc1(norm(x)))); `out`, then fc2's bias with `return_bias`, then the norm output
        with `return_layernorm_output` (a tuple when more than `out`).

        Parameters
        ----------
        inp : torch.Tensor
            [..., hidden_size] (with `sequence_parallel`: this rank's dim-0 shard), float32,
            bfloat16 or float16.
        is_first_microbatch : {None, True, False}, default = None
            Weight caching over gradient-accumulation micro-batches, for both GEMMs, as in
            `Linear.forward`.
        """
        self._check_input(inp, self.hidden_size)
        self._check_gemm_module()
        if self.checkpoint and torch.is_grad_enabled():
            out, ln_out = _checkpoint(self._block, inp, is_first_microbatch, use_reentrant=False)
        else:
            out, ln_out = self._block(inp, is_first_microbatch)
        return self._pack_outputs(out, self.fc2_bias, ln_out)

    def _block(self, inp: torch.Tensor, is_first_microbatch: Optional[bool]):
        """(output, norm output): the computation `checkpoint=True` recomputes in backward."""
        group = self._tp_group_name if self.tp_size > 1 else None
        ln_out, fc1_in, ln_q, seq = self._norm_into_gemm(inp, self.fc1, self.fc1_weight, group)
        kw = dict(is_first_microbatch=is_first_microbatch, fuse_wgrad_accumulation=self.fuse_wgrad_accumulation)
        h = self.fc1.forward(fc1_in, self.fc1_weight, self.fc1_bias, inp_quantized=ln_q, sequence_gather=seq, **kw)
        h = self._act(h)
        fc2_bias = None if (self.return_bias or group is not None) else self.fc2_bias
        out = self.fc2.forward(h, self.fc2_weight, fc2_bias, **kw)
        if group is not None:
            out = _tp.reduce_row_parallel_output(out, group, self.tp_size, self.sequence_parallel,
                                                 None if self.return_bias else self.fc2_bias)
        return out, ln_out
