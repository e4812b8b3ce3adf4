"""transformer_engine_proto: a torch.compile-native prototype of Transformer Engine's FP8 stack."""
from . import recipe  # noqa: F401
from .tensor import QuantizedTensor, TensorProto, to_tensor_proto  # noqa: F401

__version__ = "0.1.0"
