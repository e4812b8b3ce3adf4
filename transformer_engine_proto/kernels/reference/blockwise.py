"""FP8 blockwise (DeepSeek-style) quantize/dequantize: one fp32 scale per 1x128 or 128x128 tile.

Partial tiles at the matrix edges are allowed: their amax covers only the real elements (the
padding used to shape the reduction is zeros, which cannot raise an amax). Non-finite values as in
`common`: a tile's amax is that of its finite values, and inf / NaN stay non-finite in the data.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_true

from .. import register_kernel
from .common import fp8_max, scale_from_amax, scaled_cast, transpose_2d

TILE = 128


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def tile_scales(x2d: torch.Tensor, rows: int, fp8_dtype, power_2: bool, epsilon: float) -> torch.Tensor:
    """fp32 quantization scale per (rows x 128) tile of the (R, C) matrix `x2d`, from the amax of
    the tile's finite values: shape (ceil(R/rows), ceil(C/128))."""
    r, c = x2d.shape
    rt, ct = ceil_div(r, rows), ceil_div(c, TILE)
    a = x2d.float().abs()
    a = torch.where(a < math.inf, a, 0.0)  # NaN compares False too
    # unknown (a data-dependent row count): pad, maybe by 0
    if guard_or_true(rt * rows != r) or guard_or_true(ct * TILE != c):
        a = F.pad(a, (0, ct * TILE - c, 0, rt * rows - r))
    amax = a.reshape(rt, rows, ct, TILE).amax(dim=(1, 3))
    return scale_from_amax(amax, fp8_max(fp8_dtype), 0, power_2, epsilon)


def expand_tiles(s: torch.Tensor, rows: int, r: int, c: int) -> torch.Tensor:
    """Broadcast per-tile values (rt, ct) to every element of an (r, c) matrix."""
    rt, ct = s.shape
    full = s[:, None, :, None].expand(rt, rows, ct, TILE).reshape(rt * rows, ct * TILE)
    return full[:r, :c]


def _per_tile(fn, x2d: torch.Tensor, s: torch.Tensor, rows: int) -> torch.Tensor:
    """fn(x, s) elementwise, with the per-tile values `s` (rt, ct) broadcast over the (r, c) `x2d`.
    Whole 1x128 tiles run on a (r, c/128, 128) view: then no loop indexes `s` by `col // 128`,
    a loop inductor's CPU codegen fails to split when it is fused with a loop over the transpose
    (torch 2.13, `CppScheduling.try_loop_split`)."""
    r, c = x2d.shape
    if rows == 1 and c % TILE == 0:
        return fn(x2d.reshape(r, c // TILE, TILE), s[:, :, None]).reshape(r, c)
    return fn(x2d, expand_tiles(s, rows, r, c))


def _cast_tiles(x2d, scale, rows, fp8_dtype) -> torch.Tensor:
    return _per_tile(lambda x, s: scaled_cast(x, s, fp8_dtype), x2d, scale, rows)


def outer_dim_major(s: torch.Tensor) -> torch.Tensor:
    """Same shape, strides (1, R): the layout `torch._scaled_mm` wants for 1x128 scales."""
    return transpose_2d(s).t()


def _quantize_1x128(x2d, fp8_dtype, power_2, epsilon):
    scale = tile_scales(x2d, 1, fp8_dtype, power_2, epsilon)
    return _cast_tiles(x2d, scale, 1, fp8_dtype), outer_dim_major(scale.reciprocal())


@register_kernel("fp8_blockwise_quantize")
def fp8_blockwise_quantize(x: torch.Tensor, fp8_dtype, block_scaling_dim: int, rowwise: bool,
                           columnwise: bool, power_2: bool = True, epsilon: float = 0.0
                           ) -> Tuple[Optional[torch.Tensor], ...]:
    """Returns (rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv); the
    buffers of an unrequested usage are None. Layouts: see tensor/float8_blockwise.py."""
    shape = tuple(x.shape)
    x2d = x.reshape(math.prod(shape[:-1]), shape[-1])
    row_data = row_si = col_data = col_si = None
    if block_scaling_dim == 1:
        if rowwise:
            row_data, row_si = _quantize_1x128(x2d, fp8_dtype, power_2, epsilon)
            row_data = row_data.view(shape)
        if columnwise:
            col_data, col_si = _quantize_1x128(transpose_2d(x2d), fp8_dtype, power_2, epsilon)
    elif block_scaling_dim == 2:
        scale = tile_scales(x2d, TILE, fp8_dtype, power_2, epsilon)
        data2d = _cast_tiles(x2d, scale, TILE, fp8_dtype)
        scale_inv = scale.reciprocal()
        if rowwise:
            row_data, row_si = data2d.view(shape), scale_inv
        if columnwise:
            # Same tiles as rowwise: the columnwise copy is an exact relayout.
            col_data, col_si = transpose_2d(data2d), transpose_2d(scale_inv)
    else:
        raise ValueError(f"block_scaling_dim must be 1 or 2, got {block_scaling_dim}")
    return row_data, row_si, col_data, col_si


@register_kernel("fp8_blockwise_dequantize")
def fp8_blockwise_dequantize(data2d: torch.Tensor, scale_inv: torch.Tensor, block_rows: int,
                             dtype: torch.dtype) -> torch.Tensor:
    """(R, C) fp8 data times its per-(block_rows x 128) tile scale_inv, cast to `dtype`."""
    return _per_tile(lambda x, s: (x.float() * s.float()).to(dtype), data2d, scale_inv, block_rows)
