"""te.ops collectives (AllGather, AllReduce, ReduceScatter): each rank's forward and backward
against the same sums and concatenations computed from every rank's data, eager and compiled."""
import pytest
import torch
import torch.distributed as dist
from dist_harness import generator, init_worker, one_rank_group, spawn_and_collect, to_cpu  # noqa: F401  (fixture)

import transformer_engine_proto as te

WORLD = 2


def _case(op_name, rank, compiled):
    g = generator(100)  # same stream on every rank: each rank takes its own slice below
    xs = [torch.randn(4, 6, generator=g) for _ in range(WORLD)]
    dys = [torch.randn(8 if op_name == "AllGather" else 2 if op_name == "ReduceScatter" else 4, 6, generator=g)
           for _ in range(WORLD)]
    op = getattr(te.ops, op_name)()
    model = te.ops.Sequential(op)
    if compiled:
        torch._dynamo.reset()
        model = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = xs[rank].clone().requires_grad_()
    y = model(x)
    y.backward(dys[rank])
    return {"y": y.detach(), "dx": x.grad, "xs": xs, "dys": dys}


def _worker(rank, init_file, out_dir):
    torch.set_num_threads(1)
    init_worker(rank, WORLD, f"file://{init_file}")
    try:
        res = {(name, compiled): _case(name, rank, compiled)
               for name in ("AllGather", "AllReduce", "ReduceScatter") for compiled in (False, True)}
        torch.save(to_cpu(res), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return spawn_and_collect(_worker, tmp_path_factory, "ops_collectives", WORLD)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_forward_and_backward_are_the_conjugate_collectives(results, compiled):
    for rank, res in enumerate(results):
        r = res[("AllGather", compiled)]
        assert torch.equal(r["y"], torch.cat(r["xs"]))
        assert torch.equal(r["dx"], (r["dys"][0] + r["dys"][1]).chunk(WORLD)[rank])  # reduce-scatter
        r = res[("ReduceScatter", compiled)]
        assert torch.equal(r["y"], (r["xs"][0] + r["xs"][1]).chunk(WORLD)[rank])
        assert torch.equal(r["dx"], torch.cat(r["dys"]))  # all-gather
        r = res[("AllReduce", compiled)]
        assert torch.equal(r["y"], r["xs"][0] + r["xs"][1])
        assert torch.equal(r["dx"], r["dys"][rank])  # identity


def test_one_rank_is_the_identity_and_bad_shapes_say_so(one_rank_group):  # noqa: F811
    x = torch.randn(3, 4)
    for name in ("AllGather", "AllReduce", "ReduceScatter"):
        assert getattr(te.ops, name)(one_rank_group)(x) is x
    op = te.ops.ReduceScatter()
    op.process_group_size = 2  # as on two ranks: 3 rows cannot be split
    with pytest.raises(RuntimeError, match=r"ReduceScatter: cannot reduce-scatter a tensor of shape \[3, 4\]"):
        op(x)


def test_needs_an_initialized_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match="AllGather: torch.distributed is not initialized"):
        te.ops.AllGather()
