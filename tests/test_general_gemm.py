"""cpp_extensions.general_gemm: TE's GEMM entry point (column-major layout names) on `gemm`."""
import pytest
import torch

from transformer_engine_proto import Float8CurrentScalingQuantizer
from transformer_engine_proto.cpp_extensions import general_gemm
from transformer_engine_proto.gemm import gemm


def _mats(device="cpu"):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g)   # (out, in)
    x = torch.randn(16, 32, generator=g)   # (tokens, in)
    dy = torch.randn(16, 48, generator=g)  # (tokens, out)
    return w.to(device), x.to(device), dy.to(device)


def test_layouts_are_a_linears_three_gemms():
    w, x, dy = _mats()
    torch.testing.assert_close(general_gemm(w, x, layout="TN")[0], x @ w.t())     # fprop
    torch.testing.assert_close(general_gemm(w, dy, layout="NN")[0], dy @ w)       # dgrad
    torch.testing.assert_close(general_gemm(x, dy, layout="NT")[0], dy.t() @ x)   # wgrad
    with pytest.raises(ValueError, match="layout must be one of"):
        general_gemm(w, x, layout="TT")


def test_epilogues():
    w, x, dy = _mats()
    b = torch.randn(48)
    out, bias_grad, gelu_input, extra = general_gemm(w, x, bias=b, gelu=True)
    pre = x @ w.t() + b
    torch.testing.assert_close(gelu_input, pre)
    torch.testing.assert_close(out, torch.nn.functional.gelu(pre, approximate="tanh"))
    assert bias_grad is None and extra is None
    # the GELU backward: out = dgelu_out * gelu'(gelu_in)
    dgelu = general_gemm(w, dy, layout="NN", gelu=True, grad=True, gelu_in=x)[0]
    ref = torch.ops.aten.gelu_backward(dy @ w, x, approximate="tanh")
    torch.testing.assert_close(dgelu, ref)
    # wgrad with the fused dbias, accumulated into an existing main_grad with alpha / beta
    main = torch.randn(48, 32)
    before = main.clone()
    res, db, _, _ = general_gemm(x, dy, layout="NT", grad=True, bias=b, accumulate=True, out=main, alpha=0.5,
                                 beta=2.0)
    assert res is main
    torch.testing.assert_close(main, 0.5 * (dy.t() @ x) + 2.0 * before)
    torch.testing.assert_close(db, dy.sum(0))
    with pytest.raises(ValueError, match="accumulate=True adds into `out`"):
        general_gemm(x, dy, layout="NT", accumulate=True)
    with pytest.raises(NotImplementedError, match="communication overlap"):
        general_gemm(w, x, ub=object())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_quantized_operands_read_the_usage_each_layout_needs(device):
    """Each layout equals the dequantized product (CUDA: `torch._scaled_mm` on the buffers it reads)."""
    w, x, dy = _mats(device)
    # Hopper's FP8 tensor cores accumulate with fewer bits than an fp32 matmul: about 0.5% apart
    fp8_accumulation_tol = {"rtol": 1e-2, "atol": 1e-2} if device == "cuda" else {}
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=device)
    wq, xq, dyq = (q.quantize(t) for t in (w, x, dy))  # tensors holding both usages
    for internal in (False, True):
        if internal:
            wq, xq, dyq = (q.quantize(t, internal=True) for t in (w, x, dy))
        fprop = general_gemm(wq, xq, out_dtype=torch.float32, layout="TN")[0]
        assert torch.equal(fprop, gemm(q.quantize(x, internal=True).only_usage(True),
                                       q.quantize(w, internal=True).only_usage(True),
                                       out_dtype=torch.float32, trans_b=True, use_split_accumulator=False))
        dgrad = general_gemm(wq, dyq, out_dtype=torch.float32, layout="NN")[0]
        torch.testing.assert_close(dgrad, dyq.dequantize(dtype=torch.float32) @ wq.dequantize(dtype=torch.float32),
                                   **fp8_accumulation_tol)
        wgrad = general_gemm(xq, dyq, out_dtype=torch.bfloat16, layout="NT")[0]
        assert wgrad.dtype == torch.bfloat16
        ref = dyq.dequantize(dtype=torch.float32).t() @ xq.dequantize(dtype=torch.float32)
        if device == "cuda":  # the accumulation difference can move a value across a bf16 rounding step
            torch.testing.assert_close(wgrad.float(), ref, **fp8_accumulation_tol)
        else:
            torch.testing.assert_close(wgrad, ref.to(torch.bfloat16))
    rowwise_only = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device=device, columnwise_usage=False)
    with pytest.raises(ValueError, match="holds no columnwise buffers"):
        general_gemm(rowwise_only.quantize(w, internal=True), dyq, layout="NN")


def test_output_quantizer():
    w, x, _ = _mats()
    q = Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device="cpu")
    out = general_gemm(w, x, out_dtype=torch.float32, quantization_params=q)[0]
    assert torch.equal(out.dequantize(dtype=torch.float32), q.quantize(x @ w.t()).dequantize(dtype=torch.float32))


def test_te_alias_names_it():
    from transformer_engine_proto import as_te
    assert as_te.ALIASES["transformer_engine.pytorch.cpp_extensions"] == "transformer_engine_proto.cpp_extensions"
