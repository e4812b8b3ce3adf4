"""FP8 blockwise cases for the format-generic tests: 1x128 tiles (activations/gradients) and
128x128 tiles (weights). Partial edge tiles are allowed, so no shape multiples are required."""
import torch
from format_cases import FormatCase

from transformer_engine_proto.tensor import Float8BlockQuantizer


def _blockwise(fp8_dtype, dim, pow2):
    def make(rowwise, columnwise):
        return Float8BlockQuantizer(fp8_dtype, dim, pow2, rowwise_usage=rowwise, columnwise_usage=columnwise)
    return make


# Error bound: one rounding at 3 (e4m3) / 2 (e5m2) mantissa bits relative to the tile's amax,
# i.e. <= 2**-4 / 2**-3 of the tensor's amax (pow2 scales keep the tile max in [fp8_max/2, fp8_max]).
CASES = [
    FormatCase("blockwise_1x128_e4m3_pow2", _blockwise(torch.float8_e4m3fn, 1, True), max_abs_rel_err=0.07),
    FormatCase("blockwise_1x128_e4m3", _blockwise(torch.float8_e4m3fn, 1, False), max_abs_rel_err=0.07),
    FormatCase("blockwise_128x128_e4m3_pow2", _blockwise(torch.float8_e4m3fn, 2, True), max_abs_rel_err=0.07),
    FormatCase("blockwise_1x128_e5m2_pow2", _blockwise(torch.float8_e5m2, 1, True), max_abs_rel_err=0.13),
]
