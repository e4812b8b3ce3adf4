"""Decoding quantized tensors for statistics and dumps, per format and usage.

`usage_view(q, x, columnwise)` puts the original tensor x and the quantized values side by side in
the quantized buffer's own layout (transposed for columnwise buffers stored as (K, M), after the
random Hadamard transform for NVFP4 columnwise data that had it), with the mask of saturated codes
and the effective scale_inv of every block. `internals(q)` decodes every buffer into plain tensors
with plain (row-major, unswizzled) scale layouts, and `reconstruct(internals)` rebuilds the
dequantized tensor from them alone, bit for bit.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch

from ..kernels.reference.blockwise import expand_tiles
from ..kernels.reference.common import FP8_MAX
from ..kernels.reference.nvfp4 import _apply_rht, global_encode_scale, rht_matrix, unpack_fp4, unpack_fp4_codes
from ..tensor import (Float8BlockQuantizer, Float8BlockwiseQTensor, Float8CurrentScalingQuantizer, Float8Quantizer,
                      Float8Tensor, MXFP8Quantizer, MXFP8Tensor, NVFP4Quantizer, NVFP4Tensor)

__all__ = ["RECIPE_NAMES", "recipe_name", "tensor_recipe_name", "new_quantizer", "usage_view", "internals",
           "reconstruct", "UsageView"]

RECIPE_NAMES = ("fp8_delayed_scaling", "fp8_current_scaling", "mxfp8", "fp8_block_scaling", "nvfp4")
SCALE_LAYOUT = "plain"  # row-major, one scale per block, no swizzle/padding (see internals())


def recipe_name(quantizer) -> str:
    """TE's recipe name for a quantizer ('' for None: high precision)."""
    if quantizer is None:
        return ""
    for cls, name in ((Float8Quantizer, "fp8_delayed_scaling"), (Float8CurrentScalingQuantizer, "fp8_current_scaling"),
                      (MXFP8Quantizer, "mxfp8"), (Float8BlockQuantizer, "fp8_block_scaling"),
                      (NVFP4Quantizer, "nvfp4")):
        if isinstance(quantizer, cls):
            return name
    raise TypeError(f"unsupported quantizer {type(quantizer).__name__}")


def tensor_recipe_name(q) -> str:
    """The format family of a quantized tensor (per-tensor FP8 tensors do not say which recipe)."""
    for cls, name in ((Float8Tensor, "fp8_per_tensor"), (MXFP8Tensor, "mxfp8"),
                      (Float8BlockwiseQTensor, "fp8_block_scaling"), (NVFP4Tensor, "nvfp4")):
        if isinstance(q, cls):
            return name
    raise TypeError(f"unsupported quantized tensor {type(q).__name__}")


def new_quantizer(recipe: str, fp8_dtype: Optional[torch.dtype], tensor_name: str):
    """A quantizer of `recipe` for a tensor role, for stats of a recipe other than the current one."""
    dtype = fp8_dtype or torch.float8_e4m3fn
    if recipe == "fp8_current_scaling":
        return Float8CurrentScalingQuantizer(dtype)
    if recipe == "mxfp8":
        return MXFP8Quantizer(dtype)
    if recipe == "fp8_block_scaling":
        return Float8BlockQuantizer(dtype, block_scaling_dim=2 if tensor_name == "weight" else 1)
    if recipe == "nvfp4":
        return NVFP4Quantizer(with_2d_quantization=tensor_name == "weight")
    if recipe == "fp8_delayed_scaling":
        raise ValueError("stats of fp8_delayed_scaling need the DelayedScaling recipe to be the training recipe "
                         "(its scales come from the amax history)")
    raise ValueError(f"unknown recipe {recipe!r}; expected one of {RECIPE_NAMES}")


class UsageView(NamedTuple):
    x: torch.Tensor  # float32 original values in the buffer layout
    dq: torch.Tensor  # float32 dequantized values, same layout
    saturated: torch.Tensor  # bool: the code is the format's largest magnitude
    scale_inv: torch.Tensor  # float32 effective scale_inv of every block


def _x2d(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1, x.shape[-1]).float()


