"""kernels/triton/trace_analysis.py: torch's TTIR analysis of a Triton launch runs once per kernel
and specialization for this package's kernels, every time for others."""
import sys
import types

import pytest
import sympy
import torch

pytest.importorskip("triton")
from transformer_engine_proto.kernels.triton import trace_analysis  # noqa: E402


def _kernel(module):
    fn = types.FunctionType((lambda x_ptr, n, BLOCK: None).__code__, {}, "k")
    fn.__module__ = module
    params = [types.SimpleNamespace(name=n, is_constexpr=n == "BLOCK") for n in ("x_ptr", "n", "BLOCK")]
    return types.SimpleNamespace(fn=types.SimpleNamespace(fn=fn, params=params))  # Autotuner -> JITFunction -> fn


def test_memoized_per_specialization_for_our_kernels_only():
    calls = []

    def analysis(kernel, kwargs, tma):
        calls.append(dict(kwargs))
        return ["x_ptr"]

    memo = trace_analysis._memoized(analysis)
    ours, theirs = _kernel("transformer_engine_proto.kernels.triton.float8"), _kernel("user.kernels")
    x = torch.empty(4, dtype=torch.bfloat16)
    assert memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {}) == ["x_ptr"]
    memo(ours, {"x_ptr": x.clone(), "n": 8192, "BLOCK": 128}, {})  # same class of n (multiple of 16)
    memo(ours, {"x_ptr": x, "n": sympy.Integer(64), "BLOCK": 128}, {})  # inductor's size, same class
    assert len(calls) == 1
    memo(ours, {"x_ptr": x, "n": 4097, "BLOCK": 128}, {})  # n not a multiple of 16
    memo(ours, {"x_ptr": x.float(), "n": 4096, "BLOCK": 128}, {})  # another dtype
    memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 256}, {})  # another constexpr value (same int class)
    memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {"x_ptr": ("stable", ())})  # TMA: never cached
    assert len(calls) == 5
    memo(theirs, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {})
    memo(theirs, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {})
    assert len(calls) == 7
    result = memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {})
    result.append("mutated by the caller")
    assert memo(ours, {"x_ptr": x, "n": 4096, "BLOCK": 128}, {}) == ["x_ptr"]


def test_installed_over_torchs_analysis():
    from torch._higher_order_ops import triton_kernel_wrap
    names = [n for n in trace_analysis._ANALYSES if hasattr(triton_kernel_wrap, n)]
    assert names, "torch has neither analysis: trace_analysis needs updating"
    assert all(getattr(triton_kernel_wrap, n).te_proto_memoized for n in names)
    before = [getattr(triton_kernel_wrap, n) for n in names]
    trace_analysis.install()
    assert [getattr(triton_kernel_wrap, n) for n in names] == before  # idempotent
    assert "transformer_engine_proto.kernels.triton.trace_analysis" in sys.modules


def test_constexprs_read_from_the_jit_function():
    from transformer_engine_proto.kernels.triton import float8
    names = trace_analysis._constexprs(float8._cast_transpose_packed_kernel.fn)
    assert {"BM", "BK", "FMAX", "ROWWISE"} <= names and not names & {"x_ptr", "M", "K", "n_k"}


def test_source_closure_memoized_per_kernel_for_our_kernels_only():
    calls = []

    def closure(kernel, epilogue_fusion=None):
        calls.append((kernel, epilogue_fusion))
        return f"source of {id(kernel)} {epilogue_fusion}"

    memo = trace_analysis._memoized_closure(closure)
    ours, ours2 = _kernel("transformer_engine_proto.kernels.triton.float8"), _kernel("transformer_engine_proto.x")
    theirs = _kernel("user.kernels")
    assert memo(ours) == memo(ours) == memo(ours, None) == f"source of {id(ours)} None"
    assert len(calls) == 1
    assert memo(ours2) != memo(ours) and len(calls) == 2  # one entry per kernel
    assert memo(ours, ("node", "fused src")) == f"source of {id(ours)} ('node', 'fused src')"  # epilogue: torch's
    memo(theirs)
    memo(theirs)
    assert len(calls) == 5


def test_source_closure_of_a_real_kernel_is_torchs_and_installed_on_first_inductor_trace():
    wrapper = pytest.importorskip("torch._inductor.codegen.wrapper")
    from transformer_engine_proto import kernels
    from transformer_engine_proto.kernels.triton import float8

    name = "user_defined_triton_kernel_transitive_closure_source_code"
    with kernels.tracing_for_inductor():
        pass
    installed = getattr(wrapper, name)
    assert installed.te_proto_memoized
    trace_analysis.install_closure()
    assert getattr(wrapper, name) is installed  # idempotent
    kernel = float8._cast_transpose_packed_kernel
    kernel = kernel.fn if not hasattr(kernel, "src") else kernel  # inductor passes the JITFunction
    torchs = installed.__wrapped__(kernel)
    assert "_cast_transpose_packed_kernel" in torchs and installed(kernel) == torchs
    assert installed(kernel) is installed(kernel)  # the cached string


@pytest.mark.cuda
def test_a_compile_asks_torchs_source_closure_once_per_kernel_of_ours(monkeypatch, tmp_path):
    from torch._inductor.codegen import wrapper

    import transformer_engine_proto as te
    from transformer_engine_proto import recipe as R
    from transformer_engine_proto.kernels.triton.direct_swap import ours, python_fn

    name = "user_defined_triton_kernel_transitive_closure_source_code"
    trace_analysis.install_closure()
    torchs = getattr(wrapper, name).__wrapped__
    ours_computed, asked = [], []

    def counted(kernel, *args, **kw):
        if ours(python_fn(kernel)):
            ours_computed.append(kernel)
        return torchs(kernel, *args, **kw)

    memo = trace_analysis._memoized_closure(counted)

    def asking(kernel, *args, **kw):
        asked.append(kernel)
        return memo(kernel, *args, **kw)

    asking.te_proto_memoized = True
    monkeypatch.setattr(wrapper, name, asking)
    torch._dynamo.reset()
    model = torch.nn.Sequential(*[te.Linear(256, 256, device="cuda", params_dtype=torch.bfloat16) for _ in range(3)])
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # an empty FX graph cache (its key asks for every launch's closure), AOT's cache off (a hit skips it)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    no_aot_cache = torch._functorch.config.patch(enable_autograd_cache=False)
    with no_aot_cache, torch._inductor.config.patch(fx_graph_cache=True), te.autocast(recipe=R.Float8CurrentScaling()):
        y = torch.compile(model, fullgraph=True)(x)
    y.float().sum().backward()
    mine = [k for k in asked if ours(python_fn(k))]
    assert ours_computed, "no kernel of this package reached inductor's code generation"
    assert len(ours_computed) == len({id(k) for k in ours_computed}) < len(mine)
