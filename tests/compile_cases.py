"""Compiled vs eager under each backend of linear_cases.backend_params.

aot_eager runs the op bodies as eager does: bitwise. Inductor on CPU reproduces the library's ops
bit for bit as well, but not all of the high-precision glue between them: it reduces in float32
(norm statistics, bias and residual sums, softmax) in another order than ATen, a few float32 ulps
that the rounding to bfloat16 sometimes turns into one bf16 ulp. And in bfloat16 it keeps fused
intermediates in float32 where eager rounds each op's result, one-ulp differences that quantization
turns into whole FP8 steps: `compile_for` turns on inductor's emulate_precision_casts (round where
eager rounds) so that those runs stay comparable, and fallback_random (dropout draws from torch's
generator as in eager, not from inductor's own).
"""
import torch

# torch 2.11's CPU inductor (torch 2.13's does both): a kernel that reads an E8M0 buffer does not
# compile (no C++ type: "KeyError: torch.float8_e8m0fnu"), and emulate_precision_casts leaves fused
# bf16 intermediates in float32, so quantizing them can differ from eager by one FP8 step
TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
OLD_CPU_INDUCTOR = TORCH_VERSION < (2, 13)

# under inductor, in ulps of the tensor's largest magnitude; measured at most 6 (float32) and 1
# (bfloat16) for LayerNormLinear, LayerNormMLP and TransformerLayer
ULPS = {torch.float32: 16, torch.bfloat16: 2}


def compile_for(model, backend, **kw):
    """torch.compile(fullgraph=True) with `backend`; inductor rounds bf16 and draws random numbers
    as eager does."""
    options = {"emulate_precision_casts": True, "fallback_random": True} if backend == "inductor" else None
    return torch.compile(model, fullgraph=True, backend=backend, options=options, **kw)


def assert_matches_eager(compiled, eager, backend, what=""):
    """Bitwise; under inductor within ULPS ulps of the tensor's largest magnitude."""
    assert compiled.shape == eager.shape and compiled.dtype == eager.dtype, what
    if backend == "inductor" and eager.dtype in ULPS:
        atol = ULPS[eager.dtype] * torch.finfo(eager.dtype).eps * eager.float().abs().max().item()
        torch.testing.assert_close(compiled, eager, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        diff = (compiled.float() - eager.float()).abs().max().item() if compiled.numel() else 0.0
        assert torch.equal(compiled, eager), f"{what}: max abs diff {diff}"
