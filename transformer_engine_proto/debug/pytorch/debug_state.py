"""`TEDebugState`: TE's class-level view of the precision debug tools' state, on ours.

TE code reads `TEDebugState.debug_enabled`, calls `TEDebugState._reset()` after
`debug_api.end_debug()` and `set_weight_tensor_tp_group_reduce(...)`. Here the state lives in
`debug.state` / `debug.stats`, so these are views of it: `debug_enabled` is whether a debug
session drives our layers now (they check at every forward, so, unlike TE, modules built before
`debug_api.initialize` take part too and `initialize()` has nothing to enforce).
"""
from __future__ import annotations

from .. import state, stats

__all__ = ["TEDebugState", "set_weight_tensor_tp_group_reduce"]


class _TEDebugStateMeta(type):
    """Class properties: the values are read from the live debug state, never stored here."""

    @property
    def debug_enabled(cls) -> bool:
        return bool(state.SESSION.active and state.debug_manager() is not None)

    @property
    def weight_tensor_tp_group_reduce(cls) -> bool:
        return stats.weight_tensor_tp_group_reduce()


class TEDebugState(metaclass=_TEDebugStateMeta):
    """TE's debug-state class: `debug_enabled`, `weight_tensor_tp_group_reduce` (read-only
    views), `initialize()`, `_reset()`, `get_iteration()`, `set_weight_tensor_tp_group_reduce()`,
    and TE's layer counter (`layer_count`, `get_layer_count()`; our modules name themselves
    `<type>_<n>` from their own counter, so it numbers nothing here)."""

    layer_count = 1
    layers_initialized: dict = {}

    @classmethod
    def initialize(cls) -> bool:
        """TE calls it when a module is built; here nothing is latched: returns `debug_enabled`."""
        return cls.debug_enabled

    @classmethod
    def _reset(cls) -> None:
        """Drop pending stats and the record of initialized layers (TE's reset between sessions)."""
        stats.BUFFERS.reset()
        cls.layers_initialized.clear()

    @classmethod
    def get_layer_count(cls) -> int:
        count = cls.layer_count
        cls.layer_count += 1
        return count

    @classmethod
    def set_weight_tensor_tp_group_reduce(cls, enabled: bool) -> None:
        stats.set_weight_tensor_tp_group_reduce(enabled)

    @classmethod
    def get_iteration(cls) -> int:
        """The debug session's iteration (0 without a session)."""
        return state.current_iteration()


def set_weight_tensor_tp_group_reduce(enabled: bool) -> None:
    """Weight stats of a tensor-parallel layer over its TP group (True) or per rank (False)."""
    TEDebugState.set_weight_tensor_tp_group_reduce(enabled)
