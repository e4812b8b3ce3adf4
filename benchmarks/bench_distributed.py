"""Bytes moved per training step and step time of a TransformerLayer stack: bf16 vs quantized all-gathers.

    python benchmarks/bench_distributed.py                     # NCCL, one process per visible GPU (needs >= 2)
    python benchmarks/bench_distributed.py --out out/          # + out/bench_distributed.json
    python benchmarks/bench_distributed.py --backend gloo --device cpu --smoke   # tiny, 2 CPU processes
    python benchmarks/bench_distributed.py --parallel fsdp --recipes current --profile 25   # where the time goes

Setups (`--parallel`, each over all `--world` ranks, launched with torch.multiprocessing spawn):
  fsdp  FSDP2: `fully_shard` on every layer and the root (reshard after forward), data parallel
        (each rank its own batch). "quantized" gathers call `enable_quantized_all_gather` first, so
        the GEMM weights are all-gathered in the recipe's format; "hp" gathers the bf16 params and
        the module quantizes after the gather. Current scaling / NVFP4 run
        `precompute_fp8_scales_for_fsdp` after the optimizer step (one small all-reduce).
  tp    Tensor + sequence parallel TransformerLayers (`tp_group`, `sequence_parallel=True`): the
        column-parallel inputs (QKV, fc1) are all-gathered along the sequence, quantized first
        ("quantized", the default of the modules) or in bf16 ("hp",
        `set_quantized_sequence_parallel_gather(model, False)`); row-parallel outputs are
        reduce-scattered; grads of `sequence_parallel` parameters are all-reduced after backward.

A step is: zero grads, forward under `te.autocast(recipe)`, backward with a fixed dy, SGD step.
Bytes are counted by wrapping torch.distributed's collectives for one step on every rank:
"AG" is what each rank contributes to all-gathers (its shard; the output is world x that), "RS"
the reduce-scatter inputs, "AR" all-reduces (amaxes, SP parameter grads), all per rank and step.
ms/step is the median over `--steps` timed steps of the slowest rank. Ratios are vs the bf16 row
(no recipe) of the same setup. Every variant runs on a freshly built model (same seed); an error
in one variant is reported in its row and the others still run. NCCL runs use all_gather_single /
reduce_scatter_single; gloo (CPU) is for checking the wiring, not for timings.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ALL_RECIPES = ["delayed", "current", "mxfp8", "blockwise", "nvfp4"]
SETUPS = ["fsdp", "tp"]


# ---- counting the bytes of collectives ------------------------------------------------------------
# collective -> (kind, name of the argument holding what this rank sends in)
_COLLECTIVES = {
    "all_gather": ("AG", "tensor"), "all_gather_single": ("AG", "input_tensor"),
    "all_gather_into_tensor": ("AG", "input_tensor"), "_all_gather_base": ("AG", "input_tensor"),
    "reduce_scatter_single": ("RS", "input"), "reduce_scatter_tensor": ("RS", "input"),
    "_reduce_scatter_base": ("RS", "input"), "reduce_scatter": ("RS", "input_list"),
    "all_reduce": ("AR", "tensor"),
}


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class CollectiveCounter:
    """Wraps torch.distributed's collectives (module attributes, looked up at call time by FSDP2 and
    the TE-proto ops) and, while `active`, adds up the bytes each rank sends in, per kind. Only the
    outermost call counts (a deprecated alias calling its replacement is one collective)."""

    def __init__(self):
        self.active = False
        self.bytes = {"AG": 0, "RS": 0, "AR": 0}
        self.calls = {"AG": 0, "RS": 0, "AR": 0}
        self.dtypes = {"AG": set(), "RS": set(), "AR": set()}
        self._depth = threading.local()

    def reset(self):
        for d in (self.bytes, self.calls):
            for k in d:
                d[k] = 0
        for k in self.dtypes:
            self.dtypes[k] = set()

    def install(self):
        for name, (kind, arg) in _COLLECTIVES.items():
            fn = getattr(dist, name, None)
            if fn is None or getattr(fn, "_bench_counted", False):
                continue
            setattr(dist, name, self._wrap(fn, kind, arg))

    def _wrap(self, fn, kind, arg):
        sig = inspect.signature(fn)
        counter = self

        def wrapped(*args, **kwargs):
            depth = getattr(counter._depth, "n", 0)
            if counter.active and depth == 0:
                try:
                    t = sig.bind_partial(*args, **kwargs).arguments.get(arg)
                except TypeError:
                    t = None
                counter.bytes[kind] += _nbytes(t)
                counter.calls[kind] += 1
                first = t[0] if isinstance(t, (list, tuple)) and t else t
                if isinstance(first, torch.Tensor):
                    counter.dtypes[kind].add(str(first.dtype).replace("torch.", ""))
            counter._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                counter._depth.n = depth

        wrapped._bench_counted = True
        wrapped.__wrapped__ = fn
        return wrapped


# ---- models ----------------------------------------------------------------------------------------
def _layers(args, device, dtype, **tp):
    import transformer_engine_proto as te

    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        te.TransformerLayer(args.hidden, args.ffn, args.heads, hidden_dropout=0.0, attention_dropout=0.0,
                            params_dtype=dtype, device=device, **tp)
        for _ in range(args.layers)])


def build(setup, gather, recipe, args, device, dtype, rank, world):
    """(model, callable run on the input, x, dy, post-backward hook, post-step hook)."""
    g = torch.Generator().manual_seed(1 + rank)
    if setup == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from transformer_engine_proto.distributed.fsdp import (
            enable_quantized_all_gather,
            precompute_fp8_scales_for_fsdp,
        )

        model = _layers(args, device, dtype)
        quantized = gather == "quantized" and recipe is not None
        if quantized:
            enable_quantized_all_gather(model)
        mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        if args.compile:
            for layer in model:  # FSDP2's hooks stay eager; each unit's inner forward compiles
                layer.forward = torch.compile(layer.forward, fullgraph=True)
        seq = args.seq
        post_step = (lambda: precompute_fp8_scales_for_fsdp(model)) if quantized else None
        run = model
        after_backward = None
    else:
        from transformer_engine_proto.distributed.sp_gather import set_quantized_sequence_parallel_gather

        model = _layers(args, device, dtype, tp_group=dist.group.WORLD, tp_size=world, sequence_parallel=True)
        set_quantized_sequence_parallel_gather(model, gather == "quantized")
        run = torch.compile(model, fullgraph=True) if args.compile else model
        seq = args.seq // world  # this rank's sequence shard ([seq, batch, hidden])
        sp_params = [p for p in model.parameters() if getattr(p, "sequence_parallel", False)]

        def after_backward():  # Megatron / TE: partial grads of SP parameters summed over the group
            grads = [p.grad for p in sp_params if p.grad is not None]
            if grads:
                flat = torch.cat([gr.reshape(-1) for gr in grads])
                dist.all_reduce(flat)
                for gr, new in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    gr.copy_(new)

        post_step = None
    x = torch.randn(seq, args.batch, args.hidden, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(seq, args.batch, args.hidden, generator=g).to(device=device, dtype=dtype)
    return model, run, x, dy, after_backward, post_step


def run_variant(setup, recipe_name, gather, args, device, dtype, rank, world, counter, comm_device):
    import transformer_engine_proto as te

    C.reset_compile_state(device)
    recipe = C.make_recipe(recipe_name or "none")
    model, run, x, dy, after_backward, post_step = build(setup, gather, recipe, args, device, dtype, rank, world)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)

    def step():
        opt.zero_grad(set_to_none=True)
        with (te.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()):
            y = run(x)
        y.backward(dy)
        if after_backward is not None:
            after_backward()
        opt.step()
        if post_step is not None:
            post_step()

    t0 = time.perf_counter()
    for _ in range(max(1, args.warmup)):
        step()
    C.synchronize(device)
    first_s = time.perf_counter() - t0
    counter.reset()
    counter.active = True
    try:
        step()
        C.synchronize(device)
    finally:
        counter.active = False
    counted = {"bytes": dict(counter.bytes), "calls": dict(counter.calls),
               "dtypes": {k: sorted(v) for k, v in counter.dtypes.items()}}
    times = []
    for _ in range(max(1, args.steps)):
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()
        C.synchronize(device)
        t0 = time.perf_counter()
        step()
        C.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    ms = torch.tensor([statistics.median(times)], dtype=torch.float64, device=comm_device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)  # the slowest rank's median
    res = {"setup": setup, "recipe": recipe_name or "bf16", "gather": gather, "ms": float(ms.item()),
           "warmup_s": first_s, **counted, **C.compile_stats()}
    if args.profile:
        res["profile"] = profile_step(step, device, args.profile, record=rank == 0)
    return res


def profile_step(step, device, top: int, record: bool):
    """One more step under torch.profiler (every rank steps, for the collectives; `record` on one):
    the `top` ops by self device time (CPU time without a GPU), to tell where a variant's time goes."""
    from torch.profiler import ProfilerActivity, profile

    if not record:
        step()
        C.synchronize(device)
        return None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        C.synchronize(device)
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, attr), reverse=True)[:top]
    return [{"op": e.key[:90], "calls": e.count, "self_us": round(getattr(e, attr), 1)} for e in events]


