"""Quantized tensors: quantizers, storages, the wrapper subclass, one module per format, protos."""
from .float8 import *  # noqa: F401,F403
from .float8_blockwise import *  # noqa: F401,F403
from .hybrid import *  # noqa: F401,F403
from .identity import *  # noqa: F401,F403
from .mxfp8 import *  # noqa: F401,F403
from .nvfp4 import *  # noqa: F401,F403
from .proto import TensorProto, to_tensor_proto  # noqa: F401
from .quantized_tensor import QuantizedTensor  # noqa: F401
from .quantizer import BufferSpec, Quantizer  # noqa: F401
from .storage import QuantizedTensorStorage, storage_class_by_qualname  # noqa: F401
