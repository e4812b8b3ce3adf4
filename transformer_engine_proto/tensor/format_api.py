"""What a format declares about itself: the capability interface shared code asks.

Every scaled format answers, on its quantizer or storage class (in its own module under
`tensor/`), what the GEMM, the FSDP2 / sequence-parallel gathers, the linear op and the debug
tools need to know about it; shared code asks these methods instead of testing the class. A
capability a format does not declare raises `NotImplementedError` naming the format and the
capability (`missing_capability`), never a quiet fallback. `docs/adding_a_format.md` lists them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

__all__ = ["missing_capability", "GemmOperand", "GatherRule", "UsageView"]


def missing_capability(obj, capability: str) -> NotImplementedError:
    """The error a format that does not declare `capability` raises (name it in its module)."""
    cls = obj if isinstance(obj, type) else type(obj)
    return NotImplementedError(f"{cls.__name__} does not declare the format capability {capability!r}; "
                               f"a scaled format declares it in its own module under tensor/ "
                               f"(docs/adding_a_format.md)")


class GemmOperand(NamedTuple):
    """One operand of a native scaled GEMM, read from the stored buffers with no copy."""

    data: torch.Tensor  # (outer, K) matrix of op(t) as stored (K = the reduction dim)
    scale: torch.Tensor  # scale_inv: (1,) per tensor, else (outer, K/block) block scales (view as stored)
    block: Tuple[int, int]  # scale block along (outer, K); (0, 0): one scale for the tensor
    k_major: bool = True  # `data` is row-major (outer, K); False: a transposed view of a K-minor buffer
    global_scale: Optional[torch.Tensor] = None  # a second-level per-tensor decode scale (NVFP4), else None
    rht_seed: Optional[int] = None  # the random Hadamard transform the buffer carries along K, else None


class GatherRule(NamedTuple):
    """How a quantizer's output all-gathers along dim 0 (FSDP2 weights, sequence-parallel inputs).

    `layout` names the gather layout (the handler in `distributed/fsdp.py` / `distributed/sp_gather.py`
    that quantizes a shard and rebuilds the full buffers); None: this setting gathers in high
    precision and quantizes after, `reason` says why. `row_block`: the multiple of rows a shard
    needs (1: any). `pads_uneven`: uneven shards may be zero-padded (one scale per tensor)."""

    layout: Optional[str]
    row_block: int = 1
    reason: str = ""
    pads_uneven: bool = False


class UsageView(NamedTuple):
    """Original and quantized values side by side in one usage's buffer layout (debug stats)."""

    x: torch.Tensor  # float32 original values in the buffer layout
    dq: torch.Tensor  # float32 dequantized values, same layout
    saturated: torch.Tensor  # bool: the code is the format's largest magnitude
    scale_inv: torch.Tensor  # float32 effective scale_inv of every block
