"""Megatron-LM's `grad_added_to_main_grad` under `fuse_wgrad_accumulation=True`, as TE sets it:
every GEMM weight carrying the attribute has it set to True by backward, once its gradient has
been added into `main_grad` (eager: forward alone leaves it False; compiled: set by the step);
a weight without the attribute does not get one."""
import pytest
import torch
from linear_cases import RECIPES, fresh_dynamo, graph_breaks, recipe_ctx

import transformer_engine_proto as te

H, T = 64, 32

MODULES = {
    "Linear": lambda: te.Linear(H, H, fuse_wgrad_accumulation=True),
    "LayerNormLinear": lambda: te.LayerNormLinear(H, H, fuse_wgrad_accumulation=True),
    "LayerNormMLP": lambda: te.LayerNormMLP(H, 2 * H, fuse_wgrad_accumulation=True),
    "GroupedLinear": lambda: te.GroupedLinear(2, H, H, fuse_wgrad_accumulation=True),
    "TransformerLayer": lambda: te.TransformerLayer(H, 2 * H, 4, fuse_qkv_params=True, fuse_wgrad_accumulation=True,
                                                    hidden_dropout=0.0, attention_dropout=0.0),
}


def _call(name, m, x):
    if name == "GroupedLinear":
        return m(x, [T // 2, T // 2])
    return m(x.view(T // 4, 4, H) if name == "TransformerLayer" else x)


def _gemm_weights(m):
    """What TE's test_sanity_gradient_accumulation_fusion checks: weights but the norms'."""
    return {n: p for n, p in m.named_parameters() if "weight" in n and "layer_norm_weight" not in n}


def _prepare(m, with_flag=True):
    for p in _gemm_weights(m).values():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        if with_flag:
            p.grad_added_to_main_grad = False


@pytest.mark.parametrize("rid", ["high_precision", "current"])
@pytest.mark.parametrize("name", list(MODULES))
def test_backward_sets_the_flag_after_accumulating(name, rid):
    torch.manual_seed(0)
    m = MODULES[name]()
    _prepare(m)
    with recipe_ctx(RECIPES[rid]):
        y = _call(name, m, torch.randn(T, H))
    assert not any(p.grad_added_to_main_grad for p in _gemm_weights(m).values())  # forward alone
    y.float().sum().backward()
    for n, p in _gemm_weights(m).items():
        assert p.grad_added_to_main_grad is True, n
        assert p.main_grad.count_nonzero() > 0, n


def test_no_flag_without_the_attribute_or_without_backward():
    m = MODULES["Linear"]()
    _prepare(m, with_flag=False)
    m(torch.randn(T, H)).sum().backward()
    assert not hasattr(m.weight, "grad_added_to_main_grad")
    _prepare(m)
    with torch.no_grad():
        m(torch.randn(T, H))
    assert m.weight.grad_added_to_main_grad is False


@pytest.mark.parametrize("name", ["Linear", "GroupedLinear"])
def test_compiled_step_sets_the_flag(name):
    """A compiled backward runs no Python: the compiled step sets the flag (in forward), on every
    call, with no graph break."""
    torch.manual_seed(0)
    m = MODULES[name]()
    _prepare(m)
    fresh_dynamo()
    cm = torch.compile(m, fullgraph=True, backend="aot_eager")
    for _ in range(2):
        for p in _gemm_weights(m).values():
            p.grad_added_to_main_grad = False
        _call(name, cm, torch.randn(T, H)).sum().backward()
        assert all(p.grad_added_to_main_grad is True for p in _gemm_weights(m).values())
    assert graph_breaks() == 0
