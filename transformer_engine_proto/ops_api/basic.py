"""The basic (single-step) operations, under TE's module name `ops.basic`."""
from .activations import (  # noqa: F401
                          GEGLU,
                          GELU,
                          GLU,
                          QGEGLU,
                          QGELU,
                          ClampedSwiGLU,
                          ReGLU,
                          ReLU,
                          ScaledClampedQGeGLU,
                          ScaledSiTUGLU,
                          ScaledSReLU,
                          ScaledSwiGLU,
                          SiLU,
                          SiTUGLU,
                          SReGLU,
                          SReLU,
                          SwiGLU,
)
from .collectives import AllGather, AllReduce, ReduceScatter  # noqa: F401
from .extra_tensors import AddExtraInput, MakeExtraOutput  # noqa: F401
from .grouped_linear import GroupedLinear  # noqa: F401
from .linear import BasicLinear, Bias  # noqa: F401
from .norms import L2Normalization, LayerNorm, RMSNorm  # noqa: F401
from .quantize import Quantize  # noqa: F401
from .shape_ops import ConstantScale, Dropout, Identity, Reshape  # noqa: F401

__all__ = ["AddExtraInput", "AllGather", "AllReduce", "BasicLinear", "Bias", "ClampedSwiGLU", "ConstantScale",
           "Dropout", "GEGLU", "GELU", "GLU", "GroupedLinear", "Identity", "L2Normalization", "LayerNorm",
           "MakeExtraOutput", "QGEGLU", "QGELU", "Quantize", "ReGLU", "ReLU", "RMSNorm", "Reshape", "ReduceScatter",
           "ScaledClampedQGeGLU", "ScaledSiTUGLU", "ScaledSReLU", "ScaledSwiGLU", "SiLU", "SiTUGLU", "SReGLU",
           "SReLU", "SwiGLU"]
