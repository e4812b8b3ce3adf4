"""TE's capability queries: can this package run a recipe on the current device, and why not.

Each `is_*_available(return_reason=False)` answers for this package, not for TE's kernels:
MXFP8 and NVFP4 run on Hopper by emulation (quantize natively, bf16 GEMM), and every recipe runs on
CPU through the float32 reference kernels; the reason says which. With `return_reason=True` the
answer is `(bool, reason)`, as in TE.
"""
from __future__ import annotations

from typing import Tuple, Union

import torch

__all__ = ["default_device", "get_device_compute_capability", "is_bf16_available", "is_fp8_available",
           "is_mxfp8_available", "is_fp8_block_scaling_available", "is_nvfp4_available"]

_CPU = "CPU: runs on the pure-torch reference kernels (float32 emulation of the GEMMs)"


def get_device_compute_capability() -> Tuple[int, int]:
    """(major, minor) of the current CUDA device; (0, 0) without one."""
    if not torch.cuda.is_available():
        return (0, 0)
    return tuple(torch.cuda.get_device_capability())


def default_device(device=None) -> torch.device:
    """Where a module creates its parameters when not told: TE's default, CUDA, when there is one.

    An explicit `device` wins; so does a default device the user set (`torch.set_default_device`,
    `with torch.device("meta"):` for deferred init). Otherwise CUDA if available, else the CPU.
    """
    if device is not None:
        return torch.device(device)
    current = torch.get_default_device()
    if current.type != "cpu" or not torch.cuda.is_available():
        return current
    return torch.device("cuda", torch.cuda.current_device())


def _answer(ok: bool, reason: str, return_reason: bool) -> Union[bool, Tuple[bool, str]]:
    return (ok, reason) if return_reason else ok


def _needs(minimum: Tuple[int, int], what: str, native_from=None):
    if not torch.cuda.is_available():
        return True, _CPU
    cc = get_device_compute_capability()
    if cc < minimum:
        return False, (f"{what} needs compute capability {minimum[0]}.{minimum[1]} or newer; "
                       f"this GPU has {cc[0]}.{cc[1]}")
    if native_from is not None and not (native_from[0] <= cc < native_from[1]):
        return True, f"{what}: emulated on compute capability {cc[0]}.{cc[1]} (native quantize, bf16 GEMM)"
    return True, ""


def is_bf16_available(return_reason: bool = False):
    return _answer(*_needs((8, 0), "bf16"), return_reason)


def is_fp8_available(return_reason: bool = False):
    """Per-tensor FP8 (delayed and current scaling): `torch._scaled_mm` needs Ada / Hopper or newer."""
    return _answer(*_needs((8, 9), "FP8"), return_reason)


def is_fp8_block_scaling_available(return_reason: bool = False):
    """Float8BlockScaling: cuBLAS's 1x128 / 128x128 block-scaled GEMM (Hopper)."""
    return _answer(*_needs((9, 0), "FP8 block scaling"), return_reason)


def is_mxfp8_available(return_reason: bool = False):
    return _answer(*_needs((8, 9), "MXFP8", native_from=((10, 0), (13, 0))), return_reason)


def is_nvfp4_available(return_reason: bool = False):
    return _answer(*_needs((8, 9), "NVFP4", native_from=((10, 0), (13, 0))), return_reason)
