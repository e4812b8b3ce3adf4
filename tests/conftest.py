import os

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
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs in qa/L1_gpu.sh)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
