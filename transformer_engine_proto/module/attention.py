"""`DotProductAttention`: TE's core attention (softmax(Q K^T * scale + mask) V) on torch's SDPA.

Attention runs in the inputs' precision (bf16 / fp32; TE's default `fp8_dpa=False`) through
`F.scaled_dot_product_attention`; a recipe asking for FP8 attention (`fp8_dpa` / `fp8_mha`) is
refused in forward (`check_no_fp8_attention`) rather than run in high precision unnoticed.
Masks: `is_causal=True` for plain top-left causal masks, no mask for "no_mask", and otherwise an
explicit boolean mask built on the device from token positions (padding, bottom-right causal,
sliding windows, "arbitrary", and the document mask of packed "thd" input). Building it needs no
host sync and no data-dependent Python, so every case traces with `torch.compile(fullgraph=True)`;
`cu_seqlens` is a tensor input, so a new split of the same token count reuses the compiled graph.

Why not FlexAttention: on torch 2.13 CPU `flex_attention` has no backward ("FlexAttention does not
support backward on CPU"), so it cannot train here; the explicit mask costs O(s_q * s_kv) bools per
batch element (for "thd": per packed batch) and computes the masked-out blocks.

Rows that no key may attend (padded query tokens, the first rows of a bottom-right mask with
s_q > s_kv) return zeros, as TE's fused backends do.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

from ..autocast import entered_recipe
from ..errors import raise_error, shape_str
from .base import TransformerEngineBaseModule
from .rope import token_positions

__all__ = ["DotProductAttention", "ATTN_MASK_TYPES", "QKV_FORMATS", "attention_mask_from_positions",
           "check_no_fp8_attention"]

ATTN_MASK_TYPES = ("no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
                   "padding_causal_bottom_right", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd", "thd")
_THD_MASK = {"no_mask": "padding", "causal": "padding_causal", "causal_bottom_right": "padding_causal_bottom_right"}
_PADDING_MASK_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right")


def canonical_mask_type(who: str, mask_type: str) -> str:
    mask_type = mask_type.replace(",", "_")
    if mask_type == "causal_padding":
        mask_type = "padding_causal"
    if mask_type not in ATTN_MASK_TYPES:
        raise_error(ValueError, f"{who}: attn_mask_type must be one of {ATTN_MASK_TYPES}, got {mask_type!r}")
    return mask_type


def check_no_fp8_attention(who: str) -> None:
    """Refuse an autocast recipe with `fp8_dpa` / `fp8_mha` set: FP8 attention is not implemented,
    and running attention in high precision instead would hide that the flag has no effect."""
    recipe = entered_recipe()
    flags = [f for f in ("fp8_dpa", "fp8_mha") if getattr(recipe, f, False)]
    if flags:
        on, off = " and ".join(f"{f}=True" for f in flags), ", ".join(f"{f}=False" for f in flags)
        raise_error(NotImplementedError, f"{who}: the te.autocast recipe {type(recipe).__name__} sets {on}, but FP8 "
                                         f"attention is not implemented here: attention runs in high precision "
                                         f"(the inputs' dtype). Build the recipe with {off}; its other settings "
                                         "still apply to the Linear layers")


def check_window(who: str, window_size) -> Tuple[int, int]:
    """TE's (left, right) window; None and (-1, -1) mean no window, -1 on a side means unbounded."""
    if window_size is None:
        return (-1, -1)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window_size)):
        raise_error(ValueError, f"{who}: window_size must be a (left, right) tuple of ints >= -1, got {window_size!r}")
    return (int(window_size[0]), int(window_size[1]))


