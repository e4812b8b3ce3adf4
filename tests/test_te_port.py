"""TE code that ports by changing the import: DType, TE's quantizer keywords and tensor attributes,
`quantization` (FP8GlobalStateManager, RecipeState), recipe fields, CustomRecipe, and
`quantized_model_init` parameters that are stored quantized and train."""
import io
import warnings

import pytest
import torch
from linear_cases import QUANTIZED_IDS, RECIPES, backend_params, fresh_dynamo, graph_breaks

import transformer_engine_proto as te
from transformer_engine_proto import recipe
from transformer_engine_proto.constants import DType
from transformer_engine_proto.quantization import FP8GlobalStateManager, QuantizerRole, RecipeState
from transformer_engine_proto.tensor import QuantizedTensor

FP8_AVAILABLE, REASON = te.is_fp8_available(return_reason=True)


# ---- a TE training script, as written for TE -------------------------------------------------
def test_te_style_training_script():
    assert FP8_AVAILABLE, REASON
    fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16,
                                       amax_compute_algo="max")
    torch.manual_seed(0)
    with te.fp8_model_init(enabled=False):
        model = torch.nn.Sequential(te.LayerNormLinear(64, 128), te.Linear(128, 64))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64)
    losses = []
    for _ in range(3):
        with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
            assert FP8GlobalStateManager.is_fp8_enabled()
            assert FP8GlobalStateManager.get_fp8_recipe() is fp8_recipe
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert losses[-1] < losses[0]


# ---- DType, quantizer constructors, tensor attributes ---------------------------------------
def test_dtype_maps_to_torch_dtypes():
    assert DType.kFloat8E4M3.torch_dtype is torch.float8_e4m3fn
    assert DType.cast(torch.bfloat16) is DType.kBFloat16
    assert te.DType is DType
    with pytest.raises(TypeError, match="no Transformer Engine data type"):
        DType.cast(torch.complex64)


def test_fused_amax_and_scale_update_after_reduction():
    """tex's multi-tensor delayed-scaling update: two TE-layout states in one call, the reduced
    amaxes back to back in one buffer; TE's scale rule at 0 / tiny / inf / NaN amaxes."""
    from transformer_engine_proto.constants import fused_amax_and_scale_update_after_reduction as update

    h1, s1 = torch.tensor([[0.0, 0.0], [2.0, 1.0], [5.0, 1.0]]), torch.tensor([1.0, 2.0])
    h2, s2 = torch.tensor([[4.0], [1.0], [1.0]]), torch.tensor([3.0])
    update(torch.tensor([3.0, 0.0, 0.0]), [h1, h2], [s1, s2], "max", DType.kFloat8E4M3, 1)
    # h1 column 0: newest 3 rolls in; column 1: the buffer's 0 takes row 0 (0): no roll, scale kept
    assert torch.equal(h1, torch.tensor([[0.0, 0.0], [5.0, 1.0], [3.0, 1.0]]))
    assert torch.equal(s1, torch.tensor([224.0 / 5.0, 2.0]))
    assert torch.equal(h2, torch.tensor([[0.0], [1.0], [4.0]])) and torch.equal(s2, torch.tensor([224.0 / 4.0]))
    fp32_max = torch.finfo(torch.float32).max
    for amax, want in [(0.0, 7.0), (57344.0 / fp32_max / 2, fp32_max), (float("inf"), 7.0), (float("nan"), 7.0)]:
        h, s = torch.tensor([[amax]]), torch.tensor([7.0])
        update(h.clone().view(-1), [h], [s], "most_recent", DType.kFloat8E5M2, 0)
        assert s.item() == want, amax
    with pytest.raises(ValueError, match="amax_compute_algo must be"):
        update(None, [h], [s], "mean", DType.kFloat8E4M3, 0)


