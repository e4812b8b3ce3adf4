"""Shared behaviour of TE-proto modules: naming, input checks, recipe preparation."""
from __future__ import annotations

import functools
import inspect
import itertools
import warnings
from typing import Optional

import torch
from torch import nn

from ..autocast import FP8GlobalState, get_fp8_recipe, get_fp8_recipe_key
from ..debug import state as _debug_state  # precision debug tools: GEMM routing by layer name
from ..distributed import tp as _tp
from ..distributed.gemm_owner import GemmOwner
from ..errors import raise_error, shape_str
from ..tensor.quantizer import HIGH_PRECISION_DTYPES
from .delayed_wgrad import DelayedWgrad

__all__ = ["TransformerEngineBaseModule", "rename_state_dict_keys"]

_counter = itertools.count()
# ---- precision debug tools: TE-style default layer names (`layernorm_linear_3`, ...)
_DEFAULT_NAMES = {"LayerNormLinear": "layernorm_linear", "LayerNormMLP": "layernorm_mlp",
                  "TransformerLayer": "transformer_layer", "RMSNorm": "rmsnorm", "LayerNorm": "layernorm",
                  "DotProductAttention": "dot_product_attention", "MultiheadAttention": "multihead_attention",
                  "GroupedLinear": "grouped_linear"}
# ---- end debug


def autocast_operands(inp: torch.Tensor, *params: Optional[torch.Tensor]) -> tuple:
    """`(inp, *params)` cast to torch.autocast's dtype where it is on for the input's device, else
    as given: TE's activation dtype. TE's modules (GEMMs and norms) compute in it, so under AMP
    their output has it; autograd returns each gradient in its own tensor's dtype."""
    device = inp.device.type
    if not torch.is_autocast_enabled(device):
        return (inp, *params)
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in (inp, *params))


class _RegisteredWhenBuilt(type):
    """Registers a module with `autocast` once its constructor has returned: a constructor that
    raises (an unsupported argument) leaves no half-built module for the next autocast entry to
    prepare."""

    def __call__(cls, *args, **kwargs):
        module = super().__call__(*args, **kwargs)
        FP8GlobalState.register_module(module)
        return module

    @property
    def __signature__(cls):
        """The constructor's (`inspect.signature(te.Linear)` would show `__call__`'s otherwise)."""
        sig = inspect.signature(cls.__init__)
        return sig.replace(parameters=list(sig.parameters.values())[1:])


