"""IdentityQuantizer and HybridQuantizer: the tensors themselves, and CustomRecipe factories that
pick each Linear GEMM's precision with them (tensor/gemm_formats.py)."""
import copy
import importlib
import io

import pytest
import torch
from linear_cases import forget_modules, fresh_dynamo, graph_breaks

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_recipes import quantizer_factories as qf
from transformer_engine_proto.custom_recipes import quantizer_factory_zoo as zoo
from transformer_engine_proto.recipe import CustomRecipe
from transformer_engine_proto.tensor import MXFP8TensorStorage

BF16 = torch.bfloat16


def _fp8(dtype=torch.float8_e4m3fn):
    return te.Float8CurrentScalingQuantizer(dtype)


def _mxfp8():
    return te.MXFP8Quantizer(torch.float8_e4m3fn)


def _is_grad(role):
    return role.tensor_type == "grad_output"


def identity_all(role):
    return te.IdentityQuantizer()


def hybrid_identity_all(role):
    if _is_grad(role):
        return te.IdentityQuantizer()
    return te.HybridQuantizer(rowwise_quantizer=te.IdentityQuantizer(), columnwise_quantizer=te.IdentityQuantizer())


def fwd_quantized_bwd_identity(make, source="original"):
    def qfactory(role):
        if _is_grad(role):
            return te.IdentityQuantizer()
        return te.HybridQuantizer(rowwise_quantizer=make(), columnwise_quantizer=te.IdentityQuantizer(),
                                  columnwise_source=source)
    return qfactory


def all_of(make, grad_make=None):
    return lambda role: (grad_make or make)() if _is_grad(role) else make()


def fwd_identity_bwd_fp8(role):
    if _is_grad(role):
        return _fp8(torch.float8_e5m2)
    return te.HybridQuantizer(rowwise_quantizer=te.IdentityQuantizer(), columnwise_quantizer=_fp8())


def _fwd_bwd(module_cls, recipe, bias=False, compile_backend=None):
    torch.manual_seed(0)
    if module_cls is te.GroupedLinear:
        # the expert loop (what a recipe runs) also without one: torch._grouped_mm's CPU kernel rounds
        # its bf16 dgrad differently from per-expert mm on some CPUs (AVX2), not on others
        m = te.GroupedLinear(2, 64, 64, bias=bias, params_dtype=BF16, use_grouped_tensor=False)
    else:
        m = module_cls(64, 128 if module_cls is te.LayerNormMLP else 64, bias=bias, params_dtype=BF16)
    run = torch.compile(m, fullgraph=True, backend=compile_backend) if compile_backend else m
    torch.manual_seed(1)
    x = torch.randn(32, 64, dtype=BF16, requires_grad=True)
    args = (x, [16, 16]) if module_cls is te.GroupedLinear else (x,)
    with forget_modules(m):
        if recipe is None:
            y = run(*args)
        else:
            with te.autocast(recipe=recipe):
                y = run(*args)
        y.backward(torch.randn_like(y))
    return [y.detach(), x.grad] + [p.grad for p in m.parameters()]


def _assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"output {i}: max diff {(a.float() - b.float()).abs().max()}"


# ---- the tensors -------------------------------------------------------------------------------
def test_identity_quantize_holds_the_input_exactly():
    x = torch.randn(8, 16, dtype=BF16)
    t = te.IdentityQuantizer()(x)
    assert isinstance(t, te.IdentityTensor) and t.dtype == BF16
    assert t._hp_data.data_ptr() == x.data_ptr()  # no copy
    assert torch.equal(t.dequantize(), x)
    assert isinstance(te.IdentityQuantizer().quantize(x, internal=True), te.IdentityTensorStorage)
    assert not isinstance(te.IdentityQuantizer().quantize(x, internal=True), te.IdentityTensor)


def test_identity_dtype_casts_and_views_keep_the_class():
    x = torch.randn(8, 16, dtype=BF16)
    t = te.IdentityQuantizer(dtype=torch.float32)(x)
    assert t.dtype == torch.float32 and torch.equal(t.dequantize(), x.float())
    v = te.IdentityQuantizer()(x).view(4, 32)
    assert type(v) is te.IdentityTensor and torch.equal(v.dequantize(), x.view(4, 32))
    assert torch.equal(te.IdentityQuantizer()(x).t().dequantize(), x.t())
    with pytest.raises(TypeError, match="IdentityQuantizer.dtype"):
        te.IdentityQuantizer(dtype=torch.int8)


