"""Native block-scaled GEMMs for MXFP8 and NVFP4 through `F.scaled_mm`, where the tensor cores
apply the block scales themselves (compute capability 10.x and 12.x). Hopper has no such MMA:
`gemm.py` emulates these formats there (dequantize + bf16 matmul) and never calls this.

Operands come as they are stored, with no transpose copy:
- NVFP4 keeps its columnwise copy transposed (rows of x^T), so every operand is K-major.
- MXFP8 keeps its columnwise copy untransposed (blocks of 32 down the columns). A GEMM that
  reduces over the stored rows (dgrad's weight, both wgrad operands) reads it as a transposed
  view: an "NN"/"TT" layout that cuBLAS runs on 10.x but not on 12.x, whose block-scaled kernels
  take only "TN" (cuBLAS docs, narrow-precision usage). There those GEMMs stay emulated.

Our scale buffers keep the plain (rows, K/block) layout of the format spec; cuBLAS reads them in
its swizzled 128x4-tile layout, so each GEMM swizzles a copy (1/32 or 1/16 of the data's bytes).
NVFP4's second-level scale is the per-tensor decode factor 1/S_enc of the operand's amax. Each
operand comes from the format's `gemm_operand` (its module under `tensor/`); this file names no format.
`TE_PROTO_NATIVE_BLOCK_GEMM=0` turns the native path off (emulated everywhere); the variable is read
once, at the first GEMM. `set_native_block_gemm(False | True)` switches in Python, `None` goes back to
the variable (read again at the next GEMM).
"""
from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from .tensor.storage import QuantizedTensorStorage

__all__ = ["swizzle_block_scales", "native_layouts", "block_scaled_mm", "set_native_block_gemm"]

_TILE_ROWS, _TILE_COLS = 128, 4


def swizzle_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """(rows, cols) block scales -> the flat layout cuBLAS block-scaled GEMMs read: zero-padded to
    128x4 tiles, tiles in row-major order, and inside a tile the scale of (row r, col c) at byte
    (r % 32) * 16 + (r // 32) * 4 + c."""
    if scale.dim() != 2:
        raise ValueError(f"swizzle_block_scales: expected a 2D (rows, K/block) scale, got shape {tuple(scale.shape)}")
    rows, cols = scale.shape
    prow, pcol = -(-rows // _TILE_ROWS) * _TILE_ROWS, -(-cols // _TILE_COLS) * _TILE_COLS
    raw = scale.view(torch.uint8)  # 1-byte scales (E8M0 / E4M3): pad and permute as bytes
    if (prow, pcol) != (rows, cols):
        padded = raw.new_zeros((prow, pcol))
        padded[:rows, :cols] = raw
        raw = padded
    tiles = raw.reshape(prow // _TILE_ROWS, 4, 32, pcol // _TILE_COLS, _TILE_COLS)  # (tr, r//32, r%32, tc, c)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1).view(scale.dtype)


_native = None  # None: not read yet, take TE_PROTO_NATIVE_BLOCK_GEMM at the next GEMM


def set_native_block_gemm(on: Optional[bool]) -> None:
    """True: native block-scaled GEMMs where the GPU has them (the default); False: emulated
    everywhere; None: follow `TE_PROTO_NATIVE_BLOCK_GEMM` again."""
    global _native
    _native = None if on is None else bool(on)


def _env_allows() -> bool:
    global _native
    if _native is None:
        flag = os.environ.get("TE_PROTO_NATIVE_BLOCK_GEMM", "1")
        if flag not in ("0", "1"):
            raise ValueError(f"TE_PROTO_NATIVE_BLOCK_GEMM={flag!r}: expected 0 or 1")
        _native = flag == "1"
    return _native


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def native_layouts(device: torch.device) -> Optional[str]:
    """"all" (every operand layout), "tn" (both operands K-major only) or None (no block-scaled
    MMA, or turned off) for block-scaled GEMMs on `device`."""
    if device.type != "cuda" or not _env_allows() or not hasattr(F, "scaled_mm"):
        return None
    major = _capability(device.index if device.index is not None else torch.cuda.current_device())[0]
    return {10: "all", 12: "tn"}.get(major)


def block_scaled_mm(a, b, trans_a: bool, trans_b: bool, out_dtype: torch.dtype, bias, layouts: str,
                    scaled_mm=None) -> Optional[torch.Tensor]:
    """op(a) @ op(b) (+ bias) in one block-scaled `scaled_mm`, or None when this pair cannot run
    natively under `layouts` ("all" / "tn"), so the caller emulates it."""
    if not (isinstance(a, QuantizedTensorStorage) and isinstance(b, QuantizedTensorStorage)):
        return None
    if a.gemm_native() != "block_scaled" or a.format_name() != b.format_name():
        return None
    # each operand as stored (`gemm_operand`): (outer, K) data, (outer, K/block) scales, the
    # second-level decode scale (NVFP4's 1/S_enc) or None, K-major?, the RHT it carries or None
    pa, pb = a.gemm_operand(reduce_last=not trans_a), b.gemm_operand(reduce_last=trans_b)
    if pa is None or pb is None:
        return None
    mat_a, sa, rows_b, sb = pa.data, pa.scale, pb.data, pb.scale  # rows_b: op(b)^T, (N, K)
    if layouts == "tn" and not (pa.k_major and pb.k_major):
        return None
    if pa.rht_seed != pb.rht_seed:
        return None  # one rotated operand: the rotations must cancel (wgrad), else emulate
    if mat_a.shape[1] != rows_b.shape[1] or sa.shape[1] != sb.shape[1]:
        return None  # inner dims differ: the emulated path raises the error
    m, n = mat_a.shape[0], rows_b.shape[0]
    k = sa.shape[1] * pa.block[1]
    if m % 16 or n % 16 or k % 32:
        return None  # cuBLAS alignment (16-byte leading dims, whole 32-element K blocks)
    st, sw = F.ScalingType, F.SwizzleType
    block_rec = getattr(st, f"BlockWise1x{pa.block[1]}")  # 1x32 (MXFP8, E8M0) / 1x16 (NVFP4, E4M3)
    if pa.global_scale is None:
        scale_a, rec_a, swz_a = swizzle_block_scales(sa), block_rec, sw.SWIZZLE_32_4_4
        scale_b, rec_b, swz_b = swizzle_block_scales(sb), block_rec, sw.SWIZZLE_32_4_4
    else:  # a per-tensor second-level scale: two scales per operand
        rec = [block_rec, st.TensorWise]
        swz = [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE]
        scale_a, rec_a, swz_a = [swizzle_block_scales(sa), pa.global_scale], rec, swz
        scale_b, rec_b, swz_b = [swizzle_block_scales(sb), pb.global_scale], rec, swz
    # bf16 out (what torch's block-scaled kernels are known to take; the Hopper emulation rounds its
    # product to bf16 as well), widened afterwards when the caller wants fp32
    out = (scaled_mm or F.scaled_mm)(mat_a, rows_b.t(), scale_a, rec_a, scale_b, rec_b, swizzle_a=swz_a,
                                     swizzle_b=swz_b, output_dtype=torch.bfloat16)
    if bias is not None:  # added in fp32 like the emulated path (no bias epilogue assumed for MX)
        return (out.float() + bias.float()).to(out_dtype)
    return out.to(out_dtype)
