"""transformer_engine_proto: a torch.compile-native prototype of Transformer Engine's FP8 stack.

TE code ports by changing one import: `import transformer_engine_proto as te` gives
`te.Linear`, `te.LayerNormLinear`, `te.LayerNormMLP`, `te.LayerNorm`, `te.RMSNorm`,
`te.DotProductAttention`, `te.MultiheadAttention`, `te.RotaryPositionEmbedding`, `te.TransformerLayer`,
`te.GroupedLinear`, `te.autocast` / `te.fp8_autocast` and `te.recipe`, `te.checkpoint` (activation
recompute), `te.make_graphed_callables` (CUDA graphs), `te.ops` (TE's fusible operations:
`te.ops.Sequential`, `te.ops.Linear`, ...); `te.convert_model(model)` swaps any model's
`nn.Linear` (and norms) for them in place.
"""
from . import (  # noqa: F401
                           constants,
                           quantization,
                           recipe,  # noqa: F401
)
from . import ops_api as ops  # noqa: F401  (te.ops: TE's fusible operations)
from .autocast import autocast, fp8_autocast, get_fp8_recipe, is_fp8_enabled  # noqa: F401
from .capabilities import (  # noqa: F401
                           get_device_compute_capability,
                           is_bf16_available,
                           is_fp8_available,
                           is_fp8_block_scaling_available,
                           is_mxfp8_available,
                           is_nvfp4_available,
)
from .constants import DType  # noqa: F401
from .graph import make_graphed_callables  # noqa: F401
from .module import (  # noqa: F401  # noqa: F401
                           ConversionWarning,
                           DotProductAttention,
                           GroupedLinear,
                           LayerNorm,
                           LayerNormLinear,
                           LayerNormMLP,
                           Linear,
                           MultiheadAttention,
                           RMSNorm,
                           RotaryPositionEmbedding,
                           TransformerLayer,
                           apply_rotary_pos_emb,
                           convert_model,
)
from .module.precision_report import pin_gemm_precision, precision_report  # noqa: F401
from .precision.policy import GemmPolicy  # noqa: F401
from .quantization import QuantizerRole, fp8_model_init, get_default_recipe, quantized_model_init  # noqa: F401
from .recompute import checkpoint  # noqa: F401
from .tensor import (  # noqa: F401  # noqa: F401  # noqa: F401
                           Float8BlockQuantizer,
                           Float8BlockwiseQTensor,
                           Float8CurrentScalingQuantizer,
                           Float8Quantizer,
                           Float8Tensor,
                           HybridQuantizedTensor,
                           HybridQuantizedTensorStorage,
                           HybridQuantizer,
                           IdentityQuantizer,
                           IdentityTensor,
                           IdentityTensorStorage,
                           MXFP8Quantizer,
                           MXFP8Tensor,
                           NVFP4Quantizer,
                           NVFP4Tensor,
                           QuantizedTensor,
                           Quantizer,
                           TensorProto,
                           to_tensor_proto,
)

__version__ = "0.1.0"

from .serialization import register_safe_globals as _register_safe_globals  # noqa: E402

_register_safe_globals()  # torch.load's default weights_only=True loads quantized tensors (serialization.py)

from .triton_ptxas import use_inductor_ptxas as _use_inductor_ptxas  # noqa: E402

_use_inductor_ptxas()  # a second process hits Triton's cache (triton_ptxas.py)
