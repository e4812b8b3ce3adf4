"""te.ops (transformer_engine_proto/ops_api/): TE's fusible-operation API.

Each op against plain torch (forward and backward); a `Sequential(LayerNorm, Linear, SwiGLU,
Linear)` under the recipes bit for bit equal to the same computation by hand with te.LayerNorm /
te.Linear, and compiled (aot_eager, fullgraph) bit for bit equal to eager with no graph break;
TE's extra-input / extra-output semantics and container behaviour; checkpoints; clear errors.
"""
import copy
import inspect

import pytest
import torch
import torch.nn.functional as F
from linear_cases import RECIPES, fresh_dynamo, graph_breaks, recipe_ctx, unique_graphs
from test_docs import argument_names, documented_parameters

import transformer_engine_proto as te
from transformer_engine_proto import ops_api
from transformer_engine_proto.tensor import QuantizedTensor

ops = te.ops
SEQ_RECIPES = ["high_precision", "delayed", "current", "mxfp8"]


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _fwd_bwd(fn, *inputs):
    """fn's output and the grads of its inputs for a fixed random grad."""
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    grads = torch.autograd.grad(out, [t for t in inputs if t.requires_grad], g)
    return out, grads


def _x(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=True)


# ---- each op against plain torch (activations: test_ops_activations.py) ------------------------------
def test_linear_ops_match_torch():
    torch.manual_seed(0)
    lin = ops.Linear(32, 48)
    with torch.no_grad():
        lin.bias.normal_()
    basic, bias = ops.BasicLinear(32, 48), ops.Bias(48)
    with torch.no_grad():
        bias.bias.normal_()
    x = _x(3, 5, 32)
    cases = [(lin, lambda t: F.linear(t, lin.weight, lin.bias), [lin.weight, lin.bias]),
             (basic, lambda t: F.linear(t, basic.weight), [basic.weight]),
             (bias, lambda t: t + bias.bias, [bias.bias])]
    for op, ref_fn, params in cases:
        inp = x if op is not bias else _x(3, 5, 48)
        out = op(inp)
        ref = ref_fn(inp)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, [inp, *params], g)
        want = torch.autograd.grad(ref, [inp, *params], g)
        _close(out, ref)
        for a, b in zip(got, want):
            _close(a, b, 1e-4)
    assert lin.weight.shape == (48, 32) and lin.bias.shape == (48,)
    assert ops.Linear(32, 48, bias=False).bias is None


@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norms_match_torch(zero_centered_gamma):
    torch.manual_seed(0)
    ln = ops.LayerNorm(32, eps=1e-5, zero_centered_gamma=zero_centered_gamma)
    rms = ops.RMSNorm(32, eps=1e-5, zero_centered_gamma=zero_centered_gamma)
    with torch.no_grad():
        for p in [*ln.parameters(), *rms.parameters()]:
            p.normal_()
    x = _x(4, 6, 32)

    def ln_ref(t):
        gamma = ln.weight + 1 if zero_centered_gamma else ln.weight
        return F.layer_norm(t, (32,), gamma, ln.bias, 1e-5)

    def rms_ref(t):
        gamma = rms.weight + 1 if zero_centered_gamma else rms.weight
        return t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-5) * gamma

    for op, ref_fn in ((ln, ln_ref), (rms, rms_ref)):
        out, ref = op(x), ref_fn(x)
        g = torch.randn_like(out)
        params = list(op.parameters())
        _close(out, ref)
        for a, b in zip(torch.autograd.grad(out, [x, *params], g), torch.autograd.grad(ref, [x, *params], g)):
            _close(a, b, 1e-4)
    assert rms.bias is None and [n for n, _ in rms.named_parameters()] == ["weight"]


def test_norm_over_several_trailing_dims():
    torch.manual_seed(0)
    op = ops.LayerNorm((4, 8))
    with torch.no_grad():
        op.weight.normal_()
        op.bias.normal_()
    x = torch.randn(3, 4, 8)
    _close(op(x), F.layer_norm(x, (4, 8), op.weight, op.bias, 1e-5))


