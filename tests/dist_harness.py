"""Run a test worker on several gloo CPU processes and collect what each rank saved.

A worker is `worker(rank, init_file, out_dir)`: it joins the group through `file://{init_file}`
and `torch.save`s its results to `{out_dir}/{prefix}{rank}.pt`. One spawn serves many checks
(process start-up dominates these tests on 2 cores).
"""
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn_and_collect(worker, tmp_path_factory, name: str, world: int, prefix: str = "rank"):
    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    d = tmp_path_factory.mktemp(name)
    mp.start_processes(worker, args=(str(d / "init"), str(d)), nprocs=world, join=True, start_method="spawn")
    return [torch.load(d / f"{prefix}{r}.pt", weights_only=False) for r in range(world)]