def attention_mask_from_positions(q_pos, kv_pos, mask_type: str, window: Tuple[int, int], offset=None,
                                  q_valid=None, kv_valid=None, q_seq=None, kv_seq=None) -> Optional[torch.Tensor]:
    """Boolean "may attend" mask [..., s_q, s_kv] (True = attend, SDPA's convention).

    q_pos / kv_pos: positions inside each sequence ([..., s_q] / [..., s_kv]); offset: per-query
    shift of the diagonal (0: top-left alignment, len_kv - len_q: bottom-right); q_valid /
    kv_valid: padding; q_seq / kv_seq: sequence ids of packed tokens (block-diagonal mask).
    Query i may attend key j when i + offset - left <= j <= i + offset + right (causal: right = 0)."""
    mask = None

    def _and(m, c):
        return c if m is None else m & c

    left, right = window
    if "causal" in mask_type:
        right = 0
    if left >= 0 or right >= 0:
        qi = q_pos if offset is None else q_pos + offset
        d = qi.unsqueeze(-1) - kv_pos.unsqueeze(-2)  # i + offset - j
        if right >= 0:
            mask = _and(mask, d >= -right)
        if left >= 0:
            mask = _and(mask, d <= left)
    if q_valid is not None:
        mask = _and(mask, q_valid.unsqueeze(-1) & kv_valid.unsqueeze(-2))
    if q_seq is not None:
        mask = _and(mask, q_seq.unsqueeze(-1) == kv_seq.unsqueeze(-2))
    return mask


def _to_bhsd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "bshd":
        return t.transpose(1, 2)
    if fmt == "sbhd":
        return t.permute(1, 2, 0, 3)
    return t.transpose(0, 1).unsqueeze(0)  # thd -> [1, h, t, d]


def _from_bhsd(o: torch.Tensor, fmt: str) -> torch.Tensor:
    b, h, s, d = o.shape
    if fmt == "bshd":
        return o.transpose(1, 2).reshape(b, s, h * d)
    if fmt == "sbhd":
        return o.permute(2, 0, 1, 3).reshape(s, b, h * d)
    return o.squeeze(0).transpose(0, 1).reshape(s, h * d)


