"""GroupedLinear's single grouped parameters (TE's `single_grouped_weight` / `single_grouped_bias`):
one `weight` [n, out, in] and `bias` [n, out] with TE's names, gated by
NVTE_GROUPED_LINEAR_SINGLE_PARAM as in TE, computing exactly what per-expert parameters holding
the same values compute (forward, dgrad, wgrad, dbias, main_grad accumulation), eager and compiled."""
import copy

import pytest
import torch
from linear_cases import RECIPES, fresh_dynamo, graph_breaks, recipe_ctx

import transformer_engine_proto as te
from transformer_engine_proto.module.grouped_linear import grouped_mm_supported

N, K, OUT = 3, 32, 64
SPLITS = [32, 0, 64]
SINGLE = dict(single_grouped_weight=True, single_grouped_bias=True)


@pytest.fixture
def single_param_env(monkeypatch):
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")


def _pair(dtype=torch.float32, cls=None, **kw):
    """A single-parameter GroupedLinear and a per-expert one built from the same seed (so the
    same values), biases made non-zero."""
    make = cls or (lambda **a: te.GroupedLinear(N, K, OUT, params_dtype=dtype, device="cpu", **a))
    torch.manual_seed(0)
    single = make(**SINGLE, **kw)
    torch.manual_seed(0)
    per_expert = make(**kw)
    with torch.no_grad():
        single.bias.normal_()
        for i in range(N):
            getattr(per_expert, f"bias{i}").copy_(single.bias[i])
    return single, per_expert


def _step(module, x, dy, splits=SPLITS):
    x = x.detach().clone().requires_grad_()
    y = module(x, splits)
    y.backward(dy)
    return y.detach(), x.grad


def _assert_same_grads(single, per_expert):
    for i in range(N):
        assert torch.equal(single.weight.grad[i], getattr(per_expert, f"weight{i}").grad)
        assert torch.equal(single.bias.grad[i], getattr(per_expert, f"bias{i}").grad)


def test_one_parameter_each_with_te_names_and_init(single_param_env):
    single, per_expert = _pair()
    assert [(n, tuple(p.shape)) for n, p in single.named_parameters()] == [("weight", (N, OUT, K)),
                                                                           ("bias", (N, OUT))]
    assert set(single.state_dict()) == {"weight", "bias", "_extra_state"}
    assert single.weight0 is None and single.bias0 is None  # as TE registers them
    for i in range(N):  # each expert initialized as its own parameter would be
        assert torch.equal(single.weight[i], getattr(per_expert, f"weight{i}"))
    weight_only = te.GroupedLinear(N, K, OUT, device="cpu", single_grouped_weight=True)
    assert {n for n, _ in weight_only.named_parameters()} == {"weight"} | {f"bias{i}" for i in range(N)}


def test_without_the_environment_variable_falls_back_with_a_warning(monkeypatch):
    monkeypatch.delenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", raising=False)
    with pytest.warns(UserWarning, match="NVTE_GROUPED_LINEAR_SINGLE_PARAM is not set"):
        g = te.GroupedLinear(N, K, OUT, device="cpu", **SINGLE)
    assert "weight0" in dict(g.named_parameters()) and not g.single_grouped_weight


@pytest.mark.parametrize("rid", ["high_precision", "current", "mxfp8"])
def test_expert_loop_matches_per_expert_parameters(single_param_env, rid):
    single, per_expert = _pair(use_grouped_tensor=False)
    torch.manual_seed(1)
    for splits in (SPLITS, [61, 35, 0]):
        x, dy = torch.randn(96, K), torch.randn(96, OUT)
        with recipe_ctx(RECIPES[rid]):
            y, dx = _step(single, x, dy, splits)
            y_ref, dx_ref = _step(per_expert, x, dy, splits)
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    _assert_same_grads(single, per_expert)


