"""TE's `delay_wgrad_compute=True`: backward leaves the weight gradients for `backward_dw()`, which
gives bit for bit what the module without it gives in backward (main_grad included), runs the
wgrad hooks, and is refused under torch.compile."""
import pytest
import torch
from linear_cases import fresh_dynamo

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R

RECIPES = {"bf16": None, "current": R.Float8CurrentScaling(), "mxfp8": R.MXFP8BlockScaling()}
H = 64


def _build(kind, delay, bias=True, fuse=False, stored=None):
    torch.manual_seed(0)
    kw = dict(bias=bias, params_dtype=torch.bfloat16, device="cpu", delay_wgrad_compute=delay,
              fuse_wgrad_accumulation=fuse)
    with te.quantized_model_init(enabled=stored is not None, recipe=stored):
        if kind == "Linear":
            m = te.Linear(H, 2 * H, **kw)
        elif kind == "LayerNormLinear":
            m = te.LayerNormLinear(H, 2 * H, normalization="RMSNorm", **kw)
        elif kind == "LayerNormMLP":
            m = te.LayerNormMLP(H, 2 * H, activation="swiglu", **kw)
        else:  # use_grouped_tensor=None: the grouped GEMM without a recipe, else the expert loop
            m = te.GroupedLinear(3, H, H, use_grouped_tensor=kind == "GroupedLinear", **kw)
    if fuse:
        for p in m.parameters():
            if p.dim() == 2:
                p.main_grad = torch.rand(p.shape, generator=torch.Generator().manual_seed(p.numel()))
    return m


def _step(m, recipe, x_requires_grad=True, seed=1):
    """(output, input grad, [each parameter's main_grad or grad]) after backward and backward_dw."""
    x = torch.randn(48, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(seed))
    x.requires_grad_(x_requires_grad)
    with te.autocast(enabled=recipe is not None, recipe=recipe):
        y = m(x, [16, 0, 32]) if isinstance(m, te.GroupedLinear) else m(x)
    y.float().pow(2).sum().backward()
    weights = [p for n, p in m.named_parameters() if p.dim() == 2]
    if m.delay_wgrad_compute:
        main_grads = [p.main_grad.clone() for p in weights if hasattr(p, "main_grad")]
        m.backward_dw()
        assert not main_grads or not all(torch.equal(a, p.main_grad) for a, p in zip(main_grads, weights))
    grads = [p.main_grad if hasattr(p, "main_grad") else p.grad for p in m.parameters()]
    return [None if t is None else t.clone() for t in [y.detach(), x.grad] + grads]


def _assert_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert (a is None and b is None) or torch.equal(a, b), i


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "GroupedLinearLoop"])
@pytest.mark.parametrize("rid", ["bf16", "current"])
@pytest.mark.parametrize("fuse", [False, True], ids=["grad", "main_grad"])
def test_backward_dw_equals_the_undelayed_backward(kind, rid, fuse):
    recipe = RECIPES[rid]
    delayed = _build(kind, True, fuse=fuse)
    _assert_equal(_step(delayed, recipe), _step(_build(kind, False, fuse=fuse), recipe))
    for p in delayed.parameters():
        assert p.grad is not None or hasattr(p, "main_grad")


@pytest.mark.parametrize("rid", ["current", "mxfp8"])
def test_weight_stored_quantized(rid):
    """quantized_model_init: the weight is a QuantizedTensor (the op's dispatcher path)."""
    recipe = RECIPES[rid]
    _assert_equal(_step(_build("Linear", True, stored=recipe), recipe),
                  _step(_build("Linear", False, stored=recipe), recipe))


@pytest.mark.parametrize("rid", ["bf16", "current"])
def test_weight_grad_waits_and_bias_grad_follows_te(rid):
    """Before backward_dw the weight has no gradient; the bias gradient waits with it where the
    gradient is not quantized (TE fuses it into the wgrad GEMM there) and is computed in backward
    where it is (fused with the gradient's quantize)."""
    m = _build("Linear", True)
    x = torch.randn(48, H, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=RECIPES[rid] is not None, recipe=RECIPES[rid]):
        y = m(x)
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is None and len(m.gemm.pending_wgrads) == 1
    assert (m.bias.grad is None) == (rid == "bf16")
    m.backward_dw()
    assert m.weight.grad is not None and m.bias.grad is not None and not m.gemm.pending_wgrads
    assert not m.weight.grad.requires_grad  # computed as in a backward: no graph kept


def test_delayed_scaling_state_follows_the_undelayed_module():
    """The gradient amax is recorded in backward, also for a first layer (no dgrad: backward
    quantizes nothing), so the scales and histories match after several steps."""
    def run(delay):
        m = _build("Linear", delay)
        outs = [t for i in range(3) for t in _step(m, R.DelayedScaling(), x_requires_grad=False, seed=i)
                if t is not None]
        with te.autocast(recipe=R.DelayedScaling()):  # folds the last gradient amax
            pass
        return outs + [b.clone() for b in m.gemm.buffers()]

    _assert_equal(run(True), run(False))


def test_queue_is_first_in_first_out_and_hooks_run_after_it():
    """Two backwards, then two backward_dw: each runs one queued wgrad (the sum is the undelayed
    gradient); the hooks run after each that computed something, not for an empty queue."""
    m, ref = _build("Linear", True), _build("Linear", False)
    calls = []
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(m.weight.grad.clone()))
    xs = [torch.randn(48, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for x in xs:
        m(x).float().pow(2).sum().backward()
        ref(x).float().pow(2).sum().backward()
    assert len(m.gemm.pending_wgrads) == 2 and m.need_backward_dw()
    m.backward_dw()
    m.backward_dw()
    m.backward_dw()  # nothing queued: no hook
    assert len(calls) == 2 and not torch.equal(calls[0], calls[1])
    assert torch.equal(m.weight.grad, ref.weight.grad) and torch.equal(m.bias.grad, ref.bias.grad)


def test_without_delay_backward_dw_does_nothing():
    m = _build("Linear", False)
    m(torch.randn(4, H, dtype=torch.bfloat16)).sum().backward()
    grad = m.weight.grad.clone()
    m.register_wgrad_accumulation_and_reduce_hooks(lambda: pytest.fail("hook ran"))
    m.backward_dw()
    assert not m.need_backward_dw() and torch.equal(m.weight.grad, grad)


@pytest.mark.parametrize("backend", ["aot_eager"])
def test_refused_under_torch_compile_naming_the_module(backend):
    fresh_dynamo()
    m = te.Linear(H, H, params_dtype=torch.bfloat16, device="cpu", delay_wgrad_compute=True, name="proj")
    x = torch.randn(8, H, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="proj: delay_wgrad_compute=True is not supported under torch.compile"):
        torch.compile(m, backend=backend, fullgraph=True)(x)
    with torch.no_grad():  # no backward: nothing to delay
        assert torch.equal(torch.compile(m, backend=backend, fullgraph=True)(x), m(x))
