"""One ptxas for this process and inductor's compile workers, so that a second process finds every
Triton kernel the first one compiled.

Inductor's compile workers point Triton at the ptxas shipped inside torch (`TRITON_PTXAS_PATH`). A
process whose compiled graphs come from the FX graph cache compiles nothing in those workers, and
Triton in that process keeps its own ptxas. The ptxas version is part of Triton's cache key, so
every kernel that Triton's launcher loads in the process (this library's quantize kernels inside a
compiled graph, any kernel inductor's static launcher does not take) misses the cache and is
compiled again, in every new process. Choosing the workers' ptxas at import gives both the same
key. A `TRITON_PTXAS_PATH` the user set is kept (inductor keeps it too)."""
from __future__ import annotations

__all__ = ["use_inductor_ptxas"]


def use_inductor_ptxas() -> None:
    """Set `TRITON_PTXAS_PATH` as inductor's compile workers do (nothing on a CPU build of torch,
    which ships no ptxas)."""
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # a torch without it: its workers choose no ptxas either
        return
    _set_triton_ptxas_path()