@pytest.mark.parametrize("make_te, make_ours", [
    (lambda: te.Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3, rowwise=True, columnwise=False),
     lambda: te.Float8Quantizer(torch.ones(1), torch.zeros(1), torch.float8_e4m3fn, rowwise_usage=True,
                                columnwise_usage=False)),
    (lambda: te.Float8CurrentScalingQuantizer(DType.kFloat8E5M2, torch.device("cpu"), rowwise=False, columnwise=True),
     lambda: te.Float8CurrentScalingQuantizer(torch.float8_e5m2, rowwise_usage=False)),
    (lambda: te.MXFP8Quantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True),
     lambda: te.MXFP8Quantizer(torch.float8_e4m3fn)),
    (lambda: te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=1),
     lambda: te.Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, columnwise_usage=False)),
    (lambda: te.NVFP4Quantizer(DType.kFloat4E2M1, True, False, False, None, False, False, True),
     lambda: te.NVFP4Quantizer(with_2d_quantization=True, columnwise_usage=False)),
])
def test_quantizers_take_te_constructor_arguments(make_te, make_ours):
    ours_q, te_q = make_ours(), make_te()
    assert te_q == ours_q
    x = torch.randn(64, 128)
    a, b = te_q(x), ours_q(x)
    assert a.get_buffers().keys() == b.get_buffers().keys()
    assert all(u.dtype == v.dtype and torch.equal(u.float(), v.float())
               for u, v in zip(a.get_buffers().values(), b.get_buffers().values()))


def test_te_only_quantizer_options_are_refused_not_ignored():
    with pytest.raises(NotImplementedError, match="with_amax_reduction=True"):
        te.NVFP4Quantizer(with_amax_reduction=True)
    with pytest.raises(NotImplementedError, match="with_2d_quantization=True"):
        te.MXFP8Quantizer(DType.kFloat8E4M3, with_2d_quantization=True)
    with pytest.raises(NotImplementedError, match="fp4_dtype"):
        te.NVFP4Quantizer(DType.kFloat8E4M3)
    with pytest.raises(TypeError, match="multiple values"):
        te.MXFP8Quantizer(DType.kFloat8E4M3, fp8_dtype=DType.kFloat8E5M2)


def test_nvfp4_random_sign_mask_off_is_taken_without_an_rht():
    """TE's tests pass with_random_sign_mask=False with with_rht=False: no RHT, nothing to mask."""
    q = te.NVFP4Quantizer(with_rht=False, with_random_sign_mask=False)
    assert q == te.NVFP4Quantizer()
    with pytest.raises(NotImplementedError, match="with_random_sign_mask=False"):
        te.NVFP4Quantizer(with_rht=True, with_random_sign_mask=False)


def test_quantized_tensors_answer_te_attribute_names():
    x = torch.randn(64, 128)
    f8 = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)(x)
    assert f8._fp8_dtype == DType.kFloat8E4M3 and f8._data.shape == (64, 128) and f8._scale_inv.numel() == 1
    assert f8._transpose_invalid is False and f8.get_usages() == {"rowwise": True, "columnwise": True}
    f8.update_usage(columnwise_usage=False)
    assert f8._transpose_invalid is True and f8.get_usages() == {"rowwise": True, "columnwise": False}
    ident = te.IdentityQuantizer().quantize(x, internal=True)
    ident.update_usage(rowwise_usage=False, columnwise_usage=True)  # one buffer serves both: no-op
    assert ident.get_usages() == {"rowwise": True, "columnwise": True}
    mx = te.MXFP8Quantizer(DType.kFloat8E5M2)(x)
    assert mx._fp8_dtype == DType.kFloat8E5M2
    assert mx._rowwise_data is not None and mx._columnwise_scale_inv is not None
    blk = te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=2)(x)
    assert blk._is_2D_scaled is True and blk._columnwise_data is not None
    fp4 = te.NVFP4Quantizer()(x)
    assert fp4._fp4_dtype == DType.kFloat4E2M1 and fp4._amax_rowwise is not None
    assert not hasattr(fp4, "_fp8_dtype")
    assert te.NVFP4Quantizer().dtype == DType.kFloat4E2M1 and te.MXFP8Quantizer(DType.kFloat8E4M3).dtype == 7


