"""te.GroupedLinear: every recipe equals a loop of per-expert te.Linear (same weights), empty
experts, list and tensor splits, one graph for any split of the same total under torch.compile
(a list: one recompile, at its first new split), wrong splits named under compile too."""
import copy

import pytest
import torch
from compile_cases import TORCH_VERSION
from linear_cases import RECIPE_IDS, RECIPES, fresh_dynamo, graph_breaks, recipe_ctx, unique_graphs

import transformer_engine_proto as te
from transformer_engine_proto.module.grouped_linear import grouped_mm_supported

N, K, OUT = 3, 32, 64
SPLITS = [[32, 0, 64], [61, 35, 0], [0, 96, 0]]  # empty experts; 61 / 35: partial MXFP8 / NVFP4 row blocks


@pytest.fixture
def capture_scalars():
    """Tensor splits under compile are read into the graph (unbacked sizes)."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        yield


def _pair(bias=True, dtype=torch.float32):
    torch.manual_seed(0)
    g = te.GroupedLinear(N, K, OUT, bias=bias, params_dtype=dtype)
    with torch.no_grad():
        for i in range(N):
            getattr(g, f"bias{i}").normal_() if bias else None
    refs = [te.Linear(K, OUT, bias=bias, params_dtype=dtype) for _ in range(N)]
    with torch.no_grad():
        for i, r in enumerate(refs):
            r.weight.copy_(getattr(g, f"weight{i}"))
            if bias:
                r.bias.copy_(getattr(g, f"bias{i}"))
    return g, refs


def _ref_loop(refs, x, splits):
    return torch.cat([r(p) for r, p in zip(refs, torch.split(x, splits))])


def _step(fn, x, dy):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


def _state(module_gemms):
    return [torch.cat([g.amax_history.flatten(), g.fp8_scale, g.grad_fp8_scale, g.grad_amax_history.flatten()])
            for g in module_gemms]


def _compiled_equals_eager(rid, dtype, splits_list, as_arg):
    """A GroupedLinear compiled with aot_eager and an eager twin, called with `as_arg(splits)` for
    each entry of `splits_list`: forward, dgrad and an expert's wgrad bitwise equal, no graph
    break. Returns the compiled module and its twin."""
    recipe = RECIPES[rid]
    g, _ = _pair(dtype=dtype)
    ge, _ = _pair(dtype=dtype)
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    torch.manual_seed(2)
    for splits in splits_list:
        x, dy = torch.randn(96, K, dtype=dtype), torch.randn(96, OUT, dtype=dtype)
        with recipe_ctx(recipe):
            y, dx = _step(lambda t, splits=splits: cg(t, as_arg(splits)), x, dy)
            y_e, dx_e = _step(lambda t, splits=splits: ge(t, as_arg(splits)), x, dy)
        assert torch.equal(y, y_e) and torch.equal(dx, dx_e)
        assert torch.equal(g.weight1.grad, ge.weight1.grad)
    assert graph_breaks() == 0
    return g, ge


@pytest.mark.parametrize("rid", RECIPE_IDS)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_matches_loop_of_linear(rid, as_tensor):
    """Forward, dgrad, wgrad, dbias (and delayed scaling's per-expert state) over three steps
    whose splits differ and leave experts empty: bitwise where the same kernels run (every
    recipe: the expert loop), within fp32 tolerance for high precision (torch._grouped_mm)."""
    recipe = RECIPES[rid]
    g, refs = _pair()
    torch.manual_seed(1)
    for splits in SPLITS:
        x, dy = torch.randn(96, K), torch.randn(96, OUT)
        m = torch.tensor(splits) if as_tensor else splits
        with recipe_ctx(recipe):
            y, dx = _step(lambda t, m=m: g(t, m), x, dy)
            y_ref, dx_ref = _step(lambda t, splits=splits: _ref_loop(refs, t, splits), x, dy)
        exact = recipe is not None or not grouped_mm_supported(x.device, x.dtype, K, OUT)
        check = (lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0)) if exact else torch.testing.assert_close
        check(y, y_ref)
        check(dx, dx_ref)
        for i, r in enumerate(refs):
            check(getattr(g, f"weight{i}").grad, r.weight.grad)
            check(getattr(g, f"bias{i}").grad, r.bias.grad)
    for a, b in zip(_state(g.gemms), _state([r.gemm for r in refs])):
        assert torch.equal(a, b)
    if rid == "delayed":  # the scales did move: the comparison above is not of untouched buffers
        assert not torch.equal(g.gemms[0].fp8_scale, torch.ones(2))


def test_high_precision_grouped_mm_matches_loop_of_linear():
    """bf16 high precision goes through torch._grouped_mm (on torch 2.13 CPU): forward and every
    grad equal a loop of te.Linear within bf16 rounding (the bias is added after the grouped GEMM,
    not inside it); use_grouped_tensor=False takes the expert loop."""
    assert grouped_mm_supported(torch.device("cpu"), torch.bfloat16, K, OUT)
    assert not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, 12, OUT)  # 24-byte rows
    assert not grouped_mm_supported(torch.device("cpu"), torch.float32, K, OUT)  # compile's meta: bf16 only
    g, refs = _pair(dtype=torch.bfloat16)
    calls = []
    real = torch._grouped_mm
    torch._grouped_mm = lambda *a, **k: calls.append(1) or real(*a, **k)
    x, dy = torch.randn(96, K, dtype=torch.bfloat16), torch.randn(96, OUT, dtype=torch.bfloat16)
    try:
        y, dx = _step(lambda t: g(t, torch.tensor([32, 0, 64])), x, dy)
    finally:
        torch._grouped_mm = real
    assert calls == [1]
    y_ref, dx_ref = _step(lambda t: _ref_loop(refs, t, [32, 0, 64]), x, dy)
    tol = dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    for i, r in enumerate(refs):
        torch.testing.assert_close(getattr(g, f"weight{i}").grad, r.weight.grad, **tol)
        torch.testing.assert_close(getattr(g, f"bias{i}").grad, r.bias.grad, **tol)
    assert torch.equal(g.weight1.grad, torch.zeros_like(g.weight1))  # the empty expert
    g.use_grouped_tensor = False
    torch.testing.assert_close(g(x, [32, 0, 64]), y, **tol)


def test_return_bias_and_state_dict_names():
    g = te.GroupedLinear(2, K, OUT, return_bias=True)
    assert set(dict(g.named_parameters())) == {"weight0", "weight1", "bias0", "bias1"}
    with torch.no_grad():
        g.bias0.fill_(1.0)
    x = torch.randn(8, K)
    out, biases = g(x, [3, 5])
    assert out.shape == (8, OUT) and len(biases) == 2 and biases[0] is g.bias0
    torch.testing.assert_close(out[:3], x[:3] @ g.weight0.T)  # the bias is returned, not added


@pytest.mark.parametrize("bad, msg", [([32, 32, 0], "sum to 64 but the input has 96"),
                                      ([96, 0], "must be 3 split sizes"),
                                      ([100, -4, 0], "negative size")])
@pytest.mark.parametrize("as_tensor", [False, True], ids=["list", "tensor"])
def test_wrong_splits_name_the_layer(bad, msg, as_tensor):
    g = te.GroupedLinear(N, K, OUT, name="experts_fc1")
    with pytest.raises(ValueError, match=f"experts_fc1: .*{msg}"):
        g(torch.randn(96, K), torch.tensor(bad) if as_tensor else bad)


@pytest.mark.parametrize("rid", ["mxfp8", "nvfp4"])
def test_any_split_for_block_formats(rid, capture_scalars):
    """Token counts that MXFP8's / NVFP4's row blocks do not divide (the Linear op pads them),
    eager and compiled (aot_eager, tensor splits): bitwise the loop of te.Linear."""
    g, refs = _pair()
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    for splits in ([40, 56, 0], [7, 0, 89]):
        x = torch.randn(96, K)
        with recipe_ctx(RECIPES[rid]):
            y_ref = _ref_loop(refs, x, splits)
            assert torch.equal(g(x, splits), y_ref)
            assert torch.equal(cg(x, torch.tensor(splits)), y_ref)
    assert graph_breaks() == 0 and unique_graphs() == 1


@pytest.mark.parametrize("rid, dtype", [("high_precision", torch.float32), ("high_precision", torch.bfloat16),
                                        ("delayed", torch.float32), ("mxfp8", torch.float32)],
                         ids=["hp-loop", "hp-grouped_mm", "delayed", "mxfp8"])
def test_compiled_tensor_splits_one_graph_no_recompile(rid, dtype, capture_scalars):
    """Two (three) different splits of the same total through one compiled graph: no recompile,
    no graph break, and the same numbers as eager (aot_eager: bitwise)."""
    g, ge = _compiled_equals_eager(rid, dtype, SPLITS, torch.tensor)
    assert unique_graphs() == 1
    for a, b in zip(_state(g.gemms), _state(ge.gemms)):
        assert torch.equal(a, b)


def test_compiled_list_splits_wrong_sum_is_the_same_error():
    g = te.GroupedLinear(N, K, OUT, name="experts_gate")
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    # torch 2.11's dynamo does not tell the list's constant ints from dynamic ones: no numbers
    detail = ("have a negative size or do not sum to" if TORCH_VERSION < (2, 13)
              else "sum to 64 but the input has 96 tokens")
    with pytest.raises(ValueError, match=f"experts_gate: GroupedLinear m_splits {detail}"):
        cg(torch.randn(96, K), [32, 32, 0])


_WRONG_SUM = ("experts_up: GroupedLinear m_splits sum to 92 but the input has 96 tokens \\(rows\\); "
              "splits \\[32, 0, 60\\]")


def test_compiled_tensor_splits_wrong_sum_raises(capture_scalars):
    """The sizes are data: the check runs in the graph, and its error carries the values."""
    g = te.GroupedLinear(N, K, OUT, name="experts_up")
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    with recipe_ctx(RECIPES["current"]):
        cg(torch.randn(96, K), torch.tensor([32, 64, 0]))
        for f in (g, cg):
            with pytest.raises(ValueError, match=_WRONG_SUM):
                f(torch.randn(96, K), torch.tensor([32, 0, 60]))


def test_compiled_dynamic_list_splits_wrong_sum_raises(capture_scalars):
    """A wrong list once dynamo made the list's ints dynamic: the same error as eager."""
    g = te.GroupedLinear(N, K, OUT, name="experts_up")
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    with recipe_ctx(RECIPES["current"]):
        for splits in SPLITS[:2]:
            cg(torch.randn(96, K), splits)
        for f in (g, cg):
            with pytest.raises(ValueError, match=_WRONG_SUM):
                f(torch.randn(96, K), [32, 0, 60])
    assert unique_graphs() == 2


def test_compiled_dynamic_list_splits_without_capture_scalar_outputs():
    """Without capture_scalar_outputs a list stays dynamo's ints; once they are dynamic (SymInts)
    a wrong split is still a ValueError naming the layer (the values cannot be formatted)."""
    g = te.GroupedLinear(N, K, OUT, name="experts_up")
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=False), recipe_ctx(RECIPES["current"]):
        for splits in SPLITS[:2]:
            cg(torch.randn(96, K), splits)
        with pytest.raises(ValueError, match="experts_up: GroupedLinear m_splits have a negative size or do not "
                                             "sum to the input's token count"):
            cg(torch.randn(96, K), [32, 0, 60])


