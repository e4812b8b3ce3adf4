"""NVFP4: E2M1 values packed two per byte, an E4M3 scale per 16 values, one fp32 amax per usage.

x is viewed as (M, K). Rowwise buffers quantize x along K: `_rowwise_data` uint8 (M, K/2),
`_rowwise_scale_inv` e4m3 (M, K/16), `_amax_rowwise` (1,). Columnwise buffers quantize x^T along
M (optionally after the random Hadamard transform, for wgrad): `_columnwise_data` (K, M/2),
`_columnwise_scale_inv` (K, M/16), `_amax_columnwise` (1,). All buffers are 2D over (M, K), so a
view that keeps the last dim leaves them untouched. With 2D (16x16) blocks the two usages hold
the same rounded values, so each can be derived exactly from the other.

TE's two encoding options (kernels/reference/nvfp4.py says what they do) are quantizer settings:
`row_scaled_nvfp4` (the amaxes become (M,) rowwise and (K,) columnwise) and `nvfp4_use_4over6`
with `nvfp4_4over6_err_mode` and `nvfp4_e4m3_max`. Only the reference kernels implement them, so
a quantizer with either asks the dispatcher for the reference (`kernel(..., reference=True)`) on
every device; the storage keeps `row_scaled_nvfp4` and `nvfp4_e4m3_max`, which its dequantize needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ..constants import DType
from ..kernels import kernel
from ..kernels.reference.common import abs_max, transpose_2d, true_div
from ..kernels.reference.nvfp4 import (
    BLOCK,
    E4M3_BOUNDS,
    FOUR_OVER_SIX_MODES,
    apply_rht,
    global_encode_scale,
    quantize_blocks,
    rht_matrix,
    row_abs_max,
    transpose_2d_blocks,
    unpack_fp4,
    unpack_fp4_codes,
)
from .format_api import GatherRule, GemmOperand, UsageView
from .quantized_tensor import QuantizedTensor
from .quantizer import BufferSpec, Quantizer, flat_2d, te_constructor
from .storage import QuantizedTensorStorage

__all__ = ["NVFP4Quantizer", "NVFP4TensorStorage", "NVFP4Tensor"]


class NVFP4TensorStorage(QuantizedTensorStorage):
    _FLATTEN_TENSOR_BUFFERS = (
        ("_rowwise_data", "rowwise_data"),
        ("_rowwise_scale_inv", "rowwise_scale_inv"),
        ("_columnwise_data", "columnwise_data"),
        ("_columnwise_scale_inv", "columnwise_scale_inv"),
        ("_amax_rowwise", "amax_rowwise"),
        ("_amax_columnwise", "amax_columnwise"),
    )
    # The layout settings dequantize/relayout need, kept even without a quantizer.
    # (`nvfp4_use_4over6` only records how the values were chosen: dequantize does not need it)
    _META_FIELDS = ("with_2d_quantization", "with_rht", "rht_seed", "row_scaled_nvfp4", "nvfp4_e4m3_max",
                    "nvfp4_use_4over6")
    _LOGICAL_SHAPE_BUFFERS = ()
    # Defaults of the fields added with TE's encoding options: tensors pickled, and constructor
    # calls written, before them still load and build (as plain NVFP4).
    row_scaled_nvfp4 = False
    nvfp4_e4m3_max = 448
    nvfp4_use_4over6 = False

    def __init__(self, **kwargs):
        kwargs.setdefault("row_scaled_nvfp4", False)
        kwargs.setdefault("nvfp4_e4m3_max", 448)
        kwargs.setdefault("nvfp4_use_4over6", False)
        super().__init__(**kwargs)

    # TE's attribute names for the encoding options (TE code and tests read these)
    _row_scaled_nvfp4 = property(lambda self: self.row_scaled_nvfp4)
    _nvfp4_use_4over6 = property(lambda self: self.nvfp4_use_4over6)
    _nvfp4_e4m3_max = property(lambda self: self.nvfp4_e4m3_max)

    _fp4_dtype = DType.kFloat4E2M1  # TE's attribute

    @property
    def _fp8_dtype(self):
        raise AttributeError("NVFP4 tensors have _fp4_dtype, not _fp8_dtype")

    def has_rowwise(self) -> bool:
        return self._rowwise_data is not None

    def has_columnwise(self) -> bool:
        return self._columnwise_data is not None

    def _plain_decode(self) -> bool:
        """One S_enc per usage with the 448 bound: what the fast dequantize kernels implement."""
        return not self.row_scaled_nvfp4 and self.nvfp4_e4m3_max == 448

    def _dequantize_2d(self, rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data,
                       columnwise_scale_inv, amax_columnwise, rht, rht_seed, dtype):
        """(M, K) values in `dtype`, rounded once: `nvfp4_dequantize_to`, or for the row-scaled /
        256-bound encodings the reference dequantize (which alone decodes them), then `.to`."""
        dev = (rowwise_data if rowwise_data is not None else columnwise_data).device
        args = (rowwise_data, rowwise_scale_inv, amax_rowwise, columnwise_data, columnwise_scale_inv,
                amax_columnwise, rht, rht_seed)
        if self._plain_decode():
            return kernel("nvfp4_dequantize_to", dev)(*args, dtype=dtype)  # no fp32 round trip
        return kernel("nvfp4_dequantize", dev, reference=True)(
            *args, row_scaled=self.row_scaled_nvfp4, e4m3_max=self.nvfp4_e4m3_max).to(dtype)

    def _encode_scale(self, amax):
        """S_enc of a usage: (1,), or (rows, 1) for a row-scaled tensor."""
        enc = global_encode_scale(amax, self.nvfp4_e4m3_max)
        return enc.reshape(-1, 1) if self.row_scaled_nvfp4 else enc

    def _dequantize(self, dtype):
        values = self._dequantize_2d(
            self._rowwise_data, self._rowwise_scale_inv, self._amax_rowwise,
            self._columnwise_data, self._columnwise_scale_inv, self._amax_columnwise,
            self.with_rht, self.rht_seed, dtype,
        )
        return values.reshape(self._shape)

    def derives_usages(self) -> bool:
        return self.with_2d_quantization and flat_2d(self._shape)[0] % BLOCK == 0

    def _check_derivable(self, what: str) -> None:
        m, _ = flat_2d(self._shape)
        if not self.with_2d_quantization:
            raise RuntimeError(
                f"{type(self).__name__}: {what} data cannot be derived exactly with 1D blocks (the "
                f"blocks run along the other dim); quantize with {what} usage instead"
            )
        if m % BLOCK:
            raise RuntimeError(
                f"NVFP4: cannot derive {what} data for shape {tuple(self._shape)}: the leading dims "
                f"product {m} is not a multiple of the block size {BLOCK}"
            )

    def _make_columnwise_from_rowwise(self) -> None:
        self._check_derivable("columnwise")
        self._columnwise_data, self._columnwise_scale_inv = transpose_2d_blocks(
            self._rowwise_data, self._rowwise_scale_inv)
        self._amax_columnwise = self._amax_rowwise.clone()

    def _make_rowwise_from_columnwise(self) -> None:
        self._check_derivable("rowwise")
        self._rowwise_data, self._rowwise_scale_inv = transpose_2d_blocks(
            self._columnwise_data, self._columnwise_scale_inv)
        self._amax_rowwise = self._amax_columnwise.clone()

    def _drop_usage(self, rowwise, columnwise) -> None:
        if not rowwise:
            self._rowwise_data = self._rowwise_scale_inv = self._amax_rowwise = None
        if not columnwise:
            self._columnwise_data = self._columnwise_scale_inv = self._amax_columnwise = None

    def _transpose_buffers(self):
        """With 16x16 tiles the columnwise buffers of x are the rowwise buffers of x^T and vice
        versa (same tiles, same values), so a 2D transpose swaps them. With 1D blocks the two
        usages round differently, so a swap would change the values: no native transpose."""
        if not (self.has_rowwise() and self.has_columnwise()) or len(self._shape) != 2:
            return None
        if not self.with_2d_quantization:
            return None
        return {
            "_rowwise_data": self._columnwise_data, "_rowwise_scale_inv": self._columnwise_scale_inv,
            "_columnwise_data": self._rowwise_data, "_columnwise_scale_inv": self._rowwise_scale_inv,
            "_amax_rowwise": self._amax_columnwise, "_amax_columnwise": self._amax_rowwise,
        }


    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    FORMAT_NAME = "nvfp4"

    def gemm_native(self):
        # a row-scaled operand has one decode factor per row, which the GEMM's single per-tensor
        # second-level scale cannot carry: always emulated
        return None if self.row_scaled_nvfp4 else "block_scaled"

    def gemm_operand(self, reduce_last):
        """Both usages K-major as stored (the columnwise copy holds rows of x^T), E4M3 block scales
        and the per-tensor decode factor 1/S_enc; the RHT rotates the columnwise copy only. None
        for a row-scaled tensor (see `gemm_native`), also when the other operand asks."""
        usage = "rowwise" if reduce_last else "columnwise"
        data = getattr(self, f"_{usage}_data")
        if data is None or self.row_scaled_nvfp4:
            return None
        decode = true_div(1.0, global_encode_scale(getattr(self, f"_amax_{usage}"), self.nvfp4_e4m3_max))
        rht = self.rht_seed if self.with_rht and not reduce_last else None
        return GemmOperand(data.view(torch.float4_e2m1fn_x2), getattr(self, f"_{usage}_scale_inv"), (1, BLOCK),
                           global_scale=decode, rht_seed=rht)

    def gemm_emulated(self, other, trans_a, trans_b, out_dtype, bias):
        """The Hopper wgrad self^T @ other from both columnwise buffers as stored, or None when
        the shortcut does not apply: the random Hadamard transform is not undone, since H is
        orthonormal and both operands carry it along the reduction dim ((H a)^T (H b) = a^T b).
        Saves two inverse transforms and two transposes per step."""
        a, b = self, other
        if not (trans_a and not trans_b and isinstance(b, NVFP4TensorStorage)):
            return None
        if a._columnwise_data is None or b._columnwise_data is None:
            return None
        if a._rowwise_data is not None or b._rowwise_data is not None:
            return None  # only-usage views are what the ops pass; anything else takes the plain path
        if a.with_rht != b.with_rht or (a.with_rht and a.rht_seed != b.rht_seed):
            return None  # the rotations must cancel
        a_t = a._stored_columnwise(torch.bfloat16)  # (N, M)
        b_t = b._stored_columnwise(torch.bfloat16)  # (K, M)
        out = a_t @ b_t.t()
        if bias is not None:
            out = out.float() + bias.float()
        return out.to(out_dtype)

    def _stored_columnwise(self, dtype) -> torch.Tensor:
        """x^T (K, M) as stored (after the RHT, if any), dequantized to `dtype`."""
        return self._dequantize_2d(self._columnwise_data, self._columnwise_scale_inv, self._amax_columnwise,
                                   None, None, None, False, 0, dtype)

    def debug_usage_view(self, x2d, columnwise):
        if columnwise:
            data, s, amax = self._columnwise_data, self._columnwise_scale_inv, self._amax_columnwise
            xs = x2d.t().contiguous()
            if self.with_rht:
                xs = apply_rht(xs, self.rht_seed)
        else:
            data, s, amax, xs = self._rowwise_data, self._rowwise_scale_inv, self._amax_rowwise, x2d
        vals = unpack_fp4(data)
        r, c = vals.shape
        enc = self._encode_scale(amax)
        enc3 = enc.unsqueeze(-1) if self.row_scaled_nvfp4 else enc
        dq = ((vals.reshape(r, c // BLOCK, BLOCK) * s.float().unsqueeze(-1)) / enc3).reshape(r, c)
        sat = (unpack_fp4_codes(data) & 7) == 7
        return UsageView(xs, dq, sat, s.float() / enc)

    def debug_internals(self):
        out = dict(with_rht=bool(self.with_rht), rht_seed=int(self.rht_seed),
                   with_2d_quantization=bool(self.with_2d_quantization),
                   row_scaled_nvfp4=bool(self.row_scaled_nvfp4), nvfp4_e4m3_max=int(self.nvfp4_e4m3_max))
        for usage in ("rowwise", "columnwise"):
            data = getattr(self, f"_{usage}_data")
            if data is None:
                continue
            amax = getattr(self, f"_amax_{usage}")
            out[f"{usage}_data"] = unpack_fp4(data)
            out[f"{usage}_scale_inv"] = getattr(self, f"_{usage}_scale_inv")
            out[f"amax_{usage}"] = amax
            out[f"{usage}_global_encode_scale"] = global_encode_scale(amax, self.nvfp4_e4m3_max)
        if self.with_rht and self._columnwise_data is not None:
            out["rht_matrix"] = rht_matrix(self.rht_seed, self._columnwise_data.device)
        return out

    @classmethod
    def debug_reconstruct(cls, d, usage):
        data = d[f"{usage}_data"]
        r, c = data.shape
        s = d[f"{usage}_scale_inv"].float()
        scaled = data.reshape(r, c // BLOCK, BLOCK) * s.unsqueeze(-1)
        enc = d[f"{usage}_global_encode_scale"]
        if d.get("row_scaled_nvfp4"):  # one S_enc per row
            enc = enc.reshape(-1, 1, 1)
        vals = (scaled / enc).reshape(r, c)
        col = usage == "columnwise"
        if col and d.get("with_rht"):  # undo the Hadamard transform exactly as the dequantize kernel does
            vals = apply_rht(vals, int(d["rht_seed"]), inverse=True)
        return vals, col


class NVFP4Tensor(NVFP4TensorStorage, QuantizedTensor):
    """NVFP4 tensor (1D or 2D blocks, optional RHT on the columnwise operand)."""


def _random_sign_masks(kwargs) -> tuple:
    """TE's `with_random_sign_mask` values built here: the RHT always draws its signs from
    `rht_seed`; without an RHT the mask has nothing to act on, so either value means the same."""
    return (True,) if kwargs.get("with_rht") else (True, False)


@te_constructor(("fp4_dtype", "rowwise", "columnwise", "with_amax_reduction", "amax_reduction_group", "with_rht",
                 "with_post_rht_amax", "with_2d_quantization", "stochastic_rounding", "row_scaled_nvfp4",
                 "nvfp4_use_4over6", "nvfp4_e4m3_max", "nvfp4_4over6_err_mode"),
                te_only={"fp4_dtype": (torch.float4_e2m1fn_x2,), "with_amax_reduction": (False,),
                         "amax_reduction_group": (None,), "with_post_rht_amax": (False, True),
                         "with_random_sign_mask": _random_sign_masks})
@dataclass(frozen=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 settings. 2D (16x16) blocks are for weights; the RHT (columnwise only) and
    stochastic rounding are for gradients. `rht_seed` fixes the RHT's random sign vector.

    TE's encoding options (kernels/reference/nvfp4.py): `row_scaled_nvfp4`, one amax per row (1D
    blocks, no RHT or stochastic rounding); `nvfp4_use_4over6`, each block's map-to-4 or map-to-6
    scale by `nvfp4_4over6_err_mode` ("MAE" / "MSE"), with `nvfp4_e4m3_max` (448 or 256) the
    block-scale bound in S_enc (no RHT or stochastic rounding). As in TE, the bound is 448 without
    4over6 (normalized then), and the error mode is kept as given, unused."""

    with_2d_quantization: bool = False
    with_rht: bool = False
    stochastic_rounding: bool = False
    rht_seed: int = 0
    row_scaled_nvfp4: bool = False
    nvfp4_use_4over6: bool = False
    nvfp4_e4m3_max: int = 448
    nvfp4_4over6_err_mode: str = "MAE"

    def __post_init__(self):
        if self.with_2d_quantization and self.with_rht:
            raise ValueError("NVFP4Quantizer: with_rht cannot be combined with with_2d_quantization (2D 16x16 blocks)")
        if not isinstance(self.rht_seed, int):
            raise TypeError(f"NVFP4Quantizer.rht_seed must be an int, got {type(self.rht_seed).__name__}")
        for name in ("row_scaled_nvfp4", "nvfp4_use_4over6"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"NVFP4Quantizer.{name} must be a bool, got {getattr(self, name)!r}")
        mode = self.nvfp4_4over6_err_mode
        if not isinstance(mode, str) or mode.upper() not in FOUR_OVER_SIX_MODES:
            raise ValueError(f"NVFP4Quantizer.nvfp4_4over6_err_mode must be one of {FOUR_OVER_SIX_MODES}, got {mode!r}")
        if isinstance(self.nvfp4_e4m3_max, bool) or self.nvfp4_e4m3_max not in E4M3_BOUNDS:
            raise ValueError(f"NVFP4Quantizer.nvfp4_e4m3_max must be one of {E4M3_BOUNDS}, got {self.nvfp4_e4m3_max!r}")
        if self.nvfp4_use_4over6 and (self.with_rht or self.stochastic_rounding):
            raise ValueError("NVFP4Quantizer: nvfp4_use_4over6 cannot be combined with with_rht or "
                             "stochastic_rounding (TE has no such kernel either)")
        if self.row_scaled_nvfp4 and (self.with_rht or self.with_2d_quantization or self.stochastic_rounding):
            raise ValueError("NVFP4Quantizer: row_scaled_nvfp4 cannot be combined with with_rht, "
                             "with_2d_quantization or stochastic_rounding (TE has no such kernel either)")
        on = self.nvfp4_use_4over6
        object.__setattr__(self, "nvfp4_4over6_err_mode", mode.upper())
        object.__setattr__(self, "nvfp4_e4m3_max", int(self.nvfp4_e4m3_max) if on else 448)

    def _reference_only(self) -> bool:
        """Whether a setting only the reference kernels implement is on."""
        return self.row_scaled_nvfp4 or self.nvfp4_use_4over6

    def _kernel_options(self) -> dict:
        """The reference quantize's keywords for the row-scaled / 4over6 settings."""
        return dict(row_scaled=self.row_scaled_nvfp4,
                    four_over_six=self.nvfp4_4over6_err_mode if self.nvfp4_use_4over6 else None,
                    e4m3_max=self.nvfp4_e4m3_max)

    @property
    def dtype(self) -> DType:
        """TE's name: the value format as a `DType`."""
        return DType.kFloat4E2M1

    @property
    def tensor_class(self):
        return NVFP4Tensor

    def metadata(self):
        return {"with_2d_quantization": self.with_2d_quantization, "with_rht": self.with_rht,
                "rht_seed": self.rht_seed, "row_scaled_nvfp4": self.row_scaled_nvfp4,
                "nvfp4_e4m3_max": self.nvfp4_e4m3_max, "nvfp4_use_4over6": self.nvfp4_use_4over6}

    def check_shape(self, shape) -> None:
        m, k = flat_2d(shape)
        if (self.rowwise_usage or self.with_2d_quantization) and k % BLOCK:
            raise ValueError(
                f"NVFP4: shape {tuple(shape)}: last dim {k} is not a multiple of the block size {BLOCK}")
        if self.columnwise_usage and m % BLOCK:
            raise ValueError(
                f"NVFP4: shape {tuple(shape)}: columnwise usage needs the leading dims product {m} "
                f"to be a multiple of the block size {BLOCK}")

    def row_block(self) -> int:
        return BLOCK if self.columnwise_usage else 1  # columnwise blocks (and RHT runs) along rows

    def is_quantizable(self, inp: torch.Tensor) -> bool:
        """As TE: a row-scaled quantizer's per-row amaxes cannot be gathered, so never."""
        return not self.row_scaled_nvfp4 and super().is_quantizable(inp)

    # ---- format capabilities (tensor/format_api.py) ------------------------------------------
    def has_scale_state(self):
        return False

    def fsdp_gather_rule(self):
        if not self.with_2d_quantization:
            return GatherRule(None, reason="NVFP4 with 1D weight blocks: the columnwise copy cannot be derived from "
                                           "gathered rowwise data (keep 2D weight quantization)")
        return GatherRule("nvfp4", BLOCK)  # rowwise gathered, columnwise by exact 16x16 relayout

    def fsdp_quantize_shard(self, x, global_amax, scale):
        """Packed data + E4M3 scales of 16x16 blocks with the whole weight's (all-reduced) amax
        (4over6 decides per tile, so a shard of whole tiles decides as the whole weight does)."""
        amax = global_amax()
        data, scale = kernel("nvfp4_quantize", x.device, reference=self._reference_only())(
            x, True, False, two_d=True, amax=amax, **self._kernel_options())[:2]
        return (data, scale.view(torch.uint8)), (amax,)

    def fsdp_rebuild(self, outputs, extra, rows):
        data, scale = outputs[0], outputs[1].view(torch.float8_e4m3fn)
        col_data, col_scale = transpose_2d_blocks(data, scale)
        amax = extra[0].clone()  # private: the amax cache must not alias the weight's buffers
        return {"_rowwise_data": data, "_rowwise_scale_inv": scale, "_columnwise_data": col_data,
                "_columnwise_scale_inv": col_scale, "_amax_rowwise": amax, "_amax_columnwise": amax.clone()}, \
            ("_columnwise_data", "_columnwise_scale_inv", "_amax_rowwise", "_amax_columnwise")

    def sp_gather_rule(self):
        if self.with_2d_quantization or self.stochastic_rounding:
            return GatherRule(None, reason="NVFP4 input with 2D blocks or stochastic rounding")
        return GatherRule("nvfp4", BLOCK)  # columnwise 16-row blocks (and 16-row RHT runs)

    def sp_quantize_shard(self, x2d, scale, all_reduce_max):
        """The kernel's math with global amaxes (rowwise, and columnwise after the RHT), one
        all-reduce; the pure-torch reference (no fused kernel takes a global amax). 4over6 decides
        per block, so whole blocks decide alike on a shard. Row-scaled: the rows' amaxes are the
        shard's own (gathered with the rows), the columnwise ones (one per column of x) and the
        recorded amax are all-reduced."""
        f = x2d.float()
        xt = transpose_2d(f) if self.columnwise_usage else None
        if xt is not None and self.with_rht:
            xt = apply_rht(xt, self.rht_seed)
        opts = dict(row_scaled=self.row_scaled_nvfp4, e4m3_max=self.nvfp4_e4m3_max,
                    four_over_six=self.nvfp4_4over6_err_mode if self.nvfp4_use_4over6 else None)
        if self.row_scaled_nvfp4:
            amaxes = torch.cat([abs_max(f, finite=True)] + ([] if xt is None else [row_abs_max(xt)]))
            all_reduce_max(amaxes)
            row_amax = row_abs_max(f)
            amax_row, amax_col = row_amax, (amaxes[1:] if xt is not None else None)
        else:
            amaxes = torch.cat([abs_max(t, finite=True) for t in (f, xt) if t is not None])  # as the quantize
            all_reduce_max(amaxes)
            amax_row, amax_col = amaxes[0:1], (amaxes[1:2] if xt is not None else None)
        data, s = quantize_blocks(f, amax_row, False, **opts)
        parts = [("_rowwise_data", data, 0), ("_rowwise_scale_inv", s, 0)]
        if self.row_scaled_nvfp4:
            parts.append(("_amax_rowwise", amax_row, 0))
            same = {}
        else:
            same = {"_amax_rowwise": amax_row.clone()}
        if xt is not None:
            data, s = quantize_blocks(xt, amax_col, False, **opts)
            parts += [("_columnwise_data", data, 1), ("_columnwise_scale_inv", s, 1)]
            same["_amax_columnwise"] = amax_col.clone()
        return parts, same, amaxes[0:1].clone()

    def sp_finish_gather(self, bufs):
        pass  # gathered as they are laid out

    DEBUG_RECIPE = "nvfp4"

    @classmethod
    def debug_quantizer(cls, fp8_dtype, tensor_name):
        return NVFP4Quantizer(with_2d_quantization=tensor_name == "weight")

    def buffer_layout(self, shape) -> Dict[str, BufferSpec]:
        m, k = flat_2d(shape)
        row_amax, col_amax = ((m,), (k,)) if self.row_scaled_nvfp4 else ((1,), (1,))
        out = {}
        if self.rowwise_usage:
            out["_rowwise_data"] = BufferSpec((m, k // 2), torch.uint8)
            out["_rowwise_scale_inv"] = BufferSpec((m, k // BLOCK), torch.float8_e4m3fn)
        if self.columnwise_usage:
            out["_columnwise_data"] = BufferSpec((k, m // 2), torch.uint8)
            out["_columnwise_scale_inv"] = BufferSpec((k, m // BLOCK), torch.float8_e4m3fn)
        if self.rowwise_usage:
            out["_amax_rowwise"] = BufferSpec(row_amax, torch.float32)
        if self.columnwise_usage:
            out["_amax_columnwise"] = BufferSpec(col_amax, torch.float32)
        return out

    def _quantize_buffers(self, x, rand=None, rand_columnwise=None):
        if self._reference_only():  # the fast kernels know neither setting
            bufs = kernel("nvfp4_quantize", x.device, reference=True)(
                x, self.rowwise_usage, self.columnwise_usage, self.with_2d_quantization,
                **self._kernel_options())
        else:
            bufs = kernel("nvfp4_quantize", x.device)(
                x, self.rowwise_usage, self.columnwise_usage, self.with_2d_quantization, self.with_rht,
                self.rht_seed, self.stochastic_rounding, rand, rand_columnwise,
            )
        names = [attr for attr, _ in NVFP4TensorStorage._FLATTEN_TENSOR_BUFFERS]
        return {name: buf for name, buf in zip(names, bufs) if buf is not None}

    def quantize(self, x: torch.Tensor, *, rand: Optional[torch.Tensor] = None,
                 rand_columnwise: Optional[torch.Tensor] = None, internal: Optional[bool] = None):
        """As `Quantizer.quantize`; with stochastic rounding, `rand` (x's shape) and
        `rand_columnwise` ((K, M)) give the uniform [0, 1) draws, so results are reproducible."""
        if rand is None and rand_columnwise is None:
            return super().quantize(x, internal=internal)
        internal = self.internal if internal is None else internal
        if isinstance(x, QuantizedTensor):
            x = x.dequantize()
        self._check_quantize_input(x)
        buffers = self._quantize_buffers(x.contiguous(), rand, rand_columnwise)
        return self.make_tensor(buffers, tuple(x.shape), x.dtype, internal)
