"""TE's `backward_override="dequantized"`: the forward is the recipe's (input and weight quantized
rowwise, a quantized GEMM); dgrad and wgrad are high-precision GEMMs of the unquantized gradient
with the forward's quantized weight and input, dequantized. Forward keeps the rowwise quantized
input only (no columnwise copy, not the original input, whatever save_original_input says).

Each recipe's gradients equal a reference computed by hand from dequantize(quantize(x)) and
dequantize(quantize(w)), bit for bit (on CPU the high-precision GEMM is a float32 matmul rounded to
the output dtype); the other modules equal their composition of checked pieces; compiled equals
eager under both backends.
"""
import pytest
import torch
from compile_cases import assert_matches_eager, compile_for
from linear_cases import backend_params, fresh_dynamo
from test_linear_opcheck import bwd_args, fp8_harness, fwd_args  # noqa: F401  (fixture)
from test_saved_bytes import saved_storages

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import linear as L
from transformer_engine_proto.custom_ops import linear_plan
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
from transformer_engine_proto.tensor.float8 import Float8CurrentScalingQuantizer

RECIPES = {
    "current": R.Float8CurrentScaling,
    "mxfp8": R.MXFP8BlockScaling,
    "block": R.Float8BlockScaling,
    "nvfp4": lambda **kw: R.NVFP4BlockScaling(disable_stochastic_rounding=True, **kw),
    # TE's test_sanity runs row-scaled NVFP4 with this override only
    "nvfp4_row_scaled": lambda **kw: R.NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                                         disable_2d_quantization=True, row_scaled_activation=True,
                                                         **kw),
    "custom": lambda **kw: R.CustomRecipe(qfactory=lambda role: Float8CurrentScalingQuantizer(torch.float8_e4m3fn),
                                          **kw),
}
TOKENS, IN, OUT = 96, 128, 64  # TOKENS != IN: a rowwise FP8 input (96, 128) is not its transpose


def dequantized(recipe):
    return RECIPES[recipe](backward_override="dequantized")


def _fwd_values(recipe, role, t):
    """dequantize(quantize(t)) with the forward's rowwise quantizer of `role`, in t's dtype."""
    q = getattr(RecipeKey.quantizers(RecipeKey.of(recipe)), role).with_usage(rowwise=True, columnwise=False)
    return q.quantize(t.detach()).dequantize(dtype=t.dtype)


def _mm(a, b, dtype):
    return (a.float() @ b.float()).to(dtype)