def test_host_splits_op():
    torch.library.opcheck(torch.ops.te_proto.grouped_linear_host_splits, (torch.tensor([3, 0, 5]), 8, "experts"))
    with pytest.raises(ValueError, match="experts: GroupedLinear m_splits has a negative size: \\[9, -1\\]"):
        torch.ops.te_proto.grouped_linear_host_splits(torch.tensor([9, -1]), 8, "experts")


def test_compiled_tensor_splits_need_capture_scalar_outputs():
    g = te.GroupedLinear(N, K, OUT, name="experts_down")
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(capture_scalar_outputs=False), recipe_ctx(RECIPES["current"]):
        with pytest.raises(Exception, match="experts_down: .*capture_scalar_outputs = True"):
            cg(torch.randn(96, K), torch.tensor([32, 64, 0]))


@pytest.mark.parametrize("rid, dtype", [("high_precision", torch.bfloat16), ("delayed", torch.float32),
                                        ("nvfp4", torch.float32)], ids=["hp-grouped_mm", "delayed", "nvfp4"])
def test_compiled_list_splits_recompile_once(rid, dtype, capture_scalars):
    """TE's list of split sizes under compile: the first graph has the ints baked in, the first
    new split recompiles with them dynamic, and no later split recompiles. Forward and grads
    equal eager (aot_eager: bitwise)."""
    _compiled_equals_eager(rid, dtype, SPLITS + [[10, 20, 66]], lambda splits: splits)
    assert unique_graphs() == 2