class TransformerEngineBaseModule(DelayedWgrad, GemmOwner, nn.Module, metaclass=_RegisteredWhenBuilt):
    """Registered (when built) so `autocast` can prepare recipe state before any compiled graph runs."""

    def __init__(self, name: Optional[str] = None):
        super().__init__()
        prefix = _DEFAULT_NAMES.get(type(self).__name__, type(self).__name__.lower())
        self.name = name if name is not None else f"{prefix}_{next(_counter)}"
        self.wgrad_accumulation_and_reduce_hooks = []  # run by backward_dw (delay_wgrad_compute)

    _tp_group_name = None  # tensor-parallel modules set it (the group is kept by name)

    @property
    def tp_group(self):
        """The tensor-parallel process group (kept by name, so the module deep-copies / pickles)."""
        if self._tp_group_name is None:
            return None
        return _tp.group_by_name(self._tp_group_name)

    def __setstate__(self, state):
        # deepcopy / unpickling skip __init__: register the copy so autocast prepares it too
        super().__setstate__(state)
        FP8GlobalState.register_module(self)

    def gemm_weights(self):
        """(QuantizedGemm, weight) pairs of this module."""
        return []

    def gemm_weight_shapes(self) -> tuple:
        """Each GEMM weight's shape (a module whose GEMM weight is computed overrides it)."""
        return tuple(tuple(w.shape) for _, w in self.gemm_weights())

    def tp_sharded_gemms(self):
        """Every GEMM of a column / row parallel module over 2+ ranks (LayerNormMLP overrides)."""
        if self._tp_group_name is None or self.tp_size < 2 or getattr(self, "parallel_mode", None) is None:
            return []
        return [(gemm, self._tp_group_name, self.parallel_mode) for gemm, _ in self.gemm_weights()]

    def prepare_for_recipe(self, recipe, entered, key: str) -> list:
        """Autocast entry: `recipe` is the user's object (TE's fp8_meta["recipe"]); the GEMMs
        prepare for `entered`, its fields at entry (`RecipeKey.recipe(key)`). Returns them (the
        non-finite poll and the delayed-scaling update use them)."""
        self.__dict__["_last_recipe"] = recipe  # a plain attribute: no nn.Module.__setattr__ lookups per entry
        gemms = []
        for gemm, weight in self.gemm_weights():
            gemm.prepare_for_recipe(entered, weight, key)
            gemms.append(gemm)
        return gemms

    def _check_input(self, inp: torch.Tensor, features: int, what: str = "input") -> None:
        if not isinstance(inp, torch.Tensor):
            raise_error(TypeError, f"{self.name}: {what} must be a torch.Tensor, got {type(inp).__name__}")
        if inp.dtype not in HIGH_PRECISION_DTYPES:
            raise_error(TypeError, f"{self.name}: {what} dtype {inp.dtype} is not supported "
                                   "(float32, bfloat16, float16)")
        shape = inp.shape
        if not shape or shape[-1] != features:
            raise_error(ValueError, f"{self.name}: {what} last dim must be {features}, "
                                    f"got shape {shape_str(inp)}")
        if not torch.compiler.is_compiling():
            recipe = get_fp8_recipe()
            if recipe is not None:
                self._note_recipe_type(type(recipe))
                self._note_quantized_weights_recipe(get_fp8_recipe_key())
        # ---- precision debug tools: name this module's GEMMs for TE's debug API calls
        if _debug_state.SESSION.active:
            _debug_state.begin_forward(self)
        # ---- end debug

    def _note_recipe_type(self, recipe_type: type) -> None:
        """TE's warning when a module's recipe changes type between forwards (state built for the
        old recipe, a stored weight's format, no longer match); once per change, eager forwards."""
        previous = self.__dict__.get("_forward_recipe_type")
        if previous is not None and not (issubclass(recipe_type, previous) or issubclass(previous, recipe_type)):
            warnings.warn(f"{self.name}: Recipe type changed from {previous.__name__} to {recipe_type.__name__}. "
                          "This may affect model behavior.", UserWarning, stacklevel=4)
        self.__dict__["_forward_recipe_type"] = recipe_type

    def _note_quantized_weights_recipe(self, key: str) -> None:
        """TE's "Quantizer is being updated" warning: weights stored quantized (quantized_model_init)
        under one recipe, run under another; once per change, eager forwards."""
        made = self.__dict__.get("quantized_weights_key")
        if made is not None and made != key:
            self.__dict__["quantized_weights_key"] = key
            warnings.warn(f"{self.name}: Quantizer is being updated, this may affect model behavior (its weights "
                          "were stored quantized by quantized_model_init under another recipe than this forward's; "
                          "they keep their format)", UserWarning, stacklevel=4)

    def _check_gemm_module(self) -> None:
        """What a GEMM module checks at its entry, naming itself: delay_wgrad_compute is not traced,
        and the recipe's blocks divide each weight. `QuantizedGemm.forward` checks both for the
        GEMM it runs when given its `owner`; modules that quantize before their GEMM (a norm fused
        with the quantize) or run their GEMMs elsewhere call this first."""
        self.check_delay_wgrad_traceable()
        if get_fp8_recipe() is not None:
            check_recipe_shapes(self, get_fp8_recipe_key(), self.gemm_weight_shapes())


def rename_state_dict_keys(state_dict, prefix: str, renames: dict) -> None:
    """Load-state-dict pre-hook body: keys `prefix + old...` become `prefix + new...` (checkpoints
    written before a parameter or submodule took TE's name)."""
    for old, new in renames.items():
        for key in [k for k in state_dict if k.startswith(prefix + old)]:
            state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)


def check_recipe_shapes(owner, key: str, weight_shapes) -> None:
    """Fail early, naming the module `owner`, when the recipe of `key` cannot quantize a weight (its
    name is read only then: a traced forward reads no attribute it does not need)."""
    error = _recipe_shape_error(key, weight_shapes)
    if error:
        raise_error(ValueError, f"{owner.name}: recipe {type(get_fp8_recipe()).__name__} cannot quantize "
                                f"this layer: {error}")


@torch._dynamo.assume_constant_result
def _recipe_shape_error(key: str, weight_shapes) -> str:
    """'' if every weight (and its input's last dim) suits the recipe, else the reason.
    Evaluated once at trace time: quantizer construction stays out of compiled graphs."""
    if all(type(d) is int for shape in weight_shapes for d in shape):
        return _shape_error(key, weight_shapes)
    return _shape_error.__wrapped__(key, weight_shapes)  # symbolic sizes are no cache keys


@functools.lru_cache(maxsize=1024)
def _shape_error(key: str, weight_shapes) -> str:
    """`_recipe_shape_error`, once per recipe key and shapes (eager forwards ask every call)."""
    from ..custom_ops.recipe_key import RecipeKey

    q = RecipeKey.quantizers(key)
    if not q.enabled:  # a recipe keeping every GEMM in high precision (identity quantizers)
        return ""
    for shape in weight_shapes:
        try:
            q.weight.check_shape(shape)
            q.input.with_usage(rowwise=True, columnwise=False).check_shape((1, shape[1]))
        except ValueError as e:
            return str(e)
    return ""
