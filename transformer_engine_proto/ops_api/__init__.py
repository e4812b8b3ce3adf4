"""`te.ops`: Transformer Engine's fusible-operation API (`transformer_engine.pytorch.ops`).

    model = te.ops.Sequential(
        te.ops.LayerNorm(1024), te.ops.Linear(1024, 8192), te.ops.SwiGLU(), te.ops.Linear(4096, 1024))
    with te.autocast(recipe=recipe):
        y = model(x)

The operations are ordinary modules: each GEMM runs through a `QuantizedGemm` as in `te.Linear`
(every recipe, delayed-scaling state, quantized weights), autograd makes the backward, and a
`Sequential` compiles into one graph with torch.compile, where inductor fuses what TE's fuser
fuses by hand. The collectives (`AllGather`, `AllReduce`, `ReduceScatter`) run the package's
tensor-parallel collective ops. Not built yet: tensor parallelism inside `BasicLinear` /
`Linear`, TE's hand-fused operations and the `register_*_fusion` hooks, and user operations written
against TE's `op_forward` / `op_backward` contract.
"""
from . import basic
from .basic import *  # noqa: F401,F403  (every basic operation, listed once in basic.__all__)
from .linear import Linear  # noqa: F401
from .op import BasicOperation, FusedOperation, FusibleOperation  # noqa: F401
from .sequential import Sequential  # noqa: F401

__all__ = ["Sequential", "Linear", "BasicOperation", "FusedOperation", "FusibleOperation", *basic.__all__]

# TE names not built yet: an AttributeError that says so, instead of a bare missing attribute
_NOT_BUILT = {
    **dict.fromkeys(("register_forward_fusion", "register_backward_fusion", "register_forward_backward_fusion",
                     "fused"), "TE's hand-fused operations (torch.compile fuses a Sequential instead)"),
}


def __getattr__(name: str):
    if name in _NOT_BUILT:
        raise AttributeError(f"te.ops.{name} is not built yet ({_NOT_BUILT[name]}); see docs/modules.md")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