def test_inductor_tensor_splits_current_scaling(capture_scalars):
    """One small inductor case: tensor splits, Float8CurrentScaling, two splits, one graph."""
    g, refs = _pair()
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True)
    for splits in SPLITS[:2]:
        x = torch.randn(96, K)
        with recipe_ctx(RECIPES["current"]):
            y = cg(x, torch.tensor(splits))
            y_ref = _ref_loop(refs, x, splits)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert graph_breaks() == 0 and unique_graphs() == 1


def test_inductor_list_splits_recompile_once(capture_scalars):
    """Three different lists of splits (same number of GEMMs), inductor: two graphs (the first
    with the ints baked in, then one with them dynamic), each output equal to eager."""
    g, _ = _pair()
    ge = copy.deepcopy(g)
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True)
    with torch.no_grad(), recipe_ctx(RECIPES["current"]):
        for splits in SPLITS + [[10, 20, 66]]:
            x = torch.randn(96, K)
            torch.testing.assert_close(cg(x, splits), ge(x, splits), rtol=1e-5, atol=1e-5)
    assert graph_breaks() == 0 and unique_graphs() == 2


@pytest.mark.parametrize("rid", ["current", "delayed"])
def test_inductor_tensor_splits_wrong_sum_names_the_layer(rid, capture_scalars):
    """Under inductor the graph asserts the unbacked sizes' sum first (`Eq(u0 + u1 + u2, 96)`)
    unless the layer's own check runs before the sizes are read."""
    g = te.GroupedLinear(N, K, OUT, name="experts_up")
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True)
    with torch.no_grad(), recipe_ctx(RECIPES[rid]):
        for f in (g, cg):
            with pytest.raises(ValueError, match=_WRONG_SUM):
                f(torch.randn(96, K), torch.tensor([32, 0, 60]))