# ---- recipe fields ----------------------------------------------------------------------------
def test_recipe_format_values_and_nvfp4_role_params():
    assert recipe.Format.HYBRID.value.max_fwd == 448 and recipe.Format.HYBRID.value.max_bwd == 57344
    assert recipe.Format.E2M1.value.max_fwd == 6
    nv = recipe.NVFP4BlockScaling()
    assert nv.fp4_format is recipe.Format.E2M1
    assert nv.fp4_quant_fwd_inp.random_hadamard_transform and not nv.fp4_quant_fwd_inp.stochastic_rounding
    assert nv.fp4_quant_fwd_weight.fp4_2d_quantization
    assert nv.fp4_quant_bwd_grad.stochastic_rounding
    assert not recipe.NVFP4BlockScaling(disable_rht=True).fp4_quant_bwd_grad.random_hadamard_transform
    with pytest.raises(TypeError, match="FP8 recipe.Format"):
        recipe.Float8CurrentScaling(fp8_format=recipe.Format.E2M1)


def test_use_power_2_scales_reaches_the_quantizers():
    from transformer_engine_proto.tensor.recipe_quantizers import quantizers_for_recipe

    assert quantizers_for_recipe(recipe.Float8CurrentScaling(use_power_2_scales=True)).input.force_pow_2_scales
    assert not quantizers_for_recipe(recipe.Float8BlockScaling(use_f32_scales=True)).weight.force_pow_2_scales


def _role_factory(role):
    dtype = torch.float8_e5m2 if role.tensor_type == "grad_output" else torch.float8_e4m3fn
    return te.Float8CurrentScalingQuantizer(dtype)


def test_custom_recipe_matches_the_builtin_recipe_bitwise():
    torch.manual_seed(0)
    layer = te.Linear(64, 32)
    x = torch.randn(16, 64, requires_grad=True)
    outs = []
    for r in (recipe.CustomRecipe(qfactory=_role_factory), recipe.Float8CurrentScaling()):
        with te.autocast(recipe=r):
            y = layer(x)
        y.sum().backward()
        outs.append((y.detach(), x.grad.clone(), layer.weight.grad.clone()))
        x.grad = layer.weight.grad = layer.bias.grad = None
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_custom_recipe_rejects_mixed_formats_and_delayed_scaling():
    mixed = recipe.CustomRecipe(qfactory=lambda role: te.MXFP8Quantizer(DType.kFloat8E4M3)
                                if role.tensor_type == "weight" else _role_factory(role))
    layer = te.Linear(64, 32)
    with pytest.raises(ValueError, match="one format"):
        with te.autocast(recipe=mixed):
            layer(torch.randn(16, 64))
    delayed = recipe.CustomRecipe(qfactory=lambda role: te.Float8Quantizer(None, None, DType.kFloat8E4M3))
    with pytest.raises(NotImplementedError, match="recipe.DelayedScaling"):
        with te.autocast(recipe=delayed):
            layer(torch.randn(16, 64))


# ---- quantization: FP8GlobalStateManager, RecipeState ----------------------------------------
def test_global_state_manager():
    FP8GlobalStateManager.reset()
    assert not FP8GlobalStateManager.is_fp8_enabled()
    assert isinstance(FP8GlobalStateManager.get_fp8_recipe(), recipe.DelayedScaling)  # TE's default
    r = recipe.MXFP8BlockScaling()
    for _ in range(2):
        with te.autocast(recipe=r, amax_reduction_group="g"):
            assert FP8GlobalStateManager.is_first_fp8_module() is True
            assert FP8GlobalStateManager.is_first_fp8_module() is False
            assert FP8GlobalStateManager.get_fp8_group() == "g"
            assert FP8GlobalStateManager.get_fp8_recipe() is r
    with te.quantized_model_init(enabled=True, preserve_high_precision_init_val=True):
        assert FP8GlobalStateManager.with_fp8_parameters() and FP8GlobalStateManager.with_high_precision_init_val()
    assert not FP8GlobalStateManager.with_fp8_parameters()
    assert FP8GlobalStateManager.is_fp8_available()[0] is True


