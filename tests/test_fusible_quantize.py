"""Per-tensor FP8 quantize can be fused by inductor (kernels/__init__.py `INDUCTOR_FUSIBLE`,
`set_fusible_quantize`): while inductor traces a library op, the chosen kernels dispatch to the aten
reference, so the generated code fuses them with their neighbours instead of launching our Triton
kernels; compiled still equals eager over the recipes' options, whichever kernels are chosen."""
import re

import pytest
import torch
from linear_cases import fresh_dynamo, recipe_ctx

import transformer_engine_proto as te
from transformer_engine_proto import kernels
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import inductor_lowering  # noqa: F401  (registers the cache tag)


@pytest.fixture
def fake_fast_backend(monkeypatch):
    """A "triton" kernel for each fusible name on a fake device type, so the dispatch is visible on CPU."""
    kernels.kernel("amax")  # registers the real backends first, so they do not replace the fakes
    fast = {}
    for name in kernels.INDUCTOR_FUSIBLE:
        fast[name] = lambda *a, _n=name, **k: _n
        monkeypatch.setitem(kernels._KERNELS, (name, "triton"), fast[name])
    monkeypatch.setitem(kernels._PREFERENCE, "meta", ("triton",))
    monkeypatch.setattr(kernels, "_backend", "triton")
    return fast


@pytest.fixture
def fuse_all():
    kernels.set_fusible_quantize(True)
    yield
    kernels.set_fusible_quantize(False)


def test_inductor_trace_dispatches_fusible_kernels_to_the_reference(fake_fast_backend, fuse_all):
    dev = torch.device("meta")
    for name in kernels.INDUCTOR_FUSIBLE:
        assert kernels.kernel(name, dev) is fake_fast_backend[name]  # eager: the fast kernel
        with kernels.tracing_for_inductor():
            assert kernels.kernel(name, dev) is kernels._KERNELS[(name, "reference")]
    eager_norm = kernels.kernel("norm_fwd", dev)
    with kernels.tracing_for_inductor():
        assert kernels.kernel("norm_fwd", dev) is eager_norm  # not a fusible name: unchanged


def test_fusible_choice_selects_kernels_and_changes_the_cache_key(fake_fast_backend):
    assert not kernels.fusible_quantize_enabled()  # the default: our kernels
    before = torch.compiler.config.cache_key_tag
    kernels.set_fusible_quantize("amax")
    try:
        assert kernels.fusible_quantize_enabled() == {"amax"}
        assert torch.compiler.config.cache_key_tag != before
        with kernels.tracing_for_inductor():
            assert kernels.kernel("amax", torch.device("meta")) is kernels._KERNELS[("amax", "reference")]
            cast = kernels.kernel("fp8_quantize_current", torch.device("meta"))
            assert cast is fake_fast_backend["fp8_quantize_current"]
    finally:
        kernels.set_fusible_quantize(False)
    assert torch.compiler.config.cache_key_tag == before
    with pytest.raises(ValueError, match="unknown kernel names.*'norm_fwd'"):
        kernels.set_fusible_quantize(["amax", "norm_fwd"])


def test_fused_into_producer_scopes_the_reference_to_its_block(fake_fast_backend):
    """`fused_into_producer(names)`: the reference for those names inside the block while inductor
    traces, whatever `set_fusible_quantize` says; our kernel outside the block, in eager and for
    the other names; an unknown name is refused, naming it."""
    dev = torch.device("meta")
    ref = kernels._KERNELS[("fp8_quantize_delayed", "reference")]
    with kernels.fused_into_producer("fp8_quantize_delayed"):
        assert kernels.kernel("fp8_quantize_delayed", dev) is fake_fast_backend["fp8_quantize_delayed"]  # eager
    with kernels.tracing_for_inductor():
        with kernels.fused_into_producer("fp8_quantize_delayed"):
            assert kernels.kernel("fp8_quantize_delayed", dev) is ref
            assert kernels.kernel("amax", dev) is fake_fast_backend["amax"]
            with kernels.fused_into_producer("amax"):  # nested blocks add their names
                assert kernels.kernel("amax", dev) is kernels._KERNELS[("amax", "reference")]
                assert kernels.kernel("fp8_quantize_delayed", dev) is ref
            assert kernels.kernel("amax", dev) is fake_fast_backend["amax"]
        assert kernels.kernel("fp8_quantize_delayed", dev) is fake_fast_backend["fp8_quantize_delayed"]
    with pytest.raises(ValueError, match="unknown kernel names.*'norm_fwd'"):
        with kernels.fused_into_producer("norm_fwd"):
            pass


