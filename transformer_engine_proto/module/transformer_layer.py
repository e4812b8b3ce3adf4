"""`TransformerLayer`: pre-norm self-attention + MLP with every GEMM quantized.

Attention itself (softmax(QK^T)V) runs in high precision through
`F.scaled_dot_product_attention`; QKV, the output projection and the MLP use our quantized
modules. Inputs are [seq, batch, hidden] by default (TE's "sbhd"), or "bshd".

Tensor parallelism (`tp_group` / `tp_size` / `sequence_parallel`, as TE): QKV is a column-parallel
LayerNormLinear, the output projection a row-parallel Linear and the MLP fc1-column / fc2-row;
each rank computes attention for num_attention_heads / tp_size heads. The QKV weight's local
shard holds this rank's heads of each of Q, K and V: `cat([W[i*h:(i+1)*h].chunk(tp)[r] for i in
range(3)])` for hidden size h (the same rule as the gated MLP halves). With `sequence_parallel`
the input and output are dim-0 shards (the sequence in "sbhd"); norms, residuals and hidden
dropout run on the shard (dropout RNG is not tracked across ranks here).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import raise_error, shape_str
from .base import TransformerEngineBaseModule
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear

__all__ = ["TransformerLayer"]


class TransformerLayer(TransformerEngineBaseModule):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int, *,
                 layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1, attention_dropout: float = 0.1,
                 self_attn_mask_type: str = "causal", normalization: str = "LayerNorm",
                 activation: str = "gelu", bias: bool = True, attn_input_format: str = "sbhd",
                 params_dtype: Optional[torch.dtype] = None, device=None, fuse_wgrad_accumulation: bool = False,
                 name: Optional[str] = None, tp_group=None, tp_size: Optional[int] = None,
                 sequence_parallel: bool = False):
        super().__init__(name)
        if hidden_size % num_attention_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}")
        want = dist.get_world_size(tp_group) if tp_group is not None else (tp_size or 1)
        if isinstance(want, int) and want > 1 and num_attention_heads % want:
            raise ValueError(f"{self.name}: num_attention_heads={num_attention_heads} is not divisible by "
                             f"tp_size={want} (heads are split across tensor-parallel ranks)")
        if self_attn_mask_type not in ("causal", "no_mask"):
            raise ValueError(f"self_attn_mask_type must be 'causal' or 'no_mask', got {self_attn_mask_type!r}")
        if attn_input_format not in ("sbhd", "bshd"):
            raise ValueError(f"attn_input_format must be 'sbhd' or 'bshd', got {attn_input_format!r}")
        self.hidden_size, self.num_heads = hidden_size, num_attention_heads
        self.causal = self_attn_mask_type == "causal"
        self.attn_input_format = attn_input_format
        self.hidden_dropout, self.attention_dropout = hidden_dropout, attention_dropout
        common = dict(params_dtype=params_dtype, device=device, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel)
        tp = want > 1
        self.qkv = LayerNormLinear(hidden_size, 3 * hidden_size, layernorm_epsilon, bias,
                                   normalization=normalization, name=f"{self.name}.qkv",
                                   parallel_mode="column" if tp else None, **common)
        self.proj = Linear(hidden_size, hidden_size, bias, name=f"{self.name}.proj",
                           parallel_mode="row" if tp else None, **common)
        self.mlp = LayerNormMLP(hidden_size, ffn_hidden_size, layernorm_epsilon, bias,
                                normalization=normalization, activation=activation,
                                name=f"{self.name}.mlp", **common)
        self.tp_size = self.proj.tp_size
        self.sequence_parallel = self.proj.sequence_parallel
        self.local_heads = num_attention_heads // self.tp_size
        self.local_hidden = hidden_size // self.tp_size

    def _attention(self, x: torch.Tensor, is_first_microbatch) -> torch.Tensor:
        qkv = self.qkv(x, is_first_microbatch=is_first_microbatch)
        if self.attn_input_format == "sbhd":
            qkv = qkv.transpose(0, 1)  # -> [batch, seq, 3*hidden]
        b, s, _ = qkv.shape
        head_dim = self.local_hidden // self.local_heads  # not -1: an empty batch has no size to infer
        q, k, v = qkv.view(b, s, 3, self.local_heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        dropout = self.attention_dropout if self.training else 0.0
        ctx = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=self.causal)
        ctx = ctx.transpose(1, 2).reshape(b, s, self.local_hidden)
        if self.attn_input_format == "sbhd":
            ctx = ctx.transpose(0, 1)
        return self.proj(ctx.contiguous(), is_first_microbatch=is_first_microbatch)

    def forward(self, hidden_states: torch.Tensor, is_first_microbatch: Optional[bool] = None) -> torch.Tensor:
        self._check_input(hidden_states, self.hidden_size, "hidden_states")
        if hidden_states.dim() != 3:
            raise_error(ValueError, f"{self.name}: hidden_states must be 3D ({self.attn_input_format}), "
                                    f"got {shape_str(hidden_states)}")
        drop = self.hidden_dropout if self.training else 0.0
        x = hidden_states + F.dropout(self._attention(hidden_states, is_first_microbatch), drop, self.training)
        return x + F.dropout(self.mlp(x, is_first_microbatch=is_first_microbatch), drop, self.training)
