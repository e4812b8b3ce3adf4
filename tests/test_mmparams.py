"""recipe.MMParams: which GEMMs accumulate in the FP8 tensor cores' fast mode, as TE's defaults."""
import dataclasses

import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import linear as linear_ops
from transformer_engine_proto.gemm import gemm


def test_defaults_are_tes():
    """Per-tensor recipes: fprop fast, the gradient GEMMs split (TE's `_2X_ACC_*`); blockwise all split."""
    cur = R.Float8CurrentScaling()
    assert cur.fp8_gemm_fprop == R.MMParams(use_split_accumulator=False)
    assert cur.fp8_gemm_dgrad.use_split_accumulator and cur.fp8_gemm_wgrad.use_split_accumulator
    for recipe in (cur, R.DelayedScaling()):
        assert [R.uses_split_accumulator(recipe, g) for g in ("fprop", "dgrad", "wgrad")] == [False, True, True]
    block = R.Float8BlockScaling()
    assert all(R.uses_split_accumulator(block, g) for g in ("fprop", "dgrad", "wgrad"))
    assert R.uses_split_accumulator(R.Float8CurrentScaling(fp8_gemm_fprop=R.MMParams()), "fprop")


def test_bad_values_name_the_field():
    with pytest.raises(TypeError, match=r"Float8CurrentScaling.fp8_gemm_dgrad must be a recipe.MMParams"):
        R.Float8CurrentScaling(fp8_gemm_dgrad=True)
    with pytest.raises(ValueError, match=r"Float8BlockScaling.fp8_gemm_fprop: blockwise FP8 GEMMs need the split"):
        R.Float8BlockScaling(fp8_gemm_fprop=R.MMParams(use_split_accumulator=False))
    recipe = R.Float8CurrentScaling()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.fp8_gemm_fprop.use_split_accumulator = True


@pytest.mark.parametrize("recipe, expected", [
    (R.Float8CurrentScaling(), {"fprop": False, "dgrad": True, "wgrad": True}),
    (R.DelayedScaling(), {"fprop": False, "dgrad": True, "wgrad": True}),
    (R.Float8CurrentScaling(fp8_gemm_fprop=R.MMParams(), fp8_gemm_wgrad=R.MMParams(False)),
     {"fprop": True, "dgrad": True, "wgrad": False}),
], ids=["current", "delayed", "current-edited"])
def test_the_linear_op_passes_each_gemms_setting(monkeypatch, recipe, expected):
    """Each of a Linear's GEMMs gets its recipe's accumulation (fprop has trans_b, wgrad trans_a)."""
    seen = {}

    def recording_gemm(a, b, **kw):
        name = "fprop" if kw.get("trans_b") else "wgrad" if kw.get("trans_a") else "dgrad"
        seen[name] = kw["use_split_accumulator"]
        return gemm(a, b, **kw)

    monkeypatch.setattr(linear_ops, "gemm", recording_gemm)
    lin = te.Linear(32, 48, params_dtype=torch.float32, device="cpu")
    x = torch.randn(16, 32, requires_grad=True)
    with te.autocast(enabled=True, recipe=recipe):
        y = lin(x)
    y.sum().backward()
    assert seen == expected


@pytest.mark.cuda
@pytest.mark.parametrize("split", [False, True])
def test_cuda_gemm_is_scaled_mm_with_that_accumulation(split):
    """On the GPU the setting reaches cuBLAS: bit for bit `torch._scaled_mm(use_fast_accum=not split)`."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(512, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    q = te.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, device="cuda")
    xq, wq = q.quantize(x, internal=True).only_usage(True), q.quantize(w, internal=True).only_usage(True)
    got = gemm(xq, wq, trans_b=True, out_dtype=torch.bfloat16, use_split_accumulator=split)
    ref = torch._scaled_mm(xq._data, wq._data.t(), xq._scale_inv, wq._scale_inv, out_dtype=torch.bfloat16,
                           use_fast_accum=not split)
    assert torch.equal(got, ref)
