"""Eager Linear programs (custom_ops/eager_program.py): a served call makes the op's kernel calls,
so training with programs equals training with the op bit for bit (outputs, gradients, parameters,
main_grad, delayed-scaling state); calls no program serves take the op.

On CUDA the two are compared as they run. On CPU the op emulates its GEMMs in float32 where a
program calls `torch._scaled_mm`; the CPU cases give the op the CUDA path's per-tensor FP8 GEMM
(`gemm._tensorwise`, which CPU torch has) and allow programs on CPU, so the comparison is bitwise
there too and checks the programs' wiring in CI."""
import pytest
import torch
from linear_cases import fold_last_grad_amaxes

import transformer_engine_proto as te
from transformer_engine_proto import gemm as G
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops import eager_program
from transformer_engine_proto.custom_ops import linear as linear_ops
from transformer_engine_proto.tensor.storage import QuantizedTensorStorage

RECIPES = {
    "current": R.Float8CurrentScaling(),
    "current-pow2-eps": R.Float8CurrentScaling(fp8_quant_fwd_inp=R.QParams(power_2_scale=True, amax_epsilon=1e-3)),
    "current-hybrid-fast-accum": R.Float8CurrentScaling(fp8_format=R.Format.HYBRID,
                                                        fp8_gemm_fprop=R.MMParams(use_split_accumulator=False)),
    "delayed": R.DelayedScaling(),
    "delayed-most-recent-margin": R.DelayedScaling(margin=1, amax_history_len=4, amax_compute_algo="most_recent"),
    "delayed-e4m3": R.DelayedScaling(fp8_format=R.Format.E4M3, amax_history_len=16),
}


class _QKV(torch.nn.Module):
    """Three Linears reading one tensor (the op shares its quantized copy), then one more: one
    call signature, so 3 steps make 11 program calls."""

    calls = 3 * 4 - 1

    def __init__(self, d, device, bias):
        super().__init__()
        kw = dict(bias=bias, params_dtype=torch.bfloat16, device=device)
        self.q, self.k, self.v = (te.Linear(d, d, **kw) for _ in range(3))
        self.out = te.Linear(d, d, **kw)

    def forward(self, x):
        return self.out(self.q(x) * self.k(x) + self.v(x))


class _NormThenMainGrad(torch.nn.Module):
    """A LayerNormLinear (current scaling: its input quantized by the norm kernel) and a Linear
    accumulating its wgrad into `main_grad` (Megatron-LM's fuse_wgrad_accumulation): two
    signatures, so 3 steps make 4 program calls."""

    calls = 3 * 2 - 2

    def __init__(self, d, device, bias):
        super().__init__()
        kw = dict(bias=bias, params_dtype=torch.bfloat16, device=device)
        self.norm_fc = te.LayerNormLinear(d, d, normalization="RMSNorm", **kw)
        self.fc = te.Linear(d, d, fuse_wgrad_accumulation=True, **kw)
        self.fc.weight.main_grad = torch.zeros_like(self.fc.weight, dtype=torch.float32)

    def forward(self, x):
        return self.fc(torch.nn.functional.silu(self.norm_fc(x)))


MODELS = {"qkv": _QKV, "norm-main-grad": _NormThenMainGrad}


def _train(model, recipe, x, dy, programs: bool, steps=3):
    eager_program.set_enabled(programs)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    outs = []
    try:
        for _ in range(steps):
            x_ = x.clone().requires_grad_()
            with te.autocast(recipe=recipe):
                y = model(x_)
            y.backward(dy)
            outs += [y.detach(), x_.grad]
            opt.step()
            opt.zero_grad()
        fold_last_grad_amaxes(recipe)
    finally:
        eager_program.set_enabled(True)
    outs += [p.main_grad for p in model.parameters() if hasattr(p, "main_grad")]
    return outs, {k: v.clone() for k, v in model.state_dict().items()}, _delayed_state(model)


def _delayed_state(model):
    """Each GEMM's delayed-scaling scales and histories (left as they are by current scaling)."""
    return [(g.fp8_scale.clone(), g.amax_history.clone(), g.grad_fp8_scale.clone(), g.grad_amax_history.clone())
            for m in model.modules() if isinstance(m, te.Linear) for g, _ in m.gemm_weights()
            if "delayed_state" in g._buffers]