@pytest.mark.parametrize("shape", [(4, 8), (8,)])
def test_norm_of_an_input_with_no_batch_dims(shape):
    """An input that is exactly `normalized_shape` (one row): forward and backward as torch's."""
    torch.manual_seed(0)
    op = ops.LayerNorm(shape)
    with torch.no_grad():
        op.weight.normal_()
        op.bias.normal_()
    x = _x(*shape)
    got = _fwd_bwd(lambda t, w, b: op(t), x, op.weight, op.bias)
    want = _fwd_bwd(lambda t, w, b: F.layer_norm(t, shape, w, b, 1e-5), x, op.weight, op.bias)
    for a, b in zip((got[0], *got[1]), (want[0], *want[1])):
        _close(a, b, 1e-4)


def test_shape_scale_dropout_quantize_ops():
    torch.manual_seed(0)
    x = _x(4, 6)
    assert ops.Identity()(x) is x and ops.Quantize()(x) is x
    g = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))  # the grad _fwd_bwd draws
    out, (dx,) = _fwd_bwd(ops.Reshape((2, -1)), x)
    assert torch.equal(out, x.reshape(2, 12)) and torch.equal(dx, g)
    out, (dx,) = _fwd_bwd(ops.ConstantScale(-2.5), x)
    assert torch.equal(out, x * -2.5) and torch.equal(dx, g * -2.5)
    drop = ops.Dropout(0.5)
    out, (dx,) = _fwd_bwd(drop, x)
    mask = out != 0
    assert 0 < mask.sum() < mask.numel()
    _close(out, x * mask * 2)
    _close(dx, g * mask * 2)
    drop.eval()
    assert torch.equal(drop(x), x)


def test_extra_input_and_output_ops_alone():
    x, e = _x(4, 8), _x(4, 8)
    y = ops.AddExtraInput()(x, e)
    assert torch.equal(y, x + e)
    g = torch.randn_like(y)
    assert all(torch.equal(d, g) for d in torch.autograd.grad(y, [x, e], g))
    y1, y2 = ops.MakeExtraOutput()(x)
    assert y1 is x and y2 is x
    (dx,) = torch.autograd.grad((2 * y1 + 3 * y2).sum(), [x])
    assert torch.equal(dx, torch.full_like(x, 5.0))


# ---- Sequential = the same computation with te.LayerNorm / te.Linear --------------------------------
H, F_ = 64, 64


def _block(dtype=torch.float32):
    torch.manual_seed(0)
    seq = ops.Sequential(ops.LayerNorm(H, dtype=dtype), ops.Linear(H, 2 * F_, dtype=dtype), ops.SwiGLU(),
                         ops.Linear(F_, H, dtype=dtype))
    with torch.no_grad():
        for name in ("0.weight", "0.bias", "1.basic_ops.1.bias", "3.basic_ops.1.bias"):
            seq.get_parameter(name).normal_()
    return seq


class _ByHand(torch.nn.Module):
    """te.LayerNorm -> te.Linear -> SwiGLU written out -> te.Linear, with copies of seq's weights."""

    def __init__(self, seq):
        super().__init__()
        dtype = seq[0].weight.dtype
        self.ln = te.LayerNorm(H, params_dtype=dtype)
        self.fc1, self.fc2 = te.Linear(H, 2 * F_, params_dtype=dtype), te.Linear(F_, H, params_dtype=dtype)
        with torch.no_grad():
            for mine, theirs in ((self.ln, seq[0]), (self.fc1, seq[1]), (self.fc2, seq[3])):
                mine.weight.copy_(theirs.weight)
                mine.bias.copy_(theirs.bias)

    def forward(self, x):
        h = self.fc1(self.ln(x))
        a, b = h.float().chunk(2, -1)
        return self.fc2((F.silu(a) * b).to(h.dtype))


def _params(m):
    return [p for _, p in sorted(m.named_parameters())]


@pytest.mark.parametrize("rid, dtype", [(r, torch.float32) for r in SEQ_RECIPES] + [("current", torch.bfloat16)],
                         ids=SEQ_RECIPES + ["current-bf16"])
