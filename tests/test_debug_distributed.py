"""Stats of LogTensorStats are reduced across ranks at debug_api.step() (2 processes: gloo, or NCCL
with TE_PROTO_DIST_BACKEND=nccl, see dist_harness)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_harness import check_world, generator, init_worker, to_cpu

CFG = {"s": {"enabled": True, "layers": {"layer_types": ["lin"]},
             "transformer_engine": {"LogTensorStats": {"enabled": True,
                                                       "stats": ["min", "max", "mean", "std", "l2_norm"],
                                                       "tensors": ["activation", "weight"]}}}}


def _worker(rank, world, port, log_root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_worker(rank, world)
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
        results[rank] = to_cpu((x, m.weight.detach().clone(), last_logged_stats()))
        debug_api.end_debug()
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(worker, tmp_path):
    """`worker(rank, 2, port, log_root, results)` on two spawned processes; {rank: its results}."""
    check_world(2)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        mp.start_processes(worker, args=(2, _free_port(), str(tmp_path), results), nprocs=2, join=True,
                           start_method="spawn")
        return dict(results)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_stats_reduced_across_ranks(tmp_path):
    results = _run_two_ranks(_worker, tmp_path)
    x = torch.cat([results[0][0], results[1][0]]).double()
    for rank in (0, 1):
        _, w, logged = results[rank]
        assert abs(logged["lin_activation_min"] - x.min().item()) < 1e-6
        assert abs(logged["lin_activation_max"] - x.max().item()) < 1e-6
        assert abs(logged["lin_activation_mean"] - x.mean().item()) < 1e-6
        assert abs(logged["lin_activation_std"] - x.std().item()) < 1e-6
        assert abs(logged["lin_activation_l2_norm"] - x.norm().item()) < 1e-5
        assert abs(logged["lin_weight_max"] - w.max().item()) < 1e-6  # per rank


# ---- weight stats of tensor-parallel layers: reduced over the TP group (TE's tp_group) --------------
TP_STATS = ["min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range"]
TP_CFG = {"s": {"enabled": True, "layers": {"layer_name_regex_pattern": "^(col|row)$"},
                "transformer_engine": {
                    "LogTensorStats": {"enabled": True, "stats": TP_STATS, "tensors": ["weight"]},
                    "LogFp8TensorStats": {"enabled": True, "stats": ["mxfp8_mse", "mxfp8_underflows%"],
                                          "tensors": ["weight"]}}}}


def _tp_worker(rank, world, port, log_root, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_worker(rank, world)
    try:
        import nvdlfw_inspect.api as debug_api

        import transformer_engine_proto as te
        from transformer_engine_proto.debug import FEATURE_DIR, last_logged_stats, set_weight_tensor_tp_group_reduce

        group = dist.new_group(list(range(world)))
        gen = generator(0)
        w_col, w_row = torch.randn(64, 128, generator=gen), torch.randn(64, 128, generator=gen) * 3
        col = te.Linear(128, 64, parallel_mode="column", tp_group=group, name="col")
        row = te.Linear(128, 64, parallel_mode="row", tp_group=group, name="row")
        with torch.no_grad():
            col.weight.copy_(w_col.chunk(world, 0)[rank])
            row.weight.copy_(w_row.chunk(world, 1)[rank])
        debug_api.initialize(config_file=TP_CFG, feature_dirs=[FEATURE_DIR], log_dir=os.path.join(log_root, str(rank)))
        x = torch.randn(8, 128, generator=gen)
        logged = []
        for it in range(3):  # reduced eager, per rank (TE's switch), reduced compiled
            set_weight_tensor_tp_group_reduce(it != 1)
            run_col = torch.compile(col, backend="aot_eager", fullgraph=True) if it == 2 else col
            run_row = torch.compile(row, backend="aot_eager", fullgraph=True) if it == 2 else row
            (run_col(x).sum() + run_row(x.chunk(world, 1)[rank]).sum()).backward()
            debug_api.step()
            logged.append(last_logged_stats())
        set_weight_tensor_tp_group_reduce(True)
        results[rank] = to_cpu((w_col, w_row, col.weight.detach().clone(), row.weight.detach().clone(), logged))
        debug_api.end_debug()
    finally:
        dist.destroy_process_group()


def _hp_stats(w):
    w = w.double()
    a = w.abs()
    return {"min": w.min().item(), "max": w.max().item(), "mean": w.mean().item(), "std": w.std().item(),
            "l1_norm": a.sum().item(), "l2_norm": w.norm().item(), "cur_amax": a.max().item(),
            "dynamic_range": (a.max().log2() - a[a > 0].min().log2()).item()}


def _mxfp8_stats(w):
    from transformer_engine_proto.tensor import MXFP8Quantizer

    dq = MXFP8Quantizer(rowwise_usage=True, columnwise_usage=False)(w).dequantize().double()
    w = w.double()
    return {"mxfp8_mse": ((w - dq) ** 2).mean().item(),
            "mxfp8_underflows%": 100.0 * ((w != 0) & (dq == 0)).sum().item() / w.numel()}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_weight_stats_reduced_over_tp_group(tmp_path):
    results = _run_two_ranks(_tp_worker, tmp_path)
    for rank in (0, 1):
        w_col, w_row, shard_col, shard_row, logged = results[rank]
        for layer, full, shard in (("col", w_col, shard_col), ("row", w_row, shard_row)):
            for it, w in ((0, full), (1, shard), (2, full)):  # iteration 1: per rank
                want = dict(_hp_stats(w), **_mxfp8_stats(w))
                for stat, value in want.items():
                    got = logged[it][f"{layer}_weight_{stat}"]
                    assert abs(got - value) <= 1e-9 * max(1.0, abs(value)), (rank, it, layer, stat, got, value)
