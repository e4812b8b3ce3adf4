"""te.make_graphed_callables: CUDA-graphed eager training equals ungraphed eager training bit for
bit over several steps for every recipe (losses, weights, delayed-scaling buffers). The cuda
tests run on the GPU machine (qa/L1_gpu.sh); the argument checks run anywhere."""
import copy

import pytest
import torch
from linear_cases import RECIPE_IDS, RECIPES, fold_last_grad_amaxes

import transformer_engine_proto as te

STEPS = 6


def _model(first=te.LayerNormLinear):
    """`first=te.Linear`: the graph's static input is quantized directly (no norm before it)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(first(128, 256), torch.nn.GELU(), te.Linear(256, 128)).to(
        device="cuda", dtype=torch.bfloat16)


def _train(model, step_fn, recipe):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    torch.manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
        loss = step_fn(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    fold_last_grad_amaxes(recipe)
    return losses


@pytest.mark.cuda
@pytest.mark.parametrize("first", [te.LayerNormLinear, te.Linear], ids=["norm_first", "linear_first"])
@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_graphed_training_matches_eager(rid, first):
    recipe = RECIPES[rid]
    ref = _model(first)
    graphed_model = copy.deepcopy(ref)
    sample = (torch.randn(64, 128, device="cuda", dtype=torch.bfloat16),)
    graphed = te.make_graphed_callables(graphed_model, sample, fp8_enabled=recipe is not None, fp8_recipe=recipe)
    assert graphed is graphed_model  # modules come back with a graphed forward, as in torch

    def eager_step(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            return ref(x)

    losses_ref = _train(ref, eager_step, recipe)
    losses_graphed = _train(graphed_model, graphed, recipe)  # no autocast here: the graphed callable enters it
    for a, b in zip(losses_ref, losses_graphed):
        assert torch.equal(a, b), (losses_ref, losses_graphed)
    for (name, a), b in zip(ref.state_dict().items(), graphed_model.state_dict().values()):
        assert torch.equal(a, b), name  # weights and every delayed-scaling buffer
    if rid == "delayed":  # replays did advance the state in place
        h = graphed_model[2].gemm.amax_history
        assert h[-STEPS:].gt(0).all() and not h[0].any()  # rolled at each exit: the steps at the end


class _SyncsInForward(torch.nn.Module):
    """A forward that reads a device value on the host: illegal while a CUDA graph captures."""

    def __init__(self):
        super().__init__()
        self.lin = te.Linear(32, 32, device="cuda")

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if y.sum().item() > 0 else y


@pytest.mark.cuda
def test_failed_capture_leaves_the_cuda_rng_usable():
    """torch leaves the CUDA generator in capture mode when a capture fails (every later CUDA
    random op then raises); make_graphed_callables puts it back before re-raising."""
    sample = (torch.randn(16, 32, device="cuda", requires_grad=True),)
    with pytest.raises(Exception, match="captur"):
        te.make_graphed_callables(_SyncsInForward(), sample, recipe=RECIPES["current"], enabled=True)
    torch.manual_seed(3)
    a = torch.randn(8, device="cuda")
    torch.manual_seed(3)
    assert torch.equal(a, torch.randn(8, device="cuda"))
    model = _model(te.Linear)  # a later capture in the same process works
    graphed = te.make_graphed_callables(model, (torch.randn(64, 128, device="cuda", dtype=torch.bfloat16),))
    assert graphed(torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)).shape == (64, 128)


@pytest.mark.cuda
def test_graphed_function_and_tuple_of_modules():
    recipe = RECIPES["current"]
    a, b = _model(), _model()
    fn = lambda x: a(x) * 2  # noqa: E731
    sample = (torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
    g_fn, g_b = te.make_graphed_callables((fn, b), (sample, sample), recipe=recipe, enabled=True)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(recipe=recipe):
        want = a(x) * 2
    assert torch.equal(g_fn(x), want)
    assert g_b(x).shape == (64, 128)
    # TE's reset(): the graphs are dropped, the module runs its own forward, the function refuses
    assert "forward" in b.__dict__
    g_b.reset()
    g_fn.reset()
    assert "forward" not in b.__dict__ and g_b is b
    with te.autocast(recipe=recipe):
        assert torch.equal(b(x), _model()(x))
    with pytest.raises(RuntimeError, match="graphed callable was reset"):
        g_fn(x)


class _MicrobatchStack(torch.nn.Module):
    """Two GEMM modules that pass `is_first_microbatch` on, as TE's tests' `_Sequential`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = te.LayerNormLinear(128, 128, device="cuda", params_dtype=torch.bfloat16)
        self.b = te.Linear(128, 128, device="cuda", params_dtype=torch.bfloat16)

    def forward(self, x, is_first_microbatch=None):
        return self.b(self.a(x, is_first_microbatch=is_first_microbatch), is_first_microbatch=is_first_microbatch)