def test_recipe_state_delayed_scaling_binds_each_slot():
    state = RecipeState.create(recipe.DelayedScaling(amax_history_len=4), mode="forward", num_quantizers=3,
                               device="cpu")
    assert state.scale.shape == (3,) and state.amax_history.shape == (4, 3)
    qs = state.make_quantizers()
    assert [q.fp8_dtype for q in qs] == [torch.float8_e4m3fn] * 3
    state.scale[1] = 2.0
    x = torch.randn(32, 16)
    t = qs[1](x)
    assert torch.equal(state.amax_history[0], torch.stack([torch.tensor(0.0), x.abs().max(), torch.tensor(0.0)]))
    assert t._scale_inv.item() == 0.5
    grads = RecipeState.create(recipe.DelayedScaling(), mode="backward", num_quantizers=2, device="cpu")
    assert [q.fp8_dtype for q in grads.make_quantizers()] == [torch.float8_e5m2] * 2


def test_recipe_state_roles_and_formats():
    roles = [QuantizerRole(tensor_type="weight"), QuantizerRole(tensor_type="input")]
    state = RecipeState.create(recipe.Float8BlockScaling(), mode="forward", num_quantizers=2, roles=roles)
    qs = state.make_quantizers()
    assert [q.block_scaling_dim for q in qs] == [2, 1]
    nv = RecipeState.create(recipe.NVFP4BlockScaling(), mode="backward", num_quantizers=1).make_quantizers()[0]
    assert nv.stochastic_rounding and nv.with_rht
    with pytest.raises(ValueError, match="2 roles for 3"):
        RecipeState.create(recipe.MXFP8BlockScaling(), mode="forward", num_quantizers=3, roles=roles)
    with pytest.raises(ValueError, match="mode"):
        RecipeState.create(recipe.MXFP8BlockScaling(), mode="fwd")


# ---- quantized_model_init ---------------------------------------------------------------------
def test_in_place_ops_write_back_into_quantized_tensors():
    x = torch.randn(64, 128)
    t = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)(x)
    before = t.dequantize()
    with pytest.warns(UserWarning, match="re-quantizing"):
        t.mul_(0.5)
    torch.testing.assert_close(t.dequantize(), before * 0.5, rtol=0.07, atol=0)
    ts = [te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)(x) for _ in range(2)]
    torch._foreach_add_(ts, 1.0)
    assert all(torch.allclose(u.dequantize(), x + 1, rtol=0.07, atol=float((x + 1).abs().max()) / 16) for u in ts)
    assert not torch.allclose(ts[0].dequantize(), x, rtol=0.07, atol=0.07)


def test_quantized_parameter_detaches_under_inference_mode():
    """`weight.detach()` of a parameter stored quantized, inside `torch.inference_mode` (an
    evaluation step reading its weights, as TE's tests do): a quantized tensor sharing the data."""
    with te.quantized_model_init(enabled=True, recipe=recipe.DelayedScaling()):
        lin = te.Linear(32, 32, params_dtype=torch.bfloat16)
    with torch.inference_mode():
        d = lin.weight.detach()
        assert torch.equal(d.dequantize(), lin.weight.dequantize())
    assert isinstance(d, QuantizedTensor) and not d.requires_grad
    assert d._data.data_ptr() == lin.weight._data.data_ptr()


def _param_bytes(p: torch.Tensor) -> int:
    bufs = p.get_buffers().values() if isinstance(p, QuantizedTensor) else [p]
    return sum(b.numel() * b.element_size() for b in bufs)


# bytes of a quantized weight / bytes of the same weight in bf16 (MXFP8 stores both usages)
_MAX_RATIO = {"delayed": 0.51, "current": 0.51, "block": 0.51, "nvfp4": 0.29, "mxfp8": 1.04}


