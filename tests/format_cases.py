"""One entry per (format, role) for the format-generic tests.

`make(rowwise, columnwise)` builds a quantizer; `row_block`/`col_block` are what the leading-dims
product M and the last dim K must be multiples of (for the usages that need them) -- shape
strategies draw valid shapes from these, and invalid-shape tests from their complement.
"""
from dataclasses import dataclass
from typing import Callable

import torch

from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer, Float8Quantizer


@dataclass(frozen=True)
class FormatCase:
    name: str
    make: Callable  # (rowwise: bool, columnwise: bool) -> Quantizer
    k_multiple: int = 1  # K must be a multiple of this (rowwise blocks)
    m_multiple: int = 1  # M must be a multiple of this when columnwise usage is on
    k_multiple_columnwise: int = 1  # K multiple when only columnwise
    max_abs_rel_err: float = 0.07  # |dequant - x| <= max_abs_rel_err * amax(x) bound (loose, per format)

    def __repr__(self):
        return self.name


def _delayed(fp8_dtype):
    def make(rowwise, columnwise):
        return Float8Quantizer(torch.tensor([1.0]), torch.zeros(1), fp8_dtype,
                               rowwise_usage=rowwise, columnwise_usage=columnwise)
    return make


def _current(fp8_dtype):
    def make(rowwise, columnwise):
        return Float8CurrentScalingQuantizer(fp8_dtype, rowwise_usage=rowwise, columnwise_usage=columnwise)
    return make


FORMAT_CASES = [
    FormatCase("fp8_delayed_e4m3", _delayed(torch.float8_e4m3fn), max_abs_rel_err=1.0),
    FormatCase("fp8_current_e4m3", _current(torch.float8_e4m3fn)),
    FormatCase("fp8_current_e5m2", _current(torch.float8_e5m2), max_abs_rel_err=0.13),
]
# The block formats keep their cases next to their own tests.
for _mod in ("format_cases_mxfp8", "format_cases_blockwise", "format_cases_nvfp4"):
    FORMAT_CASES += __import__(_mod).CASES
