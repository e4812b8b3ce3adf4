"""Delayed scaling's state: an inf/NaN amax is skipped and counted, and the scaling
state stays fp32 whatever the model's dtype."""
import copy
import warnings

import pytest
import torch
from linear_cases import backend_params, fold_last_grad_amaxes

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import delayed_scaling

RECIPE = R.DelayedScaling(amax_history_len=16)


def _step(model, x, grad=None):
    with te.autocast(recipe=RECIPE):
        y = model(x)
    y.backward(torch.ones_like(y) if grad is None else grad)
    return y.detach()


def _rel_err(model, x, y):
    ref = x @ model.weight.detach().T + model.bias.detach()
    return ((y - ref).norm() / ref.norm()).item()


@pytest.fixture
def fresh_warning(monkeypatch):
    """The warning not shown yet, and no counter copy in flight from an earlier test's modules."""
    monkeypatch.setattr(delayed_scaling, "_nonfinite_warned", False)
    monkeypatch.setattr(delayed_scaling, "_polls", {})


def test_nan_input_step_is_skipped_and_scales_follow_finite_amaxes(fresh_warning):
    torch.manual_seed(0)
    model = te.Linear(64, 32)
    x = torch.randn(16, 64)
    for _ in range(3):
        _step(model, x)
    bad = x.clone()
    bad[3, 5] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(model, bad)
    # the inputs grow 100x: the scale must follow (a frozen scale would saturate the fp8 input)
    big = 100 * x
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            y = _step(model, big)
    expected = 448.0 / model.gemm.amax_history[:, 0].max()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = _step(model, big)
    assert _rel_err(model, big, y) < 0.05
    assert model.gemm.fp8_scale[0] == expected
    assert model.gemm.nonfinite_amax_count.tolist() == [1, 0, 0]
    assert torch.isfinite(model.gemm.amax_history).all()


