"""Recipes: what low-precision format each tensor role uses, with TE's names and defaults.

Recipes are mutable dataclasses, as in TE: a field may be assigned after construction. Every
assignment is checked (a bad value or an unknown field raises, naming the recipe class and the
field, and leaves the recipe as it was). Recipes compare by value and are unhashable (as TE's);
`QParams` is frozen (as TE's): assign a new one to the recipe's field.

An edit takes effect at the next `autocast(recipe=...)` entry. Entry takes the recipe's key (its
repr, `custom_ops/recipe_key.py`) and registers a private copy of its fields under it: the key
changes with any field, so torch.compile, which guards on the key, recompiles, and eager code
reads the copy. A block therefore keeps the settings it entered with: editing the recipe inside
an open `autocast` block changes nothing in that block (`get_fp8_recipe()` still returns the
user's object, edits included, as TE's does).
"""
from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, NamedTuple, Optional, Union

import torch

__all__ = [
    "Format",
    "QParams",
    "MMParams",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "NVFP4BlockScaling",
    "CustomRecipe",
    "QuantizerRole",
    "require_recipe",
    "uses_split_accumulator",
]


class _FormatHelper(NamedTuple):
    """A format's largest finite value per pass (TE's `Format.X.value.max_fwd`), and its dtypes."""

    max_fwd: float
    max_bwd: float
    fwd_dtype: torch.dtype
    bwd_dtype: torch.dtype


