"""GPU-only checks (run by qa/L1_gpu.sh): fast GEMM paths, compile parity and CUDA-graph training."""
import copy

import pytest
import torch
from torch._dynamo.utils import counters

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.block_scaled_gemm import native_layouts
from transformer_engine_proto.examples.train import Config, train
from transformer_engine_proto.gemm import emulated_gemm, gemm
from transformer_engine_proto.tensor import Float8BlockQuantizer, Float8CurrentScalingQuantizer

pytestmark = pytest.mark.cuda

RECIPES = [None, R.DelayedScaling(), R.Float8CurrentScaling(), R.MXFP8BlockScaling(), R.Float8BlockScaling(),
           R.NVFP4BlockScaling(disable_stochastic_rounding=True)]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("make", [
    lambda rw, cw: Float8CurrentScalingQuantizer(torch.float8_e4m3fn, rowwise_usage=rw, columnwise_usage=cw),
    lambda rw, cw: Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=1, rowwise_usage=rw,
                                        columnwise_usage=cw),
], ids=["tensorwise", "blockwise"])
@pytest.mark.parametrize("shape", [(256, 512, 384), (1024, 1024, 2048)])
def test_fast_gemm_matches_emulated(make, shape):
    m, k, n = shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    wq_maker = make if "Block" not in type(make(True, False)).__name__ else (
        lambda rw, cw: Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=2, rowwise_usage=rw,
                                            columnwise_usage=cw))
    cases = [  # (a, b, trans_a, trans_b): fprop, dgrad, wgrad
        (make(True, False)(x), wq_maker(True, False)(w), False, True),
        (make(True, False)(dy), wq_maker(False, True)(w), False, False),
        (make(False, True)(dy), make(False, True)(x), True, False),
    ]
    for a, b, ta, tb in cases:
        fast = gemm(a, b, out_dtype=torch.bfloat16, trans_a=ta, trans_b=tb)
        ref = emulated_gemm(a, b, out_dtype=torch.float32, trans_a=ta, trans_b=tb)
        assert fast.shape == ref.shape
        assert _rel(fast, ref) < 1e-2


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_linear_compiled_matches_eager_on_cuda(recipe):
    torch.manual_seed(0)
    m = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    mc = copy.deepcopy(m)
    torch._dynamo.reset()
    counters.clear()
    cm = torch.compile(mc, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        xc = x.detach().clone().requires_grad_()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y, yc = m(x), cm(xc)
        y.float().square().sum().backward()
        yc.float().square().sum().backward()
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(y, yc) and torch.equal(x.grad, xc.grad) and torch.equal(m.weight.grad, mc.weight.grad)


def _eager_and_graphed(recipe: str, mode: str, steps: int):
    """Losses of the example's model trained eagerly and then compiled with `mode` (fresh dynamo
    state); the compiled run must have no graph break and no cudagraph skip."""
    cfg = Config(hidden=256, ffn=1024, heads=4, layers=2, seq=128, batch=4, steps=steps, lr=1e-3)
    dev = torch.device("cuda")
    eager, _, _ = train(recipe, cfg, None, dev, torch.bfloat16, progress=False)
    torch._dynamo.reset()
    counters.clear()
    graphed, _, _ = train(recipe, cfg, mode, dev, torch.bfloat16, progress=False)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    return eager, graphed


@pytest.mark.parametrize("recipe", ["none", "delayed", "current", "blockwise", "mxfp8", "nvfp4"])
def test_reduce_overhead_training_has_no_cudagraph_skips(recipe):
    eager, compiled = _eager_and_graphed(recipe, "reduce-overhead", 20)
    assert len(compiled) == 20
    # inductor fuses the high-precision glue (residuals, softmax, losses) differently from eager,
    # so losses agree to bf16 rounding rather than bitwise
    for a, b in zip(compiled, eager):
        assert abs(a - b) <= 2e-2 * abs(b), (recipe, compiled, eager)


@pytest.mark.parametrize("recipe", ["current", "mxfp8"])
def test_gemm_policy_under_reduce_overhead(recipe):
    """te.GemmPolicy (the shipped H100 table) under reduce-overhead: no graph break, no cudagraph
    skip, the eager run's choices and (to bf16 rounding) its losses."""
    import os

    from transformer_engine_proto.precision import policy as P

    table = os.path.join(os.path.dirname(P.__file__), "tables", "h100.json")
    policy = te.GemmPolicy(table=table)
    cfg = Config(hidden=1024, ffn=4096, heads=8, layers=2, seq=512, batch=8, steps=10, lr=1e-3)
    dev = torch.device("cuda")

    def choices():  # this run's decisions only (earlier tests' GEMMs are in the registry too)
        made = sorted(sorted(d.high_precision) for d in P.decisions().values())
        P.decisions().clear()
        return made

    P.decisions().clear()
    eager, _, _ = train(recipe, cfg, None, dev, torch.bfloat16, progress=False, gemm_policy=policy)
    chosen = choices()
    torch._dynamo.reset()
    counters.clear()
    graphed, _, _ = train(recipe, cfg, "reduce-overhead", dev, torch.bfloat16, progress=False, gemm_policy=policy)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(chosen) == 9 and choices() == chosen
    for a, b in zip(graphed, eager):
        assert abs(a - b) <= 2e-2 * abs(b), (recipe, graphed, eager)


# Delayed scaling under the `cudagraphs` backend (eager kernels in CUDA-graph trees, no inductor),
# with dynamo's default inlining of nn.Modules: the backward's write of `grad_amax_pending` is lost
# from the first graphed step on (single-Linear state test: pending [amax, generation] =
# [2.04e-4, 1.0] vs eager [1.89e-4, 0.0] at step 1, H100, torch 2.11; the 2-layer model's losses
# drift after step 3). The cause is the backend: it marks as static only the inputs AOT lifted
# (`num_fw_fixed_arguments`), none when modules are inlined, so CUDA-graph trees replay on pool
# copies of the module buffers; the forward returns `grad_amax_pending` for the backward to
# write, i.e. the backward writes the copy. reduce-overhead passes the buffers as static inputs
# and is exact (tests below), and so is this backend with `inline_inbuilt_nn_modules=False`.
CUDAGRAPHS_BACKEND_DELAYED = pytest.mark.xfail(
    strict=True, reason="delayed scaling under backend='cudagraphs' with inlined nn.Modules: the "
    "backend treats module buffers as non-static, so the backward's grad_amax_pending write lands on "
    "a CUDA-graph pool copy (exact with inline_inbuilt_nn_modules=False, and under reduce-overhead)")


@pytest.mark.parametrize("recipe", [pytest.param("delayed", marks=CUDAGRAPHS_BACKEND_DELAYED),
                                    "current", "blockwise", "mxfp8", "nvfp4"])
def test_cuda_graph_training_is_bitwise_eager_over_50_steps(recipe):
    """CUDA-graph trees over eager's kernels (backend="cudagraphs"): 50 training steps give the
    eager losses bit for bit, with no graph break, no cudagraph skip and no recompile."""
    eager, graphed = _eager_and_graphed(recipe, "cudagraphs", 50)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # no recompile
    assert graphed == eager, (recipe, graphed, eager)


def _delayed_states(compile_kw, steps=8):
    """Per step, a single delayed-scaling Linear's state buffers, output and grads (x and g vary
    in scale, so the amaxes and scales move). Grads are read and then set to None every step, as
    an optimizer does: a grad left to accumulate across steps would be a CUDA-graph output of the
    previous step, which the next replay overwrites."""
    torch.manual_seed(0)
    m = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    run = m
    if compile_kw is not None:
        torch._dynamo.reset()
        run = torch.compile(m, fullgraph=True, **compile_kw)
    g = torch.Generator(device="cuda").manual_seed(1)
    recipe = R.DelayedScaling(amax_history_len=8)
    states = []
    for step in range(steps):
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g) * (1 + step % 3)
        dy = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g) * (1 + (step * 7) % 5)
        x.requires_grad_()
        if compile_kw is not None and compile_kw.get("mode") == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with te.autocast(recipe=recipe):
            y = run(x)
        y.backward(dy)
        state = {n: b.clone() for n, b in m.gemm.named_buffers()}
        state.update(y=y.detach().clone(), dx=x.grad.clone(), dw=m.weight.grad.clone(), db=m.bias.grad.clone())
        m.weight.grad = m.bias.grad = None
        states.append(state)
    return states


