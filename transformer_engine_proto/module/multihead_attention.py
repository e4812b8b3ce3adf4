"""`MultiheadAttention`: QKV projection -> RoPE -> DotProductAttention -> output projection.

QKV and the output projection are our quantized `LayerNormLinear` / `Linear`, so every recipe
applies to them; attention itself runs in high precision (`DotProductAttention`), so forward
refuses a recipe with `fp8_dpa` / `fp8_mha` set before any projection runs.

Submodules, TE's names: self attention projects to h*d + 2*g*d features in one GEMM,
`layernorm_qkv` (a LayerNormLinear, with `input_layernorm=True`) or `qkv` (a Linear); cross
attention takes the query from `hidden_states` (`layernorm_query` or `query_layer`) and keys and
values from `encoder_output` (`key_value`); then `core_attention` and `proj`.

QKV parameters as TE exposes them: with `fuse_qkv_params=True` one `weight` (and `bias`) whose
rows, with `qkv_weight_interleaved=True`, are grouped per KV head, [g, h/g + 2, d] (the h/g query
heads of a group, then its key, then its value), else [Q (h*d); K (g*d); V (g*d)]. With
`fuse_qkv_params=False` (TE's default) `query_weight`, `key_weight`, `value_weight` (and biases),
rows [Q; K; V] (interleaving is off, as in TE); the GEMM runs on them concatenated. Tensor
parallel (`set_parallel_mode=True`, tp_size > 1): QKV column-parallel, proj row-parallel, each
rank computing h/tp query and g/tp KV heads; the interleaved layout shards as a contiguous chunk,
the other as the rank's chunk of each of Q, K, V.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist

from ..errors import raise_error, shape_str
from .attention import DotProductAttention, check_no_fp8_attention
from .base import TransformerEngineBaseModule, rename_state_dict_keys
from .layernorm_linear import LayerNormLinear
from .linear import Linear
from .rope import apply_rotary_pos_emb

__all__ = ["MultiheadAttention"]

_UB = ("ub_overlap_ag", "ub_overlap_rs", "ub_overlap_rs_dgrad", "ub_bulk_dgrad", "ub_bulk_wgrad")


class MultiheadAttention(TransformerEngineBaseModule):
    """Drop-in for `transformer_engine.pytorch.MultiheadAttention` (TE's arguments and defaults).

    hidden_states: [s, b, hidden] ("sbhd"), [b, s, hidden] ("bshd") or [t, hidden] ("thd", with
    cu_seqlens_q / cu_seqlens_kv). `rotary_pos_emb`: frequencies [s, 1, 1, d] from
    `RotaryPositionEmbedding(d)(max_seq_len)`, or a (query, key) pair of them.

    Parameters
    ----------
    hidden_size : int
        Size of the input's and output's last dimension.
    num_attention_heads : int
        Number of query heads (all ranks together).
    kv_channels : int, default = None
        Head dim (one for q, k and v); None is `hidden_size / num_attention_heads`.
    attention_dropout : float, default = 0.1
        Dropout on the attention probabilities, in training mode only (TE's default 0.1).
    layernorm_epsilon : float, default = 1e-5
        The input norm's eps (with `input_layernorm`).
    init_method : Callable, default = None
        Initializes the QKV (query, key/value) weights; None is `nn.Linear`'s Kaiming-uniform
        init (TE's: a normal with std 0.023).
    output_layer_init_method : Callable, default = None
        Initializes the output projection's weight; None uses `init_method`.
    layer_number : int, default = None
        Recorded only.
    attn_mask_type : str, default = "causal"
        As `DotProductAttention`'s; forward can override it.
    window_size : (int, int), default = None
        Sliding window, as `DotProductAttention`'s.
    bottom_right_diagonal : bool, default = None
        Diagonal alignment, as `DotProductAttention`'s.
    tp_group : torch.distributed.ProcessGroup, default = None
        The tensor-parallel group (with `set_parallel_mode=True`).
    tp_size : int, default = 1
        The tensor-parallel size; a `tp_group`'s size replaces it.
    num_gqa_groups : int, default = None
        Number of key/value heads (GQA); None is `num_attention_heads`.
    fuse_wgrad_accumulation : bool, default = False
        Weight gradients into `main_grad`, as `Linear`'s, for every projection.
    get_rng_state_tracker : Callable, default = None
        Only None (`NotImplementedError` otherwise): dropout uses torch's RNG.
    sequence_parallel : bool, default = False
        Shard dim 0 of the input and output across the TP ranks (the sequence, in "sbhd").
    params_dtype : torch.dtype, default = None
        dtype of the parameters; None is `torch.get_default_dtype()`.
    return_bias : bool, default = False
        Leave the output projection's bias out and return it after the output.
    return_layernorm_output : bool, default = False
        With `input_layernorm`, also return the norm's output (last); ignored without it.
    input_layernorm : bool, default = False
        Normalize the input inside the QKV (self) or query (cross) projection, a `LayerNormLinear`.
    attention_type : {"self", "cross"}, default = "self"
        Cross attention takes keys and values from forward's `encoder_output` (submodules
        `layernorm_query` / `query_layer` and `key_value` instead of `layernorm_qkv` / `qkv`).
    set_parallel_mode : bool, default = False
        Column-parallel QKV and row-parallel output projection; required when the TP size is
        above 1 (a `ValueError` otherwise).
    fuse_qkv_params : bool, default = False
        One fused QKV `weight` parameter (True), or TE's separate `query_weight` / `key_weight` /
        `value_weight` (False; also forces `qkv_weight_interleaved=False`, as TE). False is not
        possible with `fuse_wgrad_accumulation` or `quantized_model_init` (as in TE).
    zero_centered_gamma : bool, default = False
        The input norm's gamma is zero-centered (scaled by `1 + gamma`).
    qkv_weight_interleaved : bool, default = True
        Row layout of the fused QKV (and key/value) weight: grouped per KV head, or Q; K; V (above);
        only with `fuse_qkv_params=True`.
    rotary_pos_interleaved : bool, default = False
        RoPE rotates adjacent channel pairs (GPT-J) instead of the two halves (GPT-NeoX / Llama).
    ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad : bool, default = False
        Userbuffers overlap is not supported: only False (`NotImplementedError` otherwise).
    bias : bool, default = True
        Learn the projections' biases, initialized to zero.
    normalization : {"LayerNorm", "RMSNorm"}, default = "LayerNorm"
        The input norm (with `input_layernorm`).
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    qkv_format : {"sbhd", "bshd", "thd"}, default = "sbhd"
        Layout of `hidden_states` (above).
    name : str, default = None
        The layer's name in the debug tools' configs; its projections are TE's
        `<name>.layernorm_linear_qkv` / `.linear_qkv`, `.layernorm_linear_q` / `.linear_q`,
        `.linear_kv` and `.proj`. None gives `multihead_attention_<n>`.
    qk_norm_type : str, default = None
        Only None: normalizing Q and K is not supported (`NotImplementedError` otherwise).
    qk_norm_eps : float, default = 1e-6
        Accepted and unused (no Q/K norm).
    qk_norm_before_rope : bool, default = False
        Accepted and unused (no Q/K norm).
    seq_length : int, default = None
        Accepted and unused: shapes come from the input.
    micro_batch_size : int, default = None
        Accepted and unused: shapes come from the input.
    softmax_type : str, default = "vanilla"
        Only "vanilla" (`NotImplementedError` otherwise).

    Any other keyword is a `TypeError`. FP8 attention is not implemented: forward raises
    `NotImplementedError` when the active `te.autocast` recipe sets `fp8_dpa` or `fp8_mha`."""

    def __init__(self, hidden_size: int, num_attention_heads: int, kv_channels: Optional[int] = None,
                 attention_dropout: float = 0.1, layernorm_epsilon: float = 1e-5, init_method=None,
                 output_layer_init_method=None, layer_number: Optional[int] = None, attn_mask_type: str = "causal",
                 window_size: Optional[Tuple[int, int]] = None, bottom_right_diagonal: Optional[bool] = None,
                 tp_group=None, tp_size: Optional[int] = 1, num_gqa_groups: Optional[int] = None,
                 fuse_wgrad_accumulation: bool = False, get_rng_state_tracker=None, sequence_parallel: bool = False,
                 params_dtype: Optional[torch.dtype] = None, return_bias: bool = False,
                 return_layernorm_output: bool = False, input_layernorm: bool = False, attention_type: str = "self",
                 set_parallel_mode: bool = False, fuse_qkv_params: bool = False, zero_centered_gamma: bool = False,
                 qkv_weight_interleaved: bool = True, rotary_pos_interleaved: bool = False,
                 ub_overlap_ag: bool = False, ub_overlap_rs: bool = False, ub_overlap_rs_dgrad: bool = False,
                 ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False, bias: bool = True,
                 normalization: str = "LayerNorm", device=None, qkv_format: str = "sbhd", name: Optional[str] = None,
                 qk_norm_type: Optional[str] = None, qk_norm_eps: float = 1e-6, qk_norm_before_rope: bool = False,
                 seq_length: Optional[int] = None, micro_batch_size: Optional[int] = None,
                 softmax_type: str = "vanilla", **unsupported):
        super().__init__(name)
        who = f"MultiheadAttention {self.name}"
        if unsupported:
            raise TypeError(f"{who}: unsupported arguments {sorted(unsupported)}")
        ub_flags = (ub_overlap_ag, ub_overlap_rs, ub_overlap_rs_dgrad, ub_bulk_dgrad, ub_bulk_wgrad)
        ub = [n for n, v in zip(_UB, ub_flags) if v]
        if ub:
            raise NotImplementedError(f"{who}: userbuffers overlap ({', '.join(ub)}) is not supported")
        if qk_norm_type is not None:
            raise NotImplementedError(f"{who}: qk_norm_type={qk_norm_type!r} is not supported")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{who}: attention_type must be 'self' or 'cross', got {attention_type!r}")
        if kv_channels is None:
            if num_attention_heads <= 0 or hidden_size % num_attention_heads:
                raise ValueError(f"{who}: hidden_size {hidden_size} is not divisible by num_attention_heads "
                                 f"{num_attention_heads} (or pass kv_channels)")
            kv_channels = hidden_size // num_attention_heads
        if not isinstance(kv_channels, int) or kv_channels <= 0:
            raise ValueError(f"{who}: kv_channels must be a positive int (one head dim for q, k and v), "
                             f"got {kv_channels!r}")
        tp = dist.get_world_size(tp_group) if tp_group is not None else (tp_size or 1)
        if tp > 1 and not set_parallel_mode:
            raise ValueError(f"{who}: tp_size={tp} needs set_parallel_mode=True "
                             "(column-parallel QKV, row-parallel proj)")
        self.core_attention = DotProductAttention(
            num_attention_heads, kv_channels, num_gqa_groups, attention_dropout, qkv_format, attn_mask_type,
            window_size, bottom_right_diagonal, sequence_parallel, tp_size or 1, None, tp_group, layer_number,
            attention_type, softmax_type=softmax_type, name=f"{self.name}.core_attention")
        if get_rng_state_tracker is not None:
            raise NotImplementedError(f"{who}: get_rng_state_tracker is not supported (dropout uses torch's RNG)")
        self.hidden_size, self.num_attention_heads, self.kv_channels = hidden_size, num_attention_heads, kv_channels
        self.num_gqa_groups = self.core_attention.num_gqa_groups
        self.attention_type, self.qkv_format, self.input_layernorm = attention_type, qkv_format, input_layernorm
        if not fuse_qkv_params:
            qkv_weight_interleaved = False  # TE: separate Q, K, V parameters are [Q; K; V]
        self.qkv_weight_interleaved, self.rotary_pos_interleaved = qkv_weight_interleaved, rotary_pos_interleaved
        self.fuse_qkv_params, self.layer_number = fuse_qkv_params, layer_number
        self.return_bias, self.return_layernorm_output = return_bias, return_layernorm_output and input_layernorm
        self.heads_local = self.core_attention.heads_per_partition
        self.groups_local = self.core_attention.groups_per_partition
        h, g, d = num_attention_heads, self.num_gqa_groups, kv_channels
        common = dict(params_dtype=params_dtype, device=device, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                      tp_group=tp_group, tp_size=tp_size, sequence_parallel=sequence_parallel, bias=bias,
                      init_method=init_method, parallel_mode="column" if tp > 1 else None)
        ln = dict(eps=layernorm_epsilon, normalization=normalization, zero_centered_gamma=zero_centered_gamma,
                  return_layernorm_output=self.return_layernorm_output)

        def split(*parts):  # TE's separate parameters without fuse_qkv_params
            return None if fuse_qkv_params else dict(parts)

        if fuse_wgrad_accumulation and not fuse_qkv_params:
            raise ValueError(f"{who}: fuse_wgrad_accumulation=True needs fuse_qkv_params=True (one QKV weight "
                             "parameter), as in TE")
        if attention_type == "self":
            qkv_split = split(("query", h * d), ("key", g * d), ("value", g * d))
            if input_layernorm:
                self.layernorm_qkv = LayerNormLinear(hidden_size, (h + 2 * g) * d, parameters_split=qkv_split,
                                                     name=f"{self.name}.layernorm_linear_qkv", **ln, **common)
            else:
                self.qkv = Linear(hidden_size, (h + 2 * g) * d, parameters_split=qkv_split,
                                  name=f"{self.name}.linear_qkv", **common)
        else:
            if input_layernorm:
                self.layernorm_query = LayerNormLinear(hidden_size, h * d, parameters_split=split(("query", h * d)),
                                                       name=f"{self.name}.layernorm_linear_q", **ln, **common)
            else:
                self.query_layer = Linear(hidden_size, h * d, name=f"{self.name}.linear_q", **common)
            self.key_value = Linear(hidden_size, 2 * g * d, parameters_split=split(("key", g * d), ("value", g * d)),
                                    name=f"{self.name}.linear_kv", **common)
        proj_common = dict(common, init_method=output_layer_init_method or init_method,
                           parallel_mode="row" if tp > 1 else None)
        self.proj = Linear(h * d, hidden_size, return_bias=return_bias, name=f"{self.name}.proj", **proj_common)
        self.tp_size, self.sequence_parallel = self.proj.tp_size, self.proj.sequence_parallel
        self._register_load_state_dict_pre_hook(_rename_old_keys, with_module=True)

    @property
    def qkv_linear(self):
        """The module projecting `hidden_states`: `layernorm_qkv` / `qkv` (self attention) or
        `layernorm_query` / `query_layer` (cross attention)."""
        return getattr(self, self._qkv_linear_name())

    def _qkv_linear_name(self) -> str:
        if self.attention_type == "self":
            return "layernorm_qkv" if self.input_layernorm else "qkv"
        return "layernorm_query" if self.input_layernorm else "query_layer"

    def _split_qkv(self, qkv: torch.Tensor):
        lead, hl, gl, d = qkv.shape[:-1], self.heads_local, self.groups_local, self.kv_channels
        if self.qkv_weight_interleaved:
            t = qkv.view(*lead, gl, hl // gl + 2, d)
            q = t[..., : hl // gl, :].reshape(*lead, hl, d)
            return q, t[..., -2, :], t[..., -1, :]
        q, k, v = qkv.split([hl * d, gl * d, gl * d], dim=-1)
        return q.view(*lead, hl, d), k.view(*lead, gl, d), v.view(*lead, gl, d)

    def _split_kv(self, kv: torch.Tensor):
        lead, gl, d = kv.shape[:-1], self.groups_local, self.kv_channels
        if self.qkv_weight_interleaved:
            t = kv.view(*lead, gl, 2, d)
            return t[..., 0, :], t[..., 1, :]
        k, v = kv.chunk(2, dim=-1)
        return k.view(*lead, gl, d), v.view(*lead, gl, d)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, encoder_output: Optional[torch.Tensor] = None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                bottom_right_diagonal: Optional[bool] = None, is_first_microbatch: Optional[bool] = None,
                checkpoint_core_attention: bool = False, inference_params=None, rotary_pos_emb=None,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None, alibi_slopes=None,
                cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None, cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None, fast_zero_fill: bool = True,
                pad_between_seqs: Optional[bool] = None):
        """Attention of `hidden_states` (to `encoder_output` for cross attention), projected back
        to `hidden_size`; then the projection's bias with `return_bias` and the norm output with
        `return_layernorm_output` (a tuple when more than `out`).

        Parameters
        ----------
        hidden_states : torch.Tensor
            [s, b, hidden], [b, s, hidden] or [t, hidden], per `qkv_format`.
        attention_mask : torch.Tensor or (torch.Tensor, torch.Tensor), default = None
            As `DotProductAttention.forward`'s (True = masked out).
        encoder_output : torch.Tensor, default = None
            Keys and values for cross attention (required there, an error for self attention).
        attn_mask_type, window_size, bottom_right_diagonal : default = None
            Override the constructor's for this call.
        is_first_microbatch : {None, True, False}, default = None
            Weight caching over gradient-accumulation micro-batches, as in `Linear.forward`.
        checkpoint_core_attention : bool, default = False
            Recompute attention (not the projections) in backward.
        inference_params : object, default = None
            Only None: the KV cache is not supported (`NotImplementedError` otherwise).
        rotary_pos_emb : torch.Tensor or (torch.Tensor, torch.Tensor), default = None
            RoPE frequencies [s, 1, 1, d] for queries and keys, or a (query, key) pair.
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

        An active `te.autocast` recipe with `fp8_dpa` or `fp8_mha` set is a `NotImplementedError`.
        """
        who = f"MultiheadAttention {self.name}"
        check_no_fp8_attention(who)
        self._check_input(hidden_states, self.hidden_size, "hidden_states")
        rank = 2 if self.qkv_format == "thd" else 3
        if hidden_states.dim() != rank:
            raise_error(ValueError, f"{who}: hidden_states must be {rank}D for qkv_format {self.qkv_format!r}, "
                                    f"got {shape_str(hidden_states)}")
        mb = dict(is_first_microbatch=is_first_microbatch)
        ln_out = None
        if self.attention_type == "self":
            if encoder_output is not None:
                raise_error(ValueError, f"{who}: encoder_output is only used with attention_type='cross'")
            qkv = self.qkv_linear(hidden_states, **mb)
            if self.return_layernorm_output:
                qkv, ln_out = qkv
            q, k, v = self._split_qkv(qkv)
        else:
            if encoder_output is None:
                raise_error(ValueError, f"{who}: attention_type='cross' needs encoder_output")
            self._check_input(encoder_output, self.hidden_size, "encoder_output")
            q = self.qkv_linear(hidden_states, **mb)
            if self.return_layernorm_output:
                q, ln_out = q
            q = q.view(*q.shape[:-1], self.heads_local, self.kv_channels)
            k, v = self._split_kv(self.key_value(encoder_output, **mb))
        if rotary_pos_emb is not None:
            q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
            cu_q = cu_seqlens_q_padded if pad_between_seqs else cu_seqlens_q
            cu_kv = cu_seqlens_kv_padded if pad_between_seqs else cu_seqlens_kv
            inter = self.rotary_pos_interleaved
            q = apply_rotary_pos_emb(q, q_emb, self.qkv_format, interleaved=inter, cu_seqlens=cu_q)
            k = apply_rotary_pos_emb(k, k_emb, self.qkv_format, interleaved=inter, cu_seqlens=cu_kv)
        ctx = self.core_attention(
            q, k, v, attention_mask=attention_mask, qkv_format=self.qkv_format, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            attn_mask_type=attn_mask_type, window_size=window_size, bottom_right_diagonal=bottom_right_diagonal,
            checkpoint_core_attention=checkpoint_core_attention, core_attention_bias_type=core_attention_bias_type,
            core_attention_bias=core_attention_bias, alibi_slopes=alibi_slopes, fast_zero_fill=fast_zero_fill,
            inference_params=inference_params)
        out = self.proj(ctx.contiguous(), **mb)
        outputs = out if isinstance(out, tuple) else (out,)
        if ln_out is not None:
            outputs += (ln_out,)
        return outputs if len(outputs) > 1 else outputs[0]

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, heads={self.num_attention_heads}, gqa_groups={self.num_gqa_groups}, "
                f"kv_channels={self.kv_channels}, attention_type={self.attention_type!r}, name={self.name!r}")


def _rename_old_keys(module, state_dict, prefix, *args):
    """Checkpoints written before the projections took TE's names had `qkv.` / `query.`."""
    old = "qkv." if module.attention_type == "self" else "query."
    rename_state_dict_keys(state_dict, prefix, {old: module._qkv_linear_name() + "."})
