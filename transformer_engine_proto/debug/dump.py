"""Tensor dumps of DumpTensors: one `torch.save`d dict per layer, tensor and iteration.

Files go to `{log_dir}/tensor_dumps/rank_{rank}/{layer}_{tensor}_iter_{iteration:06d}.pt` where
`log_dir` is the current nvdlfw_inspect session's (so re-initialising the session with another
log_dir writes there). Names are sanitised (only letters, digits, '_' and '-' survive; the path
must stay inside the dump dir) and a file is written to a temporary file in the same directory,
then moved into place with `os.replace`, so readers never see a partial file.

The dict holds plain tensors and Python values only (loadable with `weights_only=True`):
`high_precision` (the tensor before quantization), `quantized` (the dequantized values of the
quantized tensor the GEMM used, float32), `quantized_internals` (see `quant_view.internals`), and
`layer_name`, `tensor_name`, `iteration`, `format`.
"""
from __future__ import annotations

import os
import re
import tempfile
from typing import Dict, Optional

import torch

from . import quant_view

__all__ = ["dump_dir", "dump_path", "sanitize", "save_atomic", "dump_tensor"]


def sanitize(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_\-]", "_", str(name)).strip("-")
    return safe or "_"


def dump_dir(root: Optional[str] = None) -> str:
    if root is None:
        from nvdlfw_inspect.logging import get_logger

        root = get_logger().root_log_dir
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return os.path.join(root, "tensor_dumps", f"rank_{rank}")


def dump_path(directory: str, layer: str, tensor: str, iteration: int) -> str:
    path = os.path.join(directory, f"{sanitize(layer)}_{sanitize(tensor)}_iter_{int(iteration):06d}.pt")
    real_dir = os.path.realpath(directory)
    if os.path.dirname(os.path.realpath(path)) != real_dir:
        raise ValueError(f"DumpTensors: refusing to write {path!r} outside {real_dir!r}")
    return path


def save_atomic(obj, path: str) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp_", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def dump_tensor(layer: str, tensor_name: str, iteration: int, tensor: Optional[torch.Tensor], quantized,
                dump_hp: bool, dump_quant: bool, dump_internals: bool, root: Optional[str] = None) -> Optional[str]:
    """Write one dump; returns its path (None when there was nothing to write)."""
    d: Dict[str, object] = {"layer_name": layer, "tensor_name": tensor_name, "iteration": int(iteration)}
    if dump_hp and tensor is not None:
        d["high_precision"] = tensor.detach().clone()
    if quantized is not None and (dump_quant or dump_internals):
        from ..tensor import QuantizedTensor

        if isinstance(quantized, QuantizedTensor):
            d["format"] = quant_view.tensor_recipe_name(quantized)
            if dump_quant:
                d["quantized"] = quantized.dequantize(dtype=torch.float32).detach().clone()
            if dump_internals:
                d["quantized_internals"] = quant_view.internals(quantized)
        elif dump_quant:  # a modify_tensor() result in high precision (e.g. FakeQuant)
            d["format"] = "modified"
            d["quantized"] = quantized.detach().float().clone()
    if not any(k in d for k in ("high_precision", "quantized", "quantized_internals")):
        return None
    path = dump_path(dump_dir(root), layer, tensor_name, iteration)
    save_atomic(d, path)
    return path
