"""Stats of LogTensorStats are reduced across ranks at debug_api.step() (2 CPU processes, gloo)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CFG = {"s": {"enabled": True, "layers": {"layer_types": ["lin"]},
             "transformer_engine": {"LogTensorStats": {"enabled": True, "stats": ["min", "max", "mean", "std", "l2_norm"],
                                                       "tensors": ["activation", "weight"]}}}}


def _worker(rank, world, port, log_root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import nvdlfw_inspect.api as debug_api

        import transformer_engine_proto as te
        from transformer_engine_proto.debug import FEATURE_DIR, last_logged_stats

        torch.manual_seed(0)  # same weights everywhere
        m = te.Linear(16, 8, name="lin")
        if rank == 1:
            with torch.no_grad():
                m.weight.mul_(3)  # weight stats stay per rank
        debug_api.initialize(config_file=CFG, feature_dirs=[FEATURE_DIR], log_dir=os.path.join(log_root, str(rank)))
        torch.manual_seed(1 + rank)
        x = torch.randn(4, 16) * (rank + 1)
        m(x).sum().backward()
        debug_api.step()
        results[rank] = (x, m.weight.detach().clone(), last_logged_stats())
        debug_api.end_debug()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_stats_reduced_across_ranks(tmp_path):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path), results), nprocs=2, join=True,
                           start_method="spawn")
        results = dict(results)
    x = torch.cat([results[0][0], results[1][0]]).double()
    for rank in (0, 1):
        _, w, logged = results[rank]
        assert abs(logged["lin_activation_min"] - x.min().item()) < 1e-6
        assert abs(logged["lin_activation_max"] - x.max().item()) < 1e-6
        assert abs(logged["lin_activation_mean"] - x.mean().item()) < 1e-6
        assert abs(logged["lin_activation_std"] - x.std().item()) < 1e-6
        assert abs(logged["lin_activation_l2_norm"] - x.norm().item()) < 1e-5
        assert abs(logged["lin_weight_max"] - w.max().item()) < 1e-6  # per rank
