"""Inductor (CPU) compiles that crashed, checked against eager.

FP8 blockwise 1x128 data with two or more tiles per row, quantized (or dequantized) rowwise and
columnwise from one tensor: inductor fused the rowwise loop, which indexed the tile scales by
`col // 128`, with the loop over the transpose, and its CPU loop split asserted (torch 2.13,
`CppScheduling.try_loop_split`: "AssertionError: ({y0: 96, y1: 2, y2: 128}, {y0: 256, y1: 0, ...})").
The reference kernels now broadcast whole tiles over a (rows, cols/128, 128) view instead.
"""
import copy

import pytest
import torch
from compile_cases import OLD_CPU_INDUCTOR
from linear_cases import fresh_dynamo

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.kernels.reference.blockwise import fp8_blockwise_quantize


def test_blockwise_quantize_rowwise_and_columnwise_compiles():
    """The smallest case: one quantize of a graph input, both usages, 96 x 256."""
    fresh_dynamo()

    def quantize(x):
        return fp8_blockwise_quantize(x, torch.float8_e4m3fn, 1, True, True)

    x = torch.randn(96, 256, dtype=torch.bfloat16)
    compiled = torch.compile(quantize, backend="inductor", fullgraph=True)(x)
    for c, e in zip(compiled, quantize(x)):
        assert c.shape == e.shape and c.stride() == e.stride()
        assert torch.equal(c.view(torch.uint8) if c.dtype.itemsize == 1 else c,
                           e.view(torch.uint8) if e.dtype.itemsize == 1 else e)


def _step(module, x, g, recipe):
    x = x.clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = module(x)
    (y * g).float().sum().backward()
    return [y, x.grad] + [p.grad for p in module.parameters()]


def _compiled_matches_eager(make, shape, recipe):
    fresh_dynamo()
    torch.manual_seed(0)
    m = make()
    mc = copy.deepcopy(m)
    x, g = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
    ref = _step(m, x, g, recipe)
    # bf16 rounding of every intermediate, as eager: the comparison is then exact up to fp32
    # reduction order (the norm's input gradient)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        out = _step(torch.compile(mc, fullgraph=True), x, g, recipe)
    for c, e in zip(out, ref):
        if OLD_CPU_INDUCTOR:  # unrounded bf16 intermediates: within FP8 quantization noise of eager
            assert ((c.float() - e.float()).norm() / e.float().norm()).item() < 0.05
        else:
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_layernorm_mlp_blockwise_compiles_and_matches_eager(bias):
    """The reported case: LayerNormMLP(256, 256) bf16, Float8BlockScaling, 96 tokens; backward
    recomputes fc2's input quantize and dequantizes it (CPU GEMM emulation) in one kernel."""
    _compiled_matches_eager(lambda: te.LayerNormMLP(256, 256, bias=bias, params_dtype=torch.bfloat16),
                            (96, 256), R.Float8BlockScaling())


@pytest.mark.slow
def test_transformer_layer_blockwise_compiles_and_matches_eager():
    """Its LayerNormMLP, in a TransformerLayer (48 x 2 tokens)."""
    _compiled_matches_eager(lambda: te.TransformerLayer(256, 256, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                                        params_dtype=torch.bfloat16),
                            (48, 2, 256), R.Float8BlockScaling())
