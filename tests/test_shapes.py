"""Any shape, any input: token counts that are not a multiple of a recipe's
block (zero-padded inside the ops, equal to padding by hand), empty batches (empty outputs, zero
weight / bias grads), and library errors that keep their type and message under
torch.compile(fullgraph=True)."""
import copy

import pytest
import torch
from compile_cases import assert_matches_eager, compile_for
from linear_cases import RECIPE_IDS, RECIPES, backend_params, fresh_dynamo, graph_breaks, recipe_ctx
from torch._dynamo.testing import CompileCounterWithBackend

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.kernels.reference import blockwise as ref_bw
from transformer_engine_proto.kernels.reference import float8 as ref_f8
from transformer_engine_proto.kernels.reference import mxfp8 as ref_mx
from transformer_engine_proto.kernels.reference import norm as ref_norm
from transformer_engine_proto.kernels.reference import nvfp4 as ref_nv
from transformer_engine_proto.tensor import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

# the recipes whose columnwise blocks run along the tokens (padded), plus 128-row tiles (Float8Block
# takes a partial tile natively) and NVFP4 with stochastic rounding (seeded: same draws both ways)
BLOCK_RECIPES = {"mxfp8": RECIPES["mxfp8"], "nvfp4": RECIPES["nvfp4"], "block": RECIPES["block"],
                 "nvfp4_sr": R.NVFP4BlockScaling()}
PAD = {"mxfp8": 32, "nvfp4": 16, "block": 1, "nvfp4_sr": 16}


def _equal(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}"
    assert torch.equal(a, b), f"{what}: max abs diff {(a.float() - b.float()).abs().max().item()}"


def _run(m, x, g, recipe, input_rg, seed=1, **kw):
    x = x.clone().requires_grad_(input_rg)
    torch.manual_seed(seed)
    with recipe_ctx(recipe):
        y = m(x, **kw)
    y.backward(g)
    return y, x.grad


# ---- 1. token counts that are not a multiple of the block ------------------------------------
@pytest.mark.parametrize("lead", [(7,), (2, 50)], ids=["7", "2x50"])
@pytest.mark.parametrize("grads", ["both", "wgrad_only", "dgrad_only", "save_original_input"])
@pytest.mark.parametrize("rid", list(BLOCK_RECIPES))
def test_partial_block_equals_padding_by_hand(rid, grads, lead):
    """Output, dgrad, wgrad and dbias of a partial block equal those of the input zero-padded by
    hand to the block (with zero grad_output rows), bitwise. Without wgrad nothing is padded (no
    columnwise copy; with save_original_input the forward's input neither): there the CPU matmul
    of another row count may round differently."""
    recipe, k, n = BLOCK_RECIPES[rid], 64, 32
    torch.manual_seed(0)
    m = te.Linear(k, n, save_original_input=grads == "save_original_input")
    m.weight.requires_grad_(grads != "dgrad_only")
    hand = copy.deepcopy(m)
    x, g = torch.randn(*lead, k), torch.randn(*lead, n)
    rows = x.numel() // k
    pad = (-rows) % PAD[rid]
    xp = torch.cat([x.reshape(rows, k), x.new_zeros(pad, k)])
    gp = torch.cat([g.reshape(rows, n), g.new_zeros(pad, n)])
    input_rg = grads != "wgrad_only"
    y, dx = _run(m, x, g, recipe, input_rg)
    yp, dxp = _run(hand, xp, gp, recipe, input_rg)
    close = lambda a, b, _: torch.testing.assert_close(a, b)  # noqa: E731
    padded = m.weight.requires_grad  # dy (and the saved input) are padded only for wgrad
    (_equal if padded and grads != "save_original_input" else close)(y.reshape(rows, n), yp[:rows], "output")
    if input_rg:
        (_equal if padded else close)(dx.reshape(rows, k), dxp[:rows], "dgrad")
    if m.weight.requires_grad:
        _equal(m.weight.grad, hand.weight.grad, "wgrad")
    torch.testing.assert_close(m.bias.grad, hand.bias.grad, rtol=0, atol=1e-6)  # summed without the zeros