class Format(Enum):
    """Low-precision format per pass. HYBRID = E4M3 forward, E5M2 gradients."""

    E2M1 = _FormatHelper(6.0, 6.0, torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2)
    E4M3 = _FormatHelper(448.0, 448.0, torch.float8_e4m3fn, torch.float8_e4m3fn)
    E5M2 = _FormatHelper(57344.0, 57344.0, torch.float8_e5m2, torch.float8_e5m2)
    HYBRID = _FormatHelper(448.0, 57344.0, torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def fwd_dtype(self) -> torch.dtype:
        return self.value.fwd_dtype

    @property
    def bwd_dtype(self) -> torch.dtype:
        return self.value.bwd_dtype


@dataclass(frozen=True)
class QParams:
    """Per-tensor-role knobs (TE's `QParams`): current/blockwise scaling use the first two, NVFP4
    the last three. Frozen, as TE's: to change a role, assign a new one to the recipe's field."""

    power_2_scale: bool = False
    amax_epsilon: float = 0.0
    random_hadamard_transform: bool = False
    stochastic_rounding: bool = False
    fp4_2d_quantization: bool = False


@dataclass(frozen=True)
class MMParams:
    """One GEMM's accumulation (TE's `MMParams`). `use_split_accumulator=False` lets Hopper's FP8
    tensor cores accumulate in their fast, lower-precision mode (cuBLAS's fast accumulation,
    `torch._scaled_mm(use_fast_accum=True)`): TE's per-tensor recipes use it for fprop only, whose
    K is the hidden size; the gradient GEMMs, which reduce over the tokens, keep the split
    accumulator. Frozen, as TE's."""

    use_split_accumulator: bool = True


# TE's defaults where a recipe has no `fp8_gemm_*` field (DelayedScaling): fast fprop only
_SPLIT_ACCUMULATOR_DEFAULT = {"fprop": False, "dgrad": True, "wgrad": True}


def uses_split_accumulator(recipe: Optional["Recipe"], gemm: str) -> bool:
    """Whether `gemm` ("fprop", "dgrad" or "wgrad") of `recipe` accumulates at full precision:
    the recipe's `fp8_gemm_<gemm>` where it has one, else TE's default. Only per-tensor FP8 GEMMs
    have a fast mode; the others always accumulate at full precision."""
    params = getattr(recipe, f"fp8_gemm_{gemm}", None)
    return _SPLIT_ACCUMULATOR_DEFAULT[gemm] if params is None else params.use_split_accumulator


class Recipe:
    """Base of all recipes; the predicates mirror TE's `Recipe.delayed()` etc."""

    def __post_init__(self):
        self._validate()

    def _validate(self) -> None:
        """Raise a ValueError / TypeError naming the field for a bad value (each recipe's checks)."""

    def _edited(self, name: str, old) -> None:
        """Hook: field `name` was just assigned (was `old`), before validation."""

    def __setattr__(self, name: str, value) -> None:
        """TE's in-place edit, checked: an unknown field is an AttributeError (a typo would
        otherwise be ignored silently), a bad value raises and leaves the recipe unchanged."""
        fields = getattr(self, "__dataclass_fields__", None)
        if fields is None or name.startswith("_") or (name in fields and name not in self.__dict__):
            object.__setattr__(self, name, value)  # the dataclass __init__: __post_init__ validates
            return
        if name not in fields:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}; its fields: {', '.join(fields)}")
        saved = dict(self.__dict__)
        object.__setattr__(self, name, value)
        try:
            self._edited(name, saved[name])
            self._validate()
        except Exception:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self) -> bool:
        return isinstance(self, NVFP4BlockScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return self.delayed() or self.float8_current_scaling()

    def custom(self) -> bool:
        return isinstance(self, CustomRecipe)

    def high_precision_gemms(self) -> frozenset:
        """The GEMMs this recipe itself keeps in high precision: with TE's
        `backward_override="high_precision"` the backward ones (dgrad, wgrad), which then read the
        original operands; none otherwise."""
        return _BACKWARD_GEMMS if getattr(self, "backward_override", None) == "high_precision" else frozenset()

    def dequantized_gemms(self) -> frozenset:
        """The GEMMs this recipe runs in high precision on the forward's quantized operands,
        dequantized: with TE's `backward_override="dequantized"` dgrad (the quantized weight) and
        wgrad (the quantized input), both with the unquantized gradient; none otherwise."""
        return _BACKWARD_GEMMS if getattr(self, "backward_override", None) == "dequantized" else frozenset()


def require_recipe(recipe, where: str) -> None:
    """A TypeError naming `where` unless `recipe` is a Recipe instance; a Recipe class (the
    common slip `recipe=Float8CurrentScaling`) is told to pass an instance."""
    if isinstance(recipe, Recipe):
        return
    if isinstance(recipe, type) and issubclass(recipe, Recipe):
        raise TypeError(f"{where}: got the recipe class {recipe.__name__}; pass an instance: {recipe.__name__}()")
    raise TypeError(f"{where}: recipe must be a transformer_engine_proto.recipe.Recipe instance, "
                    f"got {type(recipe).__name__}")


_BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
_BACKWARD_GEMMS = frozenset({"dgrad", "wgrad"})


def _default_backward_override() -> Optional[str]:
    """TE's default: the NVTE_BACKWARD_OVERRIDE environment variable, else None."""
    return os.environ.get("NVTE_BACKWARD_OVERRIDE") or None


def _backward_override_field():
    return field(default_factory=_default_backward_override)


def _check_backward_override(recipe) -> None:
    """TE's backward precision modes: None (backward in the recipe's format), "high_precision"
    (dgrad and wgrad on the original high-precision operands) or "dequantized" (dgrad and wgrad in
    high precision on the forward's quantized operands, dequantized). Delayed scaling allows only
    None, as in TE."""
    value, name = recipe.backward_override, type(recipe).__name__
    if value not in _BACKWARD_OVERRIDES:
        raise ValueError(f"{name}.backward_override must be None, 'high_precision' or 'dequantized' "
                         f"(NVTE_BACKWARD_OVERRIDE), got {value!r}")
    if value is not None and isinstance(recipe, DelayedScaling):
        raise ValueError(f"DelayedScaling supports backward_override=None only (as in TE), got {value!r}")


def _check_format(recipe) -> None:
    fmt = recipe.fp8_format
    if not isinstance(fmt, Format) or fmt is Format.E2M1:
        raise TypeError(f"{type(recipe).__name__}.fp8_format must be an FP8 recipe.Format (E4M3, E5M2, HYBRID), "
                        f"got {fmt!r}")


def _check_margin(recipe) -> None:
    """margin scales by 2**-margin: a negative one would push amax past the format's max."""
    m = recipe.margin
    if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0 <= m < float("inf")):
        raise ValueError(f"{type(recipe).__name__}.margin must be a finite number >= 0, got {m!r}")


