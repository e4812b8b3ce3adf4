"""`LayerNorm` and `RMSNorm` modules (TE names and arguments) on the `te_proto::norm_*` ops."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..autocast import get_fp8_recipe_key
from ..capabilities import default_device
from ..custom_ops.norm import NORMALIZATIONS, norm, norm_quantize
from ..distributed import tp as _tp
from .base import TransformerEngineBaseModule, autocast_operands, rename_state_dict_keys
from .fp8_state import FP8StateCheckpoint

__all__ = ["LayerNorm", "RMSNorm", "NormFusedModule", "init_norm_parameters"]


def init_norm_parameters(module: nn.Module, hidden_size: int, normalization: str, eps: float,
                         zero_centered_gamma: bool, dtype: torch.dtype, device=None, prefix: str = "") -> None:
    """Set normalization / eps / zero_centered_gamma and register TE's `<prefix>weight` (gamma)
    and, for LayerNorm, `<prefix>bias` (beta; None for RMSNorm) on `module`."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    module.normalization, module.eps, module.zero_centered_gamma = normalization, eps, zero_centered_gamma
    init, device = torch.zeros if zero_centered_gamma else torch.ones, default_device(device)
    setattr(module, prefix + "weight", nn.Parameter(init(hidden_size, dtype=dtype, device=device)))
    setattr(module, prefix + "bias", nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
            if normalization == "LayerNorm" else None)


class NormFusedModule(FP8StateCheckpoint, TransformerEngineBaseModule):
    """Base of LayerNormLinear / LayerNormMLP: the norm's parameters, TE's output packing.

    The norm's gamma / beta are the module's own parameters `layer_norm_weight` /
    `layer_norm_bias`, registered before the GEMMs' (call `_init_norm` first): TE's names and
    order, which TE's tests and users rely on (`zip(module.parameters(), reference.parameters())`,
    state-dict keys, assigning `module.layer_norm_weight = Parameter(...)`)."""

    return_bias: bool
    return_layernorm_output: bool

    def _init_norm(self, hidden_size: int, normalization: str, eps: float, zero_centered_gamma: bool,
                   dtype: torch.dtype, device) -> None:
        init_norm_parameters(self, hidden_size, normalization, eps, zero_centered_gamma, dtype, device,
                             prefix="layer_norm_")
        self._register_load_state_dict_pre_hook(_rename_norm_keys)

    def apply_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The module's norm of `x` (what it feeds the first GEMM)."""
        return norm(x, self.layer_norm_weight, self.layer_norm_bias, self.eps, self.normalization,
                    self.zero_centered_gamma)

    def _norm_params(self):
        return [p for p in (self.layer_norm_weight, self.layer_norm_bias) if p is not None]

    def _norm_into_gemm(self, inp, gemm, weight, column_group: Optional[str]):
        """(norm output, the next GEMM's input, its quantized buffers, the GEMM's `sequence_gather`).
        With a column-parallel group: under sequence parallelism the GEMM all-gathers the norm's
        output shard (quantized where the recipe allows; the fused norm + quantize is skipped),
        else an identity whose backward all-reduces dgrad. With a stateless recipe the norm and
        the quantize of its output are one op (no buffers when `columnwise` is None)."""
        if column_group is not None and self.sequence_parallel:
            ln_out = self.apply_norm(inp)
            return ln_out, ln_out, (), (column_group, self.tp_size)
        columnwise = gemm.wants_quantized_input(weight, inp=inp)
        if columnwise is None:
            ln_out, ln_q = self.apply_norm(inp), ()
        else:
            ln_out, ln_q = norm_quantize(inp, self.layer_norm_weight, self.layer_norm_bias, self.eps,
                                         self.normalization, self.zero_centered_gamma, get_fp8_recipe_key(),
                                         columnwise)
        gemm_in = ln_out if column_group is None else _tp.copy_to_tp_region(ln_out, column_group)
        return ln_out, gemm_in, ln_q, None

    def _pack_outputs(self, out, bias, ln_out):
        """out, then the unadded bias (return_bias), then the norm output (return_layernorm_output)."""
        outputs = (out,)
        if self.return_bias:
            outputs += (bias,)
        if self.return_layernorm_output:
            outputs += (ln_out,)
        return outputs[0] if len(outputs) == 1 else outputs


def _rename_norm_keys(state_dict, prefix, *args):
    rename_state_dict_keys(state_dict, prefix, {"norm.weight": "layer_norm_weight", "norm.bias": "layer_norm_bias"})


class _Norm(TransformerEngineBaseModule):
    """Parameters at `weight` / `bias`, as TE's LayerNorm / RMSNorm: their state-dict keys are
    TE's, and those of the torch / Hugging Face norms `convert_model` replaces."""

    _KIND = ""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, name: Optional[str] = None):
        super().__init__(name)
        self.hidden_size = hidden_size
        init_norm_parameters(self, hidden_size, self._KIND, eps, zero_centered_gamma,
                             params_dtype or torch.get_default_dtype(), device)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        """The norm over the last dimension, computed in float32, returned in the input's dtype
        (under torch.autocast, as in TE: the input and parameters cast to its dtype).

        Parameters
        ----------
        inp : torch.Tensor
            [..., hidden_size], float32, bfloat16 or float16.
        """
        self._check_input(inp, self.hidden_size)
        inp, weight, bias = autocast_operands(inp, self.weight, self.bias)
        return norm(inp, weight, bias, self.eps, self.normalization, self.zero_centered_gamma)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, name={self.name!r}"


class LayerNorm(_Norm):
    """Drop-in for `transformer_engine.pytorch.LayerNorm`: (x - mean) / sqrt(var + eps) * gamma
    + beta over the last dimension, parameters `weight` (gamma) and `bias` (beta).

    Parameters
    ----------
    hidden_size : int
        Size of the normalized (last) dimension. TE's newer `normalized_shape` keyword (and a
        tuple of dims) is not accepted.
    eps : float, default = 1e-5
        Added to the variance for numerical stability.
    zero_centered_gamma : bool, default = False
        Initialize gamma to zero and scale by `1 + gamma` (TE's formulation).
    params_dtype : torch.dtype, default = None
        dtype of the parameters; None is `torch.get_default_dtype()`.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    name : str, default = None
        The layer's name in the debug tools' configs; None gives `layernorm_<n>`.

    TE's `sequence_parallel` and `dtype` keywords are a `TypeError` (use `params_dtype`; mark
    the parameters `sequence_parallel` yourself where a loop all-reduces their grads)."""

    _KIND = "LayerNorm"


class RMSNorm(_Norm):
    """Drop-in for `transformer_engine.pytorch.RMSNorm`: x / sqrt(mean(x^2) + eps) * gamma over the
    last dimension, parameter `weight` (gamma; `bias` is None).

    Parameters
    ----------
    hidden_size : int
        Size of the normalized (last) dimension. TE's newer `normalized_shape` keyword (and a
        tuple of dims) is not accepted.
    eps : float, default = 1e-5
        Added to the mean square for numerical stability.
    zero_centered_gamma : bool, default = False
        Initialize gamma to zero and scale by `1 + gamma` (TE's formulation).
    params_dtype : torch.dtype, default = None
        dtype of the parameters; None is `torch.get_default_dtype()`.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    name : str, default = None
        The layer's name in the debug tools' configs; None gives `rmsnorm_<n>`.

    TE's `sequence_parallel` and `dtype` keywords are a `TypeError` (use `params_dtype`; mark
    the parameters `sequence_parallel` yourself where a loop all-reduces their grads)."""

    _KIND = "RMSNorm"
