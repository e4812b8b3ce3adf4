"""`convert_model`: any PyTorch / Hugging Face model onto TE-proto modules in one call.

torchao's `convert_to_float8_training(model, module_filter_fn=...)` is the model: walk the module
tree and swap, in place, every `torch.nn.Linear` for a `te.Linear` (and, when asked, every norm
whose math `te.LayerNorm` / `te.RMSNorm` reproduce) holding the SAME Parameter objects, so tied
weights, optimizer state, `requires_grad`, device and dtype carry over. Layers that cannot be
converted stay as they are, listed in one warning.
"""
from __future__ import annotations

import warnings
import weakref
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import recipe as R
from ..tensor.quantizer import HIGH_PRECISION_DTYPES
from .base import TransformerEngineBaseModule, _recipe_shape_error
from .linear import Linear
from .normalization import LayerNorm, RMSNorm

__all__ = ["convert_model", "ConversionWarning"]

FilterFn = Callable[[nn.Module, str], bool]


class ConversionWarning(UserWarning):
    """Layers `convert_model` left in high precision (one warning per call, new layers only)."""


# the (module -> reasons) already warned about: converting twice warns nothing new
_WARNED: "weakref.WeakKeyDictionary[nn.Module, set]" = weakref.WeakKeyDictionary()


def _no_init(weight: torch.Tensor) -> None:
    """The fresh weight is replaced by the original Parameter: skip the kaiming init."""


# ---- what can be converted ----------------------------------------------------------------
def _tensor_problem(what: str, t: Optional[torch.Tensor]) -> str:
    if t is None:
        return ""
    if type(t.data) is not torch.Tensor:  # DTensor (FSDP2 / TP), a quantized weight, ...
        return f"{what} is a {type(t.data).__name__}, not a plain tensor (convert before sharding or quantizing)"
    if t.dtype not in HIGH_PRECISION_DTYPES:
        return f"{what} dtype {t.dtype} is not float32 / bfloat16 / float16"
    return ""


def _linear_problem(m: nn.Linear, recipes: Sequence, min_multiple: int) -> str:
    """'' when `m` can become a te.Linear that runs every recipe in `recipes`, else why not."""
    problem = _tensor_problem("weight", m.weight) or _tensor_problem("bias", m.bias)
    if problem:
        return problem
    out_f, in_f = m.weight.shape
    if min_multiple > 1 and (in_f % min_multiple or out_f % min_multiple):
        return (f"in_features={in_f}, out_features={out_f}: not both multiples of {min_multiple} "
                f"(min_multiple; FP8 GEMMs need 16)")
    from ..custom_ops.recipe_key import RecipeKey

    for recipe in recipes:
        error = _recipe_shape_error(RecipeKey.of(recipe), ((out_f, in_f),))
        if error:
            return f"{type(recipe).__name__}: {error}"
    return ""


def _llama_rmsnorm_code():
    """The forward bytecode of HF's LlamaRMSNorm (Mistral, Qwen2/3, Phi3 copy it), or None."""
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except Exception:  # transformers is optional
        return None
    return LlamaRMSNorm.forward.__code__


def _same_code(a, b) -> bool:
    return a.co_code == b.co_code and a.co_consts == b.co_consts and a.co_names == b.co_names


def _is_hf_llama_rmsnorm(m: nn.Module) -> bool:
    if not type(m).__module__.startswith("transformers.") or not hasattr(m, "variance_epsilon"):
        return False
    ref = _llama_rmsnorm_code()
    forward = getattr(type(m).forward, "__code__", None)
    return ref is not None and forward is not None and _same_code(forward, ref)


def _looks_like_norm(m: nn.Module) -> bool:
    name = type(m).__name__.lower()
    return "layernorm" in name or "rmsnorm" in name


_NormSpec = Tuple[type, int, Optional[float], nn.Parameter, Optional[nn.Parameter]]


def _norm_spec(m: nn.Module) -> Union[None, str, _NormSpec]:
    """None: not a norm; a str: a norm we do not convert, and why; else
    (te class, hidden size, eps, weight, bias) of a norm whose math we reproduce: elementwise
    affine, normalized over the last dim only."""
    if isinstance(m, TransformerEngineBaseModule):
        return None  # ours already
    if type(m) in (nn.LayerNorm, nn.RMSNorm):
        kind = LayerNorm if type(m) is nn.LayerNorm else RMSNorm
        if len(m.normalized_shape) != 1:
            return f"normalized_shape {tuple(m.normalized_shape)} spans more than the last dim"
        if m.weight is None:
            return "elementwise_affine=False (te norms always have a weight)"
        bias = getattr(m, "bias", None)
        if kind is LayerNorm and bias is None:
            return "bias=False (te.LayerNorm always has a bias)"
        # eps=None: torch takes the machine epsilon of its compute type, float32 for every dtype
        # the te norms accept (fp32 / bf16 / fp16), which is what te computes in as well
        eps = torch.finfo(torch.float32).eps if m.eps is None else m.eps
        return kind, m.normalized_shape[0], eps, m.weight, bias
    if _is_hf_llama_rmsnorm(m):
        weight = getattr(m, "weight", None)
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            return "weight is not a 1-D Parameter"
        return RMSNorm, weight.shape[0], float(m.variance_epsilon), weight, None
    if _looks_like_norm(m):
        return (f"{type(m).__name__} is not a norm whose math te.LayerNorm / te.RMSNorm reproduce "
                f"(recognised: torch.nn.LayerNorm, torch.nn.RMSNorm, Hugging Face Llama-style RMSNorm)")
    return None


