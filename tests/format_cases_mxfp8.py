"""MXFP8 entries for the format-generic tests: rowwise blocks of 32 along K, columnwise along M.

Error bound: within a block every value is scaled by the same power of two and rounded to
nearest, so |error| <= half an ulp <= |x| * 2**-(mantissa bits + 1): 1/16 for E4M3 (0.07 used),
1/8 for E5M2 (0.13 used); values far below the block amax lose at most the subnormal step, which
is below that bound too.
"""
import torch
from format_cases import FormatCase

from transformer_engine_proto.tensor import MXFP8Quantizer


def _mxfp8(fp8_dtype):
    def make(rowwise, columnwise):
        return MXFP8Quantizer(fp8_dtype, rowwise_usage=rowwise, columnwise_usage=columnwise)
    return make


CASES = [
    FormatCase("mxfp8_e4m3", _mxfp8(torch.float8_e4m3fn), k_multiple=32, m_multiple=32,
               k_multiple_columnwise=1, max_abs_rel_err=0.07),
    FormatCase("mxfp8_e5m2", _mxfp8(torch.float8_e5m2), k_multiple=32, m_multiple=32,
               k_multiple_columnwise=1, max_abs_rel_err=0.13),
]
