"""Float64 reference attention for test_attention.py / test_mha.py: an explicit
softmax(Q K^T * scale + mask) V whose mask is built by Python loops over (i, j), independently of
the module's vectorized mask."""
import math

import torch


def ref_allowed(sq, skv, mask_type, window=None, len_q=None, len_kv=None, bottom_right=True):
    """[sq, skv] bool, True = may attend; TE's rules (utils.get_full_mask), written as loops."""
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask_type:
        right = 0
    padding = "padding" in mask_type
    lq = len_q if padding and len_q is not None else sq
    lk = len_kv if padding and len_kv is not None else skv
    if mask_type in ("causal", "padding_causal"):
        off = 0
    elif mask_type.endswith("bottom_right") or bottom_right:
        off = lk - lq
    else:
        off = 0
    m = torch.zeros(sq, skv, dtype=torch.bool)
    for i in range(sq):
        for j in range(skv):
            ok = i < lq and j < lk
            if right >= 0:
                ok = ok and j <= i + off + right
            if left >= 0:
                ok = ok and j >= i + off - left
            m[i, j] = ok
    return m


def ref_attention(q, k, v, allowed, scale=None):
    """q [b, h, sq, d], k/v [b, hk, skv, d] (GQA: hk divides h), allowed broadcastable to
    [b, h, sq, skv]; float64; rows with nothing allowed give 0."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v