def test_identity_and_hybrid_load_weights_only():
    x = torch.randn(64, 64, dtype=BF16)
    for t in (te.IdentityQuantizer()(x),
              te.HybridQuantizer(rowwise_quantizer=_mxfp8(), columnwise_quantizer=te.IdentityQuantizer())(x)):
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert type(loaded) is type(t) and torch.equal(loaded.dequantize(), t.dequantize())


def test_hybrid_holds_one_format_per_usage():
    x = torch.randn(64, 64, dtype=BF16)
    q = te.HybridQuantizer(rowwise_quantizer=_mxfp8(), columnwise_quantizer=te.IdentityQuantizer())
    t = q(x)
    assert isinstance(t, te.HybridQuantizedTensor)
    assert isinstance(t.rowwise_sub_storage, MXFP8TensorStorage)
    assert isinstance(t.columnwise_sub_storage, te.IdentityTensorStorage)
    assert torch.equal(t.dequantize(), _mxfp8()(x).dequantize())  # rowwise first
    assert torch.equal(t.columnwise_sub_storage.dequantize(), x)
    # the sub-quantizers are pinned to their usage
    assert not q.rowwise_quantizer.columnwise_usage and not q.columnwise_quantizer.rowwise_usage
    empty = q.make_empty((64, 64), BF16)
    assert {k: (v.shape, v.dtype) for k, v in empty.get_buffers().items()} == \
        {k: (v.shape, v.dtype) for k, v in t.get_buffers().items()}


def test_hybrid_rowwise_dequantized_source():
    x = torch.randn(64, 64, dtype=BF16)
    t = te.HybridQuantizer(rowwise_quantizer=_fp8(), columnwise_quantizer=te.IdentityQuantizer(),
                           columnwise_source="rowwise_dequantized")(x)
    assert torch.equal(t.columnwise_sub_storage.dequantize(), _fp8()(x).dequantize())
    assert not torch.equal(t.columnwise_sub_storage.dequantize(), x)


def test_hybrid_rejects_bad_arguments():
    with pytest.raises(ValueError, match="columnwise_source"):
        te.HybridQuantizer(rowwise_quantizer=_fp8(), columnwise_quantizer=_fp8(), columnwise_source="x")
    with pytest.raises(TypeError, match="concrete Quantizer"):
        te.HybridQuantizer(rowwise_quantizer=_fp8(), columnwise_quantizer=None)


def test_te_module_paths():
    from transformer_engine_proto import as_te

    zoo_path = "custom_recipes.quantizer_factory_zoo"
    for te_name, ours in (("transformer_engine.pytorch.tensor.identity_tensor", "tensor.identity"),
                          ("transformer_engine.pytorch.tensor.storage.identity_tensor_storage", "tensor.identity"),
                          ("transformer_engine.pytorch.tensor.hybrid_tensor", "tensor.hybrid"),
                          (f"transformer_engine.pytorch.{zoo_path}", zoo_path)):
        assert as_te.ALIASES[te_name] == f"transformer_engine_proto.{ours}"
        importlib.import_module(as_te.ALIASES[te_name])


# ---- CustomRecipe: each GEMM's precision ---------------------------------------------------------
MODULES = [te.Linear, te.LayerNormLinear, te.LayerNormMLP, te.GroupedLinear]