@pytest.mark.parametrize("module", ["Linear", "LayerNormMLP"])
@pytest.mark.parametrize("backend, rid", backend_params(["mxfp8", "nvfp4"]))
def test_partial_block_under_compile_with_dynamic_batch(backend, rid, module):
    """fullgraph compile with a dynamic token count equals eager bitwise for token counts that are
    not multiples of the block (the Linear op's padding, and the fused norm + quantize's). One
    recompile at most: torch specializes a block count of 1 (7 tokens after 40 and 100)."""
    recipe = RECIPES[rid]
    fresh_dynamo()
    torch.manual_seed(0)
    m = te.Linear(64, 32) if module == "Linear" else te.LayerNormMLP(64, 96)
    n = 32 if module == "Linear" else 64
    mc = copy.deepcopy(m)
    cnt = CompileCounterWithBackend(backend)
    cm = torch.compile(mc, fullgraph=True, backend=cnt)
    for rows in (40, 100, 7):
        x, g = torch.randn(rows, 64), torch.randn(rows, n)
        xc = x.clone().requires_grad_()
        torch._dynamo.mark_dynamic(xc, 0)
        ye, dxe = _run(m, x, g, recipe, True)
        with recipe_ctx(recipe):
            yc = cm(xc)
        yc.backward(g)
        assert_matches_eager(yc, ye, backend, f"{rows} output")
        assert_matches_eager(xc.grad, dxe, backend, f"{rows} dgrad")
        for (name, p), pc in zip(m.named_parameters(), mc.parameters()):
            assert_matches_eager(pc.grad, p.grad, backend, f"{rows} {name} grad")
    assert graph_breaks() == 0
    assert cnt.frame_count <= 2, f"{cnt.frame_count} frames for three token counts"


@pytest.mark.parametrize("rid", ["mxfp8", "nvfp4"])
def test_layernorm_linear_partial_block_equals_layernorm_then_linear(rid):
    """The fused norm + quantize pads like the Linear op: LayerNormLinear == LayerNorm -> Linear."""
    recipe = RECIPES[rid]
    torch.manual_seed(0)
    fused = te.LayerNormLinear(64, 32)
    with torch.no_grad():
        fused.layer_norm_weight.uniform_(0.5, 1.5)
        fused.layer_norm_bias.uniform_(-0.5, 0.5)
    ln, lin = te.LayerNorm(64), te.Linear(64, 32)
    ln.load_state_dict({"weight": fused.layer_norm_weight.detach(), "bias": fused.layer_norm_bias.detach()})
    lin.load_state_dict({"weight": fused.weight.detach(), "bias": fused.bias.detach()}, strict=False)
    x, g = torch.randn(3, 7, 64), torch.randn(3, 7, 32)
    y, dx = _run(fused, x, g, recipe, True)
    y2, dx2 = _run(lambda t: lin(ln(t)), x, g, recipe, True)
    _equal(y, y2, "output")
    _equal(dx, dx2, "dgrad")
    _equal(fused.weight.grad, lin.weight.grad, "wgrad")
    _equal(fused.layer_norm_weight.grad, ln.weight.grad, "norm weight grad")


MODULES = {  # (module, output features)
    "LayerNormLinear": (lambda: te.LayerNormLinear(64, 32), 32),
    "LayerNormMLP": (lambda: te.LayerNormMLP(64, 96), 64),
    "TransformerLayer": (lambda: te.TransformerLayer(64, 96, 4), 64),
}


@pytest.mark.parametrize("backend", backend_params(ci=()))  # NVFP4: inductor compiles for minutes
@pytest.mark.parametrize("name", list(MODULES))
def test_modules_partial_block_compiled_equals_eager(name, backend):
    """7 x 3 tokens through every GEMM of a module under NVFP4 (16-row blocks): compiled == eager."""
    recipe = RECIPES["nvfp4"]
    fresh_dynamo()
    torch.manual_seed(0)
    make, out_features = MODULES[name]
    m = make()
    mc = copy.deepcopy(m)
    x, g = torch.randn(7, 3, 64), torch.randn(7, 3, out_features)
    ye, dxe = _run(m, x, g, recipe, True)
    yc, dxc = _run(compile_for(mc, backend), x, g, recipe, True)
    assert_matches_eager(yc, ye, backend, "output")
    assert_matches_eager(dxc, dxe, backend, "dgrad")
    for (pn, p), pc in zip(m.named_parameters(), mc.parameters()):
        assert_matches_eager(pc.grad, p.grad, backend, pn)
    assert graph_breaks() == 0