def _assert_states_equal(eager, graphed):
    for step, (a, b) in enumerate(zip(eager, graphed)):
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name, a[name].flatten()[:4], b[name].flatten()[:4])


@pytest.mark.parametrize("compile_kw", [dict(mode="reduce-overhead"),
                                        pytest.param(dict(backend="cudagraphs"), marks=CUDAGRAPHS_BACKEND_DELAYED)],
                         ids=["reduce-overhead", "cudagraphs"])
def test_delayed_scaling_state_under_cuda_graphs_is_eager(compile_kw):
    """The delayed-scaling handoff (grad amax pending -> next forward's history) survives CUDA-graph
    capture and replay: every buffer, the output and the grads equal eager's at every step (the
    Linear op is opaque, and the scale update's division is correctly rounded in any backend,
    `true_div`)."""
    eager, graphed = _delayed_states(None), _delayed_states(compile_kw)
    _assert_states_equal(eager, graphed)


def test_delayed_scaling_state_under_cudagraphs_backend_without_module_inlining():
    """The workaround for the xfail above: with nn.Modules not inlined, dynamo lifts the buffers,
    the `cudagraphs` backend marks them static, and every delayed-scaling buffer, the output and
    the grads equal eager's at every step."""
    eager = _delayed_states(None)
    with torch._dynamo.config.patch(inline_inbuilt_nn_modules=False):
        graphed = _delayed_states(dict(backend="cudagraphs"))
    _assert_states_equal(eager, graphed)