@pytest.mark.parametrize("module_cls", MODULES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("qfactory", [identity_all, hybrid_identity_all])
@pytest.mark.parametrize("bias", [False, True])
def test_identity_everywhere_equals_no_recipe(module_cls, qfactory, bias):
    _assert_bitwise(_fwd_bwd(module_cls, CustomRecipe(qfactory=qfactory), bias),
                    _fwd_bwd(module_cls, None, bias))


@pytest.mark.parametrize("module_cls", MODULES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("make", [_fp8, _mxfp8], ids=["fp8_current", "mxfp8"])
def test_quantized_forward_identity_backward_equals_high_precision_override(module_cls, make):
    grad = (lambda: _fp8(torch.float8_e5m2)) if make is _fp8 else None
    want = _fwd_bwd(module_cls, CustomRecipe(qfactory=all_of(make, grad), backward_override="high_precision"))
    got = _fwd_bwd(module_cls, CustomRecipe(qfactory=fwd_quantized_bwd_identity(make)))
    _assert_bitwise(got, want)
    assert not torch.equal(got[0], _fwd_bwd(module_cls, None)[0])  # the forward did quantize


@pytest.mark.parametrize("make", [_fp8, _mxfp8], ids=["fp8_current", "mxfp8"])
def test_rowwise_dequantized_backward_equals_dequantized_override(make):
    want = _fwd_bwd(te.Linear, CustomRecipe(qfactory=all_of(make), backward_override="dequantized"))
    got = _fwd_bwd(te.Linear, CustomRecipe(qfactory=fwd_quantized_bwd_identity(make, "rowwise_dequantized")))
    _assert_bitwise(got, want)
    assert not torch.equal(got[1], _fwd_bwd(te.Linear, CustomRecipe(qfactory=fwd_quantized_bwd_identity(make)))[1])


def test_identity_forward_quantized_backward():
    ref = _fwd_bwd(te.Linear, None, bias=True)
    got = _fwd_bwd(te.Linear, CustomRecipe(qfactory=fwd_identity_bwd_fp8), bias=True)
    assert torch.equal(got[0], ref[0])  # fprop in high precision
    assert not torch.equal(got[1], ref[1]) and not torch.equal(got[2], ref[2])  # dgrad, wgrad in FP8
    for a, b in zip(got[1:3], ref[1:3]):
        assert ((a.float() - b.float()).norm() / b.float().norm()) < 0.1
    assert torch.equal(got[3], ref[3])  # the bias gradient sums the same high-precision dy


def test_recipe_key_names_the_implied_gemms():
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    key = RecipeKey.of(CustomRecipe(qfactory=fwd_quantized_bwd_identity(_fp8)))
    assert RecipeKey.high_precision_gemms(key) == {"dgrad", "wgrad"}
    key = RecipeKey.of(CustomRecipe(qfactory=fwd_quantized_bwd_identity(_fp8, "rowwise_dequantized")))
    assert RecipeKey.dequantized_gemms(key) == {"dgrad", "wgrad"} and not RecipeKey.high_precision_gemms(key)
    assert RecipeKey.high_precision_gemms(RecipeKey.of(CustomRecipe(qfactory=identity_all))) == \
        {"fprop", "dgrad", "wgrad"}


def _mixed_dgrad(role):  # dgrad: FP8 grad_output beside an identity columnwise weight
    if _is_grad(role):
        return _fp8(torch.float8_e5m2)
    return te.HybridQuantizer(rowwise_quantizer=_fp8(), columnwise_quantizer=te.IdentityQuantizer())


def _two_formats_for_input(role):  # input: MXFP8 for fprop, FP8 for wgrad
    if _is_grad(role):
        return _fp8(torch.float8_e5m2)
    return te.HybridQuantizer(rowwise_quantizer=_mxfp8(), columnwise_quantizer=_fp8())


@pytest.mark.parametrize("qfactory, match", [
    (_mixed_dgrad, "dgrad reads an identity .*operand beside a quantized one"),
    (_two_formats_for_input, "role is quantized by different quantizers"),
    (lambda role: te.IdentityQuantizer(dtype=torch.float32), "casts a GEMM operand"),
])
def test_unsupported_combinations_raise_naming_the_gemm(qfactory, match):
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    with pytest.raises(NotImplementedError, match=match):
        RecipeKey.of(CustomRecipe(qfactory=qfactory))


# ---- torch.compile ---------------------------------------------------------------------------
@pytest.mark.parametrize("qfactory", [identity_all, fwd_quantized_bwd_identity(_fp8), fwd_identity_bwd_fp8],
                         ids=["identity", "hybrid_fwd_fp8", "hybrid_bwd_fp8"])
def test_compiled_equals_eager(qfactory):
    fresh_dynamo()
    recipe = CustomRecipe(qfactory=qfactory)
    eager = _fwd_bwd(te.Linear, recipe, bias=True)
    compiled = _fwd_bwd(te.Linear, copy.copy(recipe), bias=True, compile_backend="aot_eager")
    assert graph_breaks() == 0
    _assert_bitwise(compiled, eager)


@pytest.mark.parametrize("noop", [0.0, 1.0])
def test_update_quantized_noop_flag_covers_both_halves_of_a_hybrid(noop):
    """One noop flag for the rowwise (FP8) and the columnwise (identity) half, as in TE."""
    q = te.HybridQuantizer(rowwise_quantizer=_fp8(), columnwise_quantizer=te.IdentityQuantizer())
    old = torch.full((32, 32), 3.0, dtype=torch.bfloat16)
    dst = q(old)
    row_before = dst.rowwise_sub_storage.dequantize().clone()
    q.update_quantized(torch.full_like(old, 7.0), dst, noop_flag=torch.ones(1) * noop)
    want_row, want_col = (row_before, old) if noop else (torch.full_like(old, 7.0), torch.full_like(old, 7.0))
    assert torch.equal(dst.rowwise_sub_storage.dequantize(), want_row)
    assert torch.equal(dst.columnwise_sub_storage.dequantize(), want_col)


# ---- TE's custom_recipes: base factories and the zoo ---------------------------------------------
_ROW_SCALED_DEQUANTIZED = dict(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True,
                               row_scaled_activation=True, backward_override="dequantized")


@pytest.mark.parametrize("factory, builtin", [
    (qf.current_scaling_factory, R.Float8CurrentScaling()),
    (qf.float8_block_scaling_factory, R.Float8BlockScaling()),
    (qf.mxfp8_factory, R.MXFP8BlockScaling()),
    (qf.high_precision_factory, None),
    (zoo.mxfp8_fwd_high_precision_bwd_factory, R.MXFP8BlockScaling(backward_override="dequantized")),
    (zoo.nvfp4_row_scaled_fwd_high_precision_bwd_factory, R.NVFP4BlockScaling(**_ROW_SCALED_DEQUANTIZED)),
], ids=lambda v: getattr(v, "__name__", type(v).__name__))
@pytest.mark.parametrize("module_cls", [te.Linear, te.LayerNormMLP], ids=lambda c: c.__name__)
def test_factories_match_their_builtin_recipe_bitwise(module_cls, factory, builtin):
    _assert_bitwise(_fwd_bwd(module_cls, CustomRecipe(qfactory=factory)), _fwd_bwd(module_cls, builtin))


def test_nvfp4_factory_roles_are_the_recipe_defaults():
    role = lambda t: R.QuantizerRole(module_type="linear", tensor_type=t)  # noqa: E731
    w, x, g = qf.nvfp4_factory(role("weight")), qf.nvfp4_factory(role("input")), qf.nvfp4_factory(role("grad_output"))
    assert w.with_2d_quantization and not w.with_rht and not w.stochastic_rounding
    assert x.with_rht and not x.with_2d_quantization and not x.stochastic_rounding
    assert g.with_rht and g.stochastic_rounding


def test_high_precision_forward_mxfp8_backward_factory():
    """fprop in high precision (equal to no recipe), dgrad / wgrad in MXFP8 (near it)."""
    ref = _fwd_bwd(te.Linear, None)
    got = _fwd_bwd(te.Linear, CustomRecipe(qfactory=zoo.high_precision_fwd_mxfp8_bwd_factory))
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:]):
        assert not torch.equal(a, b) and ((a.float() - b.float()).norm() / b.float().norm()) < 0.1


