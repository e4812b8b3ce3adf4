"""Inductor sees through the library's custom ops.

Each op registers its own eager body as an inductor decomposition. The op keeps its fake impl
and stays one opaque node for eager, `aot_eager`, opcheck and the CUDA-graph backends (so those
run exactly the eager code), while inductor traces the body once at compile time: the plan,
quantizer and storage objects exist only while tracing, our Triton kernels become graph nodes
(`kernels/triton/launch.py` launches through `torch.library.wrap_triton` under fake tensors),
the GEMMs are aten ops, and the generated code launches them with no library Python per step,
fusing the elementwise work around them.

`set_inductor_inlining(False)` makes the ops opaque to inductor again (compiles after the call
see it): the generated code then calls the op's Python body on every step.
`set_cpu_inlining(False)` (or `TE_PROTO_INLINE_CPU=0`) does so for ops on CPU tensors only: CPU is
for correctness, and compiling the MXFP8 / NVFP4 reference kernels to C++ takes minutes where
the opaque ops compile in seconds and run eager's code.

Inductor's caches key a compiled graph on the graph before decomposition, not on the bodies: the
library tags the cache key (`torch.compiler.config.cache_key_tag`) with a hash of its own source
and the inlining setting, so an artifact built from other bodies is never reused.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Callable, Dict

import torch
import torch.utils._pytree as pytree
from torch._functorch._aot_autograd.functional_utils import from_fun, to_fun
from torch._inductor import decomposition as _inductor_decomp
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .. import kernels
from . import recompute_tags, shared_input

__all__ = ["inline_in_inductor", "set_inductor_inlining", "inductor_inlining_enabled", "set_cpu_inlining",
           "cpu_inlining_enabled"]

_BODIES: Dict[object, Callable] = {}
_enabled = True
_cpu_enabled = True


def inline_in_inductor(op, body: Callable) -> None:
    """Let inductor trace `body` (the op's eager implementation, same signature and outputs) in
    place of the opaque `op` (an OpOverload)."""
    _BODIES[op] = body
    set_inductor_inlining(_enabled)
    if not _cpu_enabled:
        _register_fallbacks()


def set_inductor_inlining(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)
    for op, body in _BODIES.items():
        if _enabled:
            _inductor_decomp.decompositions[op] = _functional(body)
        else:
            _inductor_decomp.decompositions.pop(op, None)
    _table_changed()


def inductor_inlining_enabled() -> bool:
    return _enabled


def set_cpu_inlining(enabled: bool) -> None:
    """Whether inductor traces the bodies of ops whose tensors are all on CPU (compiles after the
    call see it); False keeps those ops opaque, CUDA ones are inlined as before."""
    global _cpu_enabled
    _cpu_enabled = bool(enabled)
    if not _cpu_enabled:
        _register_fallbacks()
    _table_changed()


def cpu_inlining_enabled() -> bool:
    return _cpu_enabled


def _register_fallbacks() -> None:
    """Inductor lowers an op that its decomposition left in the graph as a call of the op (the
    lowering it would create itself, which refuses ops that have a decomposition)."""
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    for op in _BODIES:
        if op not in lowering.lowerings:
            constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            lowering.make_fallback(op, layout_constraint=constraint, warn=False, override_decomp=True)


def _functional(body: Callable) -> Callable:
    """`body` with its in-place writes functionalized: inductor applies decompositions below AOT
    autograd's functionalization, and its graphs must be functional. The body's writes go into
    buffers it allocates itself (the ops mutate none of their inputs), so nothing is copied back."""

    def run(*args, **kwargs):
        owner = _get_current_dispatch_mode()  # the trace: shared inputs never cross traces
        raw = pytree.tree_leaves((args, kwargs))
        if not _cpu_enabled and all(t.device.type == "cpu" for t in raw if isinstance(t, torch.Tensor)):
            return NotImplemented  # inductor keeps the op: it calls the eager body
        with FunctionalTensorMode():
            args, kwargs = pytree.tree_map(to_fun, (args, kwargs))
            # Linears reading one traced tensor share its quantized copy (custom_ops/shared_input.py)
            sources = {id(f): r for f, r in zip(pytree.tree_leaves((args, kwargs)), raw)
                       if isinstance(r, torch.Tensor)}
            with shared_input.scope(sources, owner, wrap=to_fun, unwrap=from_fun, commit=False) as shared, \
                    kernels.tracing_for_inductor():
                out = body(*args, **kwargs)
        shared.commit()
        return pytree.tree_map(from_fun, out)

    return run


def _source_hash() -> str:
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


_SOURCE_HASH = _source_hash()
recompute_tags.ON_CHANGE.append(lambda: _table_changed())
kernels.ON_FUSIBLE_CHANGE.append(lambda: _table_changed())


def _table_changed() -> None:
    """Inductor caches a copy of its table (`fast_random_decomps`): drop it so the next compile
    reads the current one; and tag the cache key with this source and setting."""
    cached = getattr(_inductor_decomp, "fast_random_decomps", None)
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
    config = torch.compiler.config
    if hasattr(config, "cache_key_tag"):
        tags = [t for t in config.cache_key_tag.split("|") if t and not t.startswith("te_proto:")]
        setting = (f"{int(_enabled)}{int(_cpu_enabled)}{int(recompute_tags.recompute_saved_input())}"
                   f"{','.join(sorted(kernels.fusible_quantize_enabled()))}")
        config.cache_key_tag = "|".join(tags + [f"te_proto:{_SOURCE_HASH}:{setting}"])


if os.environ.get("TE_PROTO_INLINE_CPU", "1") == "0":
    set_cpu_inlining(False)
