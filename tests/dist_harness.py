"""Helpers of the distributed tests: run a worker on several gloo CPU processes and collect what
each rank saved; a one-rank process group; a fresh aot_eager compile of a module.

A worker is `worker(rank, init_file, out_dir)`: it joins the group through `file://{init_file}`
and `torch.save`s its results to `{out_dir}/{prefix}{rank}.pt`. One spawn serves many checks
(process start-up dominates these tests on 2 cores).
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._dynamo.utils import counters

import transformer_engine_proto as te


def spawn_and_collect(worker, tmp_path_factory, name: str, world: int, prefix: str = "rank"):
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    d = tmp_path_factory.mktemp(name)
    mp.start_processes(worker, args=(str(d / "init"), str(d)), nprocs=world, join=True, start_method="spawn")
    return [torch.load(d / f"{prefix}{r}.pt", weights_only=False) for r in range(world)]


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
