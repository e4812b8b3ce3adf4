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

`record_launches()` captures the compiled launches an entry point makes (grid and constexprs
fixed) so the entry point can replay them for the next call of the same signature without its
own Python (`Replay`; see `float8.py`'s launch plans). `planned(key)` finds a plan only while
`replay_allowed()`: what sends a launch to Triton's own path sends a replayed entry point back to
its full path.
`set_fast_launch` forgets the plans; the soft-cast switch is part of a plan's key.

While torch traces the call (fake tensors: inductor inlining a library op, make_fx), the launch
goes through `torch.library.wrap_triton`, so the kernel becomes a node of the graph that the
generated code launches itself (see `custom_ops/inductor_lowering.py`). Torch turns a traced
launch given launch options (`num_warps=`) into a new one-config `triton.autotune` kernel, a new
entry of its kernel side table for every launch, and its per-entry work (the repro string each
compile writes parses every entry's source) grows with the launches; the traced launch here
passes one such kernel per kernel and options instead (`_with_options`).
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton

from ..reference.common import traced
from ._common import _INTERPRETING, soft_cast

try:
    from triton import knobs
except ImportError:  # a Triton without knobs: always Triton's own path
    knobs = None


VERIFIED_TRITON = ("3.6.",)  # versions the bitwise GPU kernel suites passed through the fast path


_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")  # what `triton.Config` takes beside kwargs
_enabled = None  # None: not decided yet, take TE_PROTO_FAST_LAUNCH / the Triton version at the next launch


def set_fast_launch(on) -> None:
    """True / False: take the fast path or always Triton's own; None: follow `TE_PROTO_FAST_LAUNCH`
    (unset: on with a verified Triton version) again."""
    global _enabled
    _enabled = None if on is None else bool(on)
    clear_plans()


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


def replay_allowed() -> bool:
    """Whether recorded launches may be replayed now: the fast path is on, nothing interprets and
    no launch hook (profiler) wants to see every launch."""
    return (_enabled if _enabled is not None else enabled()) and not _INTERPRETING and not hooks_installed()


class Replay:
    """One compiled kernel launch with its grid, its runtime arguments after the last tensor (the
    sizes), constexprs and options fixed: `replay(*tensors)` launches it with new tensor arguments
    on the current stream of the device it was recorded on.
    The compiled launcher reads only each tensor's pointer, so a tensor may be passed in the dtype
    it was allocated in instead of the view the kernel was compiled with (bf16 for int16 bits)."""

    __slots__ = ("run", "grid", "function", "metadata", "tail", "device")

    def __init__(self, kernel, grid, tail, device):
        self.run, self.function, self.metadata = kernel.run, kernel.function, kernel.packed_metadata
        self.grid, self.tail, self.device = (tuple(grid) + (1, 1))[:3], tuple(tail), device

    def __call__(self, *args):
        g = self.grid
        self.run(g[0], g[1], g[2], torch._C._cuda_getCurrentRawStream(self.device), self.function,
                 self.metadata, None, None, None, *args, *self.tail)


class _Recording(threading.local):
    launches = None  # a list while `record_launches` is active in this thread: Replay or None each


_recording = _Recording()  # per thread: another thread's launches never join this one's plan


@contextlib.contextmanager
def record_launches():
    """Collects the launches this thread makes in the block: a `Replay` for each that went
    through the fast path's cache, None for one that did not (it cannot be replayed)."""
    outer, _recording.launches = _recording.launches, []
    try:
        yield _recording.launches
    finally:
        _recording.launches = outer


PLANS = {}  # eager call signature -> an entry point's plan of replayed launches
PLAN_LIMIT = 4096  # signatures kept: beyond it (shapes that keep changing) the plans start over


def clear_plans() -> None:
    """Forget every recorded plan: a setting the launches were recorded under (a launch config,
    the fast path) changed."""
    PLANS.clear()


def aligned(t: torch.Tensor) -> bool:
    return not t.data_ptr() & 15


def plan_key(x: torch.Tensor, *settings):
    """An eager call's signature (x's shape, dtype and device, the current device, the soft-cast
    switch the kernels read, the call's settings), or None where no plan applies: a traced,
    non-contiguous or misaligned x, which the full entry point handles."""
    if traced(x) or not x.is_contiguous() or not aligned(x):
        return None
    device = x.get_device()  # -1 on CPU (the interpreter), where torch may have no CUDA functions
    return (x.shape, x.dtype, device, torch._C._cuda_getDevice() if device >= 0 else -1, soft_cast(), *settings)


def planned(key):
    """The plan recorded for `key` when it may replay now, else None (no key, no plan yet, or
    something that sends launches to Triton's own path)."""
    if key is None:
        return None
    plan = PLANS.get(key)
    return plan if plan is not None and replay_allowed() else None


def run_recorded(key, make_plan, full, *args, expect=(1,)):
    """Run the full entry point `full(*args)`, recording its launches; keep `make_plan(launches)`
    as the plan of `key` when every launch can be replayed and their number is one the plan
    expects (`expect`)."""
    with record_launches() as launches:
        out = full(*args)
    if key is not None and len(launches) in expect and None not in launches:
        if len(PLANS) >= PLAN_LIMIT:
            PLANS.clear()
        PLANS[key] = make_plan(launches)
    return out


class fast_launch:
    """Wraps a jitted kernel; `wrapped[grid](*runtime_args, **constexprs_and_options)` launches
    it like the kernel itself (runtime arguments positional, in signature order; constexprs by
    keyword)."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = list(fn.arg_names)
        self._compiled = {}
        self._tuned = {}  # launch options -> the one-config autotune kernel a traced launch passes

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _with_options(self, kwargs):
        """(kernel, the other keywords) for a traced launch: the launch options moved into a
        one-config autotune kernel made once per options, what torch makes at every launch."""
        options = tuple((k, kwargs[k]) for k in _LAUNCH_OPTIONS if k in kwargs)
        if not options:
            return self.fn, kwargs
        kernel = self._tuned.get(options)
        if kernel is None:
            kernel = self._tuned[options] = triton.autotune(configs=[triton.Config({}, **dict(options))],
                                                            key=[])(self.fn)
        return kernel, {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS}

    @staticmethod
    def _key(args, kwargs):
        # constexprs and options by keyword, in the call's order: a call site always passes them
        # the same way (another order is another key, compiled once more by Triton)
        return (torch._C._cuda_getDevice(),
                tuple([(a.dtype, not a.data_ptr() & 15) if type(a) is torch.Tensor else _arg_class(a)
                       for a in args]),
                tuple(kwargs.items()))

    def _launch(self, grid, args, kwargs):
        if _traced_call(args):
            kernel, kwargs = self._with_options(kwargs)
            return torch.library.wrap_triton(kernel)[tuple(grid)](*args, **kwargs)
        if _recording.launches is not None:
            return self._recorded(grid, args, kwargs)
        if not (_enabled if _enabled is not None else enabled()) or _INTERPRETING or hooks_installed():
            return self.fn[grid](*args, **kwargs)
        try:
            key = self._key(args, kwargs)
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

    def _recorded(self, grid, args, kwargs):
        """`_launch`, noting in the recording the launch's `Replay` (None if it took Triton's path)."""
        recording = _recording.launches
        kernel = self._launch_unrecorded(grid, args, kwargs)
        try:
            cached = replay_allowed() and self._compiled.get(self._key(args, kwargs)) is kernel
        except TypeError:
            cached = False
        # the runtime arguments after the last tensor (sizes: fixed by the plan's signature) are
        # replayed as recorded, with the constexprs; the plan passes the tensors
        n = max((i + 1 for i, a in enumerate(args) if isinstance(a, torch.Tensor)), default=0)
        fixed = (*args[n:], *map(kwargs.get, self.arg_names[len(args):]))
        recording.append(Replay(kernel, grid, fixed, torch._C._cuda_getDevice()) if cached and kernel else None)
        return kernel

    def _launch_unrecorded(self, grid, args, kwargs):
        outer, _recording.launches = _recording.launches, None
        try:
            return self._launch(grid, args, kwargs)
        finally:
            _recording.launches = outer
