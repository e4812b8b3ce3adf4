"""Decoding quantized tensors for statistics and dumps, per format and usage.

`usage_view(q, x, columnwise)` puts the original tensor x and the quantized values side by side in
the quantized buffer's own layout (transposed for columnwise buffers stored as (K, M), after the
random Hadamard transform for NVFP4 columnwise data that had it), with the mask of saturated codes
and the effective scale_inv of every block. `internals(q)` decodes every buffer into plain tensors
with plain (row-major, unswizzled) scale layouts, and `reconstruct(internals)` rebuilds the
dequantized tensor from them alone, bit for bit.

The decoding is each format's own (its module under `tensor/`: `format_name`, `debug_usage_view`,
`debug_internals`, `debug_reconstruct` on the storage; `DEBUG_RECIPE` and `debug_quantizer` on the
quantizer); this file names no format.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from ..tensor import QuantizedTensor
from ..tensor.format_api import UsageView
from ..tensor.quantizer import debug_recipe_names, quantizer_class_by_debug_recipe
from ..tensor.storage import storage_class_by_format

# RECIPE_NAMES is served by the module __getattr__ below
__all__ = ["RECIPE_NAMES", "recipe_name", "tensor_recipe_name", "new_quantizer", "usage_view",  # noqa: F822
           "internals", "reconstruct", "UsageView"]

SCALE_LAYOUT = "plain"  # row-major, one scale per block, no swizzle/padding (see internals())


def __getattr__(name):
    """`RECIPE_NAMES`: every format's DEBUG_RECIPE, read when asked (a format defined later counts):
    ("fp8_delayed_scaling", "fp8_current_scaling", "mxfp8", "fp8_block_scaling", "nvfp4")."""
    if name == "RECIPE_NAMES":
        return debug_recipe_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def recipe_name(quantizer) -> str:
    """TE's recipe name for a quantizer ('' for None: high precision): its `debug_recipe_name()`."""
    return "" if quantizer is None else quantizer.debug_recipe_name()


def tensor_recipe_name(q) -> str:
    """The format family of a quantized tensor (per-tensor FP8 tensors do not say which recipe):
    its `format_name()`."""
    _check(q)
    return q.format_name()


def new_quantizer(recipe: str, fp8_dtype: Optional[torch.dtype], tensor_name: str):
    """A quantizer of `recipe` for a tensor role, for stats of a recipe other than the current one."""
    try:
        cls = quantizer_class_by_debug_recipe(recipe)
    except KeyError:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {debug_recipe_names()}") from None
    return cls.debug_quantizer(fp8_dtype, tensor_name)  # the format's own choice


def _x2d(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]).float()


def _check(q) -> None:
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"unsupported quantized tensor {type(q).__name__}")


def usage_view(q, x: torch.Tensor, columnwise: bool) -> UsageView:
    """The format's `debug_usage_view` of the original x as (M, K) float32."""
    _check(q)
    return q.debug_usage_view(_x2d(x), columnwise)


# ---- dumps ------------------------------------------------------------------------------------------
def internals(q) -> Dict[str, object]:
    """Every buffer of `q`, decoded; enough to rebuild the dequantized tensor with `reconstruct`.

    Data stays in its storage dtype (fp8), except NVFP4 data, unpacked to float32 E2M1 values.
    Scales: fp32 scale_inv (per-tensor FP8, blockwise), float8_e8m0fnu (MXFP8), float8_e4m3fn plus
    the fp32 amax and global encode scale (NVFP4). Layouts are plain row-major: rowwise buffers are
    (M, K) with M the product of the leading dims; columnwise buffers are the (K, M) transpose,
    except MXFP8 whose columnwise data is (M, K) with (M/32, K) scales. Blockwise 1x128 scales,
    stored outer-dim-major for the GEMM, are saved contiguous. NVFP4 columnwise data that went
    through the random Hadamard transform comes with `rht_matrix` H (16x16): values = (data
    blocks of 16 along M) @ H undoes it (`reconstruct` uses the kernel's own butterfly, bitwise).
    """
    shape = tuple(q.shape)
    out: Dict[str, object] = {"format": tensor_recipe_name(q), "shape": shape, "scale_layout": SCALE_LAYOUT,
                              "hp_dtype": str(q.dtype).replace("torch.", "")}

    def put(name, t):
        if t is not None:
            out[name] = t.detach().contiguous().clone()

    for name, value in q.debug_internals().items():  # the format's own decoding
        if isinstance(value, torch.Tensor):
            put(name, value)
        elif value is not None:
            out[name] = value
    return out


def reconstruct(d: Dict[str, object], usage: Optional[str] = None) -> torch.Tensor:
    """float32 dequantized tensor (logical shape) from `internals()` output, using plain torch only.
    `usage`: 'rowwise' or 'columnwise' (default: rowwise when present)."""
    usage = usage or ("rowwise" if "rowwise_data" in d else "columnwise")
    if f"{usage}_data" not in d:
        raise KeyError(f"dump holds no {usage} data (keys: {sorted(d)})")
    shape, fmt = tuple(d["shape"]), d["format"]
    try:
        cls = storage_class_by_format(fmt)
    except KeyError:
        raise ValueError(f"unknown dump format {fmt!r}") from None
    vals, transposed = cls.debug_reconstruct(d, usage)  # the format's own decoding
    if transposed:
        vals = vals.t()
    return vals.reshape(shape)