def test_grouped_mm_matches_per_expert_parameters(single_param_env):
    if not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, K, OUT):
        pytest.skip("torch._grouped_mm does not run here")
    single, per_expert = _pair(torch.bfloat16)
    x, dy = torch.randn(96, K, dtype=torch.bfloat16), torch.randn(96, OUT, dtype=torch.bfloat16)
    y, dx = _step(single, x, dy)
    y_ref, dx_ref = _step(per_expert, x, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    _assert_same_grads(single, per_expert)


def test_return_bias_gives_the_packed_parameter(single_param_env):
    g = te.GroupedLinear(N, K, OUT, device="cpu", return_bias=True, **SINGLE)
    with torch.no_grad():
        g.bias.fill_(1.0)
    x = torch.randn(96, K)
    out, bias = g(x, SPLITS)
    assert bias is g.bias
    torch.testing.assert_close(out[:32], x[:32] @ g.weight[0].T)  # returned, not added


@pytest.mark.parametrize("use_grouped_tensor", [None, False], ids=["grouped_mm", "expert_loop"])
def test_fuse_wgrad_accumulation_into_the_grouped_main_grad(single_param_env, use_grouped_tensor):
    """`weight.main_grad` [n, out, in] ends as the per-expert main_grads stacked, `.grad` stays
    None, and Megatron's `grad_added_to_main_grad` is set by backward, not forward."""
    if use_grouped_tensor is None and not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, K, OUT):
        pytest.skip("torch._grouped_mm does not run here")
    single, per_expert = _pair(torch.bfloat16, fuse_wgrad_accumulation=True, use_grouped_tensor=use_grouped_tensor)
    start = torch.randn(N, OUT, K)
    single.weight.main_grad = start.clone()
    single.weight.grad_added_to_main_grad = False
    for i, w in enumerate(per_expert.weights):
        w.main_grad = start[i].clone()
    x, dy = torch.randn(96, K, dtype=torch.bfloat16), torch.randn(96, OUT, dtype=torch.bfloat16)
    xs = x.clone().requires_grad_()
    y = single(xs, SPLITS)
    assert single.weight.grad_added_to_main_grad is False
    y.backward(dy)
    assert single.weight.grad_added_to_main_grad is True
    _step(per_expert, x, dy)
    assert single.weight.grad is None
    assert not torch.equal(single.weight.main_grad, start)
    assert torch.equal(single.weight.main_grad, torch.stack([w.main_grad for w in per_expert.weights]))


def test_fuse_wgrad_accumulation_needs_the_grouped_main_grad(single_param_env):
    g = te.GroupedLinear(N, K, OUT, device="cpu", fuse_wgrad_accumulation=True, name="experts", **SINGLE)
    with pytest.raises(RuntimeError, match="experts: fuse_wgrad_accumulation=True needs weight.main_grad"):
        g(torch.randn(96, K), SPLITS)


@pytest.mark.parametrize("dtype, rid", [(torch.bfloat16, "high_precision"), (torch.float32, "current")],
                         ids=["grouped_mm", "current"])
def test_compiled_equals_eager(single_param_env, dtype, rid):
    """fullgraph with aot_eager, fused wgrad accumulation included: bitwise eager's."""
    g, _ = _pair(dtype, fuse_wgrad_accumulation=True)
    ge = copy.deepcopy(g)
    for m in (g, ge):
        m.weight.main_grad = torch.zeros(N, OUT, K)
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    x, dy = torch.randn(96, K, dtype=dtype), torch.randn(96, OUT, dtype=dtype)
    with recipe_ctx(RECIPES[rid]):
        y, dx = _step(cg, x, dy)
        y_e, dx_e = _step(ge, x, dy)
    assert torch.equal(y, y_e) and torch.equal(dx, dx_e)
    assert torch.equal(g.weight.main_grad, ge.weight.main_grad) and g.weight.main_grad.abs().sum() > 0
    assert torch.equal(g.bias.grad, ge.bias.grad)
    assert graph_breaks() == 0


def test_quantized_model_init_is_refused(single_param_env):
    with te.quantized_model_init(recipe=RECIPES["current"]):
        with pytest.raises(NotImplementedError, match="GroupedLinear\\(single_grouped_weight=True\\) inside "
                                                      "quantized_model_init"):
            te.GroupedLinear(N, K, OUT, device="cpu", single_grouped_weight=True)


def test_ops_grouped_linear_single_params(single_param_env):
    make = lambda **kw: te.ops.GroupedLinear(N, K, OUT, device="cpu", **kw)  # noqa: E731
    single, per_expert = _pair(cls=make)
    assert {n for n, _ in single.named_parameters()} == {"weight", "bias"}
    x, dy = torch.randn(96, K), torch.randn(96, OUT)
    y, dx = _step(single, x, dy)
    y_ref, dx_ref = _step(per_expert, x, dy)
    assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    _assert_same_grads(single, per_expert)


def test_delay_wgrad_compute_with_single_parameters_is_refused(single_param_env):
    with pytest.raises(NotImplementedError, match="delay_wgrad_compute=True with single grouped parameters"):
        te.GroupedLinear(2, 32, 16, single_grouped_weight=True, delay_wgrad_compute=True,
                         params_dtype=torch.float32, device="cpu")
