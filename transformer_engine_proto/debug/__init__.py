"""Precision debug tools: Transformer Engine's debug features for nvdlfw_inspect, on our layers.

    import nvdlfw_inspect.api as debug_api
    import transformer_engine_proto.debug as te_debug

    debug_api.initialize(config_file="config.yaml", feature_dirs=[te_debug.FEATURE_DIR], log_dir="./log")
    # or te_debug.initialize("config.yaml", log_dir="./log"): validates the config first
    model = te.Linear(1024, 1024, name="fc1")   # or names inferred: "linear_0", ...
    for step in ...:
        loss = model(x).sum(); loss.backward()
        debug_api.step()                          # logs the stats, moves the iteration on
    debug_api.end_debug()

Features (namespace `transformer_engine`): LogTensorStats, LogFp8TensorStats, LogNvfp4TensorStats,
DisableFp8Gemm, DisableFp8Layer, PerTensorScaling, FakeQuant, DumpTensors, plus user features
written against `transformer_engine_proto.debug.features.api.TEConfigAPIMapper`. TE's
`TEDebugState` is in `debug.pytorch.debug_state`.

How it runs: a layer with no active feature in a step runs its normal fast path (without a debug
session, the module code is exactly the normal one). A layer with one runs its GEMMs through the
`te_proto_debug::linear_fwd/bwd` custom ops, which make TE's API calls in eager Python at run
time -- under `torch.compile(fullgraph=True)` too, with no graph break. The fast/debug decision
per layer is a guarded constant under torch.compile: it recompiles at most once per distinct
decision (dynamo keeps each graph; mind its recompile limit, 8 by default, when many layers
switch at different steps). What stays eager: the debug GEMM ops' bodies (they are opaque to
inductor and tagged cudagraph_unsafe, so CUDA-graph trees run graphs that contain them without
CUDA graphs); the quantized-weight cache (`is_first_microbatch`) is bypassed on the debug path.
`debug_api.initialize_training_step(n)` changes the iteration without a step(): compiled graphs
follow the new windows from the next `debug_api.step()` on.
"""
from __future__ import annotations

import os

__all__ = ["FEATURE_DIR", "initialize", "validate_config", "is_active", "last_logged_stats",
           "set_weight_tensor_tp_group_reduce"]

FEATURE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "features")


def initialize(config_file, log_dir: str = ".", feature_dirs=(), **kwargs) -> None:
    """`nvdlfw_inspect.api.initialize` with our features dir, after validating the config."""
    import nvdlfw_inspect.api as debug_api

    dirs = [feature_dirs] if isinstance(feature_dirs, str) else list(feature_dirs)
    validate_config(config_file, dirs)
    debug_api.initialize(config_file=config_file, feature_dirs=[FEATURE_DIR, *dirs], log_dir=log_dir, **kwargs)


def validate_config(config, feature_dirs=()) -> None:
    """Raise `DebugConfigError` (a ValueError) naming the first wrong entry of a config (path or
    dict), or a missing / empty file; features in the user's `feature_dirs` count as known."""
    from .config_check import validate_config as _validate

    _validate(config, feature_dirs)


def is_active() -> bool:
    from .state import SESSION

    return SESSION.active


def last_logged_stats() -> dict:
    """`{layer}_{tensor}_{stat}` -> value, as logged by the last `debug_api.step()`."""
    from .stats import BUFFERS

    return dict(BUFFERS.last)


def set_weight_tensor_tp_group_reduce(enabled: bool) -> None:
    """TE's switch: weight stats of a tensor-parallel layer are reduced over its TP group (True,
    the default: the stats of the whole weight) or kept per rank (False)."""
    from .stats import set_weight_tensor_tp_group_reduce as _set

    _set(enabled)
