"""Tensor-parallel communication for TE-proto modules (torch.library custom ops)."""
from .tp import (all_gather_first_dim, all_reduce_sum, copy_to_tp_region, gather_from_sequence_parallel_region,  # noqa: F401
                 reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region, resolve_tp)
from ..recompute import checkpoint  # noqa: F401,E402  (TE's transformer_engine.pytorch.distributed.checkpoint)
