"""`kernels.zeroed.zeros`: eager amax outputs cut from a zeroed block on CUDA inside the eager path's
`slots()` scope, plain zeros elsewhere."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import transformer_engine_proto as te
from transformer_engine_proto.kernels import zeroed


def test_cpu_and_fake_tensors_get_plain_zeros():
    x = torch.randn(4)
    with zeroed.slots():
        z = zeroed.zeros(3, x)
        assert z.shape == (3,) and z.dtype == torch.float32 and not z.any()
        assert zeroed.zeros(2, x, torch.int32).dtype == torch.int32
        with FakeTensorMode() as mode:
            fake = mode.from_tensor(torch.empty(4, device="meta"))
            assert type(zeroed.zeros(1, fake)).__name__ == "FakeTensor"
    assert zeroed._local.depth == 0


@pytest.mark.cuda
def test_cuda_outside_the_eager_scope_gets_plain_zeros():
    x = torch.randn(4, device="cuda")
    with zeroed.slots():
        block = zeroed.zeros(1, x).untyped_storage().data_ptr()
    outside = zeroed.zeros(1, x)
    assert outside.untyped_storage().data_ptr() != block and outside.untyped_storage().nbytes() == 4


@pytest.mark.cuda
def test_cuda_slots_are_zero_distinct_aligned_and_independent():
    x = torch.randn(4, device="cuda")
    zeroed._blocks.clear()  # a fresh block: the slots below all fit in it
    with zeroed.slots():
        slots = [zeroed.zeros(n, x) for n in (1, 2, 1, 3)] + [zeroed.zeros(1, x, torch.int32)]
    base = slots[0].untyped_storage().data_ptr()
    assert all(s.untyped_storage().data_ptr() == base for s in slots)  # one block
    ptrs = [s.data_ptr() for s in slots]
    assert len(set(ptrs)) == len(ptrs) and all(p % 16 == 0 for p in ptrs)
    assert all(not s.any() for s in slots) and slots[-1].dtype == torch.int32
    versions = [s._version for s in slots]
    slots[0].fill_(5.0)
    slots[1].add_(1.0)
    assert slots[2].item() == 0.0 and slots[1].tolist() == [1.0, 1.0]
    # each slot has its own version counter: autograd's saved-tensor check sees only its own writes
    assert slots[0]._version == versions[0] + 1 and slots[2]._version == versions[2]


@pytest.mark.cuda
def test_cuda_blocks_are_never_reused_while_slots_live():
    x = torch.randn(4, device="cuda")
    with zeroed.slots():
        first = zeroed.zeros(1, x)
        first.fill_(7.0)
        taken = [zeroed.zeros(4, x) for _ in range(zeroed._BLOCK // 4 + 2)]  # runs past one block
    assert len({t.untyped_storage().data_ptr() for t in taken}) >= 2
    assert first.item() == 7.0 and not any(t.any() for t in taken)


@pytest.mark.cuda
def test_cuda_blocks_of_many_streams_stay_bounded(monkeypatch):
    monkeypatch.setattr(zeroed, "_STREAMS", 2)
    x = torch.randn(4, device="cuda")
    streams = [torch.cuda.Stream() for _ in range(4)]  # torch's pool: distinct streams
    kept = []
    with zeroed.slots():
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                kept.append(zeroed.zeros(1, x))
    assert len({s.cuda_stream for s in streams}) == 4 and len(zeroed._blocks) <= 2
    torch.cuda.synchronize()
    assert not any(k.any() for k in kept)


@pytest.mark.cuda
def test_cuda_graph_capture_gets_its_own_zeros():
    x = torch.randn(4, device="cuda")
    with zeroed.slots():
        block = zeroed.zeros(1, x).untyped_storage().data_ptr()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            z = zeroed.zeros(1, x)
    torch.cuda.current_stream().wait_stream(stream)
    assert z.untyped_storage().data_ptr() != block


def _steps(lin, x, recipe, n):
    out = []
    for _ in range(n):
        with te.autocast(recipe=recipe):
            y = lin(x)
        (dx,) = torch.autograd.grad(y.float().square().sum(), x)
        out += [y.detach(), dx]
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", [te.recipe.Float8CurrentScaling(), te.recipe.DelayedScaling(),
                                    te.recipe.NVFP4BlockScaling()], ids=["current", "delayed", "nvfp4"])
def test_cuda_eager_steps_equal_with_and_without_blocks(recipe, monkeypatch):
    """Eager steps whose amax slots run through several blocks equal the steps with plain zeros."""
    import copy

    torch.manual_seed(0)
    lin = te.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    plain_lin = copy.deepcopy(lin)
    n = zeroed._BLOCK // 4 + 3  # at least one slot a step
    before = [entry[0] for entry in zeroed._blocks.values()]  # kept alive: no id is reused
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws from torch's generator
    pooled = _steps(lin, x, recipe, n)
    assert any(all(e[0] is not b for b in before) for e in zeroed._blocks.values())  # a new block was cut
    monkeypatch.setattr(zeroed, "_MAX", 0)  # every request a plain allocation
    torch.manual_seed(1)
    plain = _steps(plain_lin, x, recipe, n)
    assert all(torch.equal(a, b) for a, b in zip(pooled, plain))
