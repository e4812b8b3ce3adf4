"""The one-launch delayed-scaling update (kernels/triton/delayed_scaling.py) is its reference bit for
bit, over history lengths, amax algorithms, margins, formats, pending / stale gradient amaxes and
non-finite values, with and without a newly recorded amax; and eager training equals compiled training."""
import math
import os

import pytest
import torch
from linear_cases import fold_last_grad_amaxes

from transformer_engine_proto.kernels import reference
from transformer_engine_proto.kernels.reference.common import FP8_MAX

_on_gpu = pytest.mark.cuda
_DEVICES = [pytest.param("cuda", marks=_on_gpu)]
if os.environ.get("TRITON_INTERPRET") == "1":  # the layout logic on CPU (no fp8 cast in this kernel)
    _DEVICES.append("cpu")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, NaN where NaN (inf / -inf stay themselves)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(nan=-7.0, posinf=math.inf, neginf=-math.inf),
                                                           b.nan_to_num(nan=-7.0, posinf=math.inf, neginf=-math.inf))


_PARTS = ("fp8_scale", "amax_history", "grad_fp8_scale", "grad_amax_history", "grad_amax_pending", "grad_amax_seen",
          "nonfinite_amax_count", "amax_recorded")


def _state(rows: int, seed: int, device, nonfinite: bool):
    """A GEMM's (state, handoff) (`reference.delayed_scaling`'s layout, 1024 history rows)."""
    g = torch.Generator().manual_seed(seed)
    hist = torch.rand(1024, 2, generator=g) * 10.0 ** torch.randint(-6, 4, (1024, 2), generator=g)
    ghist = torch.rand(1024, 1, generator=g) * 1e-3
    hist[rows // 2] = 0.0  # a zero amax keeps the old scale (most_recent on row 0 with rows 1)
    pending = torch.tensor([float(torch.rand(1, generator=g)) * 1e-2, float(seed % 2)])
    seen = torch.tensor([0.0])  # a new pending amax on odd seeds, a stale one on even
    if nonfinite:
        pending[0] = float("inf") if seed % 3 else float("nan")
        hist[0, 1] = float("nan")  # loaded from a checkpoint, say: the max over it is NaN
    recorded = torch.tensor([float(seed % 4 < 2)])  # a forward recorded amaxes on seeds 0, 1 only
    parts = [torch.rand(2, generator=g) + 0.5, hist, torch.rand(1, generator=g) + 0.5, ghist, pending, seen,
             torch.tensor([0.0, 0.0, 5.0]), recorded]
    state, handoff = reference.delayed_scaling.new_state(1024), torch.zeros(3)
    for view, part in zip(_parts((state, handoff)), parts):
        view.copy_(part)
    return state.to(device), handoff.to(device)


def _parts(state_and_handoff):
    """The state's parts in `_PARTS`' order (views)."""
    views = reference.delayed_scaling.views(*state_and_handoff)
    return [views[n] for n in _PARTS]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("rows", [1, 3, 16, 1024])
@pytest.mark.parametrize("most_recent", [False, True])
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("nonfinite", [False, True])
@pytest.mark.parametrize("halves", [(True, False), (False, True), (True, True)], ids=["fwd", "grad", "both"])
def test_one_launch_update_is_the_reference_bit_for_bit(device, rows, most_recent, margin, nonfinite, halves):
    from transformer_engine_proto.kernels.triton.delayed_scaling import delayed_scaling_update as fused

    forward_half, grad_half = halves
    for seed in range(4):
        fwd_max, bwd_max = (FP8_MAX[torch.float8_e4m3fn], FP8_MAX[torch.float8_e5m2]) if seed < 2 else \
            (FP8_MAX[torch.float8_e4m3fn], FP8_MAX[torch.float8_e4m3fn])
        expect, got = _state(rows, seed, "cpu", nonfinite), _state(rows, seed, device, nonfinite)
        args = (rows, most_recent, fwd_max, bwd_max, margin, forward_half, grad_half)
        reference.delayed_scaling.delayed_scaling_update(*expect, *args)
        fused(*got, *args)
        assert _same(expect[0], got[0].cpu()) and _same(expect[1], got[1].cpu()), f"seed {seed}"
        expect, before = _parts(expect), _parts(_state(rows, seed, "cpu", nonfinite))
        if forward_half and seed % 4 < 2:  # recorded: slot 0 free for the next amax and the rest rolled
            assert (expect[1][0] == 0).all() and expect[7].item() == 0  # the flag is cleared
            if rows > 1:
                assert _same(expect[1][1: rows - 1], before[1][2:rows]) and _same(expect[1][rows - 1], before[1][0])
        else:  # nothing recorded, or the half not asked for: the forward scales and history as they were
            assert _same(expect[0], before[0]) and _same(expect[1], before[1])
            assert expect[7].item() == (0 if forward_half else before[7].item())
        if grad_half and seed % 2:  # a new gradient amax: folded, then slot 0 freed by the roll
            assert (expect[3][0] == 0).all()
        else:  # none, or the half not asked for: the gradient scale and history as they were
            assert _same(expect[2], before[2]) and _same(expect[3], before[3])


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("halves", [(True, False), (False, True)], ids=["fwd", "grad"])
def test_one_launch_for_many_gemms_is_the_reference_bit_for_bit(device, halves):
    """TE's multi-tensor update: one launch for several GEMMs' states (each its own buffers, seeds
    with and without recorded / pending amaxes, non-finite ones included) equals the reference
    GEMM by GEMM, and a second call on the same buffers reuses the address table."""
    from transformer_engine_proto.kernels.triton.delayed_scaling import _TABLES
    from transformer_engine_proto.kernels.triton.delayed_scaling import delayed_scaling_update_many as fused

    states = [(seed, nonfinite) for seed in range(4) for nonfinite in (False, True)]
    expect = [_state(16, seed, "cpu", nonfinite) for seed, nonfinite in states]
    got = [_state(16, seed, device, nonfinite) for seed, nonfinite in states]
    args = (16, False, FP8_MAX[torch.float8_e4m3fn], FP8_MAX[torch.float8_e5m2], 1, *halves)
    for _ in range(2):  # twice: the second call finds its table
        reference.delayed_scaling.delayed_scaling_update_many(expect, *args)
        fused(got, *args)
    assert any(key[0] == got[0][0].data_ptr() for key in _TABLES)
    for (seed, nonfinite), e_state, g_state in zip(states, expect, got):
        for name, e, o in zip(_PARTS, _parts(e_state), _parts(g_state)):
            assert _same(e, o.cpu()), f"{name} differs (seed {seed}, nonfinite {nonfinite})"
    moved = [not _same(_parts(e)[0], _parts(_state(16, s, "cpu", n))[0]) for (s, n), e in zip(states, expect)]
    assert any(moved) if halves[0] else not any(moved)  # the forward half moved the recorded ones only


@_on_gpu
@pytest.mark.parametrize("history_len,algo,margin", [(1, "most_recent", 0), (16, "max", 1), (1024, "max", 0)])
def test_eager_training_equals_the_in_graph_update(history_len, algo, margin):
    """The eager steps leave the same scales and histories as the same steps compiled by
    inductor: the update runs at autocast's exit and entry in both (one launch per GEMM), and the
    compiled graphs hold only the amax records, one launch each."""
    from torch._inductor.utils import run_and_get_code

    import transformer_engine_proto as te
    from transformer_engine_proto import recipe as R

    recipe = R.DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo, margin=margin)
    torch.manual_seed(0)
    eager = te.Linear(64, 64, device="cuda", params_dtype=torch.bfloat16)
    compiled = te.Linear(64, 64, device="cuda", params_dtype=torch.bfloat16)
    compiled.load_state_dict(eager.state_dict())
    run = torch.compile(compiled, backend="inductor", fullgraph=True)
    code = []

    def train_step(fn, x):
        with te.autocast(recipe=recipe):
            y = fn(x)
        y.float().square().sum().backward()

    for step in range(3):
        x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16) * (step + 1)
        train_step(eager, x)
        if step == 0:  # the compiled forward's and backward's code
            code += run_and_get_code(train_step, run, x)[1]
        else:
            train_step(run, x)
        assert torch.equal(eager.weight.grad, compiled.weight.grad), step
    # the update is not in the compiled graphs; the records are, each one launch on the whole buffers
    code = "\n".join(code)
    fold_last_grad_amaxes(recipe)
    assert "_delayed_update_kernel" not in code
    assert "_record_amax_kernel" in code and "_record_grad_amax_kernel" in code
    for name in ("fp8_scale", "amax_history", "grad_fp8_scale", "grad_amax_history"):
        assert torch.equal(getattr(eager.gemm, name), getattr(compiled.gemm, name)), name


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("cols", [slice(0, 2), slice(0, 1), slice(1, 2)])
def test_one_launch_amax_records_are_the_reference_bit_for_bit(device, cols):
    """Forward records (max into slot 0, inf/NaN counted and left out) and backward's gradient
    records (new generation after a fold, max within one), over finite, inf and NaN amaxes."""
    from transformer_engine_proto.kernels.triton.delayed_scaling import delayed_record_amax, delayed_record_grad_amax

    values = [0.0, 3.5, 1e-30, float("inf"), float("nan"), 7.25]
    for a in values:
        for b in values:
            state = _record_state()
            amax = torch.tensor([a, b])[: cols.stop - cols.start]
            scales = torch.tensor([4.0, 0.25, 8.0])
            expect, got = state.clone(), state.to(device)
            reference.delayed_scaling.delayed_record_amax(expect, amax, scales, cols.start)
            delayed_record_amax(got, amax.to(device), scales.to(device), cols.start)
            assert _same(expect, got.cpu()), (a, b, cols)
            assert expect[3].item() == 1  # `amax_recorded`: the next update moves the forward scales
            assert expect[:3].tolist() == [4.0, 0.25, 8.0]  # the scales given
            for gen, seen in ((0.0, 0.0), (1.0, 0.0), (1.0, 1.0)):
                handoff = torch.tensor([b, gen, seen])
                expect, got = handoff.clone(), handoff.to(device)
                reference.delayed_scaling.delayed_record_grad_amax(expect, torch.tensor([a]))
                delayed_record_grad_amax(got, torch.tensor([a], device=device))
                assert _same(expect, got.cpu()) and expect[2].item() == seen, (a, b, gen, seen)


