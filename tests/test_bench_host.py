"""benchmarks/bench_host.py: the stubbed run times every variant and leaves the kernel registry and
the Linear GEMM as they were (the stubs return uninitialized tensors: leaking them would make every
later quantize wrong)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_host  # noqa: E402

from transformer_engine_proto import kernels  # noqa: E402
from transformer_engine_proto.custom_ops import linear as linear_ops  # noqa: E402


def test_bench_host_times_variants_and_restores_the_kernels():
    from transformer_engine_proto.custom_ops import eager_program

    kernels.kernel("amax")
    before, gemm, mm = dict(kernels._KERNELS), linear_ops.gemm, eager_program.tensorwise_mm
    results = bench_host.main(["--variants", "nn.Linear,te:current,te:current+op,te:blockwise", "--modes", "eager",
                               "--steps", "2", "--repeats", "1"])
    assert [r["variant"] for r in results] == ["nn.Linear", "te:current", "te:current+op", "te:blockwise"]
    assert all(r.get("host_us", 0) > 0 for r in results), results
    assert all(r["library_calls"] > 0 for r in results), results  # eager: the op bodies run
    assert kernels._KERNELS == before and linear_ops.gemm is gemm and eager_program.tensorwise_mm is mm