def _check_mmparams(recipe, split_only: bool = False) -> None:
    for gemm in ("fprop", "dgrad", "wgrad"):
        name = f"fp8_gemm_{gemm}"
        params = getattr(recipe, name)
        if not isinstance(params, MMParams) or not isinstance(params.use_split_accumulator, bool):
            raise TypeError(f"{type(recipe).__name__}.{name} must be a recipe.MMParams(use_split_accumulator=bool), "
                            f"got {params!r}")
        if split_only and not params.use_split_accumulator:
            raise ValueError(f"{type(recipe).__name__}.{name}: blockwise FP8 GEMMs need the split accumulator "
                             f"(use_split_accumulator=True) for accuracy, as in TE")


def _check_qparams(recipe) -> None:
    for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        q = getattr(recipe, name)
        if not isinstance(q, QParams):
            raise TypeError(f"{type(recipe).__name__}.{name} must be a recipe.QParams, got {q!r}")
        if q.random_hadamard_transform or q.stochastic_rounding or q.fp4_2d_quantization:
            raise ValueError(f"{type(recipe).__name__}.{name}: FP8 scaling uses only power_2_scale and amax_epsilon "
                             f"(the others are NVFP4's), got {q!r}")
        eps = q.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 <= eps < float("inf")):
            raise ValueError(f"{type(recipe).__name__}.{name}.amax_epsilon must be a finite number >= 0 "
                             f"(the amax is clamped to at least it), got {eps!r}")


@dataclass
class DelayedScaling(Recipe):
    """Scale from a history of amaxes recorded in earlier steps (TE's default FP8 recipe)."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    # "max", "most_recent", or f(amax_history (history_len, n)) -> amax (n,)
    amax_compute_algo: Union[str, Callable] = "max"
    # None (fp8_max / amax / 2**margin, kept where amax is 0 or not finite), or
    # f(amax, scale, fp8_max, recipe) -> new scale: the user's rule, applied as it is
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _backward_override_field()

    def _validate(self) -> None:
        _check_format(self)
        _check_backward_override(self)
        if not callable(self.amax_compute_algo) and self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling.amax_compute_algo must be 'max', 'most_recent' or a callable, "
                f"got {self.amax_compute_algo!r}"
            )
        if self.scaling_factor_compute_algo is not None and not callable(self.scaling_factor_compute_algo):
            raise TypeError("DelayedScaling.scaling_factor_compute_algo must be None or a callable (amax, scale, "
                            f"fp8_max, recipe) -> scale, got {type(self.scaling_factor_compute_algo).__name__}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or self.amax_history_len < 1:
            raise ValueError(f"DelayedScaling.amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        _check_margin(self)


@dataclass
class Float8CurrentScaling(Recipe):
    """Per-tensor scale from the amax of the tensor being quantized, computed just in time."""

    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = field(default_factory=QParams)
    use_power_2_scales: bool = False  # TE's switch: power-of-two scales for every role
    margin: int = 0
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: MMParams(use_split_accumulator=False))
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _backward_override_field()

    def _validate(self) -> None:
        _check_format(self)
        _check_backward_override(self)
        _check_margin(self)
        _check_qparams(self)
        _check_mmparams(self)


@dataclass
class MXFP8BlockScaling(Recipe):
    """OCP MX: E8M0 power-of-two scale per 32 values along the reduction dimension."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _backward_override_field()

    def _validate(self) -> None:
        _check_format(self)
        _check_backward_override(self)
        if self.margin != 0:  # kept for TE's signature; a nonzero margin would otherwise be ignored silently
            raise ValueError(f"MXFP8BlockScaling.margin is not used (MXFP8 block scales are powers of two "
                             f"rounded up from each block's amax, so blocks never overflow); got margin="
                             f"{self.margin!r}, leave it at 0")


@dataclass
class Float8BlockScaling(Recipe):
    """DeepSeek-style blockwise FP8: 1x128 tiles for activations/grads, 128x128 for weights."""

    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_fwd_weight: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_bwd_grad: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    use_f32_scales: bool = False  # TE's switch: scales not rounded to powers of two, every role
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=MMParams)
    fp8_gemm_dgrad: MMParams = field(default_factory=MMParams)
    fp8_gemm_wgrad: MMParams = field(default_factory=MMParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: Optional[str] = _backward_override_field()

    def _validate(self) -> None:
        _check_format(self)
        _check_backward_override(self)
        _check_qparams(self)
        _check_mmparams(self, split_only=True)
        for name in ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"Float8BlockScaling.{name} must be 1 (1x128 tiles) or 2 (128x128), "
                                 f"got {getattr(self, name)}")


