import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

# "ci" keeps the CPU suite within budget; "dev" explores more; "gpu" is used by qa/L1_gpu.sh.
settings.register_profile("ci", max_examples=15, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("gpu", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """Without a GPU: cuda tests skip; slow tests (CPU cases too long for CI, such as inductor
    compiles of the MXFP8 / NVFP4 reference kernels) skip unless TE_PROTO_RUN_SLOW=1. Both run in
    qa/L1_gpu.sh."""
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU (runs in qa/L1_gpu.sh)")
    skip_slow = pytest.mark.skip(reason="slow on CPU (runs in qa/L1_gpu.sh, or with TE_PROTO_RUN_SLOW=1)")
    run_slow = os.environ.get("TE_PROTO_RUN_SLOW") == "1"
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
        elif "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture(autouse=True)
def _cpu_cases_see_no_gpu(request, monkeypatch):
    """A CPU case (neither `cuda` nor `slow`, which qa/L1_gpu.sh runs on the GPU host as they are)
    runs on a GPU host as CI runs it: with no GPU visible, so a module it builds without a device
    lands on the CPU (TE's default device is CUDA where there is one) beside the case's inputs."""
    if torch.cuda.is_available() and not {"cuda", "slow"} & set(request.keywords):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# The library reads its switches (TE_PROTO_KERNELS, TE_PROTO_FAST_LAUNCH, TE_PROTO_TRITON_SOFT_CAST,
# TE_PROTO_NATIVE_BLOCK_GEMM, TE_PROTO_EAGER_PROGRAM) once; tests flip them with the Python setters.
# After every test each setter is put back to None (follow the environment variable), so no test
# leaks its choice.
_SWITCHES = (("transformer_engine_proto.kernels", "set_backend"),
             ("transformer_engine_proto.kernels", "set_fusible_quantize"),
             ("transformer_engine_proto.kernels.triton.launch", "set_fast_launch"),
             ("transformer_engine_proto.kernels.triton._common", "set_soft_cast"),
             ("transformer_engine_proto.block_scaled_gemm", "set_native_block_gemm"),
             ("transformer_engine_proto.custom_ops.eager_program", "set_enabled"))


@pytest.fixture(autouse=True)
def _reset_library_switches():
    yield
    for module, setter in _SWITCHES:
        if module in sys.modules:
            getattr(sys.modules[module], setter)(None)