class _LinearStack(torch.nn.Module):
    """te.Linear layers and nothing else: no high-precision glue for inductor to fuse differently
    from eager, so a reduce-overhead run can be held to eager's bits."""

    def __init__(self, width=256, depth=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            te.Linear(width, width, params_dtype=torch.bfloat16, device="cuda") for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _linear_stack_losses(recipe_name, compile_kw, steps):
    from transformer_engine_proto.examples.train import RECIPES

    torch.manual_seed(0)
    model = _LinearStack()
    run = model if compile_kw is None else torch.compile(model, fullgraph=True, **compile_kw)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator(device="cuda").manual_seed(2)
    recipe = RECIPES[recipe_name]()
    losses = []
    for step in range(steps):
        x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16, generator=g) * (1 + step % 4)
        with te.autocast(recipe=recipe):
            y = run(x)
        loss = y.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["delayed", "current", "blockwise", "mxfp8", "nvfp4"])
def test_reduce_overhead_linear_stack_is_bitwise_eager_over_50_steps(recipe):
    """reduce-overhead (inductor + CUDA-graph trees) on a model of te.Linear only: 50 SGD steps give
    eager's losses bit for bit, with no graph break, no cudagraph skip and no recompile. NVFP4's
    stochastic rounding draws its random numbers from inductor's own generator unless
    `fallback_random` is set (then from eager's: the same bits); without it the losses differ
    from step 4 on."""
    eager = _linear_stack_losses(recipe, None, 50)
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(fallback_random=recipe == "nvfp4"):
        graphed = _linear_stack_losses(recipe, dict(mode="reduce-overhead"), 50)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert graphed == eager, (recipe, graphed, eager)


@pytest.mark.parametrize("rht", [False, True])
def test_nvfp4_wgrad_from_stored_columnwise_matches_inverse_path(rht):
    """The Hopper NVFP4 wgrad reads both columnwise buffers as stored (RHT not undone: the
    rotations cancel in the product); it must equal the dequantize-everything path to bf16
    rounding."""
    from transformer_engine_proto.gemm import _nvfp4_wgrad
    from transformer_engine_proto.tensor import NVFP4Quantizer

    torch.manual_seed(0)
    dy = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    q = NVFP4Quantizer(with_rht=rht, rht_seed=3, rowwise_usage=False, columnwise_usage=True)
    dy_q, x_q = q(dy), q(x)
    fast = _nvfp4_wgrad(dy_q, x_q, True, False, torch.float32, None)
    assert fast is not None and fast.shape == (384, 256)
    if native_layouts(dy.device) is None:  # Hopper: gemm takes this shortcut (Blackwell: native)
        assert torch.equal(gemm(dy_q, x_q, trans_a=True, out_dtype=torch.float32), fast)
    ref = emulated_gemm(dy_q, x_q, trans_a=True, out_dtype=torch.float32)
    assert _rel(fast, ref) < 1e-2


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_gemm_path_follows_the_device(fmt):
    """MXFP8/NVFP4 GEMMs run natively only where the tensor cores scale blocks (10.x: every
    layout, 12.x: "TN" only); Hopper emulates. Wherever a GEMM of fprop/dgrad/wgrad runs
    natively it must agree with the emulated product to bf16 rounding."""
    from transformer_engine_proto.block_scaled_gemm import block_scaled_mm
    from transformer_engine_proto.tensor import MXFP8Quantizer, NVFP4Quantizer

    major = torch.cuda.get_device_capability()[0]
    layouts = native_layouts(torch.device("cuda"))
    assert layouts == {10: "all", 12: "tn"}.get(major)
    torch.manual_seed(0)
    x, w, dy = (torch.randn(*s, device="cuda", dtype=torch.bfloat16) for s in ((512, 256), (384, 256), (512, 384)))
    if fmt == "mxfp8":
        qx = qw = MXFP8Quantizer()
    else:
        qx, qw = NVFP4Quantizer(with_rht=True, rht_seed=3), NVFP4Quantizer(with_2d_quantization=True)
    xq, wq, dyq = qx.quantize(x, internal=True), qw.quantize(w, internal=True), qx.quantize(dy, internal=True)
    cases = [(xq.only_usage(True), wq.only_usage(True), False, True),
             (dyq.only_usage(True), wq.only_usage(False), False, False),
             (dyq.only_usage(False), xq.only_usage(False), True, False)]
    for a, b, ta, tb in cases:
        native = None if layouts is None else block_scaled_mm(a, b, ta, tb, torch.bfloat16, None, layouts)
        got = gemm(a, b, out_dtype=torch.bfloat16, trans_a=ta, trans_b=tb)
        if native is not None:
            assert torch.equal(got, native)
        assert _rel(got, emulated_gemm(a, b, out_dtype=torch.float32, trans_a=ta, trans_b=tb)) < 1e-2


