"""Inductor's swap of our Triton kernels' functional launches for the mutating launch, without a retrace.

After reinplacing, inductor's post-grad pass swaps each functional launch
(`triton_kernel_wrapper_functional`) for the mutating one, plus clones of the arguments it could
not reinplace, by retracing it with `make_fx`: about ten milliseconds a launch, and a Llama's
compile has a few hundred. `install_swap()` puts a direct swap in front of that pass for the
launches of this package's kernels whose clones are of contiguous tensors (a plain `aten.clone`);
the rest go to torch's pass. Nothing here imports Triton: the swap reads the graph only.
"""
from __future__ import annotations

import collections
import functools
import operator

import torch

PACKAGE = __name__.rsplit(".", 1)[0]  # transformer_engine_proto.kernels.triton


def python_fn(kernel):
    """The Python function under a Triton kernel object (Autotuner -> JITFunction -> function)."""
    fn = kernel
    while hasattr(fn, "fn"):
        fn = fn.fn
    return fn


def ours(fn) -> bool:
    """Whether the Python function `fn` (`python_fn` of a kernel) is one of this package's kernels."""
    return getattr(fn, "__module__", "").startswith(PACKAGE)


def _our_kernel_name(kernel_idx):
    """The kernel's name where it is one of this package's, else None."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        fn = python_fn(kernel_side_table.get_kernel(kernel_idx))
    except (AssertionError, KeyError):
        return None
    return fn.__name__ if ours(fn) else None


DIRECT_SWAPS = [0]  # launches swapped by `_swap_directly` in this process (tests read it)
# launches of our kernels left to torch's pass, by (kernel, arguments to clone)
LEFT_TO_TORCH = collections.Counter()


def _dense(value) -> bool:
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def _clone(graph, value):
    """A clone of a contiguous in-graph tensor (torch's `clone_preserve_strides` of it), with its
    fake value."""
    node = graph.call_function(torch.ops.aten.clone.default, (value,))
    val = value.meta["val"]
    with val.fake_mode:
        node.meta["val"] = val.clone()
    return node


def _swap_directly(torch_pass):
    """`torch_pass` (inductor's decomposition of functional Triton launches), after swapping each
    launch of our kernels for the mutating launch with the same arguments, the ones reinplacing
    could not reuse cloned first, as torch's pass does. Reinplacing keeps a clone where two
    launches write one buffer: the AOT graph's CSE merges equal constants such as every
    quantize's zeroed (1,) amax."""
    functional = torch.ops.higher_order.triton_kernel_wrapper_functional
    mutation = torch.ops.higher_order.triton_kernel_wrapper_mutation

    @functools.wraps(torch_pass)
    def run(graph):
        for node in list(graph.find_nodes(op="call_function", target=functional)):
            kwargs = dict(node.kwargs)
            clones = tuple(kwargs.pop("tensors_to_clone", None) or ())
            name = _our_kernel_name(kwargs.get("kernel_idx"))
            if name is None or node.args:
                continue
            launch_args = dict(kwargs["kwargs"])
            readers = list(node.users)
            if (not all(_dense(launch_args[c]) for c in clones)
                    or not all(u.target is operator.getitem and u.args[1] in clones for u in readers)):
                LEFT_TO_TORCH[(name, clones)] += 1
                continue
            with graph.inserting_before(node):
                launch_args.update({c: _clone(graph, launch_args[c]) for c in clones})
                swapped = graph.call_function(mutation, kwargs={**kwargs, "kwargs": launch_args})
            for reader in readers:  # the launch's result: the clone it wrote
                reader.replace_all_uses_with(launch_args[reader.args[1]])
                graph.erase_node(reader)
            # the meta torch's retrace leaves: the launch's value, its eager argument layouts
            swapped.meta.update({k: v for k, v in node.meta.items()
                                 if k not in ("eager_input_vals", "mutation_region_id")})
            eager = node.meta.get("eager_input_vals")
            if eager is not None:
                swapped.meta["eager_input_vals"] = ((), {k: v for k, v in eager[1].items() if k != "tensors_to_clone"})
            graph.erase_node(node)
            DIRECT_SWAPS[0] += 1
        return torch_pass(graph)

    run.te_proto_direct = True
    return run


def install_swap() -> None:
    """Put the direct swap in front of inductor's decomposition pass (idempotent; a torch without
    the pass is left as it is). Called when inductor first traces a library op: importing the
    post-grad passes takes seconds that an eager run should not pay."""
    from torch._inductor.fx_passes import post_grad

    decompose = getattr(post_grad, "decompose_triton_kernel_wrapper_functional", None)
    if decompose is not None and not getattr(decompose, "te_proto_direct", False):
        post_grad.decompose_triton_kernel_wrapper_functional = _swap_directly(decompose)