# ---- 2. empty batch ----------------------------------------------------------------------------
EMPTY_MODULES = {
    "Linear": lambda: te.Linear(64, 32),
    "LayerNormLinear": lambda: te.LayerNormLinear(64, 32),
    "LayerNormMLP": lambda: te.LayerNormMLP(64, 96),
    "LayerNorm": lambda: te.LayerNorm(64),
    "RMSNorm": lambda: te.RMSNorm(64),
    "TransformerLayer": lambda: te.TransformerLayer(64, 96, 4),
}


def _check_empty(m, recipe, compiled):
    shape = (0, 2, 64) if isinstance(m, te.TransformerLayer) else (0, 64)
    x = torch.randn(shape, requires_grad=True)
    fn = torch.compile(m, fullgraph=True, backend="aot_eager") if compiled else m
    with recipe_ctx(recipe):
        y = fn(x)
    assert y.shape[0] == 0 and y.shape[1:-1] == x.shape[1:-1]
    y.sum().backward()
    assert x.grad.shape == x.shape
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.count_nonzero(p.grad) == 0, f"{name}: grad of an empty batch is not zero"
    if isinstance(recipe, R.DelayedScaling):
        for mod in m.modules():
            if hasattr(mod, "amax_history"):
                assert torch.isfinite(mod.amax_history).all() and torch.isfinite(mod.grad_amax_history).all()
                # the step's update (at autocast's exit) moved the weight scale only: the empty
                # input's amax is 0, which keeps its scale
                assert mod.fp8_scale[0] == 1, "an empty tensor moved the delayed scale"
                assert mod.fp8_scale[1] != 1 and torch.isfinite(mod.fp8_scale).all()


@pytest.mark.parametrize("rid", RECIPE_IDS)
@pytest.mark.parametrize("name", list(EMPTY_MODULES))
def test_empty_batch_eager(name, rid):
    torch.manual_seed(0)
    _check_empty(EMPTY_MODULES[name](), RECIPES[rid], compiled=False)


@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_empty_batch_compiled_linear(rid):
    fresh_dynamo()
    torch.manual_seed(0)
    _check_empty(te.Linear(64, 32), RECIPES[rid], compiled=True)
    assert graph_breaks() == 0


@pytest.mark.parametrize("name", ["LayerNormMLP", "TransformerLayer"])
@pytest.mark.parametrize("rid", ["delayed", "nvfp4"])
def test_empty_batch_compiled_modules(name, rid):
    fresh_dynamo()
    torch.manual_seed(0)
    _check_empty(EMPTY_MODULES[name](), RECIPES[rid], compiled=True)
    assert graph_breaks() == 0


QUANTIZERS = {
    "current": lambda: Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
    "delayed": lambda: Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn),
    "mxfp8": lambda: MXFP8Quantizer(),
    "block": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "nvfp4": lambda: NVFP4Quantizer(with_rht=True, stochastic_rounding=True),
    "nvfp4_2d": lambda: NVFP4Quantizer(with_2d_quantization=True),
}


@pytest.mark.parametrize("qid", list(QUANTIZERS))
def test_empty_tensor_quantizes_to_empty(qid):
    q = QUANTIZERS[qid]()
    t = q(torch.randn(0, 64))
    assert t.shape == (0, 64)
    assert t.dequantize().shape == (0, 64)
    for name, buf in t.get_buffers().items():
        assert torch.isfinite(buf.float()).all(), name
    if qid == "current":
        assert t._scale_inv.item() == 1.0  # amax 0 gives scale 1
    if qid == "delayed":
        assert q.amax.item() == 0.0  # records amax 0, not a bogus value


def test_triton_entry_points_hand_empty_inputs_to_the_reference():
    """A zero-size grid is no valid launch: the Triton wrappers must not launch (this runs on CPU
    tensors without TRITON_INTERPRET, so any launch would fail) and return the reference's result."""
    pytest.importorskip("triton")
    from transformer_engine_proto.kernels.triton import blockwise, float8, mxfp8, norm, nvfp4

    x = torch.randn(0, 64)
    w = torch.ones(64)
    calls = [
        (float8.amax, ref_f8.amax, (x,)),
        (float8.fp8_quantize_current, ref_f8.fp8_quantize_current, (x, torch.float8_e4m3fn, True, True)),
        (float8.fp8_quantize_delayed, ref_f8.fp8_quantize_delayed,
         (x, torch.ones(1), torch.zeros(1), torch.float8_e4m3fn, True, True)),
        (mxfp8.mxfp8_quantize, ref_mx.mxfp8_quantize, (x, torch.float8_e4m3fn, True, True)),
        (blockwise.fp8_blockwise_quantize, ref_bw.fp8_blockwise_quantize,
         (x, torch.float8_e4m3fn, 1, True, True, True, 0.0)),
        (nvfp4.nvfp4_quantize, ref_nv.nvfp4_quantize, (x, True, True)),
        (norm.norm_fwd, ref_norm.norm_fwd, (x, w, None, 1e-5, "RMSNorm", False)),
    ]
    for fast, ref, args in calls:
        got, want = fast(*args), ref(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want):
            assert (a is None) == (b is None), fast.__name__
            if a is not None:
                _equal(a, b, fast.__name__)