@pytest.mark.slow
def test_inductor_nvfp4_tensor_splits(capture_scalars):
    """NVFP4 with tensor splits and an empty expert under inductor lowers (a torch 2.13 inductor
    reshape bug otherwise fails it: see grouped_linear._at_least_one_row) and equals eager; a
    second split reuses the graph. Forward only, with weights that need grads (so the input is
    quantized columnwise, through the RHT, for wgrad): the NVFP4 backward compile takes minutes."""
    g, _ = _pair()
    ge = copy.deepcopy(g)
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True)
    with recipe_ctx(RECIPES["nvfp4"]):
        for splits in ([32, 0, 64], [61, 35, 0]):
            x = torch.randn(96, K)
            torch.testing.assert_close(cg(x, torch.tensor(splits)), ge(x, torch.tensor(splits)), rtol=0, atol=0)
    assert graph_breaks() == 0 and unique_graphs() == 1


def _fused_pair(use_grouped_tensor, start):
    """A bf16 GroupedLinear with fuse_wgrad_accumulation and its loop of te.Linear (also fused),
    every weight's main_grad starting at `start` (fp32)."""
    torch.manual_seed(0)
    g = te.GroupedLinear(N, K, OUT, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True,
                         use_grouped_tensor=use_grouped_tensor, name="experts")
    refs = [te.Linear(K, OUT, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True) for _ in range(N)]
    with torch.no_grad():
        for i, r in enumerate(refs):
            r.weight.copy_(getattr(g, f"weight{i}"))
            r.bias.copy_(getattr(g, f"bias{i}").normal_())
    for w in g.weights + [r.weight for r in refs]:
        w.main_grad = start.clone()
    return g, refs