@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_quantized_model_init_trains_compiles_and_checkpoints(rid):
    r = RECIPES[rid]
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=r, preserve_high_precision_init_val=True):
        model = torch.nn.Sequential(te.Linear(128, 128, params_dtype=torch.bfloat16),
                                    te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16))
    weights = [model[0].weight, model[1].fc1_weight, model[1].fc2_weight]
    assert all(isinstance(w, QuantizedTensor) and isinstance(w, torch.nn.Parameter) for w in weights)
    ratio = sum(map(_param_bytes, weights)) / sum(w.numel() * 2 for w in weights)
    assert ratio <= _MAX_RATIO[rid]
    init = model[0].weight.get_high_precision_init_val()
    assert init.device.type == "cpu" and init.dtype == torch.bfloat16
    torch.testing.assert_close(model[0].weight.dequantize().float(), init.float(), rtol=0.3, atol=0.02)
    model[0].weight.clear_high_precision_init_val()
    assert model[0].weight.get_high_precision_init_val() is None

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    target = torch.randn(64, 128, dtype=torch.bfloat16)
    fresh_dynamo()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # inductor: tests/test_cuda.py
    losses = []
    for _ in range(4):
        with te.autocast(recipe=r):
            loss = (compiled(x).float() - target.float()).pow(2).mean()
        loss.backward()
        assert all(w.grad is not None and w.grad.shape == w.shape for w in weights)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert graph_breaks() == 0
    assert losses[-1] < losses[0], losses

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    with te.quantized_model_init(enabled=True, recipe=r):
        resumed = torch.nn.Sequential(te.Linear(128, 128, params_dtype=torch.bfloat16),
                                      te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16))
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))  # weights_only=True: our classes are allow-listed
    with te.autocast(recipe=r):
        assert torch.equal(resumed(x), model(x))


@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_quantized_weights_without_a_recipe_run_in_high_precision(rid):
    """Outside autocast a weight stored quantized is dequantized and the GEMM runs in high
    precision (as TE): out = x @ W_dequantized^T, the weight's gradient reaches the parameter;
    compiled (fullgraph) equals eager."""
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=RECIPES[rid]):
        lin = te.Linear(128, 64, bias=False, params_dtype=torch.bfloat16)
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    fresh_dynamo()
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (lin, compiled):
        x.grad = lin.weight.grad = None
        y = fn(x)
        y.float().square().sum().backward()
        results.append((y.detach(), x.grad.clone(), lin.weight.grad.clone()))
    w = lin.weight.dequantize()
    torch.testing.assert_close(results[0][0].float(), x.detach().float() @ w.float().T, rtol=1e-2, atol=1e-2)
    assert results[0][2].shape == lin.weight.shape and results[0][2].abs().sum() > 0
    for eager, comp in zip(*results):
        assert torch.equal(eager, comp)
    assert graph_breaks() == 0


@pytest.mark.parametrize("rid", ["delayed", "current", "mxfp8"])
def test_is_first_microbatch_is_a_no_op_for_quantized_weights(rid):
    """A weight stored quantized is its own cache: `is_first_microbatch` True / False gives the
    call without it, bit for bit (TE ignores it there too)."""
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=RECIPES[rid]):
        lin = te.Linear(128, 64, params_dtype=torch.bfloat16)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    outs = []
    for first in (None, None, True, False):
        with te.autocast(recipe=RECIPES[rid]), torch.no_grad():
            outs.append(lin(x, is_first_microbatch=first))
    for o in outs[2:]:  # from the second call on (delayed scaling's first call sets its scale)
        assert torch.equal(outs[1], o)


def test_autocast_with_another_recipe_than_the_quantized_weights_warns_once():
    """TE's "Quantizer is being updated" warning: weights stored quantized under one recipe, run
    under another (here another history length); once per change, not with the same recipe."""
    with te.quantized_model_init(recipe=recipe.DelayedScaling(amax_history_len=1024)):
        lin = te.Linear(32, 32)
    x = torch.randn(32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=1024)):
            lin(x)
    with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=1)):
        with pytest.warns(UserWarning, match="Quantizer is being updated"):  # at the forward, as TE
            lin(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with te.autocast(recipe=recipe.DelayedScaling(amax_history_len=1)):
            lin(x)


def test_quantized_model_init_names_the_layer_a_recipe_cannot_store():
    with pytest.raises(ValueError, match="linear_bad.*MXFP8BlockScaling"):
        with te.quantized_model_init(enabled=True, recipe=recipe.MXFP8BlockScaling()):
            te.Linear(48, 40, name="linear_bad")


TE_QUANTIZERS = {
    "current": lambda: te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False),
    "mxfp8": lambda: te.MXFP8Quantizer(DType.kFloat8E4M3),
    "block": lambda: te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
    "nvfp4": lambda: te.NVFP4Quantizer(with_2d_quantization=True),
    "nvfp4_te_order": lambda: te.NVFP4Quantizer(DType.kFloat4E2M1, True, True, False, None, False, False, True),
}


