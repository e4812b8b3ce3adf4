"""Inductor's per-launch work on our Triton kernels, done once per specialization or without a retrace.

When torch traces a `wrap_triton` launch (inductor inlining a library op), it asks which tensor
arguments the kernel reads and writes: `identify_mutated_tensors` (torch 2.11) or
`identify_accessed_tensors` (newer) generate the kernel's TTIR and walk it. Torch does that at
every call site, at least twice (functionalization, then lowering); a Llama's compile traces a
few hundred quantize launches, each a Triton front-end compile. The answer depends only on the
kernel and on what Triton specializes on: which arguments are tensors (and their dtypes), the
constexpr values, and each int's class (1, a multiple of 16, its width). `install()` memoizes
the analysis by that key for the kernels of this package; other kernels go to torch's function
unchanged, as do launches with TMA descriptors.

After reinplacing, inductor's post-grad pass swaps each functional launch for the mutating one
(plus clones of the arguments it could not reinplace) by retracing it with `make_fx`, about ten
milliseconds a launch. `install_swap()` puts a direct swap in front of that pass for launches of
our kernels whose clones are of contiguous tensors (a plain `aten.clone`); the rest go to torch's
pass.
"""
from __future__ import annotations

import collections
import functools
import operator

import sympy
import torch

from .launch import _arg_class

_ANALYSES = ("identify_mutated_tensors", "identify_accessed_tensors")
_PACKAGE = __name__.rsplit(".", 1)[0]  # transformer_engine_proto.kernels.triton


def _python_fn(kernel):
    fn = kernel
    while hasattr(fn, "fn"):  # Autotuner -> JITFunction -> the Python function
        fn = fn.fn
    return fn


def _constexprs(kernel):
    """The kernel's constexpr parameter names, or None where the JITFunction does not say."""
    jit = kernel
    while not hasattr(jit, "params") and hasattr(jit, "fn"):
        jit = jit.fn
    params = getattr(jit, "params", None)
    if params is None:
        return None
    return frozenset(p.name for p in params if getattr(p, "is_constexpr", False))


def _spec(value, constexpr: bool):
    """What Triton's TTIR of a launch depends on, for one argument: a constexpr's value, a runtime
    argument's class."""
    if constexpr:
        return "constexpr", (int(value) if isinstance(value, sympy.Integer) else value)
    if isinstance(value, torch.Tensor):
        return "tensor", value.dtype
    get_dtype = getattr(value, "get_dtype", None)  # inductor's IR buffers (TensorBox, ...)
    if get_dtype is not None:
        return "tensor", get_dtype()
    if isinstance(value, sympy.Expr):  # inductor's sizes
        return _spec(int(value), False) if value.is_Integer else ("symint",)
    if isinstance(value, torch.SymInt):
        return ("symint",)
    return _arg_class(value)  # what the launcher keys a compiled kernel on (TypeError: unclassified)


def _memoized(analysis):
    cache = {}

    @functools.wraps(analysis)
    def run(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        fn = _python_fn(kernel)
        constexprs = _constexprs(kernel)
        if (tma_descriptor_metadata or args or kw or constexprs is None
                or not getattr(fn, "__module__", "").startswith(_PACKAGE)):
            return analysis(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        try:
            key = (fn, tuple(sorted((name, _spec(v, name in constexprs)) for name, v in kwargs.items())))
        except TypeError:  # an argument kind we do not classify: torch's own analysis
            return analysis(kernel, kwargs, tma_descriptor_metadata)
        if key not in cache:
            cache[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
        found = cache[key]
        return list(found) if isinstance(found, list) else found

    run.te_proto_memoized = True
    run.cache = cache
    return run


def _our_kernel_name(kernel_idx):
    """The kernel's name where it is one of this package's, else None."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    try:
        fn = _python_fn(kernel_side_table.get_kernel(kernel_idx))
    except (AssertionError, KeyError):
        return None
    return fn.__name__ if getattr(fn, "__module__", "").startswith(_PACKAGE) else None


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


def install() -> None:
    """Memoize torch's TTIR analysis for this package's kernels (idempotent; a torch without the
    function is left as it is)."""
    from torch._higher_order_ops import triton_kernel_wrap

    for name in _ANALYSES:
        analysis = getattr(triton_kernel_wrap, name, None)
        if analysis is not None and not getattr(analysis, "te_proto_memoized", False):
            setattr(triton_kernel_wrap, name, _memoized(analysis))


def install_swap() -> None:
    """Put the direct swap in front of inductor's decomposition pass (idempotent; a torch without
    the pass is left as it is). Called when inductor first traces a library op: importing the
    post-grad passes takes seconds that an eager run should not pay."""
    from torch._inductor.fx_passes import post_grad

    decompose = getattr(post_grad, "decompose_triton_kernel_wrapper_functional", None)
    if decompose is not None and not getattr(decompose, "te_proto_direct", False):
        post_grad.decompose_triton_kernel_wrapper_functional = _swap_directly(decompose)