@pytest.mark.parametrize("use_grouped_tensor", [None, False], ids=["grouped_mm", "expert_loop"])
def test_fuse_wgrad_accumulation_adds_into_main_grad_like_linear(use_grouped_tensor):
    """Both paths add each expert's wgrad into its main_grad over steps and leave `.grad` None,
    as a loop of te.Linear(fuse_wgrad_accumulation=True) does: bitwise on the expert loop (the
    same GEMMs); on the grouped_mm path main_grad is the start plus the grouped GEMM's own bf16
    wgrads (what it gives as `.grad` without fusing), within bf16 rounding of Linear's fp32 wgrad."""
    if use_grouped_tensor is None and not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, K, OUT):
        pytest.skip("torch._grouped_mm does not run here")
    start = torch.randn(OUT, K)
    g, refs = _fused_pair(use_grouped_tensor, start)
    plain = copy.deepcopy(g)
    plain.fuse_wgrad_accumulation = False
    expected = [start.clone() for _ in range(N)]
    tol = dict(rtol=0, atol=0) if use_grouped_tensor is False else dict(rtol=2 ** -7, atol=1e-2)  # bf16 kernels
    torch.manual_seed(1)
    for splits in SPLITS[:2]:
        x, dy = torch.randn(96, K, dtype=torch.bfloat16), torch.randn(96, OUT, dtype=torch.bfloat16)
        y, dx = _step(lambda t, splits=splits: g(t, splits), x, dy)
        y_ref, dx_ref = _step(lambda t, splits=splits: _ref_loop(refs, t, splits), x, dy)
        _step(lambda t, splits=splits: plain(t, splits), x, dy)
        for i, w in enumerate(plain.weights):
            expected[i] += w.grad.float()
            w.grad = None
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(dx, dx_ref, **tol)
    for i, r in enumerate(refs):
        w = getattr(g, f"weight{i}")
        assert w.grad is None and r.weight.grad is None
        assert not torch.equal(w.main_grad, start)
        torch.testing.assert_close(getattr(g, f"bias{i}").grad, r.bias.grad, **tol)
        if use_grouped_tensor is False:
            assert torch.equal(w.main_grad, r.weight.main_grad)
        else:
            assert torch.equal(w.main_grad, expected[i])
            torch.testing.assert_close(w.main_grad, r.weight.main_grad, rtol=2 ** -7,
                                       atol=2 ** -7 * r.weight.main_grad.abs().max().item())