def test_nan_gradient_is_skipped_and_counted(fresh_warning):
    torch.manual_seed(0)
    model = te.Linear(64, 32)
    x = torch.randn(16, 64)
    _step(model, x)
    grad = torch.ones(16, 32)
    grad[0, 0] = float("inf")
    _step(model, x, grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step(model, x)  # the next forward folds the gradient's amax into the history
    assert model.gemm.nonfinite_amax_count.tolist() == [0, 0, 1]
    assert torch.isfinite(model.gemm.grad_amax_history).all()
    assert torch.isfinite(model.gemm.grad_fp8_scale).all() and model.gemm.grad_fp8_scale.item() > 0


def test_one_warning_at_the_next_autocast_entry(fresh_warning):
    model = te.Linear(32, 32)
    x = torch.randn(8, 32)
    bad = x.clone()
    bad[0, 0] = float("inf")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, bad)
        _step(model, x)
        _step(model, bad)
        _step(model, x)
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 1, messages
    assert model.name in messages[0] and "input 1" in messages[0]
    assert model.gemm.nonfinite_amax_count.tolist() == [2, 0, 0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_poll_covers_every_module_and_names_the_one_that_skipped(fresh_warning, device):
    """One poll reads all live modules' counters: the warning names the module whose amax was
    skipped, not the first one polled."""
    clean, dirty = te.Linear(32, 32, device=device), te.Linear(32, 32, device=device)
    x = torch.randn(8, 32, device=device)
    bad = x.clone()
    bad[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(clean, x)
        _step(dirty, bad)
        for _ in range(3):  # CUDA: the copy started at one entry is read at a later one
            _step(clean, x)
            if device == "cuda":
                torch.cuda.synchronize()
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"{dirty.name}: ") and "input 1" in messages[0]


@pytest.mark.cuda
def test_one_warning_on_cuda_and_no_host_sync_at_autocast_entry(fresh_warning):
    model = te.Linear(32, 32, device="cuda")
    x = torch.randn(8, 32, device="cuda")
    bad = x.clone()
    bad[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, bad)
        for _ in range(4):
            torch.cuda.set_sync_debug_mode("error")  # the poll must not synchronize
            try:
                with te.autocast(recipe=RECIPE):
                    pass
            finally:
                torch.cuda.set_sync_debug_mode(0)
            _step(model, x)
            torch.cuda.synchronize()
    assert len([w for w in caught if "non-finite" in str(w.message)]) == 1
    assert model.gemm.nonfinite_amax_count.tolist() == [1, 0, 0]


@pytest.mark.parametrize("backend", backend_params())
def test_nan_skipped_under_compile(fresh_warning, backend):
    """The compiled step skips and counts like eager: the same outputs, grads and scaling state."""
    torch.manual_seed(0)
    model = te.Linear(32, 32)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    x = torch.randn(8, 32)
    bad = x.clone()
    bad[1, 1] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for inp in (x, bad, x):
            torch.testing.assert_close(_step(compiled, inp), _step(eager, inp), rtol=0, atol=0, equal_nan=True)
    fold_last_grad_amaxes(RECIPE)
    assert model.gemm.nonfinite_amax_count.tolist() == [1, 0, 0]
    assert torch.isfinite(model.gemm.amax_history).all()
    for (name, a), b in zip(eager.named_buffers(), model.buffers()):
        assert torch.equal(a, b), name
    torch.testing.assert_close(model.weight.grad, eager.weight.grad, rtol=0, atol=0, equal_nan=True)


def test_the_counter_is_checkpointed_and_buffer_checkpoints_load():
    """The counter travels in `_extra_state`; a checkpoint that holds the state as the GEMM's own
    entries (`gemm.fp8_scale`, ...), with or without the counter, loads with strict=True."""
    model = te.Linear(32, 32)
    with torch.no_grad():
        model.gemm.nonfinite_amax_count.copy_(torch.tensor([1, 0, 2]))
        model.gemm.fp8_scale.copy_(torch.tensor([3.0, 5.0]))
    loaded = te.Linear(32, 32)
    loaded.load_state_dict(model.state_dict())
    assert torch.equal(loaded.gemm.nonfinite_amax_count, model.gemm.nonfinite_amax_count)
    old = {"weight": model.weight.detach(), "bias": model.bias.detach()}
    # the state as the GEMM's own entries: one per part (the counter int64), or the two packed buffers
    parts = {f"gemm.{n}": getattr(model.gemm, n).clone() for n in delayed_scaling._VIEWS}
    parts["gemm.nonfinite_amax_count"] = parts["gemm.nonfinite_amax_count"].long()
    packed = {f"gemm.{n}": b for n, b in model.gemm.named_buffers() if not n.startswith("weight_cache")}
    assert set(packed) == {"gemm.delayed_state", "gemm.grad_amax_handoff"}
    for entries, drop in ((parts, None), (parts, "gemm.nonfinite_amax_count"), (packed, None)):
        sd = {**old, **{k: v for k, v in entries.items() if k != drop}}
        fresh = te.Linear(32, 32)
        fresh.load_state_dict(sd)  # strict
        assert torch.equal(fresh.gemm.fp8_scale, model.gemm.fp8_scale)
        want = [0, 0, 0] if drop else [1, 0, 2]
        assert fresh.gemm.nonfinite_amax_count.tolist() == want


def _scaling_buffers(model):
    return {n: b for n, b in model.named_buffers() if "gemm" in n or "fc" in n}


@pytest.mark.parametrize("cast", ["to_bf16", "half", "to_meta_bf16", "to_meta"])
def test_scaling_state_stays_fp32(cast):
    model = torch.nn.Sequential(te.Linear(32, 32), te.LayerNormMLP(32, 64))
    _step(model, torch.randn(8, 32))
    before = {n: b.clone() for n, b in _scaling_buffers(model).items()}
    assert before and all(b.dtype in (torch.float32, torch.int64) for b in before.values())
    {"to_bf16": lambda: model.to(torch.bfloat16), "half": model.half,
     "to_meta_bf16": lambda: model.to("meta", torch.bfloat16), "to_meta": lambda: model.to("meta")}[cast]()
    after = _scaling_buffers(model)
    for n, b in after.items():
        assert b.dtype == before[n].dtype, n
        assert b.device.type == ("meta" if "meta" in cast else "cpu"), n
        if b.device.type == "cpu":
            assert torch.equal(b, before[n]), n
    if "meta" not in cast:
        assert model[0].weight.dtype != torch.float32  # the parameters were cast
        _step(model, torch.randn(8, 32, dtype=model[0].weight.dtype))  # and the model still runs