# ---- the per-rank worker -----------------------------------------------------------------------------
def _variants(args):
    out = []
    for setup in args.parallel:
        out.append((setup, None, "bf16"))
        for r in args.recipes:
            for gather in args.gathers:
                out.append((setup, r, gather))
    return out


def _agree(flag: bool, device) -> bool:
    """True on every rank if it is True on rank 0 (a decision all ranks must take alike)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def worker(rank, world, args, port, tmpdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=args.timeout_minutes))
    counter = CollectiveCounter()
    counter.install()
    C.configure_dynamo()
    dtype = getattr(torch, args.dtype)
    budget = C.Budget(args.max_minutes)
    comm_device = device if args.backend == "nccl" else torch.device("cpu")
    results = []
    path = os.path.join(tmpdir, f"rank{rank}.json")

    def save():  # after every variant: a later hang or crash keeps what was measured
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, default=str)
        os.replace(path + ".tmp", path)

    try:
        for setup, recipe_name, gather in _variants(args):
            name = f"{setup}/{recipe_name or 'bf16'}/{gather}"
            if not _agree(not budget.exhausted(), comm_device):
                results.append({"setup": setup, "recipe": recipe_name or "bf16", "gather": gather,
                                "error": "skipped (--max-minutes)"})
                continue
            try:
                res = run_variant(setup, recipe_name, gather, args, device, dtype, rank, world, counter,
                                  comm_device)
            except Exception as e:  # noqa: BLE001  (reported in the table; the other variants still run)
                res = {"setup": setup, "recipe": recipe_name or "bf16", "gather": gather,
                       "error": C.report_exception(f"rank {rank} {name}", e) if rank == 0 else C.short_error(e)}
            results.append(res)
            save()
            if rank == 0:
                print(f"[{name}] " + (res.get("error") or f"{res['ms']:.2f} ms/step, AG {res['bytes']['AG']} B, "
                                                          f"RS {res['bytes']['RS']} B"), flush=True)
    finally:
        save()
        dist.destroy_process_group()


# ---- report -------------------------------------------------------------------------------------------
def _mib(n) -> str:
    return f"{n / 2**20:.3f}"


def _kib(n) -> str:
    return f"{n / 2**10:.1f}"


def report(results, args):
    base = {r["setup"]: r for r in results if r["recipe"] == "bf16" and "error" not in r}
    headers = ["setup", "recipe", "gather", "AG MiB/step", "AG dtypes", "RS MiB/step", "AR KiB/step",
               "ms/step", "AG vs bf16", "ms vs bf16", "graph breaks"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["setup"], r["recipe"], r["gather"], r["error"]] + [""] * (len(headers) - 4))
            continue
        b = base.get(r["setup"])
        ag, rs, ar = r["bytes"]["AG"], r["bytes"]["RS"], r["bytes"]["AR"]
        ratio_ag = f"{ag / b['bytes']['AG']:.3f}" if b and b["bytes"]["AG"] else ""
        ratio_ms = f"{r['ms'] / b['ms']:.3f}" if b and b["ms"] else ""
        r["ag_ratio_vs_bf16"] = ratio_ag and float(ratio_ag)
        r["ms_ratio_vs_bf16"] = ratio_ms and float(ratio_ms)
        rows.append([r["setup"], r["recipe"], r["gather"], _mib(ag), ",".join(r["dtypes"]["AG"]), _mib(rs),
                     _kib(ar), f"{r['ms']:.2f}", ratio_ag, ratio_ms, r.get("graph_breaks", "")])
    print()
    print(C.markdown_table(headers, rows))
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--parallel", default=",".join(SETUPS), help=f"comma-separated subset of {SETUPS}")
    p.add_argument("--recipes", default=",".join(ALL_RECIPES), help=f"comma-separated subset of {ALL_RECIPES}")
    p.add_argument("--gathers", default="hp,quantized", help="comma-separated subset of hp,quantized")
    p.add_argument("--backend", choices=["nccl", "gloo"], default=None, help="default: nccl with CUDA, else gloo")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available")
    p.add_argument("--world", type=int, default=None, help="processes (default: visible GPUs; 2 on CPU)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (TP shards it over the ranks)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", help="parameter / activation dtype")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile(fullgraph=True) (FSDP: each layer's forward; TP: the stack); "
                        "default on with CUDA, off on CPU")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 1 warm-up + 2 timed steps (CPU ok)")
    p.add_argument("--timeout-minutes", type=float, default=10.0, help="process-group timeout (a hang fails)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="soft budget: variants not started by then are reported as skipped")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, profile one step per variant on rank 0 and print its N costliest ops")
    p.add_argument("--out", default=None, help="directory for <name>.json")
    p.add_argument("--name", default="bench_distributed")
    args = p.parse_args(argv)
    args.parallel = [s for s in args.parallel.split(",") if s]
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.gathers = [g for g in args.gathers.split(",") if g]
    for what, got, allowed in (("--parallel", args.parallel, SETUPS), ("--recipes", args.recipes, ALL_RECIPES),
                               ("--gathers", args.gathers, ["hp", "quantized"])):
        bad = sorted(set(got) - set(allowed))
        if bad:
            p.error(f"{what}: unknown {bad}; choose from {allowed}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    if args.compile is None:
        args.compile = args.device == "cuda"
    if args.smoke:
        args.layers, args.hidden, args.ffn, args.heads, args.seq, args.batch = 2, 256, 512, 4, 128, 2
        args.warmup, args.steps = 1, 2
    avail = torch.cuda.device_count() if args.device == "cuda" else None
    world = args.world or (avail if args.device == "cuda" else 2)
    if args.device == "cuda" and (world < 2 or world > avail):
        msg = (f"bench_distributed: needs 2 <= --world <= visible GPUs ({avail}); got {world}. "
               "On one machine without GPUs: --backend gloo --device cpu --smoke")
        print(msg)
        if args.out:
            C.write_json(args.out, args.name, {"skipped": msg, "args": vars(args)})
        return 0 if args.world is None else 2
    if args.seq % world:
        p.error(f"--seq {args.seq} must be divisible by the world size {world} (TP shards the sequence)")
    print(f"bench_distributed: {world} processes, backend {args.backend}, device {args.device}, dtype {args.dtype}, "
          f"compile {args.compile}; layers {args.layers} hidden {args.hidden} ffn {args.ffn} heads {args.heads} "
          f"seq {args.seq} batch {args.batch}", flush=True)
    import torch.multiprocessing as mp

    failure = None
    with tempfile.TemporaryDirectory() as tmpdir:
        try:
            mp.start_processes(worker, args=(world, args, _free_port(), tmpdir), nprocs=world, join=True,
                               start_method="spawn")
        except Exception as e:  # noqa: BLE001  (a crashed / hung rank: report what was measured)
            failure = C.short_error(e, 400)
            print(f"bench_distributed: a worker failed: {failure}", file=sys.stderr)
        per_rank = []
        for r in range(world):
            try:
                with open(os.path.join(tmpdir, f"rank{r}.json")) as f:
                    per_rank.append(json.load(f))
            except (OSError, ValueError):
                per_rank.append([])
    results = per_rank[0]
    for r, res in enumerate(results):  # bytes per rank may differ (uneven shards): report rank 0, keep all
        res["bytes_per_rank"] = [pr[r].get("bytes") for pr in per_rank if r < len(pr)]
    report(results, args)
    for r in results:
        if r.get("profile"):
            print(f"\n{r['setup']}/{r['recipe']}/{r['gather']}: costliest ops of one profiled step (rank 0)")
            print(C.markdown_table(["op", "calls", "self us"],
                                   [[e["op"], e["calls"], e["self_us"]] for e in r["profile"]]))
    if args.out:
        C.write_json(args.out, args.name, {"env": C.environment(torch.device(args.device)), "world": world,
                                           "args": vars(args), "results": results, "failure": failure})
    errors = [r for r in results if "error" in r and not r["error"].startswith("skipped")]
    return 1 if errors or failure else 0


if __name__ == "__main__":
    sys.exit(main())
