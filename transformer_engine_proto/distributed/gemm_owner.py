"""What the distributed switches that walk a model (`enable_tp_amax_reduction`,
`enable_quantized_all_gather`, `set_quantized_sequence_parallel_gather`) ask of it.

distributed/ sits below module/ (module/ imports the TP ops and the gather hooks; design.md's
layer table), so it names the questions here and `module.base.TransformerEngineBaseModule`
answers them, instead of distributed/ importing module classes.
"""
from __future__ import annotations

from typing import List, Tuple

from torch import nn

__all__ = ["GemmOwner"]


class GemmOwner:
    """Mixin of every TE-proto module. A GEMM here is the module's `QuantizedGemm` (an nn.Module
    with the attributes `tp_amax_reduction` and `quantized_sp_gather` the switches set)."""

    name: str

    def gemm_weights(self) -> List[Tuple[nn.Module, nn.Parameter]]:
        """(GEMM, weight) pairs of this module (not of its children)."""
        return []

    def tp_sharded_gemms(self) -> List[Tuple[nn.Module, str, str]]:
        """(GEMM, TP group name, "column" | "row") of the GEMMs whose weight is sharded over a TP
        group of two or more ranks."""
        return []