def _data(seed, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _step(module, recipe, x, dy, fn=None, **kw):
    """(y, dx, every parameter's grad) of one forward / backward under `recipe`, grads from zero."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with te.autocast(recipe=recipe):
        y = (module if fn is None else fn)(x, **kw)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


# ---- gradients by hand ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rid", list(RECIPES))
def test_linear_gradients_equal_the_hand_reference(rid, dtype):
    recipe = dequantized(rid)
    torch.manual_seed(0)
    lin = te.Linear(IN, OUT, params_dtype=dtype, device="cpu")
    x, dy = _data(1, TOKENS, IN, dtype=dtype), _data(2, TOKENS, OUT, dtype=dtype)
    y, dx, dw, db = _step(lin, recipe, x, dy)
    y_plain = _step(lin, RECIPES[rid](), x, dy)[0]
    assert torch.equal(y, y_plain)  # the forward is the recipe's
    x_hat, w_hat = _fwd_values(recipe, "input", x), _fwd_values(recipe, "weight", lin.weight)
    assert torch.equal(dx, _mm(dy, w_hat, dtype))
    assert torch.equal(dw, _mm(dy.t(), x_hat, dtype))
    assert torch.equal(db, dy.float().sum(0).to(dtype))
    assert not torch.equal(dx, _mm(dy, lin.weight, dtype))  # not the original weight


@pytest.mark.parametrize("rid", ["current", "mxfp8"])
def test_layernorm_linear_gradients_equal_the_hand_reference(rid):
    recipe = dequantized(rid)
    torch.manual_seed(0)
    lnl = te.LayerNormLinear(IN, OUT, return_layernorm_output=True, device="cpu")
    x = _data(1, TOKENS, IN).requires_grad_()
    dy = _data(2, TOKENS, OUT)
    with te.autocast(recipe=recipe):
        y, ln_out = lnl(x)
    y.backward(dy)
    w_hat = _fwd_values(recipe, "weight", lnl.weight)
    assert torch.equal(lnl.weight.grad, _mm(dy.t(), _fwd_values(recipe, "input", ln_out), torch.float32))
    # dx: the norm's own backward of d(ln_out) = dy @ w_hat
    x_ref = x.detach().clone().requires_grad_()
    norm = te.LayerNorm(IN, eps=lnl.eps, device="cpu")  # the same norm, alone
    with torch.no_grad():
        norm.weight.copy_(lnl.layer_norm_weight)
        norm.bias.copy_(lnl.layer_norm_bias)
    norm(x_ref).backward(_mm(dy, w_hat, torch.float32))
    assert torch.equal(x.grad, x_ref.grad)


@pytest.mark.parametrize("rid", ["current", "block"])
def test_layernorm_mlp_equals_layernorm_linear_then_linear(rid):
    """TE refuses LayerNormMLP with a backward_override; here its two GEMMs are Linear ops like any
    other, so it equals the LayerNormLinear + Linear that TE suggests instead."""
    recipe = dequantized(rid)
    torch.manual_seed(0)
    mlp = te.LayerNormMLP(IN, 2 * IN, device="cpu")
    fc1 = te.LayerNormLinear(IN, 2 * IN, device="cpu")
    fc2 = te.Linear(2 * IN, IN, device="cpu")
    with torch.no_grad():
        for dst, src in ((fc1.layer_norm_weight, mlp.layer_norm_weight), (fc1.layer_norm_bias, mlp.layer_norm_bias),
                         (fc1.weight, mlp.fc1_weight), (fc1.bias, mlp.fc1_bias),
                         (fc2.weight, mlp.fc2_weight), (fc2.bias, mlp.fc2_bias)):
            dst.copy_(src)
    x, dy = _data(1, TOKENS, IN), _data(2, TOKENS, IN)
    composed = torch.nn.Sequential(fc1, torch.nn.GELU(approximate="tanh"), fc2)
    got = _step(mlp, recipe, x, dy)
    ref = _step(composed, recipe, x, dy)
    assert len(got) == len(ref)
    for g, r in zip(got[:2], ref[:2]):
        assert torch.equal(g, r)
    named = dict(zip(("ln_w", "ln_b", "w1", "b1", "w2", "b2"),
                     (mlp.layer_norm_weight, mlp.layer_norm_bias, mlp.fc1_weight, mlp.fc1_bias, mlp.fc2_weight,
                      mlp.fc2_bias)))
    for (name, p), q in zip(named.items(), (fc1.layer_norm_weight, fc1.layer_norm_bias, fc1.weight, fc1.bias,
                                            fc2.weight, fc2.bias)):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("rid", ["current", "nvfp4"])
def test_grouped_linear_equals_a_linear_per_expert(rid):
    recipe = dequantized(rid)
    splits = [32, 64]
    torch.manual_seed(0)
    grouped = te.GroupedLinear(2, IN, OUT, device="cpu")
    experts = [te.Linear(IN, OUT, device="cpu") for _ in splits]
    with torch.no_grad():
        for i, e in enumerate(experts):
            e.weight.copy_(getattr(grouped, f"weight{i}"))
            e.bias.copy_(getattr(grouped, f"bias{i}"))
    x, dy = _data(1, sum(splits), IN), _data(2, sum(splits), OUT)
    y, dx, *_ = _step(grouped, recipe, x, dy, m_splits=splits)
    for i, (e, xs, dys, ys, dxs) in enumerate(zip(experts, x.split(splits), dy.split(splits), y.split(splits),
                                                   dx.split(splits))):
        ye, dxe, dwe, dbe = _step(e, recipe, xs, dys)
        assert torch.equal(ys, ye) and torch.equal(dxs, dxe)
        assert torch.equal(getattr(grouped, f"weight{i}").grad, dwe)
        assert torch.equal(getattr(grouped, f"bias{i}").grad, dbe)


# ---- what forward keeps ---------------------------------------------------------------------------
@pytest.mark.parametrize("save_original_input", [False, True])
@pytest.mark.parametrize("rid", ["current", "mxfp8", "block", "nvfp4"])
def test_linear_saves_the_rowwise_input_only(rid, save_original_input):
    recipe = dequantized(rid)
    torch.manual_seed(0)
    lin = te.Linear(IN, OUT, bias=False, save_original_input=save_original_input, device="cpu")
    x = _data(1, TOKENS, IN).requires_grad_()
    with te.autocast(recipe=recipe):
        seen, y = saved_storages(lambda: lin(x), lin.parameters())
    plan = linear_plan.make_plan(RecipeKey.of(recipe), (TOKENS, IN), (OUT, IN), x.dtype, x.dtype,
                       L.LinearCall(True, True, False, save_original_input, keep_quantized_weight=True), False)
    saved, weight = plan.saved_input, plan.saved_weight
    # the rowwise input, and (eager) forward's rowwise weight; compiled, backward quantizes it again
    assert plan.saved_protos == [saved, weight]
    for proto in (saved, weight):
        assert proto.quantizer.rowwise_usage and not proto.quantizer.columnwise_usage
    assert not plan.saves_raw_input()  # TE ignores save_original_input here
    buffers = [b for p in (saved, weight) for b in p.create_buffers().values()]
    assert sum(n for n, *_ in seen.values()) == sum(b.numel() * b.element_size() for b in buffers)
    assert sorted((str(dt), shape) for _, dt, shape in seen.values()) == \
        sorted((str(b.dtype), tuple(b.shape)) for b in buffers)
    y.sum().backward()


def test_layernorm_linear_saves_no_columnwise_input():
    """The fused norm + quantize produces the rowwise input only: per-tensor FP8 keeps (tokens, K),
    never its (K, tokens) transpose."""
    torch.manual_seed(0)
    lnl = te.LayerNormLinear(IN, OUT, device="cpu")
    x = _data(1, TOKENS, IN).requires_grad_()
    with te.autocast(recipe=dequantized("current")):
        seen, y = saved_storages(lambda: lnl(x), lnl.parameters())
    fp8 = sorted(shape for _, dt, shape in seen.values() if dt == torch.float8_e4m3fn)
    assert fp8 == sorted([(TOKENS, IN), (OUT, IN)])  # the rowwise input and (eager) forward's rowwise weight
    y.sum().backward()


@pytest.mark.parametrize("rid", ["current", "mxfp8", "nvfp4"])
def test_opcheck_linear_ops(fp8_harness, rid):  # noqa: F811  (fixture)
    recipe = dequantized(rid)
    for cache_mode in (L.CACHE_OFF, L.CACHE_FILL, L.CACHE_USE):
        args = fwd_args(recipe, bias=True, input_rg=True, weight_rg=True, cache_mode=cache_mode)
        torch.library.opcheck(torch.ops.te_proto.linear_fwd.default, args, raise_exception=True)
    args = bwd_args(recipe, bias=True, input_rg=True, weight_rg=True, cache_mode=L.CACHE_USE)
    torch.library.opcheck(torch.ops.te_proto.linear_bwd.default, args, raise_exception=True)


def test_weight_cache_reads_the_forward_weight():
    """With is_first_microbatch the cached weight's rowwise bytes feed dgrad: the same numbers."""
    recipe = dequantized("mxfp8")
    torch.manual_seed(0)
    lin = te.Linear(IN, OUT, device="cpu")
    x, dy = _data(1, TOKENS, IN), _data(2, TOKENS, OUT)
    ref = _step(lin, recipe, x, dy)
    for first in (True, False):
        got = _step(lin, recipe, x, dy, is_first_microbatch=first)
        for g, r in zip(got, ref):
            assert torch.equal(g, r)


_LOG_ACTIVATION_MAX = """
    log:
      enabled: True
      layers:
        layer_types: [fc1]
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats: [max]
          tensors: [activation]
          freq: 1
"""


def test_debug_gemm_path_gives_the_same_gradients(tmp_path):
    """A layer with an active precision-debug feature takes the debug GEMM path: it keeps the fprop
    operands for the dequantized backward GEMMs and quantizes no gradient."""
    import nvdlfw_inspect.api as debug_api
    from test_debug_common import debug_session

    from transformer_engine_proto.debug import last_logged_stats

    recipe = dequantized("mxfp8")
    x, dy = _data(1, TOKENS, IN), _data(2, TOKENS, OUT)
    torch.manual_seed(0)
    ref = _step(te.Linear(IN, OUT, name="fc1", device="cpu"), recipe, x, dy)
    with debug_session(tmp_path, _LOG_ACTIVATION_MAX):
        torch.manual_seed(0)
        got = _step(te.Linear(IN, OUT, name="fc1", device="cpu"), recipe, x, dy)
        debug_api.step()
        assert "fc1_activation_max" in last_logged_stats()  # the debug path ran
    for g, r in zip(got, ref):
        assert torch.equal(g, r)


# ---- compiled == eager ----------------------------------------------------------------------------
_MODULES = {
    "linear": lambda: te.Linear(IN, OUT, device="cpu"),
    "layernorm_linear": lambda: te.LayerNormLinear(IN, OUT, device="cpu"),
    "layernorm_mlp": lambda: te.LayerNormMLP(IN, 2 * IN, device="cpu"),
}


@pytest.mark.parametrize("module", list(_MODULES))
@pytest.mark.parametrize("backend,rid", backend_params(["current", "mxfp8", "block", "nvfp4"], ci=("current",)))
def test_compiled_equals_eager(backend, rid, module):
    recipe = dequantized(rid)
    x, dy = _data(1, TOKENS, IN), _data(2, TOKENS, OUT if module != "layernorm_mlp" else IN)
    torch.manual_seed(0)
    eager_module = _MODULES[module]()
    eager = _step(eager_module, recipe, x, dy)
    fresh_dynamo()
    torch.manual_seed(0)
    compiled_module = _MODULES[module]()
    got = _step(compiled_module, recipe, x, dy, fn=compile_for(compiled_module, backend))
    assert len(got) == len(eager)
    for i, (g, e) in enumerate(zip(got, eager)):
        assert_matches_eager(g, e, backend, f"{module} output {i}")


def test_compiled_saves_the_rowwise_input_only():
    """What the compiled backward graph receives: the (tokens, K) FP8 input, no (K, tokens) one."""
    from saved_tensors import compiled_backward_inputs

    torch.manual_seed(0)
    lin = te.Linear(IN, OUT, bias=False, device="cpu")
    x = _data(1, TOKENS, IN).requires_grad_()

    def step(backend):
        with te.autocast(recipe=dequantized("current")):
            y = torch.compile(lin, backend=backend, fullgraph=True)(x)
        y.sum().backward()

    fresh_dynamo()
    saved = [v for n, v in compiled_backward_inputs(step) if not n.startswith("primals")]
    assert [tuple(t.shape) for t in saved if t.dtype == torch.float8_e4m3fn] == [(TOKENS, IN)]


# ---- the recipe field -----------------------------------------------------------------------------
def test_assigned_after_construction_as_te_sanity_does():
    """TE's test_sanity deep-copies a recipe and assigns `backward_override`; the next autocast
    entry takes it."""
    torch.manual_seed(0)
    lin = te.Linear(IN, OUT, device="cpu")
    x, dy = _data(1, TOKENS, IN), _data(2, TOKENS, OUT)
    recipe = R.MXFP8BlockScaling()
    plain = _step(lin, recipe, x, dy)
    recipe.backward_override = "dequantized"
    assert RecipeKey.dequantized_gemms(RecipeKey.of(recipe)) == {"dgrad", "wgrad"}
    edited = _step(lin, recipe, x, dy)
    built = _step(lin, dequantized("mxfp8"), x, dy)
    assert all(torch.equal(a, b) for a, b in zip(edited, built))
    assert torch.equal(edited[0], plain[0]) and not torch.equal(edited[1], plain[1])


def test_delayed_scaling_refuses_it():
    with pytest.raises(ValueError, match="DelayedScaling supports backward_override=None only"):
        R.DelayedScaling(backward_override="dequantized")
    recipe = R.DelayedScaling()
    with pytest.raises(ValueError, match="DelayedScaling supports backward_override=None only"):
        recipe.backward_override = "dequantized"
    assert recipe.backward_override is None  # a refused edit leaves the recipe as it was


def test_a_gemm_kept_in_high_precision_reads_the_original_operand():
    """A per-GEMM precision choice wins over the recipe's dequantized GEMMs."""
    key = RecipeKey.with_high_precision_gemms(RecipeKey.of(dequantized("current")), {"wgrad"})
    assert RecipeKey.dequantized_gemms(key) == {"dgrad"}
    plan = linear_plan.make_plan(key, (TOKENS, IN), (OUT, IN), torch.float32, torch.float32,
                       L.LinearCall(True, True, False, False), False)
    assert plan.dgrad_deq and not plan.wgrad_deq and plan.saved_input is None and plan.saves_raw_input()