# inductor: current scaling in CI (a quantize compiles in seconds), the other formats slow
@pytest.mark.parametrize("backend, qid", backend_params(list(TE_QUANTIZERS), ci=("current",)))
def test_quantizers_built_inside_compiled_code(backend, qid):
    """dynamo rebuilds a quantizer it saw constructed with the dataclass's positional order (the
    TE-constructor layer must not reinterpret those arguments), and torch 2.11's dynamo passes
    the defaults of the fields after the positional ones as keywords."""
    fresh_dynamo()
    make = TE_QUANTIZERS[qid]
    x = torch.randn(32, 128)

    def f(x):
        return make()(x).dequantize()

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend=backend)(x), f(x), rtol=0, atol=0)


def test_shared_recipe_quantizers_refuse_in_place_usage_changes():
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    shared = RecipeKey.quantizers(RecipeKey.of(recipe.Float8CurrentScaling())).input
    with pytest.raises(TypeError, match="with_usage"):
        shared.set_usage(columnwise=False)
    assert shared.columnwise_usage is True
    assert shared.with_usage(columnwise=False).columnwise_usage is False
    own = te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3)  # TE code's own quantizer: in place, as TE
    own.set_usage(rowwise=True, columnwise=False)
    assert own.columnwise_usage is False


def test_set_usage_checks_the_input_again():
    """A quantizer checks an input's shape once per (shape, dtype); an in-place usage change
    makes it check again (MXFP8's columnwise copy needs whole 32-row blocks)."""
    q = te.MXFP8Quantizer(DType.kFloat8E4M3, rowwise=True, columnwise=False)
    x = torch.randn(16, 64)
    assert q.quantize(x, internal=True).has_rowwise()
    q.set_usage(columnwise=True)
    with pytest.raises(ValueError, match="32"):
        q.quantize(x, internal=True)


def _te_flag_quantizers():
    return [
        te.Float8Quantizer(torch.ones(1), torch.zeros(1), DType.kFloat8E4M3),
        te.Float8CurrentScalingQuantizer(DType.kFloat8E4M3),
        te.Float8BlockQuantizer(DType.kFloat8E4M3, rowwise=True, columnwise=True, block_scaling_dim=1),
        te.MXFP8Quantizer(DType.kFloat8E4M3),
        te.NVFP4Quantizer(),
        te.IdentityQuantizer(),
        te.HybridQuantizer(rowwise_quantizer=te.IdentityQuantizer(), columnwise_quantizer=te.MXFP8Quantizer()),
    ]


def test_every_quantizer_class_takes_tes_mutable_flags():
    """TE code sets `q.internal` / `q.optimize_for_gemm` on its quantizers; every concrete
    quantizer class of the package accepts them (a new class without `te_flags` fails here)."""
    import dataclasses

    from transformer_engine_proto.distributed.amax_reduction import AmaxReducingQuantizer
    from transformer_engine_proto.tensor.quantizer import Quantizer

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    covered = {type(q) for q in _te_flag_quantizers()} | {AmaxReducingQuantizer}
    package = {c for c in subclasses(Quantizer) if c.__module__.startswith("transformer_engine_proto")
               and not c.__name__.startswith("_")}
    assert package <= covered, f"not covered: {sorted(c.__name__ for c in package - covered)}"
    for q in _te_flag_quantizers():
        fresh = q.copy()
        q.internal, q.optimize_for_gemm = True, 1
        assert q.internal is True and q.optimize_for_gemm is True and fresh.internal is False
        assert q == fresh and hash(q) == hash(fresh)  # flags are not settings
        with pytest.raises(dataclasses.FrozenInstanceError):
            q.rowwise_usage = False


