"""NVFP4 role variants for the format-generic tests.

Error bounds (max |dequant - x| / amax(x)) measured over random shapes/kinds: 1D and 2D round to
nearest, at most one E2M1 unit (block amax / 6, times up to 1 + 2**-4 from the E4M3 block scale),
measured 0.166 / 0.171; the RHT spreads errors over 16 values, measured 0.171; stochastic
rounding may move a whole step (two units between 4 and 6), measured 0.33, bound 0.354.
"""
from format_cases import FormatCase

from transformer_engine_proto.tensor import NVFP4Quantizer


def _make(**settings):
    def make(rowwise, columnwise):
        return NVFP4Quantizer(**settings, rowwise_usage=rowwise, columnwise_usage=columnwise)
    return make


CASES = [
    FormatCase("nvfp4_1d", _make(), k_multiple=16, m_multiple=16, max_abs_rel_err=0.18),
    FormatCase("nvfp4_2d", _make(with_2d_quantization=True), k_multiple=16, m_multiple=16,
               k_multiple_columnwise=16, max_abs_rel_err=0.18),
    FormatCase("nvfp4_1d_rht", _make(with_rht=True), k_multiple=16, m_multiple=16, max_abs_rel_err=0.25),
    FormatCase("nvfp4_1d_sr", _make(stochastic_rounding=True), k_multiple=16, m_multiple=16,
               max_abs_rel_err=0.37),
]