@pytest.mark.cuda
@pytest.mark.parametrize("rid", [r for r in RECIPE_IDS if RECIPES[r] is not None])
def test_graphed_weight_caching_matches_eager(rid):
    """cache_quantized_params=True: each step's two micro-batches, the first quantizing the weights
    and the second reading the cache, give the eager run's outputs, gradients and weights."""
    recipe = RECIPES[rid]
    ref = _MicrobatchStack()
    graphed_model = copy.deepcopy(ref)
    sample = (torch.ones(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
    te.make_graphed_callables(graphed_model, sample, enabled=True, recipe=recipe, cache_quantized_params=True)

    def run(model, graphed):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        torch.manual_seed(1)
        outs = []
        for _ in range(3):
            for mb in range(2):
                x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                if graphed:
                    y = model(x, is_first_microbatch=mb == 0)
                else:
                    with te.autocast(recipe=recipe):
                        y = model(x, is_first_microbatch=mb == 0)
                y.float().square().mean().backward()
                outs += [y.detach().clone(), x.grad.clone()]  # a graph's static buffers: the next replay rewrites them
            opt.step()
            opt.zero_grad(set_to_none=True)
        fold_last_grad_amaxes(recipe)
        return outs

    want, got = run(ref, False), run(graphed_model, True)
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), i
    for (name, a), b in zip(ref.state_dict().items(), graphed_model.state_dict().values()):
        assert torch.equal(a, b), name


class _WithKeywords(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = te.Linear(128, 128, device="cuda", params_dtype=torch.bfloat16)

    def forward(self, x, gate=None, mode="scale"):
        y = self.lin(x)
        return y * gate if mode == "scale" else y + gate


@pytest.mark.cuda
def test_graphed_sample_kwargs():
    """TE's sample_kwargs: keyword tensors are graph inputs, other keyword values are fixed."""
    recipe = RECIPES["current"]
    ref = _WithKeywords()
    model = copy.deepcopy(ref)
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate = torch.rand(64, 128, device="cuda", dtype=torch.bfloat16)
    te.make_graphed_callables(model, (x,), sample_kwargs={"gate": gate, "mode": "add"}, recipe=recipe,
                              enabled=True)
    x2, gate2 = torch.randn_like(x).requires_grad_(), torch.rand_like(gate)
    got = model(x2, gate=gate2, mode="add")
    got.float().sum().backward()
    x3 = x2.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        want = ref(x3, gate=gate2, mode="add")
    want.float().sum().backward()
    assert torch.equal(got, want) and torch.equal(x2.grad, x3.grad)
    assert torch.equal(model.lin.weight.grad, ref.lin.weight.grad)
    with pytest.raises(ValueError, match=r"other value than captured: \['mode'\]"):
        model(x2, gate=gate2, mode="scale")
    with pytest.raises(ValueError, match=r"missing: \['gate'\]"):
        model(x2, mode="add")


@pytest.mark.cuda
@pytest.mark.parametrize("clone", [True, False])
def test_graphed_parameter_grads_are_owned(clone):
    """clone_param_grads_on_return (default): a replay's parameter gradient kept by the user is
    not rewritten by the next replay; False keeps torch's behaviour (the graph's buffer)."""
    lin = te.Linear(64, 64, bias=False, device="cuda")
    te.make_graphed_callables(lin, (torch.randn(16, 64, device="cuda"),), clone_param_grads_on_return=clone)
    first = None
    for _ in range(2):
        lin(torch.randn(16, 64, device="cuda")).sum().backward()
        if first is None:
            first, snapshot = lin.weight.grad, lin.weight.grad.clone()
        lin.zero_grad(set_to_none=True)
    assert torch.equal(first, snapshot) is clone
    lin.reset()
    assert not lin.weight._backward_hooks


def test_clone_grad_hooks_per_callable():
    """One hook per graphed parameter, owned by the first callable holding it (a reset removes
    that callable's hooks only); parameters marked skip_backward_post_hook get none."""
    from transformer_engine_proto.graph import _clone_grads_hooks, _restore_forward

    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.weight = a.weight  # shared
    b.bias.skip_backward_post_hook = True
    hooks = _clone_grads_hooks((a, b, lambda x: x))
    assert [len(h) for h in hooks] == [2, 0, 0]
    w = a.weight
    w.grad = None
    (torch.randn(2, 4) @ w.t()).sum().backward()
    assert w.grad is not None
    _restore_forward(b, None, hooks[1])
    assert len(w._backward_hooks) == 1
    _restore_forward(a, None, hooks[0])
    assert not w._backward_hooks and not a.bias._backward_hooks


def test_keyword_capture_refuses_modules_with_hooks():
    """As torch does for a module it captures itself: through the keyword stand-in the hooks would
    not run."""
    from transformer_engine_proto.graph import _Captured

    lin = te.Linear(16, 16)
    lin.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="must not have hooks"):
        _Captured(lin, None, (torch.randn(4, 16),), {}, True)


def test_weight_caching_needs_modules_and_kwargs_per_callable():
    with pytest.raises(NotImplementedError, match="weight caching .* needs modules"):
        te.make_graphed_callables(lambda x: x, (torch.randn(4, 16),), cache_quantized_params=True)
    with pytest.raises(ValueError, match="sample_kwargs must be a dict"):
        te.make_graphed_callables((te.Linear(16, 16), te.Linear(16, 16)), ((torch.randn(4, 16),),) * 2,
                                  sample_kwargs=({},))


def test_needs_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="make_graphed_callables captures CUDA graphs and needs a CUDA device"):
        te.make_graphed_callables(te.Linear(16, 16), (torch.randn(4, 16),))


def test_unsupported_arguments():
    with pytest.raises(NotImplementedError, match=r"arguments not supported: \['_order'\]"):
        te.make_graphed_callables(te.Linear(16, 16), (torch.randn(4, 16),), _order=[1, -1])
    with pytest.raises(ValueError, match="recipe / fp8_recipe given twice"):
        te.make_graphed_callables(te.Linear(16, 16), (torch.randn(4, 16),), recipe=RECIPES["current"],
                                  fp8_recipe=RECIPES["delayed"])
