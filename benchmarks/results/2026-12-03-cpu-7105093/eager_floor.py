"""Host time per eager Linear fwd+bwd (FP8 current scaling, 29 Linears per autocast block), device
work stubbed as in benchmarks/bench_host.py: te.Linear against a bare autograd.Function that makes
the same kernel calls (three quantizes, three GEMMs) with none of the library's layers, and between
them the Linear op called directly (`linear_ops.linear`, no module) and its eager call (no
`linear()` wrapper). The gap is what a per-signature eager plan ("decide once") could remove from
the host's work.

    python benchmarks/results/2026-12-03-cpu-<commit>/eager_floor.py
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "..")]

import _common as C  # noqa: E402
import bench_host as B  # noqa: E402
import torch  # noqa: E402

import transformer_engine_proto as te  # noqa: E402
from transformer_engine_proto import kernels  # noqa: E402
from transformer_engine_proto.custom_ops import linear as linear_ops  # noqa: E402
from transformer_engine_proto.custom_ops.linear_call import call_flags  # noqa: E402

N, REPS, STEPS = 29, 7, 60


def best_us(step) -> float:
    for _ in range(5):
        step()
    best = float("inf")
    for _ in range(REPS):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        best = min(best, (time.perf_counter() - t0) / STEPS / N * 1e6)
    return best


def te_linear_step():
    mods = [te.Linear(128, 128, bias=False, params_dtype=torch.float32) for _ in range(N)]
    recipe = C.make_recipe("current")
    x = torch.randn(128, 128, requires_grad=True)

    def step():
        with te.autocast(recipe=recipe):
            y = x
            for m in mods:
                y = m(y)
        y.sum().backward()
    return step


def op_steps():
    """(linear_ops.linear per GEMM, the op's eager call per GEMM): the op keys the modules use."""
    mods = [te.Linear(128, 128, bias=False, params_dtype=torch.float32) for _ in range(N)]
    recipe = C.make_recipe("current")
    x = torch.randn(128, 128, requires_grad=True)
    keys, linear = [], linear_ops.linear

    def spy(*args, **kwargs):
        keys.append(kwargs["key"])
        return linear(*args, **kwargs)

    linear_ops.linear = spy
    try:
        with te.autocast(recipe=recipe):
            y = x
            for m in mods:
                y = m(y)
    finally:
        linear_ops.linear = linear
    weights = [m.weight for m in mods]
    flags = call_flags(x, weights[0], None, keep_quantized_weight=True)  # as linear() passes in eager

    def through_linear():
        with te.autocast(recipe=recipe):
            y = x
            for w, k in zip(weights, keys):
                y = linear_ops.linear(y, w, None, key=k)[0]
        y.sum().backward()

    def through_call():
        with te.autocast(recipe=recipe):
            y = x
            for w, k in zip(weights, keys):
                y = linear_ops._linear_fwd_call(y, w, None, None, [], [], None, k, flags, [])[0]
        y.sum().backward()
    return through_linear, through_call


def bare_step():
    quant = kernels._KERNELS[("fp8_quantize_current", "reference")]  # stubbed
    gemm = linear_ops.gemm  # stubbed
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    class BareLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            x2 = x.reshape(-1, x.shape[-1])
            _, xt, xs, _ = quant(x2, e4m3, True, True, 0, False, 0.0, existing_amax=None)
            _, wt, ws, _ = quant(w, e4m3, True, True, 0, False, 0.0, existing_amax=None)
            y = gemm(x2, w, trans_b=True, out_dtype=x.dtype)
            ctx.save_for_backward(xt, xs, wt, ws)
            return y

        @staticmethod
        def backward(ctx, dy):
            quant(dy, e5m2, True, True, 0, False, 0.0, existing_amax=None)
            return gemm(dy, dy, out_dtype=dy.dtype), gemm(dy, dy, trans_a=True, out_dtype=dy.dtype)

    weights = [torch.nn.Parameter(torch.randn(128, 128)) for _ in range(N)]
    x = torch.randn(128, 128, requires_grad=True)

    def step():
        y = x
        for w in weights:
            y = BareLinear.apply(y, w)
        y.sum().backward()
    return step


if __name__ == "__main__":
    with B.stubbed_device_work():
        print(f"te.Linear (current scaling): {best_us(te_linear_step()):.1f} us per Linear fwd+bwd")
        through_linear, through_call = op_steps()
        print(f"linear_ops.linear, no module: {best_us(through_linear):.1f} us per Linear fwd+bwd")
        print(f"the op's eager call, no linear(): {best_us(through_call):.1f} us per Linear fwd+bwd")
        print(f"bare autograd.Function, same kernel calls: {best_us(bare_step()):.1f} us per Linear fwd+bwd")