def _compare(model_id, recipe_id, device, bias):
    recipe, make = RECIPES[recipe_id], MODELS[model_id]
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    dy = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    runs = []
    for programs in (True, False):
        torch.manual_seed(0)  # the same initial weights in both runs
        calls = eager_program.stats["calls"]
        runs.append(_train(make(64, device, bias), recipe, x, dy, programs))
        assert eager_program.stats["calls"] - calls == (make.calls if programs else 0)
    (fast, fast_state, fast_delayed), (slow, slow_state, slow_delayed) = runs
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)
    assert fast_state.keys() == slow_state.keys()
    for k in fast_state:
        if isinstance(fast_state[k], torch.Tensor) and fast_state[k].is_floating_point():
            assert torch.equal(fast_state[k], slow_state[k]), k
    assert len(fast_delayed) == len(slow_delayed) > 0
    for a, b in zip(fast_delayed, slow_delayed):
        for ta, tb in zip(a, b):
            assert torch.equal(ta, tb)


def cuda_path_gemm(a, b, *, out_dtype, trans_a=False, trans_b=False, bias=None, use_split_accumulator=True, **kw):
    """`gemm.gemm` with two per-tensor FP8 operands on the CUDA path's `torch._scaled_mm` call on
    any device (CPU torch has it); everything else as `gemm.gemm`."""
    if isinstance(a, QuantizedTensorStorage) and a.gemm_native() == "tensorwise" \
            and isinstance(b, QuantizedTensorStorage) and b.gemm_native() == "tensorwise":
        out = G._tensorwise(a, b, trans_a, trans_b, out_dtype, bias, not use_split_accumulator)
        if out is not None:
            return out
    return G.gemm(a, b, out_dtype=out_dtype, trans_a=trans_a, trans_b=trans_b, bias=bias,
                  use_split_accumulator=use_split_accumulator, **kw)


@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """Programs allowed on CPU, and the op's per-tensor FP8 GEMMs on the CUDA path's
    `torch._scaled_mm` call, so both compute what they compute on CUDA."""
    monkeypatch.setattr(eager_program, "SERVED_DEVICES", {"cpu"})
    monkeypatch.setattr(linear_ops, "gemm", cuda_path_gemm)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("recipe_id", list(RECIPES))
@pytest.mark.parametrize("model_id", list(MODELS))
def test_programs_train_as_the_op_does_cpu(model_id, recipe_id, bias, cpu_as_cuda):
    _compare(model_id, recipe_id, "cpu", bias)


@pytest.mark.cuda
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("recipe_id", list(RECIPES))
@pytest.mark.parametrize("model_id", list(MODELS))
def test_programs_train_as_the_op_does_cuda(model_id, recipe_id, bias):
    _compare(model_id, recipe_id, "cuda", bias)


VARIANTS = ["frozen-input", "frozen-weight", "frozen-bias", "only-bias-trains", "2d-input", "no-grad",
            "torch-autocast-fp32-params"]


def _variant_run(variant, recipe, device, programs: bool):
    """Three steps of one Linear in a call variant; what they produce (outputs, gradients, state)."""
    eager_program.set_enabled(programs)
    torch.manual_seed(0)
    fp32 = variant == "torch-autocast-fp32-params"
    lin = te.Linear(64, 32, bias=True, params_dtype=torch.float32 if fp32 else torch.bfloat16, device=device)
    if variant in ("frozen-weight", "only-bias-trains"):
        lin.weight.requires_grad_(False)
    if variant == "frozen-bias":
        lin.bias.requires_grad_(False)
    shape = (32, 64) if variant == "2d-input" else (2, 16, 64)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    out = []
    try:
        for _ in range(3):
            x_ = x.clone().requires_grad_(variant not in ("frozen-input", "only-bias-trains", "no-grad"))
            with te.autocast(recipe=recipe), torch.set_grad_enabled(variant != "no-grad"), \
                    torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=fp32):
                y = lin(x_)
            out.append(y.detach())
            if y.requires_grad:
                y.float().square().sum().backward()
                out += [t.grad for t in (x_, lin.weight, lin.bias) if t.grad is not None]
                lin.zero_grad()
        fold_last_grad_amaxes(recipe)
    finally:
        eager_program.set_enabled(True)
    return out + [t.clone() for t in lin.state_dict().values() if isinstance(t, torch.Tensor)] + \
        [t.clone() for g, _ in lin.gemm_weights() for t in g._buffers.values()]