_NVFP4_4OVER6_SCOPES = ("none", "weights", "activations", "all")
_NVFP4_4OVER6_ERR_MODES = ("MAE", "MSE")
_NVFP4_ROLES = ("fp4_quant_fwd_inp", "fp4_quant_fwd_weight", "fp4_quant_bwd_grad")
# each disable_* switch: the QParams bit it turns off, and the roles that have it on by default
_NVFP4_SWITCHES = {
    "disable_rht": ("random_hadamard_transform", ("fp4_quant_fwd_inp", "fp4_quant_bwd_grad")),
    "disable_stochastic_rounding": ("stochastic_rounding", ("fp4_quant_bwd_grad",)),
    "disable_2d_quantization": ("fp4_2d_quantization", ("fp4_quant_fwd_weight",)),
}


@dataclass
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 values, an E4M3 scale per 16 values and one FP32 global amax per tensor.

    Defaults follow TE: weights use 2D 16x16 blocks, gradients use stochastic rounding, and the
    columnwise (wgrad) operands of activations and gradients get a random Hadamard transform.

    What each role's quantizer does is its QParams (`fp4_quant_fwd_inp`, `fp4_quant_fwd_weight`,
    `fp4_quant_bwd_grad`), derived from the `disable_*` switches at construction, as in TE, and
    assignable per role (None derives it again). A switch set to True later turns its option off
    in every role (a role assigned that option while the switch is on is an error); set back to
    False, it restores the option in the roles that have it by default, as construction would.
    `dataclasses.replace` constructs a new recipe, so its roles are derived again (as TE's);
    `recipe.replace` edits a copy and keeps them.

    TE's encoding options (kernels/reference/nvfp4.py says what they do), off by default:
    `row_scaled_activation` gives the input quantizer one amax per row; `nvfp4_4over6` ("none",
    "weights", "activations", "all") picks per block between a map-to-4 and a map-to-6 scale for
    those roles (gradients never), by `nvfp4_4over6_err_mode` ("MAE" / "MSE"), with S_enc bounded
    by 256 instead of 448 for the roles `nvfp4_4over6_e4m3_use_256` names. Neither has an RHT or
    stochastic-rounding kernel in TE, so the roles they apply to need those off (`disable_rht=True`).
    """

    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    fp8_dpa: bool = False
    fp8_mha: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    backward_override: Optional[str] = _backward_override_field()
    # not constructor arguments (as in TE): derived from the switches, then assigned per role
    fp4_quant_fwd_inp: Optional[QParams] = field(default=None, init=False)
    fp4_quant_fwd_weight: Optional[QParams] = field(default=None, init=False)
    fp4_quant_bwd_grad: Optional[QParams] = field(default=None, init=False)

    def _edited(self, name: str, old) -> None:
        """A switch that changed rewrites its bit in the roles' QParams."""
        if name not in _NVFP4_SWITCHES or getattr(self, name) == old or not isinstance(getattr(self, name), bool):
            return
        bit, defaults = _NVFP4_SWITCHES[name]
        off = getattr(self, name)
        for role in _NVFP4_ROLES:
            q = getattr(self, role)
            if isinstance(q, QParams) and (role in defaults or off):
                object.__setattr__(self, role, dataclasses.replace(q, **{bit: role in defaults and not off}))

    def _validate(self) -> None:
        _check_backward_override(self)
        if self.fp4_format == "E2M1":  # the string this package took before TE's Format.E2M1
            object.__setattr__(self, "fp4_format", Format.E2M1)
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"NVFP4 supports fp4_format=Format.E2M1 only, got {self.fp4_format!r}")
        _check_format(self)
        for name in ("row_scaled_activation", *_NVFP4_SWITCHES):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"NVFP4BlockScaling.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            if getattr(self, name) not in _NVFP4_4OVER6_SCOPES:
                raise ValueError(f"NVFP4BlockScaling.{name} must be one of {_NVFP4_4OVER6_SCOPES}, "
                                 f"got {getattr(self, name)!r}")
        mode = self.nvfp4_4over6_err_mode
        if not isinstance(mode, str) or mode.upper() not in _NVFP4_4OVER6_ERR_MODES:
            raise ValueError(f"NVFP4BlockScaling.nvfp4_4over6_err_mode must be one of {_NVFP4_4OVER6_ERR_MODES}, "
                             f"got {mode!r}")
        object.__setattr__(self, "nvfp4_4over6_err_mode", mode.upper())  # TE upper-cases its variable too
        for role in _NVFP4_ROLES:
            if getattr(self, role) is None:
                object.__setattr__(self, role, QParams(**{bit: not getattr(self, switch)
                                                          for switch, (bit, roles) in _NVFP4_SWITCHES.items()
                                                          if role in roles}))
        self._check_roles()

    def _check_roles(self) -> None:
        """Each role's QParams: NVFP4's options only, none its switch turns off, and none the
        role's quantizer cannot combine."""
        four_over_six = {"fp4_quant_fwd_inp": ("activations", "all"), "fp4_quant_fwd_weight": ("weights", "all")}
        for role in _NVFP4_ROLES:
            q, where = getattr(self, role), f"NVFP4BlockScaling.{role}"
            if not isinstance(q, QParams):
                raise TypeError(f"{where} must be a recipe.QParams, got {q!r}")
            if q.power_2_scale or q.amax_epsilon:
                raise ValueError(f"{where}: NVFP4 uses only random_hadamard_transform, stochastic_rounding and "
                                 f"fp4_2d_quantization, got {q!r}")
            for switch, (bit, _) in _NVFP4_SWITCHES.items():
                if getattr(self, switch) and getattr(q, bit):
                    raise ValueError(f"{where}.{bit}=True contradicts {switch}=True")
            if q.random_hadamard_transform and q.fp4_2d_quantization:
                raise ValueError(f"{where}: random_hadamard_transform cannot be combined with fp4_2d_quantization")
            if self.nvfp4_4over6 in four_over_six.get(role, ()) and (q.random_hadamard_transform or
                                                                     q.stochastic_rounding):
                raise ValueError(f"NVFP4BlockScaling: nvfp4_4over6={self.nvfp4_4over6!r} needs disable_rht=True "
                                 f"and no stochastic rounding in {role} (4over6 has no such kernel, in TE either)")
        inp = self.fp4_quant_fwd_inp
        if self.row_scaled_activation and (inp.random_hadamard_transform or inp.stochastic_rounding
                                           or inp.fp4_2d_quantization):
            raise ValueError("NVFP4BlockScaling: row_scaled_activation=True needs disable_rht=True and an "
                             "fp4_quant_fwd_inp without other options (row-scaled NVFP4 has no random Hadamard "
                             "transform, 2D blocks or stochastic rounding, in TE either)")


