"""TE's `transformer_engine.debug.pytorch` path: `debug_state.TEDebugState`, for code written
against TE (its tests reset the debug state between sessions through it)."""
