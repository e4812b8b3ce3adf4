"""`fast_launch`: launch a `@triton.jit` kernel with less host time per call. On by default with
the Triton it was verified on (3.6; other versions: set `TE_PROTO_FAST_LAUNCH=1` after running the
GPU kernel suites, since the launcher's signature and Triton's specialization rules change between
versions); `TE_PROTO_FAST_LAUNCH=0` takes Triton's own path for every launch. The variable is read
once, at the first launch; `set_fast_launch(True | False)` switches in Python, `set_fast_launch(None)`
goes back to the variable and the Triton version (read again at the next launch). The bitwise
kernel suites run through it; its effect on a Linear's host time was measured on an H100 host
(benchmarks/results/2026-11-23-h100-b6df48f).

Triton's `kernel[grid](...)` re-binds every argument, builds a string cache key from the
specialization and options, checks globals, and -- because Triton 3.6's launch hooks are
`HookChain` objects, never None -- builds launch metadata and calls the (usually empty) enter
and exit hook chains on every launch. `fast_launch` keeps the compiled kernel per
*specialization class* of the call and calls the compiled launcher directly, without metadata
or hooks while both chains are empty (it tests the chains for emptiness: they are never None).

The class mirrors what Triton specializes on, or is finer: a tensor's dtype and whether its
pointer is 16-byte aligned; an int's width (32 or 64 bit), whether it equals 1 and whether it
is a multiple of 16; every constexpr value; every launch option; the current device. So a cached
kernel is only reused where Triton would have picked the same binary. The first call of a class,
calls under the interpreter (TRITON_INTERPRET=1), calls with unusual argument types and calls
while a Triton launch hook is installed (profilers) take Triton's own path.

While torch traces the call (fake tensors: inductor inlining a library op, make_fx), the launch
goes through `torch.library.wrap_triton`, so the kernel becomes a node of the graph that the
generated code launches itself (see `custom_ops/inductor_lowering.py`).
"""
from __future__ import annotations

import os

import torch
import triton

from ..reference.common import traced
from ._common import _INTERPRETING

try:
    from triton import knobs
except ImportError:  # a Triton without knobs: always Triton's own path
    knobs = None


VERIFIED_TRITON = ("3.6.",)  # versions the bitwise GPU kernel suites passed through the fast path


_enabled = None  # None: not decided yet, take TE_PROTO_FAST_LAUNCH / the Triton version at the next launch


def set_fast_launch(on) -> None:
    """True / False: take the fast path or always Triton's own; None: follow `TE_PROTO_FAST_LAUNCH`
    (unset: on with a verified Triton version) again."""
    global _enabled
    _enabled = None if on is None else bool(on)


def enabled() -> bool:
    global _enabled
    if _enabled is None:
        env = os.environ.get("TE_PROTO_FAST_LAUNCH")
        _enabled = env != "0" if env is not None else triton.__version__.startswith(VERIFIED_TRITON)
    return _enabled


def hooks_installed() -> bool:
    """Whether a Triton launch enter/exit hook is set (a HookChain with calls, or a plain callable)."""
    if knobs is None:
        return True
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _arg_class(a):
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if t is bool:
        return bool, a
    if t is int:
        return int, a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63
    if t is float:
        return float
    if a is None:
        return None
    raise TypeError(t)  # anything else: Triton's path


def _traced_call(args) -> bool:
    """Whether the launch is being traced: its first tensor argument is fake (a launch's tensors
    are all real or all fake)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            return traced(a)
    return False


class fast_launch:
    """Wraps a jitted kernel; `wrapped[grid](*runtime_args, **constexprs_and_options)` launches
    it like the kernel itself (runtime arguments positional, in signature order; constexprs by
    keyword)."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = list(fn.arg_names)
        self._compiled = {}

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args, kwargs):
        if _traced_call(args):
            return torch.library.wrap_triton(self.fn)[tuple(grid)](*args, **kwargs)
        if not (_enabled if _enabled is not None else enabled()) or _INTERPRETING or hooks_installed():
            return self.fn[grid](*args, **kwargs)
        try:
            # constexprs and options by keyword, in the call's order: a call site always passes
            # them the same way (another order is another key, compiled once more by Triton)
            key = (torch._C._cuda_getDevice(),
                   tuple([(a.dtype, not a.data_ptr() & 15) if type(a) is torch.Tensor else _arg_class(a)
                          for a in args]),
                   tuple(kwargs.items()))
            kernel = self._compiled.get(key)
        except TypeError:  # an argument type the class does not cover, or an unhashable keyword value
            return self.fn[grid](*args, **kwargs)
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            if hasattr(kernel, "result"):  # an async compile's future
                kernel = kernel.result()
            if any(isinstance(v, torch.Tensor) for v in kwargs.values()):
                return kernel  # a runtime argument by keyword: Triton's path, nothing cached (no tensor kept)
            # a parameter left to its default: not worth mirroring, keep Triton's path
            self._compiled[key] = kernel if all(n in kwargs for n in self.arg_names[len(args):]) else False
            return kernel
        if kernel is False:
            return self.fn[grid](*args, **kwargs)
        g = tuple(grid) + (1, 1)
        stream = torch._C._cuda_getCurrentRawStream(key[0])
        kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *args,
                   *map(kwargs.get, self.arg_names[len(args):]))
        return kernel