class DotProductAttention(TransformerEngineBaseModule):
    """Drop-in for `transformer_engine.pytorch.DotProductAttention` (high-precision attention).

    Inputs: "sbhd" [s, b, h, d], "bshd" [b, s, h, d] or "thd" [t, h, d] (packed sequences with
    `cu_seqlens_q` / `cu_seqlens_kv` [b + 1]); output with heads folded: [s, b, h*d], [b, s, h*d]
    or [t, h*d]. GQA / MQA: `num_gqa_groups` key/value heads. `attention_mask` follows TE: True
    means masked out; "padding*" takes [b, 1, 1, s] (a (q, kv) tuple for cross attention) or
    `cu_seqlens_q` / `cu_seqlens_kv`; "arbitrary" a mask broadcastable to [b, h, s_q, s_kv]; the
    other mask types ("no_mask", "causal", "causal_bottom_right") ignore an attention_mask, as TE
    does (TE's tests pass a causal mask with "causal").

    Parameters
    ----------
    num_attention_heads : int
        Number of query heads (all ranks together under tensor parallelism).
    kv_channels : int or (int, int)
        Head dim of queries and keys, and of values; one int for both.
    num_gqa_groups : int, default = None
        Number of key/value heads (GQA; 1 is MQA); None is `num_attention_heads`. Must divide
        `num_attention_heads`.
    attention_dropout : float, default = 0.0
        Dropout on the attention probabilities, in training mode only, from torch's RNG.
    qkv_format : {"sbhd", "bshd", "thd"}, default = "sbhd"
        Layout of the inputs and output (above); forward can override it.
    attn_mask_type : str, default = "causal"
        One of "no_mask", "padding", "causal", "padding_causal", "causal_bottom_right",
        "padding_causal_bottom_right", "arbitrary" (also spelled "causal_padding", or with commas
        for underscores); forward can override it.
    window_size : (int, int), default = None
        Sliding window (left, right) in tokens, -1 meaning unbounded on that side; None and
        (-1, -1) are no window; causal mask types force right = 0.
    bottom_right_diagonal : bool, default = None
        Align the causal diagonal and the window to the bottom-right corner of the score matrix
        (True) or the top-left (False). None: top-left for "causal" / "padding_causal",
        bottom-right for the other types.
    sequence_parallel : bool, default = False
        Recorded only: attention itself communicates nothing (the projections around it do).
    tp_size : int, default = 1
        Tensor-parallel size: each rank computes `num_attention_heads / tp_size` query heads and
        `num_gqa_groups / tp_size` key/value heads.
    get_rng_state_tracker : Callable, default = None
        Only None (`NotImplementedError` otherwise): dropout uses torch's RNG.
    tp_group : torch.distributed.ProcessGroup, default = None
        Tensor-parallel group; its size replaces `tp_size`.
    layer_number : int, default = None
        Recorded only.
    attention_type : {"self", "cross"}, default = "self"
        Recorded only: the shapes of the inputs decide.
    cp_group : torch.distributed.ProcessGroup, default = None
        Context parallelism is not supported: only None (`NotImplementedError` otherwise).
    cp_global_ranks : list of int, default = None
        Only None (`NotImplementedError` otherwise).
    cp_stream : torch.cuda.Stream, default = None
        Only None (`NotImplementedError` otherwise).
    cp_comm_type : str, default = "p2p"
        Accepted and unused (no context parallelism).
    softmax_scale : float, default = None
        Scale of Q K^T; None is `1 / sqrt(head dim of q and k)`.
    softmax_type : str, default = "vanilla"
        Only "vanilla" (`NotImplementedError` otherwise).
    return_max_logit : bool, default = False
        Only False (`NotImplementedError` otherwise).
    name : str, default = None
        The layer's name in the debug tools' configs; None gives `dot_product_attention_<n>`.

    Any other keyword is a `TypeError`. Attention always runs in the inputs' precision: forward
    raises `NotImplementedError` when the active `te.autocast` recipe sets `fp8_dpa` or `fp8_mha`."""

    def __init__(self, num_attention_heads: int, kv_channels: Union[int, Tuple[int, int]],
                 num_gqa_groups: Optional[int] = None, attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                 attn_mask_type: str = "causal", window_size: Optional[Tuple[int, int]] = None,
                 bottom_right_diagonal: Optional[bool] = None, sequence_parallel: bool = False, tp_size: int = 1,
                 get_rng_state_tracker=None, tp_group=None, layer_number: Optional[int] = None,
                 attention_type: str = "self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                 cp_comm_type: str = "p2p", softmax_scale: Optional[float] = None, softmax_type: str = "vanilla",
                 return_max_logit: bool = False, name: Optional[str] = None, **unsupported):
        super().__init__(name)
        who = f"DotProductAttention {self.name}"
        if unsupported:
            raise TypeError(f"{who}: unsupported arguments {sorted(unsupported)}")
        if cp_group is not None or cp_global_ranks is not None or cp_stream is not None:
            raise NotImplementedError(f"{who}: context parallelism (cp_group, cp_global_ranks, cp_stream) "
                                      "is not supported")
        if softmax_type != "vanilla" or return_max_logit:
            raise NotImplementedError(f"{who}: softmax_type={softmax_type!r} / return_max_logit are not supported "
                                      "(only the vanilla softmax)")
        if get_rng_state_tracker is not None:
            raise NotImplementedError(f"{who}: get_rng_state_tracker is not supported (dropout uses torch's RNG)")
        if qkv_format not in QKV_FORMATS:
            raise ValueError(f"{who}: qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
        if attention_type not in ("self", "cross"):
            raise ValueError(f"{who}: attention_type must be 'self' or 'cross', got {attention_type!r}")
        tp = dist.get_world_size(tp_group) if tp_group is not None else (tp_size or 1)
        groups = num_gqa_groups or num_attention_heads
        if num_attention_heads <= 0 or num_attention_heads % groups:
            raise ValueError(f"{who}: num_attention_heads={num_attention_heads} is not divisible by "
                             f"num_gqa_groups={groups}")
        if num_attention_heads % tp or groups % tp:
            raise ValueError(f"{who}: num_attention_heads={num_attention_heads} and num_gqa_groups={groups} must "
                             f"be divisible by tp_size={tp} (heads are split across tensor-parallel ranks)")
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, groups
        self.heads_per_partition, self.groups_per_partition = num_attention_heads // tp, groups // tp
        self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v = (
            kv_channels if isinstance(kv_channels, (tuple, list)) else (kv_channels, kv_channels))
        self.kv_channels = kv_channels
        self.attention_dropout, self.qkv_format = attention_dropout, qkv_format
        self.attn_mask_type = canonical_mask_type(who, attn_mask_type)
        self.window_size = check_window(who, window_size)
        self.bottom_right_diagonal = bottom_right_diagonal
        self.attention_type, self.layer_number = attention_type, layer_number
        self.sequence_parallel = sequence_parallel
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else self.hidden_size_per_attention_head_k ** -0.5)

    def _who(self) -> str:
        return f"DotProductAttention {self.name}"

    def _check_qkv(self, q, k, v, fmt):
        who, rank = self._who(), 3 if fmt == "thd" else 4
        for n, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
            if not isinstance(t, torch.Tensor):
                raise_error(TypeError, f"{who}: {n} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != rank:
                raise_error(ValueError, f"{who}: {n} must be a {rank}D tensor for qkv_format {fmt!r}, "
                                        f"got {shape_str(t)}")
        if q.dtype != k.dtype or q.dtype != v.dtype or not q.dtype.is_floating_point:
            raise_error(TypeError, f"{who}: query/key/value dtypes must be one floating dtype, "
                                   f"got {q.dtype}, {k.dtype}, {v.dtype}")
        hq, hk, hv = q.shape[-2], k.shape[-2], v.shape[-2]
        if hq != self.heads_per_partition or hk != self.groups_per_partition or hv != hk:
            raise_error(ValueError, f"{who}: expected {self.heads_per_partition} query heads and "
                                    f"{self.groups_per_partition} key/value heads (num_gqa_groups), "
                                    f"got {hq}, {hk}, {hv}")
        dk, dv = self.hidden_size_per_attention_head_k, self.hidden_size_per_attention_head_v
        if q.shape[-1] != dk or k.shape[-1] != dk or v.shape[-1] != dv:
            raise_error(ValueError, f"{who}: head dims must be kv_channels={self.kv_channels}, got q {q.shape[-1]}, "
                                    f"k {k.shape[-1]}, v {v.shape[-1]}")
        if fmt != "thd":
            b = 1 if fmt == "sbhd" else 0
            if q.shape[b] != k.shape[b] or k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
                raise_error(ValueError, f"{who}: query/key/value batch or sequence dims disagree for {fmt!r}: "
                                        f"{shape_str(q)}, {shape_str(k)}, {shape_str(v)}")
        elif k.shape[0] != v.shape[0]:
            raise_error(ValueError, f"{who}: key_layer and value_layer token counts differ: "
                                    f"{k.shape[0]} vs {v.shape[0]}")

    def _check_mask(self, mask, mask_type, fmt, q, k, cu_q, cu_kv):
        """TE's mask conventions (True = masked out), checked on shapes and dtypes only: a padding
        mask is [b, 1, 1, s] (a (q, kv) pair when s_q != s_kv), an "arbitrary" one broadcastable
        to [b, h, s_q, s_kv]. A mask the mask type does not read is not checked."""
        who = self._who()
        if fmt == "thd":
            if cu_q is None or cu_kv is None:
                raise_error(ValueError, f"{who}: qkv_format 'thd' needs cu_seqlens_q and cu_seqlens_kv")
            if mask_type == "arbitrary" or mask is not None:
                raise_error(ValueError, f"{who}: qkv_format 'thd' takes its mask from cu_seqlens (padding mask "
                                        "types), not an attention_mask / 'arbitrary'")
            return
        if mask is None:
            if mask_type == "arbitrary":
                raise_error(ValueError, f"{who}: attn_mask_type 'arbitrary' needs a bool attention_mask "
                                        "broadcastable to [b, h, s_q, s_kv] (True = masked out)")
            if mask_type in _PADDING_MASK_TYPES and cu_q is None:
                raise_error(ValueError, f"{who}: attn_mask_type {mask_type!r} needs attention_mask or "
                                        "cu_seqlens_q/kv")
            return
        if mask_type not in _PADDING_MASK_TYPES and mask_type != "arbitrary":
            return  # not read (forward drops it), as in TE
        bi, si = (1, 0) if fmt == "sbhd" else (0, 1)
        b, h, sq, skv = q.shape[bi], q.shape[-2], q.shape[si], k.shape[si]
        if mask_type == "arbitrary":
            if not isinstance(mask, torch.Tensor):
                raise_error(TypeError, f"{who}: attn_mask_type 'arbitrary' takes one attention_mask tensor, "
                                       f"got {type(mask).__name__}")
            if mask.dtype != torch.bool:
                raise_error(TypeError, f"{who}: an 'arbitrary' attention_mask must be bool (True = masked out), "
                                       f"got {mask.dtype}")
            if mask.dim() > 4 or any(m != 1 and m != e for m, e in zip(reversed(mask.shape), (skv, sq, h, b))):
                raise_error(ValueError, f"{who}: an 'arbitrary' attention_mask must be broadcastable to "
                                        f"[b, h, s_q, s_kv] = [{b}, {h}, {sq}, {skv}], got {shape_str(mask)}")
            return
        pair = isinstance(mask, (tuple, list))
        if pair and len(mask) != 2:
            raise_error(TypeError, f"{who}: a padding attention_mask is one tensor [b, 1, 1, s] or a (q, kv) pair, "
                                   f"got {len(mask)} items")
        for n, m, s in zip(("q", "kv"), mask if pair else (mask, mask), (sq, skv)):
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
                got = m.dtype if isinstance(m, torch.Tensor) else type(m).__name__
                raise_error(TypeError, f"{who}: a padding attention_mask must be bool (True = masked out), got {got}")
            if m.dim() != 4 or m.shape[0] != b or m.shape[1] != 1 or m.shape[2] != 1 or m.shape[3] != s:
                hint = ("; a padding mask is not broadcast over the batch" if m.dim() == 4 and m.shape[0] == 1
                        else "; pass a (q, kv) pair when s_q != s_kv" if not pair and sq != skv else "")
                raise_error(ValueError, f"{who}: the {n} padding attention_mask must be [b, 1, 1, s_{n}] = "
                                        f"[{b}, 1, 1, {s}], got {shape_str(m)}{hint}")

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                attention_mask=None, qkv_format: Optional[str] = None,
                cu_seqlens_q: Optional[torch.Tensor] = None, cu_seqlens_kv: Optional[torch.Tensor] = None,
                cu_seqlens_q_padded: Optional[torch.Tensor] = None, cu_seqlens_kv_padded: Optional[torch.Tensor] = None,
                max_seqlen_q: Optional[int] = None, max_seqlen_kv: Optional[int] = None,
                attn_mask_type: Optional[str] = None, window_size: Optional[Tuple[int, int]] = None,
                bottom_right_diagonal: Optional[bool] = None, checkpoint_core_attention: bool = False,
                core_attention_bias_type: str = "no_bias", core_attention_bias=None, alibi_slopes=None,
                fast_zero_fill: bool = True, inference_params=None, **unsupported) -> torch.Tensor:
        """softmax(Q K^T * softmax_scale + mask) V, heads folded into the last dim of the output.

        Every check reads only types, shapes and dtypes (no host sync) and raises through
        `raise_error`, so under torch.compile(fullgraph=True) too the user gets our type and message.
        An active `te.autocast` recipe with `fp8_dpa` or `fp8_mha` set is a `NotImplementedError`
        (FP8 attention is not implemented).

        Parameters
        ----------
        query_layer, key_layer, value_layer : torch.Tensor
            In `qkv_format`: [s, b, h, d], [b, s, h, d] or [t, h, d]; one floating dtype.
        attention_mask : torch.Tensor or (torch.Tensor, torch.Tensor), default = None
            True = masked out. Padding types: bool [b, 1, 1, s], or a (q, kv) pair when s_q !=
            s_kv; "arbitrary": bool, broadcastable to [b, h, s_q, s_kv]; other types: ignored (TE).
        qkv_format : str, default = None
            Overrides the constructor's for this call.
        cu_seqlens_q, cu_seqlens_kv : torch.Tensor, default = None
            [b + 1] cumulative sequence lengths: needed for "thd", or instead of a padding mask.
        cu_seqlens_q_padded, cu_seqlens_kv_padded : torch.Tensor, default = None
            "thd" with padding between sequences: the cumulative lengths including the padding
            (where each sequence starts).
        max_seqlen_q, max_seqlen_kv : int, default = None
            Accepted and not needed (no host sync either way).
        attn_mask_type : str, default = None
            Overrides the constructor's for this call.
        window_size : (int, int), default = None
            Overrides the constructor's for this call.
        bottom_right_diagonal : bool, default = None
            Overrides the constructor's for this call.
        checkpoint_core_attention : bool, default = False
            Recompute attention in backward instead of saving its intermediates
            (`torch.utils.checkpoint`).
        core_attention_bias_type : str, default = "no_bias"
            Only "no_bias": attention bias is not supported (`NotImplementedError`).
        core_attention_bias : torch.Tensor, default = None
            Only None (`NotImplementedError` otherwise).
        alibi_slopes : torch.Tensor, default = None
            Only None: ALiBi is not supported (`NotImplementedError` otherwise).
        fast_zero_fill : bool, default = True
            Accepted; rows no key may attend are zeros either way.
        inference_params : object, default = None
            Only None: the KV cache is not supported (`NotImplementedError` otherwise).
        """
        who = self._who()
        if unsupported:
            raise_error(TypeError, f"{who}: unsupported forward arguments {', '.join(sorted(unsupported))}")
        check_no_fp8_attention(who)
        if core_attention_bias_type != "no_bias" or core_attention_bias is not None or alibi_slopes is not None:
            raise_error(NotImplementedError, f"{who}: attention bias / ALiBi (core_attention_bias_type="
                                             f"{core_attention_bias_type!r}) is not supported")
        if inference_params is not None:
            raise_error(NotImplementedError, f"{who}: inference_params (KV cache) is not supported")
        fmt = qkv_format or self.qkv_format
        if fmt not in QKV_FORMATS:
            raise_error(ValueError, f"{who}: qkv_format must be one of {QKV_FORMATS}, got {fmt!r}")
        mask_type = self.attn_mask_type if attn_mask_type is None else canonical_mask_type(who, attn_mask_type)
        window = check_window(who, window_size) if window_size is not None else self.window_size
        if bottom_right_diagonal is None:
            bottom_right_diagonal = self.bottom_right_diagonal
        self._check_qkv(query_layer, key_layer, value_layer, fmt)
        if fmt == "thd":
            mask_type = _THD_MASK.get(mask_type, mask_type)
        self._check_mask(attention_mask, mask_type, fmt, query_layer, key_layer, cu_seqlens_q, cu_seqlens_kv)
        if mask_type not in _PADDING_MASK_TYPES and mask_type != "arbitrary":
            attention_mask = None  # TE reads attention_mask for the padding and "arbitrary" types only
        if cu_seqlens_q is not None and (cu_seqlens_q.dim() != 1 or cu_seqlens_kv is None
                                         or cu_seqlens_kv.shape != cu_seqlens_q.shape
                                         or cu_seqlens_q.is_floating_point()):
            raise_error(ValueError, f"{who}: cu_seqlens_q and cu_seqlens_kv must be integer tensors of one shape "
                                    "[batch + 1]")
        args = (query_layer, key_layer, value_layer, attention_mask, fmt, cu_seqlens_q, cu_seqlens_kv,
                cu_seqlens_q_padded, cu_seqlens_kv_padded, mask_type, window, bottom_right_diagonal)
        if checkpoint_core_attention and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._attend, *args, use_reentrant=False)
        return self._attend(*args)

    def _mask(self, q, k, attention_mask, fmt, cu_q, cu_kv, pad_q, pad_kv, mask_type, window, bottom_right):
        """(SDPA's attn_mask or None, is_causal); the inputs passed `_check_mask`."""
        sq, skv = q.shape[-2], k.shape[-2]  # [b, h, s, d]
        no_window = window[0] < 0 and (window[1] < 0 or (window[1] == 0 and "causal" in mask_type))
        if mask_type == "no_mask" and no_window:
            return None, False
        if mask_type == "causal" and no_window:
            return None, True  # SDPA's is_causal is top-left aligned
        if mask_type == "causal_bottom_right" and no_window and sq == skv:
            return None, True
        if mask_type in ("causal", "padding_causal"):
            bottom_right = False
        elif bottom_right is None or mask_type.endswith("bottom_right"):
            bottom_right = True
        dev = q.device
        q_pos, kv_pos = torch.arange(sq, device=dev), torch.arange(skv, device=dev)
        q_valid = kv_valid = q_seq = kv_seq = None
        offset = (skv - sq) if bottom_right else None
        arbitrary = None
        if fmt == "thd":
            q_seq, q_pos = token_positions(pad_q if pad_q is not None else cu_q, sq)
            kv_seq, kv_pos = token_positions(pad_kv if pad_kv is not None else cu_kv, skv)
            len_q, len_kv = cu_q.diff(), cu_kv.diff()
            nseq = len_q.numel()
            q_valid = (q_seq < nseq) & (q_pos < len_q[q_seq.clamp(max=nseq - 1)])
            kv_valid = (kv_seq < nseq) & (kv_pos < len_kv[kv_seq.clamp(max=nseq - 1)])
            if bottom_right:
                idx = q_seq.clamp(max=nseq - 1)
                offset = len_kv[idx] - len_q[idx]
        elif "padding" in mask_type:
            if attention_mask is not None:
                pair = isinstance(attention_mask, (tuple, list))
                mq, mkv = attention_mask if pair else (attention_mask, attention_mask)
                q_valid, kv_valid = ~mq[:, 0, 0], ~mkv[:, 0, 0]  # [b, 1, 1, s] -> [b, s]
            else:
                q_valid = q_pos[None, :] < cu_q.diff()[:, None]
                kv_valid = kv_pos[None, :] < cu_kv.diff()[:, None]
            if bottom_right:
                offset = (kv_valid.sum(-1) - q_valid.sum(-1))[:, None]  # [b, 1]
            q_pos, kv_pos = q_pos[None, :], kv_pos[None, :]
        elif mask_type == "arbitrary":
            arbitrary = ~attention_mask
        if offset is not None and offset.__class__ is int and offset == 0:
            offset = None
        mask = attention_mask_from_positions(q_pos, kv_pos, mask_type, window, offset, q_valid, kv_valid,
                                             q_seq, kv_seq)
        if mask is not None:
            mask = mask.unsqueeze(-3)  # [.., 1, s_q, s_kv]
            if mask.dim() == 3:
                mask = mask.unsqueeze(0)
        if arbitrary is not None:
            mask = arbitrary if mask is None else mask & arbitrary
        return mask, False

    def _attend(self, q, k, v, attention_mask, fmt, cu_q, cu_kv, pad_q, pad_kv, mask_type, window, bottom_right):
        q, k, v = _to_bhsd(q, fmt), _to_bhsd(k, fmt), _to_bhsd(v, fmt)
        mask, causal = self._mask(q, k, attention_mask, fmt, cu_q, cu_kv, pad_q, pad_kv, mask_type, window,
                                  bottom_right)
        row_ok = None
        if mask is not None:
            # rows no key may attend: attend anywhere (no NaN), then zero the output
            row_ok = mask.any(-1, keepdim=True)
            mask = mask | ~row_ok
        dropout = self.attention_dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                           scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        if row_ok is not None:
            o = o * row_ok.to(o.dtype)
        return _from_bhsd(o, fmt)

    def extra_repr(self) -> str:
        return (f"heads={self.num_attention_heads}, gqa_groups={self.num_gqa_groups}, kv_channels={self.kv_channels}, "
                f"qkv_format={self.qkv_format!r}, attn_mask_type={self.attn_mask_type!r}, "
                f"window_size={self.window_size}, name={self.name!r}")
