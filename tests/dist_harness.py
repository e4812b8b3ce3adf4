"""Helpers of the distributed tests: run a worker on several processes and collect what each rank
saved; a one-rank process group; a fresh aot_eager compile of a module.

The backend comes from `TE_PROTO_DIST_BACKEND`: "gloo" (default; CPU processes, what CI runs) or
"nccl" (the same tests with rank r on cuda:r, which is made the default device, so every tensor
and module a case builds lives on that GPU). Workers join through `init_worker` and draw data from
`generator(seed)`, so one test file serves both.

A worker is `worker(rank, init_file, out_dir)`: it joins the group through `file://{init_file}`
and `torch.save`s its results to `{out_dir}/{prefix}{rank}.pt`. One spawn serves many checks
(process start-up dominates these tests on 2 cores).
"""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._dynamo.utils import counters

import transformer_engine_proto as te

BACKEND = os.environ.get("TE_PROTO_DIST_BACKEND", "gloo")
if BACKEND not in ("gloo", "nccl"):
    raise ValueError(f"TE_PROTO_DIST_BACKEND={BACKEND!r}: expected 'gloo' (CPU) or 'nccl' (one GPU per rank)")
ON_GPU = BACKEND == "nccl"


def check_world(world: int) -> None:
    """Under NCCL each rank needs its own GPU: fail (not skip) when there are fewer."""
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    if ON_GPU and torch.cuda.device_count() < world:
        raise RuntimeError(f"TE_PROTO_DIST_BACKEND=nccl needs {world} GPUs, found {torch.cuda.device_count()}")


def init_worker(rank: int, world: int, init_method: str | None = None) -> None:
    """Join the process group with the suite's backend (NCCL: bind this rank to cuda:rank and make
    it the default device)."""
    kw = {} if init_method is None else {"init_method": init_method}
    if ON_GPU:
        # cuBLAS is bitwise reproducible across streams (FSDP gathers on side streams) only with a
        # fixed workspace; the FSDP tests compare two modules bit for bit
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(rank)
        torch.set_default_device(f"cuda:{rank}")
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(BACKEND, rank=rank, world_size=world, **kw)


def device_type() -> str:
    """The device type of a device mesh over the ranks."""
    return "cuda" if ON_GPU else "cpu"


def generator(seed: int) -> torch.Generator:
    """A seeded generator on the default device (a CPU generator cannot feed CUDA factories)."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


def to_cpu(tree):
    """Tensors of a result tree moved to the CPU (results cross process boundaries)."""
    return torch.utils._pytree.tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, tree)


def spawn_and_collect(worker, tmp_path_factory, name: str, world: int, prefix: str = "rank"):
    check_world(world)
    d = tmp_path_factory.mktemp(name)
    mp.start_processes(worker, args=(str(d / "init"), str(d)), nprocs=world, join=True, start_method="spawn")
    return [torch.load(d / f"{prefix}{r}.pt", weights_only=False, map_location="cpu") for r in range(world)]


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of this process alone (opcheck and argument checks of the collective ops)."""
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no group already initialized")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def compile_fresh(module, recipe):
    """`torch.compile(module, backend="aot_eager", fullgraph=True)` after resetting dynamo and its
    counters (graph breaks are counted per case), with autocast entered once outside the compiled
    region first (that prepares the recipe's module state)."""
    torch._dynamo.reset()
    counters.clear()
    with contextlib.nullcontext() if recipe is None else te.autocast(recipe=recipe):
        pass
    return torch.compile(module, backend="aot_eager", fullgraph=True)
