"""The Triton quantize kernels run by Triton's CPU interpreter: index / layout logic on CPU.

Skipped unless TRITON_INTERPRET=1 is set for the whole pytest process (Triton reads it when the
kernels are defined), e.g.  TRITON_INTERPRET=1 python -m pytest tests/test_triton_interpret.py

The interpreter's own fp8 cast is wrong at a mantissa carry (127.4 -> 64), so under the
interpreter the kernels round with their exact software cast (`_common.fp8_bits`, SOFT): with it
every buffer is compared BITWISE with the reference, shapes, strides and dtypes included. The
hardware-cast path is checked bitwise on the GPU (tests/test_triton_kernels.py).
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("set TRITON_INTERPRET=1 to run the Triton kernels on CPU", allow_module_level=True)
pytest.importorskip("triton")

from test_triton_kernels import (  # noqa: E402
    ALT_CONFIGS,
    assert_bitwise,
    block_exponent_walk,
    check_delayed_slots,
    check_existing_amax,
    check_scale_helpers,
    make_input,
    run_alt_config,
)

from transformer_engine_proto.kernels.reference import blockwise as ref_bw  # noqa: E402
from transformer_engine_proto.kernels.reference import float8 as ref_f8  # noqa: E402
from transformer_engine_proto.kernels.reference import mxfp8 as ref_mx  # noqa: E402
from transformer_engine_proto.kernels.triton import blockwise as tri_bw  # noqa: E402
from transformer_engine_proto.kernels.triton import float8 as tri_f8  # noqa: E402
from transformer_engine_proto.kernels.triton import mxfp8 as tri_mx  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN/Inf lanes

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
USAGES = [(True, True), (True, False), (False, True)]
KINDS = ["normal", "zero_rows", "huge", "denormal", "nan", "inf", "all_zero", "mixed"]
SHAPES = [(1, 16), (17, 48), (130, 300), (3, 5, 96)]


def cpu_input(shape, kind, dtype=torch.bfloat16, seed=0):
    return make_input(shape, kind, dtype, seed, device="cpu")


def test_scale_helpers():
    check_scale_helpers("cpu")


def test_interpreter_uses_soft_cast():
    from transformer_engine_proto.kernels.triton._common import soft_cast
    assert soft_cast()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_amax(shape, kind):
    x = cpu_input(shape, kind)
    assert_bitwise((tri_f8.amax(x),), (ref_f8.amax(x),), "amax")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES + [(132, 300), (2, 6, 40)], ids=str)  # M % 4 == 0: packed
@pytest.mark.parametrize("usage", USAGES)
def test_current_scaling(shape, kind, usage):
    x = cpu_input(shape, kind)
    for fp8_dtype in FP8:
        out = tri_f8.fp8_quantize_current(x, fp8_dtype, *usage)
        assert_bitwise(out, ref_f8.fp8_quantize_current(x, fp8_dtype, *usage), "current")
        if usage[0] and usage[1]:  # the transpose is a transpose
            data, t = out[0], out[1]
            assert torch.equal(t.view(torch.uint8), data.reshape(-1, shape[-1]).view(torch.uint8).t())


@pytest.mark.parametrize("options", [(0, False, 0.0), (2, True, 1e-3)], ids=str)
def test_current_scaling_existing_amax(options):
    check_existing_amax("cpu", [(17, 48), (132, 40), (3, 5, 96)], ["normal", "mixed", "nan"], options)


@pytest.mark.parametrize("margin,power_2,epsilon", [(0, True, 0.0), (2, False, 1e-3), (-1, True, 1e-12)])
@pytest.mark.parametrize("kind", ["normal", "denormal", "huge", "nan"])
def test_current_scaling_options(margin, power_2, epsilon, kind):
    x = cpu_input((37, 70), kind, torch.float32, seed=3)
    for fp8_dtype in FP8:
        assert_bitwise(tri_f8.fp8_quantize_current(x, fp8_dtype, True, True, margin, power_2, epsilon),
                       ref_f8.fp8_quantize_current(x, fp8_dtype, True, True, margin, power_2, epsilon),
                       "current")


@pytest.mark.parametrize("usage", USAGES + [(False, False)])
@pytest.mark.parametrize("scale_value,amax_init", [(3.7, 0.5), (1e-30, 1e30), (3.4028234663852886e38, 0.0)])
@pytest.mark.parametrize("shape,kind", [((130, 300), "mixed"), ((132, 300), "mixed"), ((132, 40), "nan"),
                                        ((4, 3, 72), "inf")], ids=str)  # M % 4 == 0: packed, tile amax
def test_delayed_scaling(usage, scale_value, amax_init, shape, kind):
    x = cpu_input(shape, kind)
    for fp8_dtype in FP8:
        scale = torch.tensor([scale_value])
        a_ref, a_tri = torch.tensor([amax_init]), torch.tensor([amax_init])
        ref = ref_f8.fp8_quantize_delayed(x, scale, a_ref, fp8_dtype, *usage)
        assert_bitwise(tri_f8.fp8_quantize_delayed(x, scale, a_tri, fp8_dtype, *usage), ref, "delayed")
        assert_bitwise((a_tri,), (a_ref,), "amax_out")


def test_delayed_scaling_slots():
    check_delayed_slots("cpu", [(132, 40), (130, 300)], ["mixed", "nan"])


@pytest.mark.parametrize("fp8_dtype", FP8)
def test_every_bf16_value(fp8_dtype):
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for scale_value in (1.0, 0.7, 2.0**-100, 1e30):
        scale = torch.tensor([scale_value])
        a_ref, a_tri = torch.zeros(1), torch.zeros(1)
        ref = ref_f8.fp8_quantize_delayed(x, scale, a_ref, fp8_dtype, True, True)
        assert_bitwise(tri_f8.fp8_quantize_delayed(x, scale, a_tri, fp8_dtype, True, True), ref, "all-bf16")
        assert_bitwise((a_tri,), (a_ref,), "amax_out")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES + [(129, 257)], ids=str)
@pytest.mark.parametrize("usage", USAGES)
@pytest.mark.parametrize("dim", [1, 2])
def test_blockwise(shape, kind, usage, dim):
    x = cpu_input(shape, kind)
    for fp8_dtype in FP8:
        out = tri_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage)
        assert_bitwise(out, ref_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, *usage), f"blockwise{dim}")
        if dim == 1 and usage[0]:
            assert out[1].stride() == (1, out[1].shape[0])  # 1x128 scales outer-dim-major
        if dim == 2 and usage == (True, True):
            assert torch.equal(out[2].view(torch.uint8), out[0].reshape(-1, shape[-1]).view(torch.uint8).t())
            assert torch.equal(out[3], out[1].t())


@pytest.mark.parametrize("power_2,epsilon", [(False, 0.0), (True, 1e-6)])
@pytest.mark.parametrize("dim", [1, 2])
def test_blockwise_options(power_2, epsilon, dim):
    x = cpu_input((200, 300), "mixed", torch.float32, seed=2)
    for fp8_dtype in FP8:
        assert_bitwise(tri_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, True, True, power_2, epsilon),
                       ref_bw.fp8_blockwise_quantize(x, fp8_dtype, dim, True, True, power_2, epsilon),
                       f"blockwise{dim}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(32, 32), (96, 160), (2, 48, 64)], ids=str)
@pytest.mark.parametrize("usage", USAGES)
def test_mxfp8(shape, kind, usage):
    x = cpu_input(shape, kind)
    for fp8_dtype in FP8:
        assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, *usage),
                       ref_mx.mxfp8_quantize(x, fp8_dtype, *usage), "mxfp8")


@pytest.mark.parametrize("shape,usage", [((17, 64), (True, False)), ((64, 48), (False, True))], ids=str)
def test_mxfp8_one_usage_odd_other_dim(shape, usage):
    x = cpu_input(shape, "mixed")
    for fp8_dtype in FP8:
        assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, *usage),
                       ref_mx.mxfp8_quantize(x, fp8_dtype, *usage), "mxfp8")


def test_mxfp8_every_block_exponent():
    x = block_exponent_walk("cpu")
    x[5, 3] = float("inf")
    for fp8_dtype in FP8:
        assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, True, True),
                       ref_mx.mxfp8_quantize(x, fp8_dtype, True, True), "mxfp8-exp")
        xt = x.t().contiguous()
        assert_bitwise(tri_mx.mxfp8_quantize(xt, fp8_dtype, True, True),
                       ref_mx.mxfp8_quantize(xt, fp8_dtype, True, True), "mxfp8-exp-t")


@pytest.mark.parametrize("table,key,cfg", [(t, k, c) for t, k, cs in ALT_CONFIGS for c in cs],
                         ids=[f"{k}-{c}" for _, k, cs in ALT_CONFIGS for c in cs])
def test_alternative_configs(table, key, cfg, monkeypatch):
    run_alt_config(table, key, cfg, "cpu", monkeypatch)


def test_non_contiguous_input():
    x = cpu_input((96, 160), "normal").t()
    for fp8_dtype in FP8:
        out = tri_f8.fp8_quantize_current(x, fp8_dtype, True, True)
        assert out[0].is_contiguous()
        assert_bitwise(out, ref_f8.fp8_quantize_current(x.contiguous(), fp8_dtype, True, True), "current-nc")
        assert_bitwise(tri_bw.fp8_blockwise_quantize(x, fp8_dtype, 1, True, True),
                       ref_bw.fp8_blockwise_quantize(x.contiguous(), fp8_dtype, 1, True, True), "bw-nc")
        assert_bitwise(tri_mx.mxfp8_quantize(x, fp8_dtype, True, True),
                       ref_mx.mxfp8_quantize(x.contiguous(), fp8_dtype, True, True), "mx-nc")