def _record_state(device="cpu"):
    """A two-row state with history [[2, 0.5, 1], [9, 9, 9]] and counters [1, 0, 4]."""
    state = reference.delayed_scaling.new_state(2)
    views = reference.delayed_scaling.views(state, torch.zeros(3))
    views["amax_history"].copy_(torch.tensor([[2.0, 0.5], [9.0, 9.0]]))
    views["grad_amax_history"].copy_(torch.tensor([[1.0], [9.0]]))
    views["nonfinite_amax_count"].copy_(torch.tensor([1.0, 0.0, 4.0]))
    return state.to(device)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_on_gpu)])
def test_record_ops_are_functional_and_equal_the_in_place_records(device):
    """Traced, the records are functional graph ops (`te_proto::delayed_record_amax` /
    `_grad_amax`) whose outputs are copied back: they leave their inputs alone, return what the
    in-place record leaves (finite, inf and NaN amaxes, both column offsets), and pass opcheck."""
    import transformer_engine_proto.custom_ops.delayed_scaling  # noqa: F401  (registers the ops)
    from transformer_engine_proto.kernels import kernel

    ops = torch.ops.te_proto
    for first, amax in ((0, [3.5, float("nan")]), (1, [float("inf")]), (0, [1e-30, 7.25])):
        state = _record_state(device)
        amax = torch.tensor(amax, device=device)
        scales = torch.tensor([2.0, 3.0, 5.0], device=device)
        before = state.clone()
        got = ops.delayed_record_amax(state, amax, scales, first)
        assert torch.equal(state, before), "input written"
        kernel("delayed_record_amax", state.device)(state, amax, scales, first)
        assert _same(got, state), first
        torch.library.opcheck(ops.delayed_record_amax.default, (before, amax, scales, first))
    for handoff, amax in (([2.0, 0.0, 0.0], [5.0]), ([2.0, 1.0, 0.0], [1.0]), ([2.0, 1.0, 0.0], [3.0])):
        handoff, amax = (torch.tensor(v, device=device) for v in (handoff, amax))
        before = handoff.clone()
        got = ops.delayed_record_grad_amax(handoff, amax)
        assert torch.equal(handoff, before), "handoff written"
        kernel("delayed_record_grad_amax", handoff.device)(handoff, amax)
        assert torch.equal(got, handoff)
        torch.library.opcheck(ops.delayed_record_grad_amax.default, (before, amax))
