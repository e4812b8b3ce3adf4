"""`TransformerLayer`: pre-norm self-attention (`MultiheadAttention`) + MLP (`LayerNormMLP`), every
GEMM quantized; attention itself (softmax(QK^T)V) runs in high precision (`DotProductAttention`).

Inputs are [seq, batch, hidden] by default (TE's "sbhd"), "bshd", or packed "thd" [tokens, hidden]
with `cu_seqlens_q` / `cu_seqlens_kv`. A Llama layer in one module:
`TransformerLayer(h, ffn, heads, num_gqa_groups=kv_heads, normalization="RMSNorm", activation="swiglu",
bias=False, self_attn_mask_type="causal", hidden_dropout=0, attention_dropout=0)` and
`forward(x, rotary_pos_emb=RotaryPositionEmbedding(h // heads)(seq))`.

Submodules and parameter names are TE's: `self_attention` (a MultiheadAttention; its input norm
and QKV GEMM are `self_attention.layernorm_qkv`, a LayerNormLinear, or `self_attention.qkv`, a
Linear, with `output_layernorm`), `self_attention.proj`, `layernorm_mlp` and, with
`output_layernorm`, `layernorm`. The QKV parameters follow `fuse_qkv_params` (TE's default False:
`query_weight`, `key_weight`, `value_weight`; True: one `weight`, rows interleaved per KV group
unless `qkv_weight_interleaved=False`). `layer.qkv` / `layer.proj` name the two attention GEMM
modules; state dicts with older keys (top-level `qkv.` / `proj.`, `mlp.`, a norm at `norm.`, a
fused QKV `weight` for the split parameters) load.

Tensor parallelism (`tp_group` / `tp_size` / `sequence_parallel`, as TE): QKV is a column-parallel
LayerNormLinear, the output projection a row-parallel Linear and the MLP fc1-column / fc2-row;
each rank computes attention for num_attention_heads / tp_size heads (and num_gqa_groups /
tp_size KV heads). Each rank holds its chunk of `query_weight`, `key_weight` and `value_weight`;
a fused non-interleaved QKV weight's local shard is
`cat([part.chunk(tp)[r] for part in W.split([h*d, g*d, g*d])])` (the same rule as the gated MLP
halves), an interleaved one a contiguous chunk. With `sequence_parallel` the input and output are
dim-0 shards (the sequence in "sbhd"); norms, residuals and hidden dropout run on the shard
(dropout RNG is not tracked across ranks here).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import raise_error, shape_str
from .attention import canonical_mask_type
from .base import TransformerEngineBaseModule, autocast_operands, rename_state_dict_keys
from .layernorm_mlp import LayerNormMLP
from .multihead_attention import MultiheadAttention
from .normalization import LayerNorm, RMSNorm

__all__ = ["TransformerLayer"]


class TransformerLayer(TransformerEngineBaseModule):
    """Drop-in for `transformer_engine.pytorch.TransformerLayer` as an encoder layer:
    x + drop(attn(norm(x))), then + drop(mlp(norm(.))), pre-norm as TE's default; the residual
    variants below (see the module docstring for submodules and tensor parallelism). Arguments
    after `num_attention_heads` are keyword-only.

    Parameters
    ----------
    hidden_size : int
        Size of the input's and output's last dimension.
    ffn_hidden_size : int
        The MLP's inner size.
    num_attention_heads : int
        Number of query heads.
    num_gqa_groups : int, default = None
        Number of key/value heads (GQA); None is `num_attention_heads`.
    layernorm_epsilon : float, default = 1e-5
        eps of both norms.
    hidden_dropout : float, default = 0.1
        Dropout on the attention and MLP outputs before each residual add, in training mode only.
    attention_dropout : float, default = 0.1
        Dropout on the attention probabilities, in training mode only.
    init_method : Callable, default = None
        Initializes QKV and fc1 weights; None is `nn.Linear`'s Kaiming-uniform init (TE's: a
        normal with std 0.023).
    output_layer_init_method : Callable, default = None
        Initializes the attention output projection and fc2; None uses `init_method`.
    layer_number : int, default = None
        Recorded only.
    kv_channels : int, default = None
        Head dim; None is `hidden_size / num_attention_heads`.
    self_attn_mask_type : str, default = "causal"
        As `DotProductAttention`'s `attn_mask_type`; forward can override it.
    window_size : (int, int), default = None
        Sliding window, as `DotProductAttention`'s.
    bottom_right_diagonal : bool, default = None
        Diagonal alignment, as `DotProductAttention`'s.
    normalization : {"LayerNorm", "RMSNorm"}, default = "LayerNorm"
        Both norms.
    activation : str, default = "gelu"
        The MLP's activation, as `LayerNormMLP`'s ("swiglu" for Llama).
    activation_params : dict, default = None
        `LayerNormMLP`'s (clamped_swiglu's limit / alpha / glu_linear_offset).
    bias : bool, default = True
        Learn the GEMMs' biases.
    attn_input_format : {"sbhd", "bshd", "thd"}, default = "sbhd"
        Layout of `hidden_states`: [s, b, hidden], [b, s, hidden] or packed [t, hidden].
    rotary_pos_interleaved : bool, default = False
        RoPE rotates adjacent channel pairs instead of the two halves.
    zero_centered_gamma : bool, default = False
        Both norms' gammas are zero-centered (scaled by `1 + gamma`).
    params_dtype : torch.dtype, default = None
        dtype of the parameters; None is `torch.get_default_dtype()`.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    fuse_wgrad_accumulation : bool, default = False
        Weight gradients into `main_grad`, as `Linear`'s, for every GEMM.
    name : str, default = None
        The layer's name in the debug tools' configs (submodules `<name>.self_attention`,
        `<name>.mlp`); None gives `transformer_layer_<n>`.
    tp_group : torch.distributed.ProcessGroup, default = None
        The tensor-parallel group; None with `tp_size > 1` uses the default process group.
    tp_size : int, default = None
        The tensor-parallel size; None is the size of `tp_group`, or 1 without one.
    sequence_parallel : bool, default = False
        Shard dim 0 of the input and output across the TP ranks too.
    layer_type : {"encoder", "decoder"}, default = "encoder"
        "decoder" adds TE's `inter_attention` between attention and MLP: cross attention of the
        normalized hidden states to forward's `encoder_output` (not with `parallel_attention_mlp`).
    enc_dec_attn_mask_type, enc_dec_window_size, enc_dec_bottom_right_diagonal : default = "no_mask", None, None
        The decoder's cross-attention mask type and window, as `self_attn_mask_type` / `window_size`.
    apply_residual_connection_post_layernorm : bool, default = False
        The residual of each block is its norm's output instead of its input:
        norm(x) + drop(attn(norm(x))) and likewise around the MLP (with `output_layernorm`, the
        attention's residual stays x, as in TE, since it has no input norm).
    output_layernorm : bool, default = False
        Post-norm (BERT): the attention takes x unnormalized (QKV is a plain Linear) and a final
        `layernorm` normalizes the output; the MLP keeps its input norm, as in TE.
    parallel_attention_mlp : bool, default = False
        Falcon's block: attention and MLP both read x, each through its own norm:
        x + drop(attn(norm1(x)) + mlp(norm2(x))). Not with the two options above.
    fuse_qkv_params : bool, default = False
        One QKV `weight` parameter instead of TE's default `query_weight`, `key_weight`,
        `value_weight` (module docstring); needed by `fuse_wgrad_accumulation` and
        `quantized_model_init` (as in TE).
    qkv_weight_interleaved : bool, default = True
        With `fuse_qkv_params`: the fused QKV rows are grouped per KV head (else [Q; K; V]), as
        `MultiheadAttention`'s; ignored without it.
    drop_path_rate : float, default = 0.0
        Stochastic depth in training (TE's `DropPath`): after the hidden dropout, each residual
        branch (attention, MLP; their sum with `parallel_attention_mlp`) is dropped whole per
        index of dim 0 (as TE: the sequence in "sbhd", the batch in "bshd") with this
        probability, and scaled by 1 / (1 - rate) where kept. 1.0 drops every branch (TE's
        division by zero gives NaN there). Identity in eval mode and at 0.

    TE's other keywords (`set_parallel_mode`, `ub_*`, ...) are a `TypeError`."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, num_attention_heads: int, *,
                 num_gqa_groups: Optional[int] = None, layernorm_epsilon: float = 1e-5, hidden_dropout: float = 0.1,
                 attention_dropout: float = 0.1, init_method=None, output_layer_init_method=None,
                 layer_number: Optional[int] = None, kv_channels: Optional[int] = None,
                 self_attn_mask_type: str = "causal", window_size: Optional[Tuple[int, int]] = None,
                 bottom_right_diagonal: Optional[bool] = None, normalization: str = "LayerNorm",
                 activation: str = "gelu", activation_params: Optional[dict] = None, bias: bool = True,
                 attn_input_format: str = "sbhd", rotary_pos_interleaved: bool = False,
                 zero_centered_gamma: bool = False,
                 params_dtype: Optional[torch.dtype] = None, device=None, fuse_wgrad_accumulation: bool = False,
                 name: Optional[str] = None, tp_group=None, tp_size: Optional[int] = None,
                 sequence_parallel: bool = False, layer_type: str = "encoder",
                 apply_residual_connection_post_layernorm: bool = False, output_layernorm: bool = False,
                 parallel_attention_mlp: bool = False, fuse_qkv_params: bool = False,
                 qkv_weight_interleaved: bool = True, drop_path_rate: float = 0.0,
                 enc_dec_attn_mask_type: str = "no_mask", enc_dec_window_size: Optional[Tuple[int, int]] = None,
                 enc_dec_bottom_right_diagonal: Optional[bool] = None):
        super().__init__(name)
        who = f"TransformerLayer {self.name}"
        flags = dict(apply_residual_connection_post_layernorm=apply_residual_connection_post_layernorm,
                     output_layernorm=output_layernorm, parallel_attention_mlp=parallel_attention_mlp,
                     fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=qkv_weight_interleaved)
        for arg, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{who}: {arg} must be a bool, got {value!r}")
        if parallel_attention_mlp and (apply_residual_connection_post_layernorm or output_layernorm):
            raise ValueError(f"{who}: parallel_attention_mlp=True does not go with "
                             "apply_residual_connection_post_layernorm or output_layernorm (as in TE)")
        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(f"{who}: fuse_wgrad_accumulation=True needs fuse_qkv_params=True (one QKV weight "
                             "parameter), as in TE")
        if layer_type not in ("encoder", "decoder"):
            raise ValueError(f"{who}: layer_type must be 'encoder' or 'decoder', got {layer_type!r}")
        if layer_type == "decoder" and parallel_attention_mlp:
            raise NotImplementedError(f"{who}: layer_type='decoder' with parallel_attention_mlp=True is not "
                                      "supported (the cross-attention block runs between attention and MLP)")
        if kv_channels is None and hidden_size % num_attention_heads:
            raise ValueError(f"{who}: hidden_size {hidden_size} is not divisible by num_attention_heads "
                             f"{num_attention_heads}")
        want = dist.get_world_size(tp_group) if tp_group is not None else (tp_size or 1)
        if isinstance(want, int) and want > 1 and num_attention_heads % want:
            raise ValueError(f"{self.name}: num_attention_heads={num_attention_heads} is not divisible by "
                             f"tp_size={want} (heads are split across tensor-parallel ranks)")
        if not 0.0 <= drop_path_rate <= 1.0:
            raise ValueError(f"{who}: drop_path_rate must be in [0, 1], got {drop_path_rate!r}")
        self_attn_mask_type = canonical_mask_type(f"TransformerLayer {self.name}", self_attn_mask_type)
        if attn_input_format not in ("sbhd", "bshd", "thd"):
            raise ValueError(f"{who}: attn_input_format must be 'sbhd', 'bshd' or 'thd', got {attn_input_format!r}")
        self.hidden_size, self.num_heads = hidden_size, num_attention_heads
        self.self_attn_mask_type, self.attn_input_format = self_attn_mask_type, attn_input_format
        self.hidden_dropout, self.attention_dropout = hidden_dropout, attention_dropout
        self.drop_path_rate = float(drop_path_rate)
        self.apply_residual_connection_post_layernorm = apply_residual_connection_post_layernorm
        self.output_layernorm, self.parallel_attention_mlp = output_layernorm, parallel_attention_mlp
        common = dict(params_dtype=params_dtype, device=device, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel,
                      zero_centered_gamma=zero_centered_gamma, normalization=normalization,
                      init_method=init_method, output_layer_init_method=output_layer_init_method,
                      return_layernorm_output=apply_residual_connection_post_layernorm)
        self.self_attention = MultiheadAttention(
            hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon,
            layer_number=layer_number, attn_mask_type=self_attn_mask_type, window_size=window_size,
            bottom_right_diagonal=bottom_right_diagonal, num_gqa_groups=num_gqa_groups,
            input_layernorm=not output_layernorm, set_parallel_mode=True, fuse_qkv_params=fuse_qkv_params,
            qkv_weight_interleaved=qkv_weight_interleaved, rotary_pos_interleaved=rotary_pos_interleaved,
            bias=bias, qkv_format=attn_input_format, name=f"{self.name}.self_attention", **common)
        self.layer_type = layer_type
        if layer_type == "decoder":  # TE's inter_attention: the query normalized, keys / values from the encoder
            self.inter_attention = MultiheadAttention(
                hidden_size, num_attention_heads, kv_channels, attention_dropout, layernorm_epsilon,
                layer_number=layer_number,
                attn_mask_type=canonical_mask_type(f"TransformerLayer {self.name}", enc_dec_attn_mask_type),
                window_size=enc_dec_window_size, bottom_right_diagonal=enc_dec_bottom_right_diagonal,
                num_gqa_groups=num_gqa_groups, input_layernorm=True, attention_type="cross", set_parallel_mode=True,
                fuse_qkv_params=fuse_qkv_params, qkv_weight_interleaved=qkv_weight_interleaved,
                rotary_pos_interleaved=rotary_pos_interleaved, bias=bias, qkv_format=attn_input_format,
                name=f"{self.name}.inter_attention", **common)
        self.layernorm_mlp = LayerNormMLP(hidden_size, ffn_hidden_size, layernorm_epsilon, bias,
                                          activation=activation, activation_params=activation_params,
                                          name=f"{self.name}.layernorm_mlp", **common)
        self.tp_size = self.self_attention.tp_size
        self.sequence_parallel = self.self_attention.sequence_parallel
        if output_layernorm:
            norm = RMSNorm if normalization == "RMSNorm" else LayerNorm
            self.layernorm = norm(hidden_size, layernorm_epsilon, zero_centered_gamma=zero_centered_gamma,
                                  params_dtype=params_dtype, device=device, name=f"{self.name}.layernorm")
            for p in self.layernorm.parameters() if self.sequence_parallel else ():
                p.sequence_parallel = True  # TE's LayerNorm(sequence_parallel=True): partial grads
        self.local_heads = self.self_attention.heads_local
        self.local_hidden = self.local_heads * self.self_attention.kv_channels
        self._register_load_state_dict_pre_hook(_load_older_state_dict, with_module=True)

    @property
    def qkv(self):
        return self.self_attention.qkv_linear

    @property
    def proj(self):
        return self.self_attention.proj

    @property
    def causal(self) -> bool:
        return "causal" in self.self_attn_mask_type

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, self_attn_mask_type: Optional[str] = None,
                window_size: Optional[Tuple[int, int]] = None, encoder_output=None, enc_dec_attn_mask=None,
                is_first_microbatch: Optional[bool] = None, checkpoint_core_attention: bool = False,
                inference_params=None, rotary_pos_emb=None, core_attention_bias_type: str = "no_bias",
                core_attention_bias=None, alibi_slopes=None, cu_seqlens_q: Optional[torch.Tensor] = None,
                cu_seqlens_kv: Optional[torch.Tensor] = None, cu_seqlens_q_padded: Optional[torch.Tensor] = None,
                cu_seqlens_kv_padded: Optional[torch.Tensor] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_kv: Optional[int] = None, bottom_right_diagonal: Optional[bool] = None,
                fast_zero_fill: bool = True, pad_between_seqs: Optional[bool] = None,
                enc_dec_attn_mask_type: Optional[str] = None, enc_dec_window_size: Optional[Tuple[int, int]] = None,
                enc_dec_bottom_right_diagonal: Optional[bool] = None) -> torch.Tensor:
        """The layer's output, shaped as `hidden_states`.

        Parameters
        ----------
        hidden_states : torch.Tensor
            Per `attn_input_format`; with `sequence_parallel`, this rank's dim-0 shard.
        attention_mask : torch.Tensor or (torch.Tensor, torch.Tensor), default = None
            As `DotProductAttention.forward`'s (True = masked out).
        self_attn_mask_type, window_size, bottom_right_diagonal : default = None
            Override the constructor's for this call.
        encoder_output, enc_dec_attn_mask : default = None
            The decoder's cross attention: keys / values and their mask (`layer_type="decoder"`; a
            `ValueError` for an encoder).
        enc_dec_attn_mask_type, enc_dec_window_size, enc_dec_bottom_right_diagonal : default = None
            Override the constructor's for the cross attention of this call.
        is_first_microbatch : {None, True, False}, default = None
            Weight caching over gradient-accumulation micro-batches, as in `Linear.forward`.
        checkpoint_core_attention : bool, default = False
            Recompute attention (not the GEMMs) in backward.
        inference_params : object, default = None
            Only None: the KV cache is not supported (`NotImplementedError` otherwise).
        rotary_pos_emb : torch.Tensor or (torch.Tensor, torch.Tensor), default = None
            RoPE frequencies [s, 1, 1, d] (`RotaryPositionEmbedding(d)(s)`), or a (query, key) pair.
        core_attention_bias_type, core_attention_bias, alibi_slopes : default = "no_bias", None, None
            Attention bias / ALiBi are not supported (`NotImplementedError` otherwise).
        cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded : torch.Tensor, default = None
            Packed-sequence boundaries, as `DotProductAttention.forward`'s.
        max_seqlen_q, max_seqlen_kv : int, default = None
            Accepted and not needed.
        fast_zero_fill : bool, default = True
            Accepted; rows no key may attend are zeros either way.
        pad_between_seqs : bool, default = None
            True: RoPE positions come from the padded `cu_seqlens_*_padded`.
        """
        self._check_input(hidden_states, self.hidden_size, "hidden_states")
        rank = 2 if self.attn_input_format == "thd" else 3
        if hidden_states.dim() != rank:
            raise_error(ValueError, f"{self.name}: hidden_states must be {rank}D ({self.attn_input_format}), "
                                    f"got {shape_str(hidden_states)}")
        (hidden_states,) = autocast_operands(hidden_states)  # TE: under AMP the layer runs in its dtype
        if self.layer_type == "encoder" and (encoder_output is not None or enc_dec_attn_mask is not None):
            raise_error(ValueError, f"{self.name}: encoder_output / enc_dec_attn_mask need layer_type='decoder'")
        mb = dict(is_first_microbatch=is_first_microbatch)
        # the per-call attention arguments both attention blocks take, as TE passes them
        call = dict(is_first_microbatch=is_first_microbatch, checkpoint_core_attention=checkpoint_core_attention,
                    inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
                    core_attention_bias_type=core_attention_bias_type, core_attention_bias=core_attention_bias,
                    alibi_slopes=alibi_slopes, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv,
                    cu_seqlens_q_padded=cu_seqlens_q_padded, cu_seqlens_kv_padded=cu_seqlens_kv_padded,
                    max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, fast_zero_fill=fast_zero_fill,
                    pad_between_seqs=pad_between_seqs)
        attn = self.self_attention(hidden_states, attention_mask=attention_mask, attn_mask_type=self_attn_mask_type,
                                   window_size=window_size, bottom_right_diagonal=bottom_right_diagonal, **call)
        residual = hidden_states
        if isinstance(attn, tuple):  # apply_residual_connection_post_layernorm with the input norm
            attn, residual = attn
        if self.parallel_attention_mlp:
            return hidden_states + self._dropout(attn + self.layernorm_mlp(hidden_states, **mb))
        x = residual + self._dropout(attn)
        if self.layer_type == "decoder":
            inter = self.inter_attention(x, attention_mask=enc_dec_attn_mask, encoder_output=encoder_output,
                                         attn_mask_type=enc_dec_attn_mask_type, window_size=enc_dec_window_size,
                                         bottom_right_diagonal=enc_dec_bottom_right_diagonal, **call)
            residual = x
            if isinstance(inter, tuple):  # apply_residual_connection_post_layernorm: the normalized query
                inter, residual = inter
            x = residual + self._dropout(inter)
        mlp, residual = self.layernorm_mlp(x, **mb), x
        if isinstance(mlp, tuple):
            mlp, residual = mlp
        out = residual + self._dropout(mlp)
        return self.layernorm(out) if self.output_layernorm else out

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """A residual branch's hidden dropout, then its drop path."""
        return drop_path(F.dropout(x, self.hidden_dropout, self.training), self.drop_path_rate, self.training)


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """TE's `DropPath` (stochastic depth): in training, each index of dim 0 keeps its slice with
    probability 1 - rate, scaled by 1 / (1 - rate) so the expectation is unchanged, or zeroes it.
    The same ops as TE's (a uniform draw in x's dtype, floored), so a seed draws the same mask."""
    if rate == 0.0 or not training:
        return x
    keep = 1.0 - rate
    mask = (keep + torch.rand((x.shape[0],) + (1,) * (x.dim() - 1), dtype=x.dtype, device=x.device)).floor_()
    return x.div(keep) * mask if keep > 0.0 else x * mask


