"""Seeded quantizer inputs by kind, shared by the per-format tests. Each format test picks the
scales that reach the edges of its own range (overflow, underflow, denormals, mixed exponents)."""
import torch

KINDS = ("normal", "large", "tiny", "zeros", "denormal", "mixed")


def seeded_input(shape, kind, seed, dtype=torch.float32, *, large=3e4, tiny=None, denormal=1e-39, mixed_exp=20):
    """torch.randn(shape) from a generator seeded with `seed`, then by kind: "large", "tiny",
    "denormal" multiply by that scale; "zeros" is all zeros; "mixed" multiplies each value by
    2**e, e drawn from [-mixed_exp, mixed_exp) by the same generator; "normal" leaves it. Cast
    to `dtype` last."""
    if kind not in KINDS or (kind == "tiny" and tiny is None):
        raise ValueError(f"no input kind {kind!r} here")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "large":
        x = x * large
    elif kind == "tiny":
        x = x * tiny
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "denormal":
        x = x * denormal
    elif kind == "mixed":
        x = x * torch.exp2(torch.randint(-mixed_exp, mixed_exp, shape, generator=g).float())
    return x.to(dtype)
