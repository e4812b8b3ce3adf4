"""kernels/triton/trace_analysis.py: torch's TTIR analysis of a Triton launch runs once per kernel
and specialization for this package's kernels, every time for others."""
import sys
import types

import pytest
import sympy
import torch

pytest.importorskip("triton")
from transformer_engine_proto.kernels.triton import trace_analysis  # noqa: E402


def _kernel(module):
    fn = types.FunctionType((lambda x_ptr, n, BLOCK: None).__code__, {}, "k")
    fn.__module__ = module
    params = [types.SimpleNamespace(name=n, is_constexpr=n == "BLOCK") for n in ("x_ptr", "n", "BLOCK")]
    return types.SimpleNamespace(fn=types.SimpleNamespace(fn=fn, params=params))  # Autotuner -> JITFunction -> fn


def test_memoized_per_specialization_for_our_kernels_only():
    calls = []

    def analysis(kernel, kwargs, tma):
        calls.append(dict(kwargs))
        return ["x_ptr"]

    memo = trace_analysis._memoized(analysis)
    ours, theirs = _kernel("transformer_engine_proto.kernels.triton.float8"), _kernel("user.kernels")
    x = torch.empty(4, dtype=torch.bfloat16)
    assert memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {}) == ["x_ptr"]
    memo(ours, {"x_ptr": x.clone(), "n": 8192, "BLOCK": 128}, {})  # same class of n (multiple of 16)
    memo(ours, {"x_ptr": x, "n": sympy.Integer(64), "BLOCK": 128}, {})  # inductor's size, same class
    assert len(calls) == 1
    memo(ours, {"x_ptr": x, "n": 4097, "BLOCK": 128}, {})  # n not a multiple of 16
    memo(ours, {"x_ptr": x.float(), "n": 4096, "BLOCK": 128}, {})  # another dtype
    memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 256}, {})  # another constexpr value (same int class)
    memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {"x_ptr": ("stable", ())})  # TMA: never cached
    assert len(calls) == 5
    memo(theirs, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {})
    memo(theirs, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {})
    assert len(calls) == 7
    result = memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {})
    result.append("mutated by the caller")
    assert memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {}) == ["x_ptr"]


def test_installed_over_torchs_analysis():
    from torch._higher_order_ops import triton_kernel_wrap
    names = [n for n in trace_analysis._ANALYSES if hasattr(triton_kernel_wrap, n)]
    assert names, "torch has neither analysis: trace_analysis needs updating"
    assert all(getattr(triton_kernel_wrap, n).te_proto_memoized for n in names)
    before = [getattr(triton_kernel_wrap, n) for n in names]
    trace_analysis.install()
    assert [getattr(triton_kernel_wrap, n) for n in names] == before  # idempotent
    assert "transformer_engine_proto.kernels.triton.trace_analysis" in sys.modules


def test_constexprs_read_from_the_jit_function():
    from transformer_engine_proto.kernels.triton import float8
    names = trace_analysis._constexprs(float8._cast_transpose_packed_kernel.fn)
    assert {"BM", "BK", "FMAX", "ROWWISE"} <= names and not names & {"x_ptr", "M", "K", "n_k"}


def test_direct_swap_installed_when_inductor_first_traces_a_library_op():
    from transformer_engine_proto import kernels

    with kernels.tracing_for_inductor():
        pass
    from torch._inductor.fx_passes import post_grad
    assert post_grad.decompose_triton_kernel_wrapper_functional.te_proto_direct
    before = post_grad.decompose_triton_kernel_wrapper_functional
    trace_analysis.install_swap()
    assert post_grad.decompose_triton_kernel_wrapper_functional is before  # idempotent


class _Launchable:
    """A kernel-side-table entry whose Python function lives in `module` (hashable, as the table needs)."""

    def __init__(self, module):
        self.fn = _kernel(module).fn


def _graph_with_launch(module, amax_val, readers=1):
    """x -> functional launch of a kernel in `module` writing a zeroed amax it must clone -> amax + 1."""
    import operator

    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = torch.fx.Graph()
    with FakeTensorMode():
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(8)
        amax = g.call_function(torch.ops.aten.full.default, ([1], 0), {"dtype": torch.int32})
        amax.meta["val"] = amax_val()
        launch = g.call_function(torch.ops.higher_order.triton_kernel_wrapper_functional, kwargs={
            "kernel_idx": kernel_side_table.add_kernel(_Launchable(module)), "constant_args_idx": 0,
            "grid": [(1, 1, 1)], "tma_descriptor_metadata": {}, "kwargs": {"x_ptr": x, "amax_ptr": amax},
            "tensors_to_clone": ["amax_ptr"]})
        launch.meta["val"] = {"amax_ptr": amax.meta["val"].clone()}
        outs = [g.call_function(torch.ops.aten.add.Tensor, (g.call_function(operator.getitem, (launch, "amax_ptr")), 1))
                for _ in range(readers)]
    g.output(outs)
    return g