@pytest.mark.parametrize("i", range(len(_te_flag_quantizers())))
def test_internal_flag_gives_bare_storages_and_survives_copies(i):
    q = _te_flag_quantizers()[i]
    x = torch.randn(64, 128)
    assert isinstance(q(x), QuantizedTensor) and isinstance(q.make_empty((64, 128), torch.float32), QuantizedTensor)
    q.internal = True
    for out in (q(x), q.quantize(x), q.make_empty((64, 128), torch.float32)):
        assert not isinstance(out, QuantizedTensor) and out.size() == (64, 128) and out.size(-1) == 128
    assert isinstance(q.quantize(x, internal=False), QuantizedTensor)  # the argument wins over the flag
    torch.testing.assert_close(q(x).dequantize(), q.quantize(x, internal=False).dequantize(), rtol=0, atol=0)
    for other in (q.copy(), q.with_usage(columnwise=False)):
        assert other.internal is True and other is not q


def test_shared_recipe_quantizers_refuse_te_flags():
    from transformer_engine_proto.custom_ops.recipe_key import RecipeKey

    shared = RecipeKey.quantizers(RecipeKey.of(recipe.Float8CurrentScaling())).input
    with pytest.raises(TypeError, match="copy"):
        shared.internal = True
    assert shared.internal is False
    own = shared.copy()
    own.internal = True
    assert own.internal and not shared.internal


def test_storages_and_tensors_take_tes_constructor_form():
    """TE builds a storage from its buffers and `fake_dtype=`; the shape comes from the buffer
    that holds the logical shape. Without one (a columnwise-only FP8 tensor) the shape is needed."""
    from transformer_engine_proto.tensor.float8 import Float8Tensor, Float8TensorStorage
    from transformer_engine_proto.tensor.identity import IdentityTensor, IdentityTensorStorage

    payload = torch.randn(4, 8)
    storage = IdentityTensorStorage(hp_data=payload, fake_dtype=torch.bfloat16)
    assert storage._shape == (4, 8) and storage.dequantize().dtype == torch.bfloat16
    assert IdentityTensorStorage(hp_data=payload, fake_dtype=torch.float32).dequantize() is payload
    tensor = IdentityTensor(hp_data=payload, fake_dtype=torch.bfloat16)
    assert tensor.shape == (4, 8) and tensor.dtype == torch.bfloat16
    assert type(tensor).size is torch.Tensor.size and tensor.size(0) == 4  # tensors keep torch's size()
    data = payload.to(torch.float8_e4m3fn)
    f8 = Float8Tensor(data=data, fp8_scale_inv=torch.full((1,), 0.5), fp8_dtype=torch.float8_e4m3fn,
                      fake_dtype=torch.bfloat16)
    torch.testing.assert_close(f8.dequantize(), (data.float() * 0.5).to(torch.bfloat16), rtol=0, atol=0)
    with pytest.raises(TypeError, match="needs dtype"):
        Float8TensorStorage(data_transpose=data.t().contiguous(), fp8_scale_inv=torch.ones(1),
                            fp8_dtype=torch.float8_e4m3fn, fake_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="differ"):
        IdentityTensorStorage(hp_data=payload, dtype=torch.float32, fake_dtype=torch.bfloat16)


def test_a_te_style_quantizer_subclass_calls_the_base_with_tes_keywords():
    """TE's own quantizer subclasses (and users') call `Quantizer.__init__(self, rowwise=...,
    columnwise=...)` and then set attributes of their own."""
    from transformer_engine_proto.tensor.quantizer import Quantizer

    class Custom(Quantizer):
        def __init__(self, rowwise=True, columnwise=True):
            super().__init__(rowwise=rowwise, columnwise=columnwise)
            self.parent_quantizer = None

    q = Custom(columnwise=False)
    assert (q.rowwise_usage, q.columnwise_usage, q.parent_quantizer) == (True, False, None)
    q.internal = True
    assert q.internal is True
    bare = object.__new__(Custom)  # TE's tests build one without its own __init__
    Quantizer.__init__(bare, rowwise=False, columnwise=True)
    assert (bare.rowwise_usage, bare.columnwise_usage) == (False, True)