def test_hybrid_prepare_for_saving_round_trip():
    """TE's save protocol over both sub-storages: the identity half comes back exact."""
    x = torch.randn(32, 32, dtype=BF16)
    h = te.HybridQuantizer(rowwise_quantizer=_mxfp8(), columnwise_quantizer=te.IdentityQuantizer()).quantize(x)
    row = h.rowwise_sub_storage.dequantize().clone()
    tensors, obj = h.prepare_for_saving()
    assert obj is h and h.columnwise_sub_storage._hp_data is None
    assert obj.restore_from_saved(tensors) == []
    assert torch.equal(h.columnwise_sub_storage.dequantize(), x)
    assert torch.equal(h.rowwise_sub_storage.dequantize(), row)


@pytest.mark.parametrize("qfactory, stored", [(identity_all, te.IdentityTensor),
                                               (hybrid_identity_all, te.HybridQuantizedTensor)])
@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_quantized_model_init_under_an_all_identity_recipe_trains_like_bf16(qfactory, stored, backend):
    """As TE: the weight is stored with the factory's own (identity) quantizer, and every GEMM
    reads it in high precision: outputs and gradients equal the plain bf16 Linear bit for bit."""
    recipe = CustomRecipe(qfactory=qfactory)
    torch.manual_seed(0)
    ref = te.Linear(32, 32, bias=False, params_dtype=BF16)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        test = te.Linear(32, 32, bias=False, params_dtype=BF16)
    assert isinstance(test.weight, stored)
    with torch.no_grad():
        test.weight.copy_(ref.weight)
    run = torch.compile(test, fullgraph=True, backend=backend) if backend else test
    x = torch.randn(16, 32, dtype=BF16)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(16, 32, dtype=BF16)
    ref(xr).backward(g)
    with forget_modules(test), te.autocast(recipe=recipe):
        y = run(xt)
    y.backward(g)
    assert torch.equal(y, ref(xr.detach())) and torch.equal(xt.grad, xr.grad)
    assert torch.equal(test.weight.grad, ref.weight.grad)