def _launches(g, hop):
    return g.find_nodes(op="call_function", target=hop)


def test_direct_swap_clones_what_reinplacing_could_not_reuse():
    """A launch of ours that must clone a contiguous argument becomes clone + mutating launch, and
    its readers read the clone (torch's decomposition, without the retrace)."""
    hop = torch.ops.higher_order
    g = _graph_with_launch("transformer_engine_proto.kernels.triton.float8", lambda: torch.zeros(1, dtype=torch.int32),
                           readers=2)
    amax = g.find_nodes(op="call_function", target=torch.ops.aten.full.default)[0]
    passed, swaps = [], trace_analysis.DIRECT_SWAPS[0]
    trace_analysis._swap_directly(passed.append)(g)
    assert passed == [g] and trace_analysis.DIRECT_SWAPS[0] == swaps + 1
    assert not _launches(g, hop.triton_kernel_wrapper_functional)
    (mutating,) = _launches(g, hop.triton_kernel_wrapper_mutation)
    clone = mutating.kwargs["kwargs"]["amax_ptr"]
    assert clone.target is torch.ops.aten.clone.default and clone.args == (amax,)
    assert clone.meta["val"].shape == (1,) and clone.meta["val"].dtype is torch.int32
    assert mutating.kwargs["kwargs"]["x_ptr"].op == "placeholder" and "tensors_to_clone" not in mutating.kwargs
    adds = g.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor)
    assert [a.args[0] for a in adds] == [clone, clone]
    g.lint()


def test_direct_swap_leaves_strided_clones_and_other_kernels_to_torch():
    hop = torch.ops.higher_order
    strided = _graph_with_launch("transformer_engine_proto.kernels.triton.float8",
                                 lambda: torch.zeros(4, dtype=torch.int32)[::2])
    left = sum(trace_analysis.LEFT_TO_TORCH.values())
    trace_analysis._swap_directly(lambda graph: None)(strided)
    assert len(_launches(strided, hop.triton_kernel_wrapper_functional)) == 1
    assert sum(trace_analysis.LEFT_TO_TORCH.values()) == left + 1
    theirs = _graph_with_launch("user.kernels", lambda: torch.zeros(1, dtype=torch.int32))
    trace_analysis._swap_directly(lambda graph: None)(theirs)
    assert len(_launches(theirs, hop.triton_kernel_wrapper_functional)) == 1
    assert sum(trace_analysis.LEFT_TO_TORCH.values()) == left + 1  # not ours: not counted either


@pytest.mark.cuda
@pytest.mark.parametrize("rid", ["current", "delayed", "mxfp8"])
def test_launches_swapped_directly_compile_to_eagers_results(rid):
    """Under inductor our kernels' launches take the direct swap, and the compiled step gives
    eager's output and gradients (each from the same module state)."""
    import copy

    from compile_cases import assert_matches_eager, compile_for
    from linear_cases import RECIPES, fresh_dynamo, recipe_ctx

    import transformer_engine_proto as te

    fresh_dynamo()
    torch.manual_seed(0)
    eager = te.Linear(256, 512, params_dtype=torch.bfloat16, device="cuda")
    twin = copy.deepcopy(eager)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(128, 512, device="cuda", dtype=torch.bfloat16)
    swaps, left = trace_analysis.DIRECT_SWAPS[0], sum(trace_analysis.LEFT_TO_TORCH.values())
    outs = []
    for module, run in ((eager, eager), (twin, compile_for(twin, "inductor"))):
        xx = x.clone().requires_grad_()
        # no cached graph: the passes run
        with recipe_ctx(RECIPES[rid]), torch.compiler.config.patch(force_disable_caches=True):
            y = run(xx)
            y.backward(g)
        outs.append([y, xx.grad, module.weight.grad])
    assert trace_analysis.DIRECT_SWAPS[0] > swaps
    if rid in ("current", "delayed"):  # their only clones are zeroed (1,) amaxes
        assert sum(trace_analysis.LEFT_TO_TORCH.values()) == left, trace_analysis.LEFT_TO_TORCH
    for name, e, c in zip(("y", "x.grad", "w.grad"), *outs):
        assert_matches_eager(c, e, "inductor", name)
