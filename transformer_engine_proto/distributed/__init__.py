"""Tensor-parallel communication for TE-proto modules (torch.library custom ops)."""
from ..recompute import checkpoint  # noqa: F401,E402  (TE's transformer_engine.pytorch.distributed.checkpoint)
from .tp import (  # noqa: F401
                 all_gather_first_dim,
                 all_reduce_sum,
                 copy_to_tp_region,
                 gather_from_sequence_parallel_region,
                 reduce_from_tp_region,
                 reduce_scatter_to_sequence_parallel_region,
                 resolve_tp,
)
