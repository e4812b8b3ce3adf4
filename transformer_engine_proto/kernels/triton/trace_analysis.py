"""Torch's per-launch analyses of our Triton kernels, done once per kernel (and specialization).

When torch traces a `wrap_triton` launch (inductor inlining a library op), it asks which tensor
arguments the kernel reads and writes: `identify_mutated_tensors` (torch 2.11) or
`identify_accessed_tensors` (newer) generate the kernel's TTIR and walk it. Torch does that at
every call site, at least twice (functionalization, then lowering); a Llama's compile traces a
few hundred quantize launches, each a Triton front-end compile. The answer depends only on the
kernel and on what Triton specializes on: which arguments are tensors (and their dtypes), the
constexpr values, and each int's class (1, a multiple of 16, its width). `install()` memoizes
the analysis by that key for the kernels of this package; other kernels go to torch's function
unchanged, as do launches with TMA descriptors.

Inductor also collects each launched kernel's source with every helper and global it reads
(`user_defined_triton_kernel_transitive_closure_source_code`, disassembling each function): for
the FX graph cache key and again for the generated code, at every launch in the graph. Our
kernels' sources and globals are fixed for the process, so `install_closure()` (called when
inductor first traces a library op: importing inductor's code generator takes seconds an eager run
should not pay) memoizes it per kernel.

Inductor's later per-launch work, the swap to the mutating launch, is `direct_swap.py`'s.
"""
from __future__ import annotations

import functools

import sympy
import torch

from .direct_swap import ours, python_fn
from .launch import _arg_class

_ANALYSES = ("identify_mutated_tensors", "identify_accessed_tensors")


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
        fn = python_fn(kernel)
        constexprs = _constexprs(kernel)
        if tma_descriptor_metadata or args or kw or constexprs is None or not ours(fn):
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


def _memoize_in(module, name: str, memoized) -> None:
    """`module.name` replaced by `memoized(it)`, once (a torch without the function keeps none)."""
    fn = getattr(module, name, None)
    if fn is not None and not getattr(fn, "te_proto_memoized", False):
        setattr(module, name, memoized(fn))


def install() -> None:
    """Memoize torch's TTIR analysis for this package's kernels (idempotent)."""
    from torch._higher_order_ops import triton_kernel_wrap

    for name in _ANALYSES:
        _memoize_in(triton_kernel_wrap, name, _memoized)


def _memoized_closure(closure):
    cache = {}  # id(kernel) -> (kernel, source): the kernel kept alive so its id stays its own

    @functools.wraps(closure)
    def run(kernel, *args, **kw):
        if any(a is not None for a in (*args, *kw.values())) or not ours(python_fn(kernel)):
            return closure(kernel, *args, **kw)  # an epilogue fused into the kernel, or not ours
        found = cache.get(id(kernel))
        if found is None:
            found = cache[id(kernel)] = (kernel, closure(kernel))
        return found[1]

    run.te_proto_memoized = True
    run.cache = cache
    return run


def install_closure() -> None:
    """Memoize inductor's source closure for this package's kernels (idempotent)."""
    from torch._inductor.codegen import wrapper

    _memoize_in(wrapper, "user_defined_triton_kernel_transitive_closure_source_code", _memoized_closure)
