"""TE's `transformer_engine.pytorch.quantization` names: the global FP8 state as TE code queries it,
`RecipeState` (a recipe's quantizers for a list of tensor slots), and `quantized_model_init`.

The state itself lives in `autocast.FP8GlobalState` (what compiled code guards on); this module is
the TE-shaped view of it, plus the parameter-creation state that `quantized_model_init` sets.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import autocast as _autocast
from . import recipe as R
from .autocast import autocast, fp8_autocast  # noqa: F401  (TE's module path for them)
from .capabilities import is_fp8_available, is_fp8_block_scaling_available, is_mxfp8_available, is_nvfp4_available  # noqa: F401
from .kernels.reference.delayed_scaling import scale_from_history_amax, update_from_history
from .recipe import QuantizerRole

__all__ = ["FP8GlobalStateManager", "RecipeState", "NVFP4BlockScalingRecipeState", "QuantizerRole",
           "quantized_model_init", "fp8_model_init",
           "get_default_recipe", "autocast", "fp8_autocast", "is_fp8_available", "is_mxfp8_available",
           "is_fp8_block_scaling_available", "is_nvfp4_available"]


def get_default_recipe() -> R.Recipe:
    """The recipe `autocast()` uses when given none (TE's default: delayed scaling)."""
    return _autocast._default_recipe()


@dataclass
class _ParamInit:
    """What `quantized_model_init` asks of parameters created inside it."""

    enabled: bool = False
    recipe: Optional[R.Recipe] = None
    preserve_high_precision_init_val: bool = False


_PARAM_INIT = _ParamInit()


def param_init_state() -> _ParamInit:
    return _PARAM_INIT


@contextlib.contextmanager
def quantized_model_init(enabled: bool = True, recipe: Optional[R.Recipe] = None,
                         preserve_high_precision_init_val: bool = False):
    """Modules created inside store their GEMM weights quantized with `recipe` (default: the
    default recipe) instead of in high precision: see `module/quantized_params.py`.
    With `preserve_high_precision_init_val`, each such weight keeps its initial high-precision
    value on the CPU (`weight.get_high_precision_init_val()`, `weight.clear_high_precision_init_val()`)
    to seed master weights."""
    global _PARAM_INIT
    _autocast._reject_recipe_as_enabled(enabled, "quantized_model_init(recipe=...)")
    if recipe is not None:
        R.require_recipe(recipe, "quantized_model_init")
    saved = _PARAM_INIT
    _PARAM_INIT = _ParamInit(bool(enabled), recipe or get_default_recipe(), bool(preserve_high_precision_init_val))
    try:
        yield
    finally:
        _PARAM_INIT = saved


def fp8_model_init(enabled: bool = True, recipe: Optional[R.Recipe] = None,
                   preserve_high_precision_init_val: bool = False):
    """TE's older name for `quantized_model_init`."""
    return quantized_model_init(enabled, recipe, preserve_high_precision_init_val)


def _with_reason(check):
    """A classmethod calling a capability check with `return_reason=True`."""
    return classmethod(lambda cls: check(return_reason=True))


class FP8GlobalStateManager:
    """TE's queries of the global quantization state (class methods, as in TE)."""

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return _autocast.is_fp8_enabled()

    @classmethod
    def get_fp8_recipe(cls) -> R.Recipe:
        """The active recipe; the default recipe outside autocast (as TE)."""
        return _autocast.FP8GlobalState.state.recipe or get_default_recipe()

    @classmethod
    def get_fp8_group(cls):
        return _autocast.FP8GlobalState.state.group

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return False  # autocast(calibrating=True) is refused

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return _PARAM_INIT.enabled

    @classmethod
    def with_high_precision_init_val(cls) -> bool:
        return _PARAM_INIT.preserve_high_precision_init_val

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        if torch.compiler.is_dynamo_compiling() or not torch.cuda.is_available():
            return False
        return torch.cuda.is_current_stream_capturing()

    @classmethod
    def in_fp8_activation_recompute_phase(cls) -> bool:
        return _autocast.in_activation_recompute_phase()

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        """True for the first caller inside each autocast region, False after."""
        state = _autocast.FP8GlobalState.state
        first, state.first_module_pending = state.first_module_pending, False
        return first

    @classmethod
    def reset(cls) -> None:
        """Back to no autocast and no quantized parameter creation."""
        global _PARAM_INIT
        _autocast.FP8GlobalState.state = _autocast._State()
        _PARAM_INIT = _ParamInit()

    @staticmethod
    def get_meta_tensor_key(forward: bool = True) -> str:
        """The key of a module's `fp8_meta` that holds one pass's delayed-scaling state."""
        return "scaling_fwd" if forward else "scaling_bwd"

    # TE's spelling: (available, reason) tuples
    is_fp8_available = _with_reason(is_fp8_available)
    is_mxfp8_available = _with_reason(is_mxfp8_available)
    is_fp8_block_scaling_available = _with_reason(is_fp8_block_scaling_available)
    is_nvfp4_available = _with_reason(is_nvfp4_available)


class RecipeState:
    """A recipe's quantizers for `num_quantizers` tensor slots of one pass (TE's `RecipeState`).

    Slots are TE's: forward `[input, weight, output, input, weight, output, ...]`, backward
    `[grad_output, grad_input, ...]`, unless `roles` names each slot's `tensor_type`. Delayed
    scaling owns `scale` (num_quantizers,) and `amax_history` (amax_history_len, num_quantizers)
    here, as in TE; each quantizer reads and records into its slot's views of them."""

    _FORWARD = ("input", "weight", "output")
    _BACKWARD = ("grad_output", "grad_input")
    # the roles this package quantizes; output / grad_input take the input / gradient quantizer
    _ROLE = {"input": "input", "weight": "weight", "output": "input", "grad_output": "grad_output",
             "grad_input": "grad_output"}

    def __init__(self, recipe: R.Recipe, *, mode: str, num_quantizers: int = 1, device=None,
                 roles: Optional[List[QuantizerRole]] = None):
        if mode not in ("forward", "backward"):
            raise ValueError(f"RecipeState: mode must be 'forward' or 'backward', got {mode!r}")
        if roles is not None and len(roles) != num_quantizers:
            raise ValueError(f"RecipeState: {len(roles)} roles for {num_quantizers} quantizers")
        self.recipe, self.mode, self.num_quantizers, self.roles = recipe, mode, num_quantizers, roles
        self.device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
        if isinstance(recipe, R.DelayedScaling):
            self.scale = torch.ones(num_quantizers, dtype=torch.float32, device=self.device)
            self.amax_history = torch.zeros(recipe.amax_history_len, num_quantizers, dtype=torch.float32,
                                            device=self.device)

    @staticmethod
    def create(recipe: R.Recipe, *, mode: str, num_quantizers: int = 1, device=None,
               roles: Optional[List[QuantizerRole]] = None) -> "RecipeState":
        R.require_recipe(recipe, "RecipeState.create")
        return RecipeState(recipe, mode=mode, num_quantizers=num_quantizers, device=device, roles=roles)

    def tensor_type(self, slot: int) -> str:
        role = self.roles[slot] if self.roles is not None else None
        if role is not None and role.tensor_type in self._ROLE:
            return role.tensor_type
        default = self._FORWARD if self.mode == "forward" else self._BACKWARD
        return default[slot % len(default)]

    def make_quantizers(self) -> list:
        from .tensor.nvfp4 import NVFP4Quantizer
        from .tensor.recipe_quantizers import quantizers_for_recipe

        by_role = quantizers_for_recipe(self.recipe)
        out = []
        for slot in range(self.num_quantizers):
            q = getattr(by_role, self._ROLE[self.tensor_type(slot)])
            if q is not None and q.has_scale_state():  # bind this slot's delayed-scaling state
                q = q.with_scale_state(self.scale[slot:slot + 1], self.amax_history[0, slot:slot + 1])
            if self.mode == "backward" and isinstance(q, NVFP4Quantizer) and q.row_scaled_nvfp4:
                q = dataclasses.replace(q, row_scaled_nvfp4=False)  # row scaling is for forward activations
            out.append(q)
        return out


class NVFP4BlockScalingRecipeState(RecipeState):
    """TE's `RecipeState` for an `NVFP4BlockScaling` recipe (stateless: only its quantizers)."""

    def __init__(self, recipe: R.NVFP4BlockScaling, *, mode: str, num_quantizers: int = 1, device=None,
                 roles: Optional[List[QuantizerRole]] = None):
        if not isinstance(recipe, R.NVFP4BlockScaling):
            raise TypeError("NVFP4BlockScalingRecipeState needs an NVFP4BlockScaling recipe, "
                            f"got {type(recipe).__name__}")
        super().__init__(recipe, mode=mode, num_quantizers=num_quantizers, device=device, roles=roles)


def _default_sf_compute(amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int) -> torch.Tensor:
    """TE's default amax -> scale rule as this package's modules apply it: `scale` takes
    fp8_max / amax * 2**-margin in place, kept where amax is 0 or inf/NaN or the quotient
    overflows; returned too, for a recipe's `scaling_factor_compute_algo` that wraps it."""
    scale.copy_(scale_from_history_amax(scale, amax, fp8_max, margin))
    return scale


def _amax_and_scale_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float,
                           recipe: R.DelayedScaling) -> None:
    """One delayed-scaling step on TE-layout state, in place: the scale from the history by the
    recipe (`amax_compute_algo`, `margin` or `scaling_factor_compute_algo`), then the history
    rolls (row i takes row i + 1) and row 0 is zeroed for the next amax."""
    update_from_history(scale, amax_history, recipe, fp8_max)
