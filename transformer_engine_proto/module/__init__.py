"""TE-style modules: Linear, GroupedLinear, LayerNormLinear, LayerNormMLP, LayerNorm, RMSNorm, DotProductAttention,
RotaryPositionEmbedding, MultiheadAttention, TransformerLayer;
convert_model swaps a model's nn.Linear / norms for them."""
from .attention import DotProductAttention  # noqa: F401
from .convert import ConversionWarning, convert_model  # noqa: F401
from .grouped_linear import GroupedLinear  # noqa: F401
from .layernorm_linear import LayerNormLinear  # noqa: F401
from .layernorm_mlp import LayerNormMLP  # noqa: F401
from .linear import Linear  # noqa: F401
from .multihead_attention import MultiheadAttention  # noqa: F401
from .normalization import LayerNorm, RMSNorm  # noqa: F401
from .rope import RotaryPositionEmbedding, apply_rotary_pos_emb  # noqa: F401
from .transformer_layer import TransformerLayer  # noqa: F401