def test_fuse_wgrad_accumulation_grouped_mm_compiled_equals_eager():
    """The grouped_mm path's main_grad accumulation in one fullgraph graph, bitwise eager's."""
    if not grouped_mm_supported(torch.device("cpu"), torch.bfloat16, K, OUT):
        pytest.skip("torch._grouped_mm does not run here")
    start = torch.zeros(OUT, K)
    g, _ = _fused_pair(None, start)
    ge = copy.deepcopy(g)
    for a, b in zip(g.weights, ge.weights):
        a.main_grad, b.main_grad = start.clone(), start.clone()
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1)
    for splits in SPLITS[:2]:
        x, dy = torch.randn(96, K, dtype=torch.bfloat16), torch.randn(96, OUT, dtype=torch.bfloat16)
        _step(lambda t, splits=splits: cg(t, splits), x, dy)
        _step(lambda t, splits=splits: ge(t, splits), x, dy)
    for a, b in zip(g.weights, ge.weights):
        assert a.grad is None and torch.equal(a.main_grad, b.main_grad) and a.main_grad.abs().sum() > 0
    assert graph_breaks() == 0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_fuse_wgrad_accumulation_without_main_grad_names_the_weight(compiled):
    g = te.GroupedLinear(N, K, OUT, params_dtype=torch.bfloat16, fuse_wgrad_accumulation=True, name="experts")
    fresh_dynamo()
    fn = torch.compile(g, fullgraph=True, backend="aot_eager") if compiled else g
    with pytest.raises(RuntimeError, match="experts: fuse_wgrad_accumulation=True needs weight0.main_grad"):
        fn(torch.randn(96, K, dtype=torch.bfloat16), [32, 0, 64])


def test_unsupported_arguments_are_errors():
    with pytest.raises(TypeError, match="unsupported arguments \\['ub_overlap_ag'\\]"):
        te.GroupedLinear(2, K, OUT, ub_overlap_ag=True)
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.GroupedLinear(2, K, OUT, tp_size=2, parallel_mode="column")


