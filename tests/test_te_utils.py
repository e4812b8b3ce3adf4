"""transformer_engine_proto.utils: TE's `transformer_engine.pytorch.utils` helpers that user code calls."""
import math

import pytest
import torch

from transformer_engine_proto import as_te, utils


def test_init_methods_draw_with_the_requested_std():
    torch.manual_seed(0)
    w = torch.empty(512, 512)
    assert utils.init_method_normal(0.5)(w) is w  # in place
    assert abs(w.std().item() - 0.5) < 0.01 and abs(w.mean().item()) < 0.01
    utils.scaled_init_method_normal(0.5, num_layers=8)(w)
    assert abs(w.std().item() - 0.5 / math.sqrt(16)) < 0.005
    utils.get_default_init_method()(w)
    assert abs(w.std().item() - 0.023) < 0.001
    assert torch.equal(utils.init_method_constant(3.0)(w), torch.full_like(w, 3.0))


def test_attention_mask_func_and_divide():
    scores = torch.zeros(2, 3)
    mask = torch.tensor([[True, False, False], [False, False, True]])
    out = utils.attention_mask_func(scores, mask)
    assert out is scores and out[0, 0] == -10000.0 and out[1, 2] == -10000.0 and out[0, 1] == 0
    assert utils.divide(12, 4) == 3
    with pytest.raises(ValueError, match="not divisible"):
        utils.divide(10, 4)


def test_non_tn_fp8_gemm_support_follows_the_capability(monkeypatch):
    for cap, want in [((0, 0), False), ((9, 0), False), ((10, 0), True), ((12, 0), False), ((13, 0), True)]:
        monkeypatch.setattr(utils, "get_device_compute_capability", lambda cap=cap: cap)
        assert utils.is_non_tn_fp8_gemm_supported() is want, cap


def test_te_name_is_aliased():
    assert as_te.ALIASES["transformer_engine.pytorch.utils"] == "transformer_engine_proto.utils"