# ---- building the replacements ------------------------------------------------------------
def _new_linear(m: nn.Linear, fqn: str) -> Linear:
    w = m.weight
    new = Linear(m.in_features, m.out_features, bias=m.bias is not None, params_dtype=w.dtype,
                 device=w.device, init_method=_no_init, name=fqn or None)
    new.weight = w
    if m.bias is not None:
        new.bias = m.bias
    return new.train(m.training)


def _new_norm(spec, m: nn.Module, fqn: str) -> nn.Module:
    cls, hidden, eps, weight, bias = spec
    new = cls(hidden, eps, params_dtype=weight.dtype, device=weight.device, name=fqn or None)
    new.weight = weight
    if bias is not None:
        new.bias = bias
    return new.train(m.training)


def _children(module: nn.Module, prefix: str) -> Iterable[Tuple[nn.Module, str, nn.Module, str]]:
    """(parent, attribute, child, qualified name), depth first; TE-proto modules are not entered."""
    for attr, child in list(module._modules.items()):
        if child is None:
            continue
        fqn = f"{prefix}.{attr}" if prefix else attr
        yield module, attr, child, fqn
        if not isinstance(child, TransformerEngineBaseModule):
            yield from _children(child, fqn)


def _recipe_list(recipe) -> List:
    if recipe is None:
        return []
    recipes = list(recipe) if isinstance(recipe, (list, tuple)) else [recipe]
    for r in recipes:
        R.require_recipe(r, "convert_model(recipe=...)")
    return recipes


# ---- the entry point ----------------------------------------------------------------------
def convert_model(model: nn.Module, *, module_filter_fn: Optional[FilterFn] = None, convert_norms: bool = False,
                  recipe=None, min_multiple: int = 16) -> nn.Module:
    """Swap `model`'s layers for TE-proto modules in place and return `model`.

    Every module whose type is exactly `torch.nn.Linear` becomes a `te.Linear` (subclasses such as
    `nn.MultiheadAttention`'s out_proj, parametrized or already-quantized layers are not touched).
    With `convert_norms=True`, `torch.nn.LayerNorm`, `torch.nn.RMSNorm` and Hugging Face's
    Llama-style RMSNorm (Llama, Mistral, Qwen2/3, Phi3: recognised by their forward's bytecode)
    become `te.LayerNorm` / `te.RMSNorm`, when they are elementwise-affine over the last dim only.

    The new modules hold the original Parameter objects (tied weights stay tied, optimizer state
    and `requires_grad` carry over) on their device and dtype, keep `training`, and are named
    with their qualified name (`model.layers.0.self_attn.q_proj`) for the debug tools.
    `module_filter_fn(module, fqn) -> bool` picks which candidates to convert (False: left alone,
    no warning), e.g. `lambda m, fqn: fqn != "lm_head"`.

    Shapes: by default a Linear is converted only when in_features and out_features are both
    multiples of `min_multiple=16`: FP8 GEMMs (cuBLASLt / torch._scaled_mm) need that, and every
    recipe except MXFP8 (32) accepts such weights; other shapes would run an emulated GEMM,
    slower than high precision. `recipe=` (a recipe or a list of them) adds each recipe's own rule
    (MXFP8: multiples of 32; NVFP4: 16; blockwise pads any shape). Layers that fail stay in high
    precision, listed with the reason in ONE `ConversionWarning`; a second call converts nothing
    new and repeats no warning. If `model` itself is a Linear / norm, the new module is returned.

    Parameter names and state-dict keys stay those of the original model; te.Linear adds its
    recipe state buffers under `<name>.gemm.*` (unexpected keys for the unconverted model: load a
    plain checkpoint with strict=False, or before converting). te norms compute in float32 and
    round once, where HF's RMSNorm rounds the normalized value to the input dtype before scaling
    (about one bf16 ulp apart), and return the input's dtype (HF promotes to the weight's dtype
    when the two differ). Hooks registered on a replaced module are not carried over: convert
    before registering hooks, sharding (FSDP2 / TP) or compiling.
    """
    recipes = _recipe_list(recipe)
    memo = {}  # id(old module) -> its replacement: a module shared at two places is converted once
    skipped = []

    def replacement(child: nn.Module, fqn: str) -> Optional[nn.Module]:
        if id(child) in memo:
            return memo[id(child)]
        spec = None
        if type(child) is not nn.Linear:
            spec = _norm_spec(child) if convert_norms else None
            if spec is None:
                return None
        if module_filter_fn is not None and not module_filter_fn(child, fqn):
            return None
        problem = spec if isinstance(spec, str) else (
            _linear_problem(child, recipes, min_multiple) if spec is None
            else _tensor_problem("weight", spec[3]) or _tensor_problem("bias", spec[4]))
        if problem:
            skipped.append((child, fqn, problem))
            return None
        new = _new_linear(child, fqn) if spec is None else _new_norm(spec, child, fqn)
        memo[id(child)] = new
        return new

    root = replacement(model, "")
    if root is None:
        for parent, attr, child, fqn in _children(model, ""):
            new = replacement(child, fqn)
            if new is not None:
                setattr(parent, attr, new)
    _warn_skipped(skipped)
    return model if root is None else root


def _warn_skipped(skipped) -> None:
    new = []
    for module, fqn, problem in skipped:
        seen = _WARNED.setdefault(module, set())
        if problem not in seen:
            seen.add(problem)
            new.append(f"  {fqn or '<root>'} ({type(module).__name__}): {problem}")
    if new:
        warnings.warn(f"convert_model: {len(new)} layer(s) left in high precision:\n" + "\n".join(new),
                      ConversionWarning, stacklevel=3)
