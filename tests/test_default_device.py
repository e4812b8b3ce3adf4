"""Modules built without `device=` go where TE's would: CUDA when there is one, else the CPU; an
explicit device or a default device the user set (deferred init on "meta") wins."""
import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import capabilities
from transformer_engine_proto import ops_api as te_ops


def test_resolution_order(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert capabilities.default_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert capabilities.default_device() == torch.device("cuda", 3)
    assert capabilities.default_device("cpu") == torch.device("cpu")  # an explicit device wins
    with torch.device("meta"):
        assert capabilities.default_device() == torch.device("meta")  # so does the user's default


BUILDERS = {
    "Linear": lambda: te.Linear(8, 8),
    "LayerNormLinear": lambda: te.LayerNormLinear(8, 8),
    "LayerNormMLP": lambda: te.LayerNormMLP(8, 16),
    "GroupedLinear": lambda: te.GroupedLinear(2, 8, 8),
    "RMSNorm": lambda: te.RMSNorm(8),
    "TransformerLayer": lambda: te.TransformerLayer(8, 16, 2),
    "RotaryPositionEmbedding": lambda: te.RotaryPositionEmbedding(4),
    "ops.Linear": lambda: te_ops.Linear(8, 8),
    "ops.LayerNorm": lambda: te_ops.LayerNorm(8),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_parameter_and_buffer_follows_the_default(name):
    build = BUILDERS[name]
    on_this_machine = capabilities.default_device()
    module = build()
    tensors = list(module.parameters()) + list(module.buffers())
    assert tensors and all(t.device.type == on_this_machine.type for t in tensors)
    with torch.device("meta"):  # deferred init: nothing is allocated
        module = build()
    assert all(t.is_meta for t in list(module.parameters()) + list(module.buffers()))


@pytest.mark.cuda
def test_cuda_is_the_default_on_a_gpu_machine():
    layer = te.Linear(16, 16)
    assert layer.weight.is_cuda
    out = layer(torch.randn(4, 16, device="cuda"))  # TE's tests feed .cuda() inputs to such a module
    assert out.is_cuda
