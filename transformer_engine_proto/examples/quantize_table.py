"""Quantize one tensor in every format and print the error table (a smoke test of the stack).

    python -m transformer_engine_proto.examples.quantize_table [--rows 1024 --cols 1024]
"""
from __future__ import annotations

import argparse

import torch

from transformer_engine_proto.tensor import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)


def quantizers():
    e4m3 = torch.float8_e4m3fn
    return {
        "fp8 delayed (scale 1)": Float8Quantizer(torch.ones(1), torch.zeros(1), e4m3),
        "fp8 current e4m3": Float8CurrentScalingQuantizer(e4m3),
        "fp8 current e5m2": Float8CurrentScalingQuantizer(torch.float8_e5m2),
        "mxfp8 e4m3": MXFP8Quantizer(e4m3),
        "fp8 blockwise 1x128": Float8BlockQuantizer(e4m3, block_scaling_dim=1),
        "fp8 blockwise 128x128": Float8BlockQuantizer(e4m3, block_scaling_dim=2),
        "nvfp4 1d": NVFP4Quantizer(),
        "nvfp4 2d": NVFP4Quantizer(with_2d_quantization=True),
    }


def error_table(x: torch.Tensor):
    rows = []
    for name, q in quantizers().items():
        t = q.with_usage(rowwise=True, columnwise=False).quantize(x)
        y = t.dequantize(dtype=torch.float32)
        err = (y - x.float()).abs()
        bits = sum(b.numel() * b.element_size() for b in t.get_buffers().values()) * 8
        rows.append((name, (err.norm() / x.float().norm()).item(), err.max().item(), bits / x.numel()))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    x = torch.randn(args.rows, args.cols) * torch.exp2(torch.randn(args.rows, 1) * 2)
    print(f"{'format':24s} {'rel. L2 err':>12s} {'max abs err':>12s} {'bits/value':>11s}  (rowwise usage)")
    for name, rel, mx, bpv in error_table(x):
        print(f"{name:24s} {rel:12.3e} {mx:12.3e} {bpv:11.2f}")


if __name__ == "__main__":
    main()
