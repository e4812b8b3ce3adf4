"""Forward under `torch.inference_mode()` (CPU, eager): every recipe and module runs, state first
allocated there is made of normal tensors (training afterwards works), and delayed scaling
behaves as under `torch.no_grad()`, as in TE: amaxes recorded, no scale update. Weights stored
quantized by a module built without grad keep no columnwise usage, as in TE."""
import copy

import pytest
import torch
from linear_cases import QUANTIZED_IDS, RECIPES, fresh_dynamo, graph_breaks

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import shared_input
from transformer_engine_proto.tensor import QuantizedTensor

MODULES = {
    "Linear": (lambda: te.Linear(64, 64), (32, 64)),
    "LayerNormMLP": (lambda: te.LayerNormMLP(64, 128), (32, 64)),
    "TransformerLayer": (lambda: te.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0),
                         (8, 4, 64)),
}


def _inference_tensors(m):
    return [n for n, t in list(m.named_parameters()) + list(m.named_buffers()) if t.is_inference()]


@pytest.mark.parametrize("mid", list(MODULES))
@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_inference_mode_forward_matches_no_grad(rid, mid):
    """An input made inside inference_mode has no version counter: the shared quantized input
    (custom_ops/shared_input.py) must not key on it. The output equals a no_grad forward's."""
    make, shape = MODULES[mid]
    torch.manual_seed(0)
    m = make()
    twin = copy.deepcopy(m)
    x = torch.randn(shape)
    with torch.no_grad(), te.autocast(recipe=RECIPES[rid]):
        ref = twin(x)
    with torch.inference_mode():
        xi = x.clone()
        with te.autocast(recipe=RECIPES[rid]):
            y = m(xi)
    assert y.is_inference()
    assert torch.equal(y, ref)
    assert _inference_tensors(m) == []


def test_inference_tensors_are_not_shared():
    """Two Linears reading one inference tensor each quantize it (an in-place write to it could
    not be detected), where a normal tensor's quantized copy is shared."""
    torch.manual_seed(0)
    a, b = te.Linear(64, 64), te.Linear(64, 64)
    recipe = R.Float8CurrentScaling()

    def hits(x):
        before = shared_input.stats["hits"]
        with te.autocast(recipe=recipe):
            a(x), b(x)
        return shared_input.stats["hits"] - before

    with torch.no_grad():
        assert hits(torch.randn(32, 64)) == 1
    with torch.inference_mode():
        assert hits(torch.randn(32, 64)) == 0


def _train_step(m, recipe, **kw):
    x = torch.randn(32, 64, requires_grad=True)
    with te.autocast(recipe=recipe):
        y = m(x, **kw)
    y.sum().backward()
    assert x.grad is not None and m.weight.grad is not None


def test_history_reallocated_in_inference_mode_then_training():
    """A longer amax history, first allocated when autocast is entered inside inference_mode,
    is a normal buffer: the next training step updates it in place."""
    torch.manual_seed(0)
    m = te.Linear(64, 64)
    recipe = R.DelayedScaling(amax_history_len=2048)
    with torch.inference_mode():
        with te.autocast(recipe=recipe):
            m(torch.randn(32, 64))
    assert m.gemm.amax_history.shape[0] == 2048
    assert _inference_tensors(m) == []
    _train_step(m, recipe)