# ---- 3. errors under torch.compile(fullgraph=True) --------------------------------------------
def _compiled_error(module, x, exc_type, recipe=None, dynamic=False):
    fresh_dynamo()
    fn = torch.compile(module, fullgraph=True, backend="eager", dynamic=dynamic)
    with pytest.raises(exc_type) as info, recipe_ctx(recipe):
        fn(x)
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_wrong_last_dim_is_our_value_error(dynamic):
    m = te.Linear(64, 64, name="proj")
    first = _compiled_error(m, torch.randn(4, 32), ValueError, dynamic=dynamic)
    assert first == "proj: input last dim must be 64, got shape (4, 32)"


def test_compiled_wrong_dtype_is_our_type_error():
    first = _compiled_error(te.Linear(64, 64, name="proj"), torch.randn(4, 64, dtype=torch.float64), TypeError)
    assert first.startswith("proj: input dtype torch.float64 is not supported")


def test_compiled_recipe_that_cannot_take_the_layer_is_our_value_error():
    first = _compiled_error(te.Linear(48, 64, name="proj"), torch.randn(32, 48), ValueError,
                            recipe=R.MXFP8BlockScaling())
    assert first.startswith("proj: recipe MXFP8BlockScaling cannot quantize this layer: MXFP8")


def test_compiled_error_inside_a_user_model_names_the_layer():
    model = torch.nn.Sequential(te.Linear(64, 64, name="first"), te.Linear(32, 8, name="second"))
    first = _compiled_error(model, torch.randn(4, 64), ValueError, dynamic=True)
    assert first == "second: input last dim must be 32, got shape (4, 64)"


def test_compiled_transformer_layer_wants_3d():
    first = _compiled_error(te.TransformerLayer(64, 96, 4, name="block"), torch.randn(4, 64), ValueError)
    assert first == "block: hidden_states must be 3D (sbhd), got (4, 64)"


def test_compiled_error_without_fullgraph_is_the_plain_error():
    fresh_dynamo()
    fn = torch.compile(te.Linear(64, 64, name="proj"), backend="eager")
    with pytest.raises(ValueError, match="^proj: input last dim must be 64, got shape \\(4, 32\\)$") as info:
        fn(torch.randn(4, 32))
    assert type(info.value) is ValueError


@pytest.mark.parametrize("make, x, exc_type, first", [
    (MXFP8Quantizer, torch.randn(7, 128), ValueError, "MXFP8 columnwise usage: shape (7, 128) has 7 rows"),
    (NVFP4Quantizer, torch.randn(16, 8), ValueError, "NVFP4: shape (16, 8): last dim 8 is not a multiple"),
    (MXFP8Quantizer, torch.randn(32, 64, dtype=torch.float64), TypeError,
     "MXFP8Quantizer.quantize: input dtype torch.float64 is not supported"),
], ids=["mxfp8_rows", "nvfp4_last_dim", "dtype"])
def test_compiled_quantizer_errors_keep_type_and_message(make, x, exc_type, first):
    fresh_dynamo()
    q = make()
    fn = torch.compile(lambda t: q(t).dequantize(), fullgraph=True, backend="eager")
    with pytest.raises(exc_type) as info:
        fn(x)
    assert str(info.value).splitlines()[0].startswith(first)
    with pytest.raises(exc_type) as info:  # eager: the plain type
        q(x)
    assert type(info.value) is exc_type and str(info.value).startswith(first)


@pytest.mark.parametrize("exc", [ValueError, TypeError, RuntimeError, NotImplementedError])
def test_raise_error_keeps_every_type_under_compile(exc):
    from transformer_engine_proto.errors import raise_error

    def f(x):
        raise_error(exc, "layer_x: the message")
        return x

    with pytest.raises(exc) as info:
        torch.compile(f, fullgraph=True, backend="eager")(torch.ones(2))
    assert str(info.value).splitlines()[0] == "layer_x: the message"