@pytest.mark.parametrize("recipe", RECIPES[1:], ids=lambda r: type(r).__name__)
def test_quantized_model_init_under_inductor_and_reduce_overhead(recipe):
    """Weights stored quantized (`quantized_model_init`) through inductor and CUDA graphs: the
    compiled steps match eager's losses."""
    torch._dynamo.reset()  # the recipes before this one compiled the same forwards (recompile limit)
    torch.manual_seed(0)
    with te.quantized_model_init(enabled=True, recipe=recipe):
        model = torch.nn.Sequential(te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda"),
                                    te.LayerNormMLP(256, 512, params_dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(128, 256, dtype=torch.bfloat16, device="cuda")
    losses = {}
    for mode in ("eager", "default", "reduce-overhead"):
        m = copy.deepcopy(model)
        run = m if mode == "eager" else torch.compile(m, fullgraph=True, mode=mode)
        with te.autocast(recipe=recipe):
            losses[mode] = [run(x).float().pow(2).mean().item() for _ in range(3)]
    for mode in ("default", "reduce-overhead"):
        assert losses[mode] == pytest.approx(losses["eager"], rel=1e-2), (mode, losses)


class _LlamaMoEBlock(torch.nn.Module):
    """The new modules in one small model: a Llama TransformerLayer (GQA, RMSNorm, SwiGLU, RoPE)
    and a GroupedLinear over fixed expert splits."""

    def __init__(self):
        super().__init__()
        kw = dict(params_dtype=torch.bfloat16, device="cuda")
        self.layer = te.TransformerLayer(256, 512, 8, num_gqa_groups=2, normalization="RMSNorm",
                                         activation="swiglu", bias=False, hidden_dropout=0.0,
                                         attention_dropout=0.0, **kw)
        self.experts = te.GroupedLinear(4, 256, 256, **kw)
        self.rope = te.RotaryPositionEmbedding(32)(128).to("cuda")

    def forward(self, x):
        h = self.layer(x, rotary_pos_emb=self.rope)  # [s, b, h]
        return self.experts(h.reshape(-1, 256), [64, 0, 128, 64])


@pytest.mark.parametrize("recipe", RECIPES[1:], ids=lambda r: type(r).__name__)
def test_new_modules_train_under_reduce_overhead(recipe):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _LlamaMoEBlock()
    x = torch.randn(128, 2, 256, dtype=torch.bfloat16, device="cuda")
    losses = {}
    for mode in ("eager", "reduce-overhead"):
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=1e-2)
        run = m if mode == "eager" else torch.compile(m, fullgraph=True, mode=mode)
        out = []
        for _ in range(4):
            if mode != "eager":
                torch.compiler.cudagraph_mark_step_begin()
            with te.autocast(recipe=recipe):
                loss = run(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        losses[mode] = out
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert losses["reduce-overhead"] == pytest.approx(losses["eager"], rel=2e-2), losses