@dataclass(frozen=True)
class QuantizerRole:
    """Which tensor a `CustomRecipe` factory is asked to quantize (TE's `QuantizerRole`)."""

    module_type: str = ""
    tensor_type: str = ""
    name: str = ""


@dataclass
class CustomRecipe(Recipe):
    """A quantizer per GEMM operand from the user's factory: `qfactory(role)` gets a
    `quantization.QuantizerRole` (`module_type="linear"`, `tensor_type` "input", "weight" or
    "grad_output"; `name` is empty: quantizers are per recipe here, not per layer) and returns a
    stateless quantizer. The three must be one format (the GEMM takes operands of one format);
    delayed scaling keeps its state in the modules, so it is `DelayedScaling`, not a factory."""

    qfactory: Callable[[Any], Any]
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    quantization_alignment: int = 128
    backward_override: Optional[str] = _backward_override_field()

    def _validate(self) -> None:
        _check_backward_override(self)
        if not callable(self.qfactory):
            raise TypeError(f"CustomRecipe.qfactory must be callable, got {type(self.qfactory).__name__}")
        if self.quantization_alignment <= 0:
            raise ValueError(f"CustomRecipe.quantization_alignment must be positive, "
                             f"got {self.quantization_alignment}")


def replace(recipe: Recipe, **changes) -> Recipe:
    """A copy of `recipe` with `changes` assigned, as edits of the copy (checked, and an NVFP4
    switch updates the roles' QParams as an edit does; `dataclasses.replace` would rebuild the
    copy from the fields, where a changed switch and the old QParams can contradict)."""
    new = copy.copy(recipe)
    for name, value in changes.items():
        setattr(new, name, value)
    return new