def test_sequential_equals_te_modules_bitwise(rid, dtype):
    seq = _block(dtype)
    hand = _ByHand(seq)
    for _ in range(2):  # delayed scaling: the second step runs on the first step's amaxes
        x = torch.randn(16, 2, H, dtype=dtype, requires_grad=True)
        xh = x.detach().clone().requires_grad_()
        with recipe_ctx(RECIPES[rid]):
            y, yh = seq(x), hand(xh)
        g = torch.randn_like(y)
        y.backward(g)
        yh.backward(g)
        assert torch.equal(y, yh) and torch.equal(x.grad, xh.grad)
        pairs = [(seq[0].weight, hand.ln.weight), (seq[0].bias, hand.ln.bias), (seq[1].weight, hand.fc1.weight),
                 (seq[1].bias, hand.fc1.bias), (seq[3].weight, hand.fc2.weight), (seq[3].bias, hand.fc2.bias)]
        for mine, theirs in pairs:
            assert torch.equal(mine.grad, theirs.grad)
    for op, mod in ((seq[1], hand.fc1), (seq[3], hand.fc2)):  # the same delayed-scaling state
        assert torch.equal(op.basic_ops[0].gemm.amax_history, mod.gemm.amax_history)
        assert torch.equal(op.basic_ops[0].gemm.fp8_scale, mod.gemm.fp8_scale)


