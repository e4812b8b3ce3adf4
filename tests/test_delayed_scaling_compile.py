"""DelayedScaling under inductor equals eager over the recipe's options (history length, compute
algo, margin, format), step after step: the forward, both gradients and the scaling state.

Inductor's partitioner decides what backward saves and what it recomputes; a value it recomputes
from a module buffer that the forward has since mutated (the scale from the amax history) gives
backward another step's scale. `aot_eager` never partitions that way, so this runs inductor.
"""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from linear_cases import fresh_dynamo, graph_breaks

from transformer_engine_proto import recipe as R
from transformer_engine_proto.autocast import autocast
from transformer_engine_proto.module import Linear

STATE = ("fp8_scale", "amax_history", "grad_fp8_scale", "grad_amax_history", "grad_amax_pending", "grad_amax_seen",
         "nonfinite_amax_count", "amax_recorded", "delayed_state", "grad_amax_handoff")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@st.composite
def delayed_recipes(draw):
    return R.DelayedScaling(
        amax_history_len=draw(st.sampled_from([1, 2, 3, 16, 1024])),
        amax_compute_algo=draw(st.sampled_from(["max", "most_recent"])),
        margin=draw(st.integers(0, 2)),
        fp8_format=draw(st.sampled_from([R.Format.HYBRID, R.Format.E4M3])),
    )


def _run(recipe, device, mode=None, steps=3, bias=True):
    fresh_dynamo()
    torch.manual_seed(0)
    m = Linear(64, 32, bias=bias, device=device)
    mc = copy.deepcopy(m)
    cm = torch.compile(mc, fullgraph=True, backend="inductor", mode=mode)
    for step in range(steps):
        # the scale of each step depends on the previous steps' amaxes: vary them
        x = torch.randn(48, 64, device=device) * (step + 1)
        g = torch.randn(48, 32, device=device) * 10.0 ** step
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        with autocast(recipe=recipe):
            ye, yc = m(xe), cm(xc)
        ye.backward(g)
        yc.backward(g)
        tag = f"{recipe} step {step}"
        pairs = [("output", ye, yc), ("input grad", xe.grad, xc.grad), ("weight grad", m.weight.grad, mc.weight.grad)]
        pairs += [(n, getattr(m.gemm, n), getattr(mc.gemm, n)) for n in STATE]
        for what, e, c in pairs:
            assert torch.equal(e, c), f"{tag} {what}: max abs diff {(e.float() - c.float()).abs().max().item()}"
        m.zero_grad(set_to_none=True)
        mc.zero_grad(set_to_none=True)
    assert graph_breaks() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("history,algo", [(1, "most_recent"), (2, "max")])
def test_megatron_defaults_match_eager_under_inductor(device, history, algo):
    """History 1 / most_recent (Megatron-LM's defaults) and history 2: the cases that gave
    backward the next step's scale."""
    _run(R.DelayedScaling(amax_history_len=history, amax_compute_algo=algo), device)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=4)
@given(recipe=delayed_recipes())
def test_recipe_options_match_eager_under_inductor(device, recipe):
    _run(recipe, device)


@pytest.mark.cuda
@pytest.mark.parametrize("history,algo", [(1, "most_recent"), (16, "max")])
def test_reduce_overhead_matches_eager(history, algo):
    _run(R.DelayedScaling(amax_history_len=history, amax_compute_algo=algo), "cuda", mode="reduce-overhead",
         steps=4)


def test_each_gemm_brings_two_state_inputs_and_three_ops_into_the_graph():
    """Dynamo's graph of two delayed-scaling Linears has two inputs per GEMM more than current
    scaling's (its packed state and its gradient-amax handoff, each a guarded graph input) and, per
    GEMM, one scale pin and one amax record: the state is read through the whole buffers, never
    sliced in the trace (a slice costs dynamo what another buffer does)."""
    graphs = {}
    for name, recipe in (("current", R.Float8CurrentScaling()), ("delayed", R.DelayedScaling(amax_history_len=4))):
        fresh_dynamo()
        model = torch.nn.Sequential(Linear(32, 32), Linear(32, 32))

        def keep(gm, inputs, name=name):
            graphs[name] = gm
            return gm.forward

        with autocast(recipe=recipe):
            torch.compile(model, backend=keep, fullgraph=True)(torch.randn(16, 32, requires_grad=True))
    inputs = {k: sum(n.op == "placeholder" for n in g.graph.nodes) for k, g in graphs.items()}
    assert inputs["delayed"] - inputs["current"] == 2 * 2, inputs
    targets = [str(n.target) for n in graphs["delayed"].graph.nodes if n.op == "call_function"]
    assert targets.count("te_proto.saved_state.default") == 2, targets
    assert targets.count("te_proto.delayed_record_amax.default") == 2, targets


# ---- TE's callable options: the amax from a function of the history, the scale from a function --------
def _mean_of_history(history):
    return history.mean(0)


def _half_headroom(amax, scale, fp8_max, recipe):
    return torch.where(amax > 0, fp8_max / amax / 2.0, scale)


CALLABLE_RECIPES = [
    R.DelayedScaling(amax_history_len=4, amax_compute_algo=_mean_of_history),
    R.DelayedScaling(amax_history_len=2, scaling_factor_compute_algo=_half_headroom),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", CALLABLE_RECIPES, ids=["amax_compute_algo", "scaling_factor_compute_algo"])
def test_callable_options_match_eager_under_inductor(device, recipe):
    _run(recipe, device)


@pytest.mark.parametrize("recipe", CALLABLE_RECIPES, ids=["amax_compute_algo", "scaling_factor_compute_algo"])
def test_callable_options_set_the_scale_they_compute(recipe):
    """After a step's update (at the autocast exit) the scale is the callables' result on the
    history as the step's forward left it."""
    torch.manual_seed(0)
    m = Linear(64, 32)
    fwd_max = 448.0
    for step in range(3):
        scale = m.gemm.fp8_scale.clone()
        with autocast(recipe=recipe):
            y = m(torch.randn(16, 64) * (step + 1))
            history = m.gemm.amax_history[: recipe.amax_history_len].clone()
        y.sum().backward()
        if recipe.scaling_factor_compute_algo is None:
            amax = _mean_of_history(history)
            want = torch.where(amax > 0, torch.tensor(fwd_max) / amax, scale)
        else:
            want = _half_headroom(history.amax(0), scale, fwd_max, recipe)
        assert torch.equal(m.gemm.fp8_scale, want), (step, m.gemm.fp8_scale, want)
    assert (m.gemm.fp8_scale != 1).all()  # the rule ran on recorded amaxes, not only on the initial zeros


def test_callable_options_are_checked():
    with pytest.raises(ValueError, match=r"amax_compute_algo must be 'max', 'most_recent' or a callable"):
        R.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(TypeError, match=r"scaling_factor_compute_algo must be None or a callable"):
        R.DelayedScaling(scaling_factor_compute_algo=2.0)