@pytest.mark.parametrize("rid", QUANTIZED_IDS)
def test_weight_cache_allocated_in_inference_mode_then_training(rid):
    """The is_first_microbatch weight cache, first allocated inside inference_mode, is a normal
    buffer: later training micro-batches fill and read it."""
    torch.manual_seed(0)
    m = te.Linear(64, 64)
    with torch.inference_mode():
        with te.autocast(recipe=RECIPES[rid]):
            m(torch.randn(32, 64), is_first_microbatch=True)
    assert m.gemm._cache_names and _inference_tensors(m) == []
    _train_step(m, RECIPES[rid], is_first_microbatch=True)
    _train_step(m, RECIPES[rid], is_first_microbatch=False)


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
def test_delayed_scaling_without_grad_records_amax_but_keeps_scales(grad_mode):
    """TE updates delayed-scaling scales (and rolls the history) at autocast exit only with grad
    enabled, while the forward's quantize still records its amax into the current slot. Here:
    a forward without grad leaves the scales and the older history rows alone and takes the max
    into slot 0; the next training block's exit then rolls it in."""
    torch.manual_seed(0)
    m = te.Linear(64, 64)
    recipe = R.DelayedScaling()
    for _ in range(2):
        _train_step(m, recipe)
    g = m.gemm
    scale, history = g.fp8_scale.clone(), g.amax_history.clone()
    x = 8 * torch.randn(32, 64)  # a larger input amax than the training steps'
    ctx = torch.no_grad() if grad_mode == "no_grad" else torch.inference_mode()
    with ctx:
        with te.autocast(recipe=recipe):
            m(x)
    assert torch.equal(g.fp8_scale, scale)
    assert torch.equal(g.amax_history[1:], history[1:])
    assert g.amax_history[0, 0] == torch.maximum(history[0, 0], x.abs().amax())
    assert g.amax_history[0, 1] == m.weight.detach().abs().amax()  # the weight's amax, recorded too
    _train_step(m, recipe)
    assert g.amax_history[-1, 0] == x.abs().amax()  # rolled in at the training block's exit (slot 0 -> -1)
    assert not torch.equal(g.fp8_scale, scale)


# ---- weights stored quantized for inference (quantized_model_init without grad) ---------------------
STORED = {
    "Linear": (lambda: te.Linear(64, 64), {}),
    "LayerNormLinear": (lambda: te.LayerNormLinear(64, 64), {}),
    "LayerNormMLP": (lambda: te.LayerNormMLP(64, 128), {}),
    "GroupedLinear": (lambda: te.GroupedLinear(2, 64, 64), {"m_splits": [8, 24]}),
}


def _stored(mid, rid, grad: bool):
    torch.manual_seed(0)
    with torch.set_grad_enabled(grad), te.quantized_model_init(recipe=RECIPES[rid]):
        return STORED[mid][0]()


def _columnwise_kept(m):
    return [n for n, p in m.named_parameters() if isinstance(p, QuantizedTensor) and p._quantizer.columnwise_usage
            and not p.derives_usages()]


@pytest.mark.parametrize("mid", list(STORED))
@pytest.mark.parametrize("rid", ["mxfp8", "current"])
def test_weights_built_without_grad_keep_no_columnwise_usage(mid, rid):
    """TE's test_inference_mode: a module built under no_grad inside quantized_model_init stores
    its weights rowwise only (MXFP8 would otherwise keep its columnwise copy), and an
    inference_mode forward neither builds nor keeps one; its output is the one a module built for
    training gives (the same rowwise bytes)."""
    m, trained = _stored(mid, rid, grad=False), _stored(mid, rid, grad=True)
    params = [p for p in m.parameters() if isinstance(p, QuantizedTensor)]
    assert params and all(not p._quantizer.columnwise_usage for p in params)
    if rid == "mxfp8":
        assert _columnwise_kept(trained) and all(p._columnwise_data is None for p in params)
    x = torch.randn(32, 64)
    with torch.inference_mode(), te.autocast(recipe=RECIPES[rid]):
        y = m(x.clone(), **STORED[mid][1])
    assert all(not p._quantizer.columnwise_usage for p in params)
    with torch.no_grad(), te.autocast(recipe=RECIPES[rid]):
        assert torch.equal(y, trained(x, **STORED[mid][1]))


def test_training_a_model_built_for_inference_names_the_cause():
    m = _stored("Linear", "mxfp8", grad=False)
    with te.autocast(recipe=RECIPES["mxfp8"]), pytest.raises(RuntimeError, match="built inside quantized_model_init "
                                                                                  "under torch.no_grad"):
        m(torch.randn(32, 64, requires_grad=True))
    with te.autocast(recipe=RECIPES["mxfp8"]):  # no dgrad: the rowwise usage is all it needs
        m(torch.randn(32, 64)).sum().backward()


def test_compiled_forward_of_a_model_built_for_inference():
    m = _stored("Linear", "mxfp8", grad=False)
    fresh_dynamo()
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(32, 64)
    with torch.no_grad(), te.autocast(recipe=RECIPES["mxfp8"]):
        assert torch.equal(compiled(x), m(x))
    assert graph_breaks() == 0