@pytest.mark.parametrize("rid", SEQ_RECIPES)
def test_sequential_compiled_equals_eager(rid):
    seq = _block()
    seqc = copy.deepcopy(seq)
    fresh_dynamo()
    compiled = torch.compile(seqc, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        x = torch.randn(16, 2, H, requires_grad=True)
        xc = x.detach().clone().requires_grad_()
        with recipe_ctx(RECIPES[rid]):
            y, yc = seq(x), compiled(xc)
        g = torch.randn_like(y)
        y.backward(g)
        yc.backward(g)
        assert torch.equal(y, yc) and torch.equal(x.grad, xc.grad)
        for p, pc in zip(_params(seq), _params(seqc)):
            assert torch.equal(p.grad, pc.grad)
    assert graph_breaks() == 0 and unique_graphs() == 1


def test_residual_block_compiled_with_extra_tensors():
    """MakeExtraOutput / AddExtraInput in a compiled Sequential: same outputs and grads, one graph."""
    torch.manual_seed(0)
    block = ops.Sequential(ops.MakeExtraOutput(), ops.RMSNorm(H), ops.Linear(H, H), ops.GELU(),
                           ops.Dropout(0.0), ops.AddExtraInput(), ops.ConstantScale(0.5))
    blockc = copy.deepcopy(block)
    fresh_dynamo()
    compiled = torch.compile(blockc, backend="aot_eager", fullgraph=True)
    x, r = torch.randn(8, H, requires_grad=True), torch.randn(8, H, requires_grad=True)
    xc, rc = (t.detach().clone().requires_grad_() for t in (x, r))
    with recipe_ctx(RECIPES["current"]):
        (y, skip), (yc, skipc) = block(x, r), compiled(xc, rc)
    assert skip is x and torch.equal(y, yc) and torch.equal(skipc, xc)
    (y.sum() + 2 * skip.sum()).backward()
    (yc.sum() + 2 * skipc.sum()).backward()
    assert torch.equal(x.grad, xc.grad) and torch.equal(r.grad, rc.grad)
    assert torch.equal(r.grad, torch.full_like(r, 0.5))
    assert graph_breaks() == 0 and unique_graphs() == 1


# ---- TE's Sequential semantics ---------------------------------------------------------------------
def test_extra_tensors_in_place_as_te():
    """TE's container test: extra inputs go to the ops in order, extra outputs come back in order,
    and in_place=True writes into the caller's tensors."""
    size = 16
    bias = ops.Bias(size)
    with torch.no_grad():
        bias.bias.copy_(torch.rand(size))
    model = ops.Sequential(
        torch.nn.Identity(),                  # x1      -> x1
        ops.MakeExtraOutput(in_place=True),   # x1      -> x1 [x1]
        bias,                                 # x1      -> h1 = x1 + b
        ops.MakeExtraOutput(in_place=True),   # h1      -> h1 [h1]
        ops.AddExtraInput(in_place=True),     # h1 [x2] -> x2 += h1
        ops.MakeExtraOutput(in_place=True),   # x2      -> x2 [x2]
        torch.nn.Identity(),
        bias,                                 # x2      -> h2 = x2 + b
        ops.AddExtraInput(in_place=True),     # h2 [x3] -> x3 += h2
        ops.MakeExtraOutput(in_place=True),   # x3      -> x3 [x3]
        ops.AddExtraInput(in_place=True),     # x3 [x4] -> x4 += x3
        torch.nn.Identity(),
        ops.Identity(),
        ops.MakeExtraOutput(in_place=True),   # x4      -> x4 [x4]
        ops.Identity(),
    )
    x1, x2, x3, x4 = (torch.rand(size) for _ in range(4))
    orig = [t.clone() for t in (x1, x2, x3, x4)]
    ys = model(x1, x2, x3, x4)
    assert len(ys) == 6
    assert [ys[i].data_ptr() for i in (0, 1, 3, 4, 5)] == [x4.data_ptr(), x1.data_ptr(), x2.data_ptr(),
                                                           x3.data_ptr(), x4.data_ptr()]
    assert ys[2].data_ptr() not in [t.data_ptr() for t in (x1, x2, x3, x4)]
    b, h1 = bias.bias, ys[2]
    _close(x1, orig[0])
    _close(h1, orig[0] + b)
    _close(x2, orig[1] + h1)
    _close(x3, orig[2] + x2 + b)
    _close(x4, orig[3] + x3)


def test_extra_input_gradients_flow_in_place():
    x, e = _x(4, 8), _x(4, 8)
    e_before = e.detach().clone()
    y = ops.Sequential(ops.ConstantScale(2.0), ops.AddExtraInput(in_place=True))(x, e)
    assert y.data_ptr() == e.data_ptr() and torch.equal(y, e_before + 2 * x.detach())
    g = torch.randn_like(y)
    dx, de = torch.autograd.grad(y, [x, e], g)
    assert torch.equal(dx, 2 * g) and torch.equal(de, g)


def test_sequential_behaves_as_a_list():
    modules = [ops.Identity(), ops.Identity(), torch.nn.Identity(), ops.Identity()]
    model = ops.Sequential(*modules)

    def same():
        assert len(model) == len(modules) and all(a is b for a, b in zip(model, modules))

    same()
    assert all(model[i] is m and model[i - len(modules)] is m for i, m in enumerate(modules))
    sub = model[1:-1]
    assert isinstance(sub, ops.Sequential) and list(sub) == modules[1:-1]
    new = torch.nn.Identity()
    modules[1] = model[1] = new
    same()
    del modules[1], model[1]
    same()
    m = torch.nn.Identity()
    modules.append(m)
    model.append(m)
    same()
    more = [ops.Identity(), ops.Identity()]
    modules.extend(more)
    model.extend(more)
    same()
    m = ops.Identity()
    modules.insert(2, m)
    model.insert(2, m)
    same()
    assert model.pop(2) is modules.pop(2)
    same()
    more = [torch.nn.Identity(), ops.Identity()]
    added = model + ops.Sequential(*more)
    assert list(added) == modules + more and len(model) == len(modules)
    model += ops.Sequential(*more)
    modules += more
    same()
    named = ops.Sequential({"norm": ops.RMSNorm(8), "act": ops.ReLU()})
    assert list(dict(named.named_children())) == ["norm", "act"]


def test_module_between_ops_and_outputs_without_extras():
    model = ops.Sequential(ops.ConstantScale(3.0), torch.nn.ReLU(), ops.ConstantScale(-1.0))
    x = torch.randn(5)
    out = model(x)
    assert isinstance(out, torch.Tensor) and torch.equal(out, -F.relu(3 * x))


# ---- checkpoints and module features ------------------------------------------------------------------
def test_state_dict_layout_and_fp8_state_round_trip():
    seq = _block()
    with recipe_ctx(RECIPES["delayed"]):
        for _ in range(2):
            seq(torch.randn(8, H, requires_grad=True)).sum().backward()
    state = seq.state_dict()
    assert {"1.basic_ops.0.weight", "1.basic_ops.1.bias", "1.basic_ops.0._extra_state", "2._extra_state"} <= set(state)
    assert "1.weight" not in state and "1._extra_state" not in state  # as TE: the basic ops own the params
    fresh = _block()
    fresh.load_state_dict(state, strict=True)
    for a, b in ((seq[1], fresh[1]), (seq[3], fresh[3])):
        assert torch.equal(a.basic_ops[0].gemm.fp8_scale, b.basic_ops[0].gemm.fp8_scale)
        assert torch.equal(a.basic_ops[0].gemm.amax_history, b.basic_ops[0].gemm.amax_history)
    # a te.Linear's checkpoint (its _extra_state layout) loads into the op, and back
    lin = te.Linear(H, 2 * F_)
    with recipe_ctx(RECIPES["delayed"]):
        lin(torch.randn(8, H)).sum().backward()
    sd = lin.state_dict()
    fresh[1].load_state_dict({"basic_ops.0.weight": sd["weight"], "basic_ops.0._extra_state": sd["_extra_state"],
                              "basic_ops.1.bias": sd["bias"], "basic_ops.1._extra_state": torch.empty(0)})
    assert torch.equal(fresh[1].basic_ops[0].gemm.fp8_scale, lin.gemm.fp8_scale)


def test_weight_and_bias_assignment_reach_the_basic_ops():
    lin = ops.Linear(8, 4)
    w = torch.nn.Parameter(torch.ones(4, 8))
    lin.weight = w
    assert lin.basic_ops[0].weight is w and lin.weight is w
    assert "weight" not in lin._parameters
    nobias = ops.Linear(8, 4, bias=False)
    nobias.bias = None
    with pytest.raises(ValueError, match="bias=False"):
        nobias.bias = torch.nn.Parameter(torch.zeros(4))


def test_accumulate_into_main_grad_matches_te_linear():
    torch.manual_seed(0)
    op = ops.Linear(32, 16, accumulate_into_main_grad=True)
    ref = te.Linear(32, 16, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        ref.weight.copy_(op.weight)
    for m in (op, ref):
        m.weight.main_grad = torch.zeros(16, 32)
    x = torch.randn(4, 32)
    for m in (op, ref):
        for _ in range(2):
            m(x).sum().backward()
    assert op.weight.grad is None and torch.equal(op.weight.main_grad, ref.weight.main_grad)
    assert op.weight.main_grad.abs().sum() > 0
    op.weight.overwrite_main_grad = True
    with pytest.raises(NotImplementedError, match="overwrite_main_grad"):
        op(x)


def test_quantized_model_init_stores_the_weight_quantized():
    with te.quantized_model_init(recipe=RECIPES["current"]):
        op = ops.Linear(64, 32)
    assert isinstance(op.weight, QuantizedTensor)
    with recipe_ctx(RECIPES["current"]):
        y = op(torch.randn(4, 64))
    assert y.shape == (4, 32)


def test_rng_state_tracker_function_forks_the_init():
    forks = []

    class Tracker:
        def fork(self):
            forks.append(1)
            return torch.random.fork_rng()

    ops.BasicLinear(8, 8, rng_state_tracker_function=Tracker)
    assert forks == [1]


def test_te_ops_is_the_package_and_the_alias_maps_it():
    from transformer_engine_proto import as_te

    assert te.ops is ops_api and te.ops.basic.BasicLinear is ops.BasicLinear
    assert as_te.ALIASES["transformer_engine.pytorch.ops"] == "transformer_engine_proto.ops_api"
    assert isinstance(ops.Linear(4, 4), ops.FusedOperation) and isinstance(ops.Bias(4), ops.BasicOperation)
    assert not ops.Identity().is_fused_op and ops.Linear(4, 4).is_fused_op


# ---- clear errors ----------------------------------------------------------------------------------------
def test_bad_arguments_give_clear_errors():
    x = torch.randn(4, 8)
    bad = [
        (ValueError, "take 1 extra input", lambda: ops.Sequential(ops.AddExtraInput())(x)),
        (ValueError, "take 0 extra input", lambda: ops.Sequential(ops.Identity())(x, x)),
        (ValueError, "features must be positive", lambda: ops.Linear(0, 4)),
        (ValueError, "dtype must be", lambda: ops.BasicLinear(4, 4, dtype=torch.float64)),
        (ValueError, "last dim must be 16", lambda: ops.BasicLinear(16, 4)(x)),
        (ValueError, "last dim must be 16", lambda: ops.Bias(16)(x)),
        (ValueError, "tensor_parallel_mode must be", lambda: ops.Linear(4, 4, tensor_parallel_mode="diagonal")),
        (NotImplementedError, "userbuffers", lambda: ops.BasicLinear(4, 4, userbuffers_options={})),
        (ValueError, "normalized_shape", lambda: ops.LayerNorm(0)),
        (ValueError, "trailing dims must be", lambda: ops.RMSNorm(16)(x)),
        (ValueError, "sm_margin", lambda: ops.LayerNorm(8, sm_margin=-1)),
        (ValueError, "even last dim", lambda: ops.SwiGLU()(torch.randn(4, 7))),
        (ValueError, "glu_interleave_size", lambda: ops.SwiGLU(glu_interleave_size=0)),
        (ValueError, "ClampedSwiGLU: limit must be finite and positive", lambda: ops.ClampedSwiGLU(limit=0.0)),
        (ValueError, "SiTUGLU: beta2 must be finite and positive", lambda: ops.SiTUGLU(beta2=float("inf"))),
        (ValueError, "probability", lambda: ops.Dropout(1.5)),
        (ValueError, "at most one -1", lambda: ops.Reshape((-1, -1))),
        (TypeError, "must be a number", lambda: ops.ConstantScale("2")),
        (TypeError, "must be bools", lambda: ops.Quantize(forward=1)),
        (TypeError, "torch.nn.Module", lambda: ops.Sequential(lambda t: t)),
        (IndexError, "out of range", lambda: ops.Sequential(ops.Identity())[3]),
        (TypeError, "BasicOperation instances", lambda: ops.FusedOperation([torch.nn.ReLU()])),
    ]
    for exc, match, call in bad:
        with pytest.raises(exc, match=match):
            call()


def test_te_names_not_built_say_so():
    for name in ("register_forward_fusion", "register_backward_fusion"):
        with pytest.raises(AttributeError, match="not built yet"):
            getattr(ops, name)
    assert not hasattr(ops, "NoSuchOp")


def test_a_te_style_hand_written_op_is_refused():
    class Scale(ops.BasicOperation):
        def op_forward(self, ctx, input_, **kwargs):
            return 2 * input_

        def op_backward(self, ctx, grad_output):
            return 2 * grad_output, ()

    with pytest.raises(NotImplementedError, match="op_forward, op_backward"):
        Scale()


def test_extra_input_count_error_keeps_its_type_under_compile():
    fresh_dynamo()
    compiled = torch.compile(ops.Sequential(ops.AddExtraInput()), backend="aot_eager", fullgraph=True)
    with pytest.raises(ValueError, match="take 1 extra input"):
        compiled(torch.randn(4))


# ---- docs: every argument in a numpy-style Parameters section ---------------------------------------------
OP_CLASSES = [getattr(ops, n) for n in ops.__all__ if isinstance(getattr(ops, n), type)
              and n not in ("BasicOperation", "FusibleOperation")]


def _documented_ok(doc, fn):
    """The Parameters section names exactly fn's named arguments (a `*args` may be named too)."""
    star = {p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.VAR_POSITIONAL}
    documented = documented_parameters(doc)
    return documented - star == argument_names(fn)


@pytest.mark.parametrize("cls", OP_CLASSES, ids=lambda c: c.__name__)
def test_every_argument_is_documented(cls):
    own = cls.__dict__.get("__doc__")
    assert own, f"{cls.__name__} has no docstring of its own"
    assert _documented_ok(own, cls), cls.__name__
    assert _documented_ok(cls.forward.__doc__, cls.forward), f"{cls.__name__}.forward"


def test_l2_normalization_matches_te_formula_eager_and_compiled():
    """TE's formula in float32 (forward and its hand-written backward), rounded once."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 64, dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    op = ops.L2Normalization(eps=1e-5, seq_length=3, micro_batch_size=4)
    xf, dyf = x.float(), dy.float()
    s = xf.square().sum(-1, keepdim=True) + 1e-5
    ref_y = (xf * torch.rsqrt(s)).to(x.dtype)
    ref_dx = torch.rsqrt(s) * (dyf - xf * (xf * dyf).sum(-1, keepdim=True) / s)
    fresh_dynamo()
    for model in (ops.Sequential(op), torch.compile(ops.Sequential(op), backend="aot_eager", fullgraph=True)):
        xx = x.clone().requires_grad_()
        y = model(xx)
        y.backward(dy)
        assert torch.equal(y, ref_y)
        torch.testing.assert_close(xx.grad.float(), ref_dx, rtol=1e-2, atol=1e-2)  # bf16 gradient
    assert dict(op.named_parameters()) == {}
    with pytest.raises(ValueError, match="L2Normalization: eps must be non-negative"):
        ops.L2Normalization(eps=-1.0)
