"""`zeros(n, like)`: a small zero-filled float32 (or int32) vector for an eager call's amax
outputs, cut from a block zeroed once instead of allocated and filled per call.

An eager FP8 quantize takes its amax by atomic max into a zeroed buffer, and delayed scaling's
Linear collects its amaxes in one: on a CUDA device each `torch.zeros` is an allocation, a fill
launch and their dispatch (a Llama step makes about a hundred). A slot of a zeroed block costs
one tensor construction. Each slot is handed out once (a used-up block is dropped and freed with
its last slot), starts 16-byte aligned (the kernels' pointer specialization stays the same), has
its own version counter (an in-place op on one slot never trips autograd's check on another),
and comes from a block filled on the stream that is current when it is taken.

Slots are handed out only inside `slots()`, which the eager path opens around an op's body
(`custom_ops/eager_path.py`), and there not while a CUDA graph is captured (a replay would find
its slot already written). Everywhere else `torch.zeros`: a custom op called through the
dispatcher (its outputs must not share a storage, and under the `cudagraphs` backend or CUDA-graph
trees a block would be memory of the graph's pool that no output accounts for), traced tensors,
other devices (no launch to save) and requests larger than `_MAX`.
"""
from __future__ import annotations

import threading

import torch

from .reference.common import traced

__all__ = ["zeros", "slots"]

_BLOCK = 4096  # floats per block: about eight eager Llama steps of amax slots
_ALIGN = 4  # floats: slots start 16-byte aligned
_MAX = 64  # larger requests are plain allocations
_DTYPES = (torch.float32, torch.int32)  # 4-byte elements: zero bits are zero in both
_blocks = {}  # (device index, raw stream) -> [storage, next free offset]
_STREAMS = 64  # blocks kept at most (one per device and stream in use); live slots keep theirs


class _Depth(threading.local):
    depth = 0  # > 0 inside `slots()` in this thread (forward and autograd's backward thread)


_local = _Depth()


class slots:
    """Inside this block (this thread), `zeros` may hand out slots. A class, not a generator:
    the eager path opens one per op call."""

    __slots__ = ()

    def __enter__(self):
        _local.depth += 1

    def __exit__(self, *exc):
        _local.depth -= 1


def zeros(n: int, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (n,) tensor of zeros, float32 or int32, on `like`'s device (see the module docstring)."""
    device = like.device
    if (not _local.depth or device.type != "cuda" or n > _MAX or dtype not in _DTYPES or traced(like)
            or torch.cuda.is_current_stream_capturing()):
        return torch.zeros((n,), dtype=dtype, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    entry = _blocks.get(key)
    if entry is None or entry[1] + n > _BLOCK:
        if entry is None and len(_blocks) >= _STREAMS:  # streams made and dropped: forget their blocks
            _blocks.clear()
        entry = _blocks[key] = [torch.zeros((_BLOCK,), dtype=torch.float32, device=device).untyped_storage(), 0]
    storage, offset = entry
    entry[1] = offset + -(-n // _ALIGN) * _ALIGN
    return torch.empty(0, dtype=dtype, device=device).set_(storage, offset, (n,), (1,))
