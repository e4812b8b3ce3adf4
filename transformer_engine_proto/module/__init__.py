"""TE-style modules: Linear, LayerNormLinear, LayerNormMLP, LayerNorm, RMSNorm, TransformerLayer."""
from .linear import Linear  # noqa: F401
