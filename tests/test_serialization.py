"""torch.save / torch.load (default weights_only=True) of quantized tensors, and state dicts that
resume training exactly, for every recipe."""
import io

import pytest
import torch
from format_cases import FORMAT_CASES
from linear_cases import fold_last_grad_amaxes

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.examples.train import RECIPES

USAGES = [(True, True), (True, False), (False, True)]


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True, torch's default


def _assert_same_quantized(a, b):
    assert type(a) is type(b) and a._shape == b._shape and a._hp_dtype == b._hp_dtype
    assert a._quantizer == b._quantizer
    bufs_a, bufs_b = a.get_buffers(), b.get_buffers()
    assert bufs_a.keys() == bufs_b.keys()
    for name in bufs_a:
        if bufs_a[name] is None:
            assert bufs_b[name] is None, name
        else:
            x, y = bufs_a[name], bufs_b[name]
            assert x.dtype == y.dtype and x.stride() == y.stride(), name
            x_bytes, y_bytes = (t.flatten().contiguous().view(torch.uint8) for t in (x, y))
            assert torch.equal(x_bytes, y_bytes), name


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
@pytest.mark.parametrize("usage", USAGES, ids=["rw+cw", "rw", "cw"])
def test_quantized_tensor_loads_weights_only_bitwise(case, usage):
    torch.manual_seed(0)
    t = case.make(*usage)(torch.randn(128, 256))
    loaded = _round_trip(t)
    _assert_same_quantized(t, loaded)
    assert torch.equal(loaded.dequantize(), t.dequantize())


@pytest.mark.parametrize("case", FORMAT_CASES, ids=repr)
def test_bare_storage_and_quantizer_load_weights_only(case):
    q = case.make(True, True)
    storage = q.quantize(torch.randn(128, 256), internal=True)
    loaded = _round_trip({"storage": storage, "quantizer": q})
    _assert_same_quantized(storage, loaded["storage"])
    assert loaded["quantizer"] == q


def test_state_dict_with_quantized_parameter_and_recipes_loads_weights_only():
    q = FORMAT_CASES[1].make(True, True)
    param = torch.nn.Parameter(q(torch.randn(64, 64)), requires_grad=False)
    recipes = [make() for make in RECIPES.values() if make() is not None]
    sd = {"weight": param, "recipes": recipes, "format": R.Format.HYBRID, "bias": torch.randn(64)}
    loaded = _round_trip(sd)
    assert isinstance(loaded["weight"], torch.nn.Parameter)
    _assert_same_quantized(param, loaded["weight"])
    assert loaded["recipes"] == recipes and loaded["format"] is R.Format.HYBRID


@pytest.mark.parametrize("name", [n for n in RECIPES if n != "none"])
def test_quantized_model_init_state_dict_loads_weights_only_bitwise(name):
    recipe = RECIPES[name]()

    def build():
        with te.quantized_model_init(enabled=True, recipe=recipe):
            return torch.nn.Sequential(te.Linear(128, 128), te.LayerNormMLP(128, 256))

    torch.manual_seed(0)
    model = build()
    sd = model.state_dict()
    assert isinstance(sd["0.weight"], te.QuantizedTensor)
    loaded = _round_trip(sd)
    for key, t in sd.items():
        if isinstance(t, te.QuantizedTensor):
            _assert_same_quantized(t, loaded[key])
        else:
            assert torch.equal(t, loaded[key]), key
    torch.manual_seed(1)
    resumed = build()
    resumed.load_state_dict(loaded)
    x = torch.randn(64, 128)
    with te.autocast(recipe=recipe):
        assert torch.equal(resumed(x), model(x))


def test_fsdp_quantized_gather_model_state_dict_loads_weights_only():
    from transformer_engine_proto.distributed.fsdp import FSDPWeight, enable_quantized_all_gather

    model = torch.nn.Sequential(te.Linear(32, 32), te.LayerNormMLP(32, 64))
    assert enable_quantized_all_gather(model) == 3
    sd = model.state_dict()
    loaded = _round_trip(sd)
    assert isinstance(loaded["0.weight"], FSDPWeight) and loaded["0.weight"]._gemm_name == "gemm"
    plain = torch.nn.Sequential(te.Linear(32, 32), te.LayerNormMLP(32, 64))
    plain.load_state_dict(loaded)
    for name, t in plain.state_dict().items():
        ref = sd[name]._tensor if isinstance(sd[name], FSDPWeight) else sd[name]
        assert torch.equal(t, ref), name


def test_only_this_packages_classes_are_allow_listed():
    from transformer_engine_proto.serialization import safe_globals

    names = {c.__module__ for c in safe_globals()}
    assert names and all(n.startswith("transformer_engine_proto.") for n in names)


# ---- resume: a checkpoint taken after compiled steps continues exactly like an uninterrupted run
def _model():
    return torch.nn.Sequential(te.LayerNormLinear(128, 128), torch.nn.GELU(), te.Linear(128, 128))


def _train(model, opt, recipe, steps, first):
    step_fn = torch.compile(model, fullgraph=True, backend="aot_eager")
    losses = []
    for i in range(first, first + steps):
        x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(i))
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = step_fn(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(RECIPES))
def test_resume_from_state_dict_continues_identically(name):
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    first = _train(ref, ref_opt, recipe, 3, 0)
    ckpt = _round_trip({"model": ref.state_dict(), "opt": ref_opt.state_dict(), "rng": torch.get_rng_state()})
    uninterrupted = _train(ref, ref_opt, recipe, 3, 3)

    torch.manual_seed(1)  # a fresh model, differently initialised: everything must come from the checkpoint
    resumed = _model()
    resumed.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    opt.load_state_dict(ckpt["opt"])
    torch.set_rng_state(ckpt["rng"])
    assert first[-1] != uninterrupted[0]
    assert _train(resumed, opt, recipe, 3, 3) == uninterrupted
    fold_last_grad_amaxes(recipe)
    for (n, a), b in zip(ref.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), n