def _load_older_state_dict(module, state_dict, prefix, *args):
    """Older state dicts kept QKV / proj at top-level `qkv.` / `proj.`, the MLP at `mlp.`, and the
    input norm + QKV at `self_attention.qkv.` with one QKV weight of [Q; K; V] rows (split here
    into TE's query / key / value parameters)."""
    rename_state_dict_keys(state_dict, prefix, {"qkv.": "self_attention.qkv.", "proj.": "self_attention.proj.",
                                                "mlp.": "layernorm_mlp."})
    old = prefix + "self_attention.qkv."
    if module.output_layernorm or not any(k.startswith(old) for k in state_dict):
        return
    rename_state_dict_keys(state_dict, prefix, {"self_attention.qkv.": "self_attention.layernorm_qkv."})
    qkv, new = module.self_attention.layernorm_qkv, prefix + "self_attention.layernorm_qkv."
    if module.self_attention.qkv_weight_interleaved:
        raise ValueError(f"TransformerLayer {module.name}: this state dict's QKV weight has [Q; K; V] rows: load it "
                         "with fuse_qkv_params=False or qkv_weight_interleaved=False")
    if len(qkv.weight_names) > 1:
        for fused, names in (("weight", qkv.weight_names), ("bias", qkv.bias_names)):
            if new + fused in state_dict:
                parts = state_dict.pop(new + fused).split(qkv.parameter_split_sizes)
                state_dict.update({new + n: part for n, part in zip(names, parts)})
