"""TE's collective operations: `AllGather`, `AllReduce`, `ReduceScatter` (along dim 0).

Each runs the package's differentiable tensor-parallel collectives (`distributed/tp.py`, custom
ops that compile without graph breaks), so the backward is the conjugate collective: all-gather
<-> reduce-scatter, all-reduce -> identity (the gradient is taken to be replicated, as in TE). A
group of one process returns the input.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..distributed import tp as _tp
from .op import BasicOperation

__all__ = ["AllGather", "AllReduce", "ReduceScatter"]


class _Collective(BasicOperation):
    def __init__(self, process_group: Optional["dist.ProcessGroup"] = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(f"{type(self).__name__}: torch.distributed is not initialized "
                               "(call torch.distributed.init_process_group first)")
        self.process_group = process_group
        self.process_group_size = dist.get_world_size(process_group)
        self._group_name = _tp.group_name_of(process_group)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """The collective's result on this rank (the input itself in a group of one).

        Parameters
        ----------
        input : torch.Tensor
            This rank's tensor.
        """
        return input if self.process_group_size == 1 else self._collective(input)

    def extra_repr(self) -> str:
        return f"process_group_size={self.process_group_size}"


class AllGather(_Collective):
    """The ranks' tensors concatenated along dim 0; backward reduce-scatters the gradient.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, default = the world group
    """

    def _collective(self, x):
        return _tp.all_gather_first_dim(x, self._group_name, self.process_group_size)


class ReduceScatter(_Collective):
    """The ranks' tensors summed, this rank's dim-0 chunk kept; backward all-gathers the gradient.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, default = the world group
    """

    def _collective(self, x):
        if x.dim() == 0 or x.shape[0] % self.process_group_size:
            raise RuntimeError(f"ReduceScatter: cannot reduce-scatter a tensor of shape {list(x.shape)} over "
                               f"{self.process_group_size} processes (dim 0 must be a multiple)")
        return _tp.reduce_scatter_first_dim(x, self._group_name, self.process_group_size)


class AllReduce(_Collective):
    """The ranks' tensors summed; backward is the identity (TE's assumption: the output feeds
    computations replicated on every rank, so their gradients are already equal).

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, default = the world group
    reduce_in_backward : bool, default = True
        TE's argument, kept for its signature; TE's backward is the identity either way.
    """

    def __init__(self, process_group: Optional["dist.ProcessGroup"] = None, reduce_in_backward: bool = True) -> None:
        super().__init__(process_group)
        self._reduce_in_backward = reduce_in_backward

    def _collective(self, x):
        return _tp.all_reduce_sum(x, self._group_name)
