"""Rotary position embedding (TE's `RotaryPositionEmbedding` / `apply_rotary_pos_emb`).

`RotaryPositionEmbedding(dim)(max_seq_len)` returns the float32 frequencies [s, 1, 1, dim], as TE
does; `apply_rotary_pos_emb(t, freqs, tensor_format)` rotates the first `dim` channels of each head
of `t` ("sbhd", "bshd" or "thd"). For "thd" the position of a token is its offset inside its own
sequence (from `cu_seqlens`), computed on the device: no host sync, no per-sequence loop, so it
traces under torch.compile with `cu_seqlens` as a tensor input.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..capabilities import default_device

__all__ = ["RotaryPositionEmbedding", "apply_rotary_pos_emb", "token_positions"]


class RotaryPositionEmbedding(nn.Module):
    """Drop-in for `transformer_engine.pytorch.RotaryPositionEmbedding` (https://arxiv.org/abs/2104.09864).

    `rotary_percent < 1` rotates only that fraction of the head dim; `seq_len_interpolation_factor`
    (with `pretrained_max_position_embeddings`) interpolates positions as TE does; `interleaved`
    pairs adjacent channels (GPT-J style) instead of the two halves (GPT-NeoX / Llama style)."""

    def __init__(self, dim: int, rotary_percent: float = 1.0, seq_len_interpolation_factor: Optional[int] = None,
                 pretrained_max_position_embeddings: Optional[int] = None, rotary_base: float = 10000.0,
                 interleaved: bool = False, device=None):
        super().__init__()
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        if dim <= 0 or dim % 2:
            raise ValueError(f"RotaryPositionEmbedding: rotary dim must be a positive even number, got {dim}")
        self.dim, self.rotary_base, self.interleaved = dim, rotary_base, interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.pretrained_max_position_embeddings = pretrained_max_position_embeddings
        positions = torch.arange(0, dim, 2, dtype=torch.float32, device=default_device(device))
        inv_freq = 1.0 / (rotary_base ** (positions / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        seq = torch.arange(max_seq_len, device=self.inv_freq.device, dtype=torch.float32) + offset
        factor = self.seq_len_interpolation_factor
        if factor is not None and self.pretrained_max_position_embeddings is not None:
            if max_seq_len > self.pretrained_max_position_embeddings * factor:
                seq = seq * (self.pretrained_max_position_embeddings / max_seq_len)
            else:
                seq = seq / factor
        freqs = torch.outer(seq, self.inv_freq.float())
        if self.interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb.reshape(emb.size(0), 1, 1, emb.size(1))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, rotary_base={self.rotary_base}, interleaved={self.interleaved}"


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def token_positions(cu_seqlens: torch.Tensor, total: int):
    """(sequence index, position inside the sequence) of each of `total` packed tokens, on the
    device. Tokens past `cu_seqlens[-1]` get sequence index `len(cu_seqlens) - 1` (no sequence)."""
    idx = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    seq = torch.searchsorted(cu_seqlens[1:].contiguous(), idx, right=True)
    start = cu_seqlens[seq.clamp(max=cu_seqlens.numel() - 2)]
    return seq, idx - start


def apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, tensor_format: str = "sbhd",
                         start_positions: Optional[torch.Tensor] = None, interleaved: bool = False,
                         fused: bool = False, cu_seqlens: Optional[torch.Tensor] = None,
                         cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """Rotate `t` ([s, b, h, d], [b, s, h, d] or [t, h, d]) by `freqs` ([s2, 1, 1, d2], s2 >= s,
    d2 <= d; channels past d2 pass through). `start_positions[i]` offsets sequence i's positions.
    `fused` is accepted (TE's switch between its kernels); the computation is the same."""
    del fused
    if cp_size != 1:
        raise NotImplementedError("apply_rotary_pos_emb: context parallelism (cp_size > 1) is not supported")
    if tensor_format not in ("sbhd", "bshd", "thd"):
        raise ValueError(f"apply_rotary_pos_emb: tensor_format must be 'sbhd', 'bshd' or 'thd', got {tensor_format!r}")
    if freqs.dim() != 4 or freqs.shape[1] != 1 or freqs.shape[2] != 1:
        raise ValueError(f"apply_rotary_pos_emb: freqs must be [s, 1, 1, d] (RotaryPositionEmbedding's output), "
                         f"got {tuple(freqs.shape)}")
    rot_dim = freqs.shape[-1]
    if rot_dim > t.shape[-1]:
        raise ValueError(f"apply_rotary_pos_emb: rotary dim {rot_dim} exceeds the head dim {t.shape[-1]}")
    f = freqs.float().reshape(freqs.shape[0], rot_dim)  # [s2, d2]
    if tensor_format == "thd":
        if cu_seqlens is None:
            raise ValueError("apply_rotary_pos_emb: cu_seqlens is required for tensor_format 'thd'")
        seq, pos = token_positions(cu_seqlens, t.shape[0])
        if start_positions is not None:
            pos = pos + start_positions[seq.clamp(max=start_positions.numel() - 1)]
        f = f[pos.clamp(0, f.shape[0] - 1)].unsqueeze(1)  # [t, 1, d2]
    else:
        s = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
        if s > f.shape[0]:
            raise ValueError(f"apply_rotary_pos_emb: sequence length {s} exceeds the {f.shape[0]} positions of freqs")
        if start_positions is None:
            f = f[:s].unsqueeze(1)  # [s, 1, d2]
            f = f.unsqueeze(1) if tensor_format == "sbhd" else f  # sbhd: [s, 1, 1, d2]; bshd: [s, 1, d2]
        else:
            pos = torch.arange(s, device=t.device)[None, :] + start_positions.to(t.device)[:, None]  # [b, s]
            f = f[pos.clamp(max=f.shape[0] - 1)].unsqueeze(2)  # [b, s, 1, d2]
            f = f.transpose(0, 1) if tensor_format == "sbhd" else f
    cos, sin = torch.cos(f).to(t.dtype), torch.sin(f).to(t.dtype)
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t_rot = t_rot * cos + _rotate_half(t_rot, interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1) if t_pass.shape[-1] else t_rot
