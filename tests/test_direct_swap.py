"""kernels/triton/direct_swap.py: launches of our Triton kernels swapped for the mutating launch
without inductor's retrace (no Triton needed: the swap reads the graph only)."""
import types

import pytest
import torch

from transformer_engine_proto.kernels.triton import direct_swap


def test_direct_swap_installed_when_inductor_first_traces_a_library_op():
    pytest.importorskip("triton")  # the Triton backend registers the swap when it loads
    from transformer_engine_proto import kernels

    with kernels.tracing_for_inductor():
        pass
    from torch._inductor.fx_passes import post_grad
    assert post_grad.decompose_triton_kernel_wrapper_functional.te_proto_direct
    before = post_grad.decompose_triton_kernel_wrapper_functional
    direct_swap.install_swap()
    assert post_grad.decompose_triton_kernel_wrapper_functional is before  # idempotent


class _Launchable:
    """A kernel-side-table entry whose Python function lives in `module` (hashable, as the table needs)."""

    def __init__(self, module):
        self.fn = types.FunctionType((lambda x_ptr, amax_ptr: None).__code__, {}, "k")
        self.fn.__module__ = module


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
    passed, swaps = [], direct_swap.DIRECT_SWAPS[0]
    direct_swap._swap_directly(passed.append)(g)
    assert passed == [g] and direct_swap.DIRECT_SWAPS[0] == swaps + 1
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
    left = sum(direct_swap.LEFT_TO_TORCH.values())
    direct_swap._swap_directly(lambda graph: None)(strided)
    assert len(_launches(strided, hop.triton_kernel_wrapper_functional)) == 1
    assert sum(direct_swap.LEFT_TO_TORCH.values()) == left + 1
    theirs = _graph_with_launch("user.kernels", lambda: torch.zeros(1, dtype=torch.int32))
    direct_swap._swap_directly(lambda graph: None)(theirs)
    assert len(_launches(theirs, hop.triton_kernel_wrapper_functional)) == 1
    assert sum(direct_swap.LEFT_TO_TORCH.values()) == left + 1  # not ours: not counted either


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
    swaps, left = direct_swap.DIRECT_SWAPS[0], sum(direct_swap.LEFT_TO_TORCH.values())
    outs = []
    for module, run in ((eager, eager), (twin, compile_for(twin, "inductor"))):
        xx = x.clone().requires_grad_()
        # no cached graph: the passes run
        with recipe_ctx(RECIPES[rid]), torch.compiler.config.patch(force_disable_caches=True):
            y = run(xx)
            y.backward(g)
        outs.append([y, xx.grad, module.weight.grad])
    assert direct_swap.DIRECT_SWAPS[0] > swaps
    if rid in ("current", "delayed"):  # their only clones are zeroed (1,) amaxes
        assert sum(direct_swap.LEFT_TO_TORCH.values()) == left, direct_swap.LEFT_TO_TORCH
    for name, e, c in zip(("y", "x.grad", "w.grad"), *outs):
        assert_matches_eager(c, e, "inductor", name)
