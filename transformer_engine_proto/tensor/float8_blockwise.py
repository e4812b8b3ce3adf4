"""FP8 blockwise scaling (DeepSeek-style; TE's `Float8BlockScaling`): one fp32 scale per tile.

Tiles are 1x128 (`block_scaling_dim=1`, activations and gradients) or 128x128
(`block_scaling_dim=2`, weights), over x viewed as (M, K) with M the product of the leading
dims. Edge tiles may be partial (ceil(dim/128) tiles; a partial tile's amax covers its real
elements only), so any shape with at least one dim is accepted.

Buffers (M, K = flat 2D shape, Mt/Kt = ceil(M/128)/ceil(K/128)):

=================================  =========================  ==================================
buffer                             1x128                      128x128
=================================  =========================  ==================================
``_rowwise_data`` (fp8)            logical shape              logical shape
``_rowwise_scale_inv`` (fp32)      (M, Kt), strides (1, M)    (Mt, Kt), contiguous
``_columnwise_data`` (fp8)         (K, M): x^T, tiles of      (K, M): bitwise transpose of the
                                   128 along M                rowwise data (same tiles)
``_columnwise_scale_inv`` (fp32)   (K, Mt), strides (1, K)    (Kt, Mt): transpose of rowwise
=================================  =========================  ==================================

The 1x128 scales are stored outer-dim-major because that is the layout `torch._scaled_mm`
takes for a blockwise 1x128 operand, so GEMMs need no relayout:

* fprop ``y = x @ w.T`` (x 1x128, w 128x128)::

      torch._scaled_mm(x._rowwise_data.view(M, K),       # A (M, K)
                       w._rowwise_data.t(),              # B (K, N), column-major
                       scale_a=x._rowwise_scale_inv,     # (M, Kt), strides (1, M)
                       scale_b=w._rowwise_scale_inv.t(), # (Kt, Nt), strides (1, Kt)
                       out_dtype=torch.bfloat16)

* dgrad ``dx = dy @ w``: A = dy rowwise (1x128), B = ``w._columnwise_data.t()`` (N, K) with
  ``scale_b = w._columnwise_scale_inv.t()`` (Nt, Kt).
* wgrad ``dw = dy.T @ x``: A = ``dy._columnwise_data`` (N, M) with its (N, Mt) scales,
  B = ``x._columnwise_data.t()`` (M, K) with ``scale_b = x._columnwise_scale_inv.t()`` (Mt, K).

Alignment (checked on H100, torch 2.11, `torch._scaled_mm`): besides the GEMM's own % 16 rules,
the 1x128 A operand needs M % 4 == 0 (else CUBLAS_STATUS_NOT_SUPPORTED), and the 128x128 operand
needs its reduction-dim tile count % 4 == 0 -- ceil(K/128) for fprop, ceil(N/128) for dgrad --
else the result is silently wrong (padded scale strides are refused). `F.scaled_mm` (v2) takes
that scale padded to L4 = round_up(count, 4) instead (docs/internals.md, section "`torch._scaled_mm`
rules the GEMM code follows"): a small copy into ``zeros(Nt, L4)[:, :Kt]`` at the GEMM. 1x128 x
1x128 (wgrad) has no such rule.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import torch

from ..kernels import kernel
from ..kernels.reference.blockwise import expand_tiles
from ..kernels.reference.common import FP8_MAX, fp8_max, transpose_2d
from .format_api import GatherRule, GemmOperand, UsageView
from .quantized_tensor import QuantizedTensor
from .quantizer import BufferSpec, Quantizer, flat_2d, te_constructor
from .storage import QuantizedTensorStorage

__all__ = ["Float8BlockQuantizer", "Float8BlockwiseQTensorStorage", "Float8BlockwiseQTensor"]

BLOCK = 128
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _tiles(n: int) -> int:
    return -(-n // BLOCK)


def _outer_dim_major_stride(rows: int):
    """Strides of `torch.empty((cols, rows)).t()`, i.e. a (rows, cols) tensor stored column-major
    (torch uses max(size, 1) when computing contiguous strides)."""
    return (1, max(rows, 1))


class Float8BlockwiseQTensorStorage(QuantizedTensorStorage):
    _FLATTEN_TENSOR_BUFFERS = (
        ("_rowwise_data", "rowwise_data"),
        ("_rowwise_scale_inv", "rowwise_scale_inv"),
        ("_columnwise_data", "columnwise_data"),
        ("_columnwise_scale_inv", "columnwise_scale_inv"),
    )
    _META_FIELDS = ("fp8_dtype", "block_scaling_dim")
    _LOGICAL_SHAPE_BUFFERS = ("_rowwise_data",)

    def has_rowwise(self) -> bool:
        return self._rowwise_data is not None

    def has_columnwise(self) -> bool:
        return self._columnwise_data is not None

    @property
    def _is_2D_scaled(self) -> bool:  # TE's attribute
        return self.block_scaling_dim == 2

    @property
    def _block_rows(self) -> int:
        return 1 if self.block_scaling_dim == 1 else BLOCK

    def _dequantize(self, dtype):
        m, k = flat_2d(self._shape)
        if self._rowwise_data is not None:
            data, scale_inv = self._rowwise_data.reshape(m, k), self._rowwise_scale_inv
        else:
            data, scale_inv = self._columnwise_data, self._columnwise_scale_inv
        out = kernel("fp8_blockwise_dequantize", data.device)(data, scale_inv, self._block_rows, dtype)
        if self._rowwise_data is None:
            out = transpose_2d(out)
        return out.view(self._shape)

    def derives_usages(self) -> bool:
        return self.block_scaling_dim == 2  # a 128x128 tile is its own transpose

    def _make_columnwise_from_rowwise(self) -> None:
        if self.block_scaling_dim != 2:
            return super()._make_columnwise_from_rowwise()  # 1x128 tiles run along the other dim
        m, k = flat_2d(self._shape)
        self._columnwise_data = transpose_2d(self._rowwise_data.reshape(m, k))
        self._columnwise_scale_inv = transpose_2d(self._rowwise_scale_inv)

    def _make_rowwise_from_columnwise(self) -> None:
        if self.block_scaling_dim != 2:
            return super()._make_rowwise_from_columnwise()
        self._rowwise_data = transpose_2d(self._columnwise_data).view(self._shape)
        self._rowwise_scale_inv = transpose_2d(self._columnwise_scale_inv)

    def _drop_usage(self, rowwise, columnwise) -> None:
        if not rowwise:
            self._rowwise_data = self._rowwise_scale_inv = None
        if not columnwise:
            self._columnwise_data = self._columnwise_scale_inv = None

    def _transpose_buffers(self):
        # 128x128 only: with 1x128 tiles the swap is exact too, but the transposed tensor would
        # dequantize from the columnwise tiles, i.e. to slightly different values than x.T.
        if (self.block_scaling_dim != 2 or len(self._shape) != 2
                or self._rowwise_data is None or self._columnwise_data is None):
            return None
        return {
            "_rowwise_data": self._columnwise_data,
            "_rowwise_scale_inv": self._columnwise_scale_inv,
            "_columnwise_data": self._rowwise_data,
            "_columnwise_scale_inv": self._rowwise_scale_inv,
        }


    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    FORMAT_NAME = "fp8_block_scaling"

    def gemm_native(self):
        return "blockwise"

    def gemm_operand(self, reduce_last):
        """Row-major op(t) and its tile scales as stored (1x128 scales outer-dim-major)."""
        if reduce_last:
            if self._rowwise_data is None:
                return None
            data, scale = self._rowwise_data.reshape(-1, self._shape[-1]), self._rowwise_scale_inv
        else:
            data, scale = self._columnwise_data, self._columnwise_scale_inv
        return None if data is None else GemmOperand(data, scale, (self._block_rows, BLOCK))

    def debug_usage_view(self, x2d, columnwise):
        m, k = x2d.shape
        data = self._columnwise_data if columnwise else self._rowwise_data.reshape(m, k)
        s = (self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv).float()
        r, c = data.shape
        dq = data.float() * expand_tiles(s, self._block_rows, r, c)
        return UsageView(x2d.t() if columnwise else x2d, dq, data.float().abs() == FP8_MAX[self.fp8_dtype], s)

    def debug_internals(self):
        rd = self._rowwise_data
        return {"fp8_dtype": str(self.fp8_dtype).replace("torch.", ""), "block_scaling_dim": self.block_scaling_dim,
                "rowwise_data": None if rd is None else rd.reshape(-1, self._shape[-1]),
                "columnwise_data": self._columnwise_data,
                "rowwise_scale_inv": self._rowwise_scale_inv, "columnwise_scale_inv": self._columnwise_scale_inv}

    @classmethod
    def debug_reconstruct(cls, d, usage):
        data = d[f"{usage}_data"]
        r, c = data.shape
        rows = 1 if d["block_scaling_dim"] == 1 else BLOCK
        s = d[f"{usage}_scale_inv"].float()
        expanded = s.repeat_interleave(rows, 0)[:r].repeat_interleave(BLOCK, 1)[:, :c]
        return data.float() * expanded, usage == "columnwise"


class Float8BlockwiseQTensor(Float8BlockwiseQTensorStorage, QuantizedTensor):
    """FP8 tensor with per-tile (1x128 or 128x128) fp32 scales."""


@te_constructor()
@dataclass(frozen=True)
class Float8BlockQuantizer(Quantizer):
    """Blockwise FP8: scale = fp8_max / amax(tile) per 1x128 (`block_scaling_dim=1`) or 128x128
    (`block_scaling_dim=2`) tile; `force_pow_2_scales` rounds each scale down to a power of two
    (exact scale_inv, never overflows); `amax_epsilon` is a floor on each tile's amax."""

    fp8_dtype: torch.dtype = torch.float8_e4m3fn
    block_scaling_dim: int = 2
    force_pow_2_scales: bool = True
    amax_epsilon: float = 0.0

    def __post_init__(self):
        name = type(self).__name__
        if self.fp8_dtype not in _FP8_DTYPES:
            raise TypeError(f"{name}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, "
                            f"got {self.fp8_dtype}")
        if type(self.block_scaling_dim) is not int or self.block_scaling_dim not in (1, 2):
            raise ValueError(f"{name}: block_scaling_dim must be 1 (1x128 tiles) or 2 (128x128 tiles), "
                             f"got {self.block_scaling_dim!r}")
        if not isinstance(self.force_pow_2_scales, bool):
            raise TypeError(f"{name}: force_pow_2_scales must be a bool, got {self.force_pow_2_scales!r}")
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            raise TypeError(f"{name}: amax_epsilon must be a float, got {eps!r}")
        if not (math.isfinite(eps) and eps >= 0):
            raise ValueError(f"{name}: amax_epsilon must be finite and >= 0, got {eps!r}")
        object.__setattr__(self, "amax_epsilon", float(eps))

    @property
    def tensor_class(self):
        return Float8BlockwiseQTensor

    @property
    def fp8_max(self) -> float:
        return fp8_max(self.fp8_dtype)

    def metadata(self):
        return {"fp8_dtype": self.fp8_dtype, "block_scaling_dim": self.block_scaling_dim}

    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    def row_block(self):
        return 1  # partial tiles at the edges: any row count

    def has_scale_state(self):
        return False

    def fsdp_gather_rule(self):
        if self.block_scaling_dim != 2:
            return GatherRule(None, reason="Float8BlockScaling with 1x128 weight tiles: the columnwise copy cannot "
                                           "be derived from gathered rowwise data (set w_block_scaling_dim=2)")
        return GatherRule("blockwise", BLOCK)  # rowwise gathered, the columnwise copy is its exact transpose

    def fsdp_quantize_shard(self, x, global_amax, scale):
        t = self.with_usage(rowwise=True, columnwise=False).quantize(x)
        return (t._rowwise_data.view(torch.uint8), t._rowwise_scale_inv.view(torch.uint8)), ()

    def fsdp_rebuild(self, outputs, extra, rows):
        data, scale = outputs[0].view(self.fp8_dtype), outputs[1].view(torch.float32)
        return {"_rowwise_data": data, "_rowwise_scale_inv": scale, "_columnwise_data": transpose_2d(data),
                "_columnwise_scale_inv": transpose_2d(scale)}, ("_columnwise_data", "_columnwise_scale_inv")

    def sp_gather_rule(self):
        if self.block_scaling_dim != 1:
            return GatherRule(None, reason="Float8BlockScaling with 128x128 input tiles (x_block_scaling_dim=2)")
        return GatherRule("blockwise", BLOCK)  # columnwise tiles run 128 along the rows

    def sp_quantize_shard(self, x2d, scale, all_reduce_max):
        """The 1x128 scales are stored transposed (outer-dim-major): gathered in that layout."""
        bufs = self.quantize(x2d, internal=True).get_buffers()
        parts = [("_rowwise_data", bufs["_rowwise_data"], 0), ("_rowwise_scale_inv", bufs["_rowwise_scale_inv"].t(), 1)]
        if self.columnwise_usage:
            parts += [("_columnwise_data", bufs["_columnwise_data"], 1),
                      ("_columnwise_scale_inv", bufs["_columnwise_scale_inv"].t(), 0)]
        return parts, {}, torch.zeros(1, dtype=torch.float32, device=x2d.device)

    def sp_finish_gather(self, bufs):
        bufs["_rowwise_scale_inv"] = bufs["_rowwise_scale_inv"].t()
        if self.columnwise_usage:
            bufs["_columnwise_scale_inv"] = bufs["_columnwise_scale_inv"].t()

    DEBUG_RECIPE = "fp8_block_scaling"

    @classmethod
    def debug_quantizer(cls, fp8_dtype, tensor_name):
        return Float8BlockQuantizer(fp8_dtype or torch.float8_e4m3fn,
                                    block_scaling_dim=2 if tensor_name == "weight" else 1)

    def buffer_layout(self, shape) -> Dict[str, BufferSpec]:
        m, k = flat_2d(shape)
        mt, kt = _tiles(m), _tiles(k)
        f32 = torch.float32
        out = {}
        if self.rowwise_usage:
            out["_rowwise_data"] = BufferSpec(tuple(shape), self.fp8_dtype)
            if self.block_scaling_dim == 1:
                out["_rowwise_scale_inv"] = BufferSpec((m, kt), f32, _outer_dim_major_stride(m))
            else:
                out["_rowwise_scale_inv"] = BufferSpec((mt, kt), f32)
        if self.columnwise_usage:
            out["_columnwise_data"] = BufferSpec((k, m), self.fp8_dtype)
            if self.block_scaling_dim == 1:
                out["_columnwise_scale_inv"] = BufferSpec((k, mt), f32, _outer_dim_major_stride(k))
            else:
                out["_columnwise_scale_inv"] = BufferSpec((kt, mt), f32)
        return out

    def _quantize_buffers(self, x):
        row_data, row_si, col_data, col_si = kernel("fp8_blockwise_quantize", x.device)(
            x, self.fp8_dtype, self.block_scaling_dim, self.rowwise_usage, self.columnwise_usage,
            self.force_pow_2_scales, self.amax_epsilon,
        )
        out = {}
        if self.rowwise_usage:
            out["_rowwise_data"], out["_rowwise_scale_inv"] = row_data, row_si
        if self.columnwise_usage:
            out["_columnwise_data"], out["_columnwise_scale_inv"] = col_data, col_si
        return out