# ---- GPU (qa/L1_gpu.sh): Triton quantize kernels, torch._grouped_mm on sm90, inductor with unbacked sizes ----
@pytest.mark.cuda
@pytest.mark.parametrize("rid", RECIPE_IDS)
def test_cuda_matches_loop_of_linear(rid):
    recipe = RECIPES[rid]
    torch.manual_seed(0)
    g = te.GroupedLinear(N, 128, 256, params_dtype=torch.bfloat16, device="cuda")
    refs = [te.Linear(128, 256, params_dtype=torch.bfloat16, device="cuda") for _ in range(N)]
    with torch.no_grad():
        for i, r in enumerate(refs):
            r.weight.copy_(getattr(g, f"weight{i}"))
            r.bias.copy_(getattr(g, f"bias{i}").normal_())
    for splits in ([128, 0, 256], [0, 384, 0], [96, 160, 128]):
        x = torch.randn(384, 128, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
        with recipe_ctx(recipe):
            y, dx = _step(lambda t, splits=splits: g(t, torch.tensor(splits, device="cuda")), x, dy)
            y_ref, dx_ref = _step(lambda t, splits=splits: _ref_loop(refs, t, splits), x, dy)
        tol = dict(rtol=2e-2, atol=2e-2) if recipe is None else dict(rtol=0, atol=0)
        torch.testing.assert_close(y, y_ref, **tol)
        torch.testing.assert_close(dx, dx_ref, **tol)
        for i, r in enumerate(refs):
            torch.testing.assert_close(getattr(g, f"weight{i}").grad, r.weight.grad, **tol)
            getattr(g, f"weight{i}").grad = None
            r.weight.grad = None


@pytest.mark.cuda
@pytest.mark.parametrize("rid", ["delayed", "current", "mxfp8"])
def test_cuda_tensor_splits_with_a_recipe_under_compile_is_refused_clearly(rid, capture_scalars):
    """The Triton quantize kernels check sizes at trace time, which unbacked expert sizes cannot
    answer: a clear error naming the layer and the way out, not a dynamo guard failure."""
    g = te.GroupedLinear(N, 128, 256, params_dtype=torch.bfloat16, device="cuda", name="experts")
    fresh_dynamo()
    x = torch.randn(384, 128, device="cuda", dtype=torch.bfloat16)
    with recipe_ctx(RECIPES[rid]):
        with pytest.raises(NotImplementedError, match="experts: .*pass m_splits as a list"):
            torch.compile(g, fullgraph=True)(x, torch.tensor([128, 0, 256], device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("rid", ["high_precision"])
def test_cuda_inductor_tensor_splits_one_graph(rid, capture_scalars):
    recipe = RECIPES[rid]
    torch.manual_seed(0)
    g = te.GroupedLinear(N, 128, 256, params_dtype=torch.bfloat16, device="cuda")
    ge = copy.deepcopy(g)
    fresh_dynamo()
    cg = torch.compile(g, fullgraph=True)
    for splits in ([128, 0, 256], [256, 128, 0], [0, 0, 384]):
        x = torch.randn(384, 128, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16)
        m = torch.tensor(splits, device="cuda")
        with recipe_ctx(recipe):
            y, dx = _step(lambda t, m=m: cg(t, m), x, dy)
            y_e, dx_e = _step(lambda t, m=m: ge(t, m), x, dy)
        torch.testing.assert_close(y, y_e, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dx, dx_e, rtol=2e-2, atol=2e-2)
    assert graph_breaks() == 0 and unique_graphs() == 1


@pytest.mark.parametrize("recipe_id", ["delayed", "current", "mxfp8", "nvfp4"])
def test_quantized_model_init_stores_each_expert_quantized(recipe_id):
    """Inside quantized_model_init every expert's weight is stored quantized, as te.Linear's is: the
    grouped layer gives the bits of a per-expert te.Linear loop sharing those stored weights,
    forward and backward; without a recipe they run dequantized, in high precision."""
    from transformer_engine_proto.tensor.quantized_tensor import QuantizedTensor

    recipe = RECIPES[recipe_id]
    torch.manual_seed(0)
    with te.quantized_model_init(recipe=recipe):
        g = te.GroupedLinear(N, K, OUT, bias=False, params_dtype=torch.bfloat16)
        refs = [te.Linear(K, OUT, bias=False, params_dtype=torch.bfloat16) for _ in range(N)]
    assert all(isinstance(w, QuantizedTensor) for w in g.weights)
    for i, r in enumerate(refs):
        r.weight = getattr(g, f"weight{i}")  # the same stored parameter
    splits = [32, 0, 64]
    x = torch.randn(sum(splits), K, dtype=torch.bfloat16)
    xg, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    with recipe_ctx(recipe):
        y = g(xg, splits)
        ref = torch.cat([r(xi) for r, xi in zip(refs, xr.split(splits))])
    assert torch.equal(y, ref)
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy)
    assert torch.equal(xg.grad, xr.grad)
    # without a recipe the stored weights are dequantized and the GEMMs run in high precision, as TE's
    y_hp = g(x, splits)
    ref_hp = torch.cat([xi.float() @ w.dequantize().float().T for xi, w in zip(x.split(splits), g.weights)])
    torch.testing.assert_close(y_hp.float(), ref_hp, rtol=1e-2, atol=1e-2)


def test_an_nd_input_splits_its_flattened_rows():
    """As TE: a [b, s, in] input is split along its b * s rows; the output is [b, s, out]."""
    g, refs = _pair()
    x = torch.randn(4, 6, K)
    splits = [10, 0, 14]
    out = g(x, splits)
    assert out.shape == (4, 6, OUT)
    assert torch.equal(out, g(x.reshape(-1, K), splits).view(4, 6, OUT))
    g.return_bias = True
    out, biases = g(x, splits)
    assert out.shape == (4, 6, OUT) and len(biases) == N
    with pytest.raises(ValueError, match="GroupedLinear takes an input"):
        g(torch.randn(K), [1, 0, 0])


def test_a_weight_stored_for_another_recipe_is_named():
    """A weight stored by quantized_model_init under one recipe, run under another: TE's words."""
    with te.quantized_model_init(recipe=RECIPES["mxfp8"]):
        g = te.GroupedLinear(N, K, OUT, params_dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="Recipe mismatch for the weight: it is stored quantized as a MXFP8Tensor"):
        with recipe_ctx(RECIPES["current"]):
            g(torch.randn(8, K, dtype=torch.bfloat16), [8, 0, 0])