def _compare_variant(variant, recipe_id, device):
    recipe = RECIPES[recipe_id]
    calls = eager_program.stats["calls"]
    fast = _variant_run(variant, recipe, device, True)
    assert eager_program.stats["calls"] - calls == 2  # steps 2 and 3
    slow = _variant_run(variant, recipe, device, False)
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("recipe_id", ["current", "delayed"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_programs_follow_every_call_variant_cpu(variant, recipe_id, cpu_as_cuda):
    _compare_variant(variant, recipe_id, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_id", ["current", "delayed"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_programs_follow_every_call_variant_cuda(variant, recipe_id):
    _compare_variant(variant, recipe_id, "cuda")


TOKEN_COUNTS = (32, 48, 64, 40, 16, 32)  # 40: not a multiple of 16, the op's


def _token_count_run(recipe, device, programs: bool):
    eager_program.set_enabled(programs)
    torch.manual_seed(0)
    lin = te.Linear(64, 32, params_dtype=torch.bfloat16, device=device)
    out = []
    try:
        for i, m in enumerate(TOKEN_COUNTS):
            x = torch.randn(m, 64, generator=torch.Generator().manual_seed(i)).to(device, torch.bfloat16)
            x.requires_grad_()
            with te.autocast(recipe=recipe):
                y = lin(x)
            y.float().square().sum().backward()
            out += [y.detach(), x.grad, lin.weight.grad.clone(), lin.bias.grad.clone()]
        fold_last_grad_amaxes(recipe)
    finally:
        eager_program.set_enabled(True)
    return out + [t.clone() for g, _ in lin.gemm_weights() for t in g._buffers.values()]


def _compare_token_counts(recipe_id, device):
    calls = eager_program.stats["calls"]
    fast = _token_count_run(RECIPES[recipe_id], device, True)
    assert eager_program.stats["calls"] - calls == 4  # all but the first call and the 40 tokens
    slow = _token_count_run(RECIPES[recipe_id], device, False)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_id", ["current", "delayed"])
def test_one_program_serves_every_token_count_cpu(recipe_id, cpu_as_cuda):
    """A varying batch (or an MoE expert's split) reuses one program: the token count is not
    part of a program's signature."""
    _compare_token_counts(recipe_id, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_id", ["current", "delayed"])
def test_one_program_serves_every_token_count_cuda(recipe_id):
    _compare_token_counts(recipe_id, "cuda")


def test_first_call_of_a_signature_runs_the_op(monkeypatch):
    """A signature's first call runs the op (its input checks, once per signature); programs
    serve the later calls."""
    monkeypatch.setattr(eager_program, "SERVED_DEVICES", {"cpu"})
    eager_program.set_enabled(True)
    lin = te.Linear(32, 32, params_dtype=torch.bfloat16)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    calls = eager_program.stats["calls"]
    for expected, node in ((0, "Eager_linear_fwdBackward"), (1, "EagerLinearProgramBackward"),
                           (2, "EagerLinearProgramBackward")):
        with te.autocast(recipe=R.Float8CurrentScaling()):
            y = lin(x)
        assert type(y.grad_fn).__name__ == node
        y.sum().backward()
        assert eager_program.stats["calls"] - calls == expected


@pytest.mark.parametrize("case", ["served", "rows-not-16", "blockwise", "save-original-input",
                                  "out-features-8"])
def test_calls_no_program_serves_take_the_op(case, monkeypatch):
    monkeypatch.setattr(eager_program, "SERVED_DEVICES", {"cpu"})
    eager_program.set_enabled(True)
    recipe, rows, kw, out_features = R.Float8CurrentScaling(), 16, {}, 32
    if case == "rows-not-16":
        rows = 24
    elif case == "blockwise":
        recipe = R.Float8BlockScaling()
    elif case == "save-original-input":
        kw = {"save_original_input": True}
    elif case == "out-features-8":
        out_features = 8
    lin = te.Linear(32, out_features, params_dtype=torch.bfloat16, **kw)
    x = torch.randn(rows, 32, dtype=torch.bfloat16, requires_grad=True)
    calls = eager_program.stats["calls"]
    for _ in range(3):
        with te.autocast(recipe=recipe):
            lin(x).sum().backward()
    assert eager_program.stats["calls"] - calls == (2 if case == "served" else 0)


def test_switching_programs_off_sends_every_call_to_the_op(monkeypatch):
    monkeypatch.setattr(eager_program, "SERVED_DEVICES", {"cpu"})
    eager_program.set_enabled(False)
    try:
        lin = te.Linear(32, 32, params_dtype=torch.bfloat16)
        x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
        calls = eager_program.stats["calls"]
        for _ in range(3):
            with te.autocast(recipe=R.Float8CurrentScaling()):
                lin(x).sum().backward()
        assert eager_program.stats["calls"] == calls
    finally:
        eager_program.set_enabled(True)
