"""Settings that would give a silent wrong answer are refused where they are made."""
import pytest
import torch
from linear_cases import backend_params

from transformer_engine_proto import recipe as R
from transformer_engine_proto.tensor import Float8CurrentScalingQuantizer, Float8Quantizer, MXFP8Quantizer, TensorProto


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_float8_quantizer_rejects_a_scale_that_dequantizes_to_nan(value):
    with pytest.raises(ValueError, match="Float8Quantizer.scale must be finite and > 0"):
        Float8Quantizer(torch.tensor([value]), torch.zeros(1), torch.float8_e4m3fn)


@pytest.mark.parametrize("backend", backend_params())
def test_float8_quantizer_scale_is_not_read_under_compile(backend):
    def f(x, scale):
        return Float8Quantizer(scale, torch.zeros(1), torch.float8_e4m3fn)(x).dequantize()

    torch._dynamo.reset()
    x, scale = torch.randn(4, 8), torch.ones(1)
    y = torch.compile(f, fullgraph=True, backend=backend)(x, scale)
    assert torch.isfinite(y).all() and torch.equal(y, f(x, scale))


@pytest.mark.parametrize("make, match", [
    (lambda: R.DelayedScaling(margin=-1), "DelayedScaling.margin"),
    (lambda: R.DelayedScaling(amax_history_len=2.5), "amax_history_len"),
    (lambda: R.Float8CurrentScaling(margin=-2), "Float8CurrentScaling.margin"),
    (lambda: R.Float8CurrentScaling(fp8_quant_fwd_inp=R.QParams(amax_epsilon=-1e-3)), "amax_epsilon"),
    (lambda: R.Float8CurrentScaling(fp8_quant_bwd_grad=R.QParams(amax_epsilon=float("nan"))), "amax_epsilon"),
    (lambda: R.Float8BlockScaling(fp8_quant_fwd_weight=R.QParams(amax_epsilon=-1.0)), "amax_epsilon"),
    (lambda: R.MXFP8BlockScaling(margin=1), "MXFP8BlockScaling.margin is not used"),
    (lambda: R.NVFP4BlockScaling(fp8_format="E4M3"), "fp8_format must be an FP8 recipe.Format"),
])
def test_recipe_fields_are_checked(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_valid_recipes_still_build():
    R.DelayedScaling(margin=2, amax_history_len=4)
    R.Float8CurrentScaling(margin=1, fp8_quant_fwd_inp=R.QParams(amax_epsilon=1e-6))
    R.MXFP8BlockScaling(margin=0)


@pytest.mark.parametrize("shape, dtype, quantizer, error, match", [
    ((4, -8), torch.float32, None, ValueError, "shape entries must be >= 0"),
    ((4, 8.0), torch.float32, None, TypeError, "shape entries must be ints"),
    ((32, 32), torch.int32, MXFP8Quantizer(), TypeError, "nominal dtype"),
    ((32, 32), torch.float8_e4m3fn, Float8CurrentScalingQuantizer(torch.float8_e4m3fn), TypeError, "nominal dtype"),
    ((32, 32), "float32", None, TypeError, "dtype must be a torch.dtype"),
])
def test_tensor_proto_rejects_bad_shapes_and_dtypes(shape, dtype, quantizer, error, match):
    with pytest.raises(error, match=match):
        TensorProto(shape, dtype, quantizer)


def test_tensor_proto_plain_integer_and_empty_shapes_are_fine():
    assert TensorProto((0, 8), torch.int64).create_tensor().shape == (0, 8)