def usage_view(q, x: torch.Tensor, columnwise: bool) -> UsageView:
    x2d = _x2d(x)
    m, k = x2d.shape
    if isinstance(q, Float8Tensor):
        data = q._transpose if columnwise else q._data.reshape(m, k)
        xs = x2d.t() if columnwise else x2d
        si = q._scale_inv.float()
        return UsageView(xs, data.float() * si, data.float().abs() == FP8_MAX[q.fp8_dtype], si)
    if isinstance(q, MXFP8Tensor):
        data = (q._columnwise_data if columnwise else q._rowwise_data).reshape(m, k).float()
        s = (q._columnwise_scale_inv if columnwise else q._rowwise_scale_inv).float()
        dq = (data.reshape(m // 32, 32, k) * s.unsqueeze(1) if columnwise
              else data.reshape(m, k // 32, 32) * s.unsqueeze(2)).reshape(m, k)
        return UsageView(x2d, dq, data.abs() == FP8_MAX[q.fp8_dtype], s)
    if isinstance(q, Float8BlockwiseQTensor):
        data = q._columnwise_data if columnwise else q._rowwise_data.reshape(m, k)
        s = (q._columnwise_scale_inv if columnwise else q._rowwise_scale_inv).float()
        r, c = data.shape
        dq = data.float() * expand_tiles(s, q._block_rows, r, c)
        return UsageView(x2d.t() if columnwise else x2d, dq, data.float().abs() == FP8_MAX[q.fp8_dtype], s)
    if isinstance(q, NVFP4Tensor):
        if columnwise:
            data, s, amax = q._columnwise_data, q._columnwise_scale_inv, q._amax_columnwise
            xs = x2d.t().contiguous()
            if q.with_rht:
                xs = _apply_rht(xs, q.rht_seed)
        else:
            data, s, amax, xs = q._rowwise_data, q._rowwise_scale_inv, q._amax_rowwise, x2d
        vals = unpack_fp4(data)
        r, c = vals.shape
        enc = global_encode_scale(amax)
        dq = ((vals.reshape(r, c // 16, 16) * s.float().unsqueeze(-1)) / enc).reshape(r, c)
        sat = (unpack_fp4_codes(data) & 7) == 7
        return UsageView(xs, dq, sat, s.float() / enc)
    raise TypeError(f"unsupported quantized tensor {type(q).__name__}")


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
    m = 1
    for s in shape[:-1]:
        m *= s
    out: Dict[str, object] = {"format": tensor_recipe_name(q), "shape": shape, "scale_layout": SCALE_LAYOUT,
                              "hp_dtype": str(q.dtype).replace("torch.", "")}

    def put(name, t):
        if t is not None:
            out[name] = t.detach().contiguous().clone()

    if isinstance(q, Float8Tensor):
        out["fp8_dtype"] = str(q.fp8_dtype).replace("torch.", "")
        put("rowwise_data", None if q._data is None else q._data.reshape(m, shape[-1]))
        put("columnwise_data", q._transpose)
        put("scale_inv", q._scale_inv)
    elif isinstance(q, (MXFP8Tensor, Float8BlockwiseQTensor)):
        out["fp8_dtype"] = str(q.fp8_dtype).replace("torch.", "")
        if isinstance(q, MXFP8Tensor):
            out["block_size"] = 32
            put("rowwise_data", None if q._rowwise_data is None else q._rowwise_data.reshape(m, shape[-1]))
            put("columnwise_data", None if q._columnwise_data is None else q._columnwise_data.reshape(m, shape[-1]))
        else:
            out["block_scaling_dim"] = q.block_scaling_dim
            put("rowwise_data", None if q._rowwise_data is None else q._rowwise_data.reshape(m, shape[-1]))
            put("columnwise_data", q._columnwise_data)
        put("rowwise_scale_inv", q._rowwise_scale_inv)
        put("columnwise_scale_inv", q._columnwise_scale_inv)
    elif isinstance(q, NVFP4Tensor):
        out.update(with_rht=bool(q.with_rht), rht_seed=int(q.rht_seed),
                   with_2d_quantization=bool(q.with_2d_quantization))
        for usage in ("rowwise", "columnwise"):
            data = getattr(q, f"_{usage}_data")
            if data is None:
                continue
            amax = getattr(q, f"_amax_{usage}")
            put(f"{usage}_data", unpack_fp4(data))
            put(f"{usage}_scale_inv", getattr(q, f"_{usage}_scale_inv"))
            put(f"amax_{usage}", amax)
            put(f"{usage}_global_encode_scale", global_encode_scale(amax))
        if q.with_rht and q._columnwise_data is not None:
            put("rht_matrix", rht_matrix(q.rht_seed, q._columnwise_data.device))
    else:
        raise TypeError(f"unsupported quantized tensor {type(q).__name__}")
    return out


def _expand(s: torch.Tensor, rows: int, r: int, c: int) -> torch.Tensor:
    return s.repeat_interleave(rows, 0)[:r].repeat_interleave(128, 1)[:, :c]


def reconstruct(d: Dict[str, object], usage: Optional[str] = None) -> torch.Tensor:
    """float32 dequantized tensor (logical shape) from `internals()` output, using plain torch only.
    `usage`: 'rowwise' or 'columnwise' (default: rowwise when present)."""
    usage = usage or ("rowwise" if "rowwise_data" in d else "columnwise")
    if f"{usage}_data" not in d:
        raise KeyError(f"dump holds no {usage} data (keys: {sorted(d)})")
    shape, fmt = tuple(d["shape"]), d["format"]
    data = d[f"{usage}_data"]
    col = usage == "columnwise"
    if fmt == "fp8_per_tensor":
        vals = data.float() * d["scale_inv"].float()
    elif fmt == "mxfp8":
        s = d[f"{usage}_scale_inv"].float()
        r, c = data.shape
        vals = (data.float().reshape(r // 32, 32, c) * s.unsqueeze(1) if col
                else data.float().reshape(r, c // 32, 32) * s.unsqueeze(2)).reshape(r, c)
        col = False  # MXFP8 columnwise data is not transposed
    elif fmt == "fp8_block_scaling":
        r, c = data.shape
        vals = data.float() * _expand(d[f"{usage}_scale_inv"].float(), 1 if d["block_scaling_dim"] == 1 else 128, r, c)
    elif fmt == "nvfp4":
        r, c = data.shape
        s = d[f"{usage}_scale_inv"].float()
        vals = ((data.reshape(r, c // 16, 16) * s.unsqueeze(-1)) / d[f"{usage}_global_encode_scale"]).reshape(r, c)
        if col and d.get("with_rht"):  # undo the Hadamard transform exactly as the dequantize kernel does
            vals = _apply_rht(vals, int(d["rht_seed"]), inverse=True)
    else:
        raise ValueError(f"unknown dump format {fmt!r}")
    if col:
        vals = vals.t()
    return vals.reshape(shape)