def test_none_reads_the_environment_again(monkeypatch):
    monkeypatch.setenv("TE_PROTO_FUSIBLE_QUANTIZE", "amax, fp8_quantize_current")
    kernels.set_fusible_quantize(None)
    assert kernels.fusible_quantize_enabled() == {"amax", "fp8_quantize_current"}
    monkeypatch.setenv("TE_PROTO_FUSIBLE_QUANTIZE", "1")
    kernels.set_fusible_quantize(None)
    assert kernels.fusible_quantize_enabled() == kernels.INDUCTOR_FUSIBLE
    monkeypatch.setenv("TE_PROTO_FUSIBLE_QUANTIZE", "amx")
    with pytest.raises(ValueError, match="unknown kernel names.*'amx'"):
        kernels.set_fusible_quantize(None)
    monkeypatch.delenv("TE_PROTO_FUSIBLE_QUANTIZE")
    kernels.set_fusible_quantize(None)
    assert not kernels.fusible_quantize_enabled()


def test_reference_scale_inv_is_the_correctly_rounded_reciprocal():
    """The reference's scale_inv is the IEEE fp32 1 / scale (as eager's reciprocal and the Triton
    kernel give it), computed so that inductor's approximate fp32 division never replaces it."""
    from transformer_engine_proto.kernels.reference import float8 as ref
    scale = torch.tensor([3.0, 7.0, 1 / 3, 448.0 / 1e-3, 1.7e38]).float()
    for s in scale:
        x = torch.randn(4, 8)
        _, _, si = ref.fp8_quantize_delayed(x, s.reshape(1), torch.zeros(1), torch.float8_e4m3fn, True, False)
        assert torch.equal(si, s.reshape(1).reciprocal()), float(s)


DELAYED = {
    "default": R.DelayedScaling(),
    "h1-recent": R.DelayedScaling(amax_history_len=1, amax_compute_algo="most_recent"),
    "h16-margin1-e4m3": R.DelayedScaling(amax_history_len=16, margin=1, fp8_format=R.Format.E4M3),
}
CURRENT = {
    "default": R.Float8CurrentScaling(),
    "pow2-margin1": R.Float8CurrentScaling(use_power_2_scales=True, margin=1),
    "e4m3": R.Float8CurrentScaling(fp8_format=R.Format.E4M3),
}
CASES = {f"delayed-{k}": v for k, v in DELAYED.items()} | {f"current-{k}": v for k, v in CURRENT.items()}


def _train(model, recipe, steps=3):
    torch.manual_seed(1)
    outs = []
    for _ in range(steps):
        x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        with recipe_ctx(recipe):
            y = model(x)
        y.backward(torch.randn_like(y))
        outs += [y.detach(), x.grad] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
    return outs + [b.clone() for _, b in sorted(model.named_buffers())]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(te.Linear(128, 256, bias=False, params_dtype=torch.bfloat16, device="cuda"),
                               te.Linear(256, 128, bias=False, params_dtype=torch.bfloat16, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("fusible", [True, False, "amax"], ids=["fuse-all", "triton", "fuse-amax"])
@pytest.mark.parametrize("case", list(CASES))
def test_inductor_quantize_matches_eager_bitwise(case, fusible):
    """Outputs, gradients and the delayed-scaling state after 3 steps: bitwise eager's; the generated
    code launches our Triton cast kernel unless the cast is fused, and our amax kernel only where
    the amax is neither fused nor taken by the cast kernel."""
    from torch._inductor.utils import run_and_get_code
    recipe = CASES[case]
    eager = _train(_model(), recipe)
    kernels.set_fusible_quantize(fusible)
    try:
        fresh_dynamo()
        model = _model()
        compiled = torch.compile(model, fullgraph=True)
        outs, code = run_and_get_code(lambda: _train(compiled, recipe))
    finally:
        kernels.set_fusible_quantize(False)
    for i, (c, e) in enumerate(zip(outs, eager)):
        assert torch.equal(c, e), f"{case}: tensor {i} differs (max {(c.float() - e.float()).abs().max()})"
    code = "\n".join(code)
    assert ("_cast_transpose" in code) == (fusible is not True), "Triton cast kernel in the generated code"
    if fusible is not False:
        assert re.search(r"\b_amax_kernel", code) is None, "Triton amax kernel in the generated code"
