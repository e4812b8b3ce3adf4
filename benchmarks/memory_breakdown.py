"""What is alive at the peak of a training step (CUDA): the HF Llama of bench_llama, per variant.

    python benchmarks/memory_breakdown.py --variants bf16,torchao:tensorwise,te:current --out out/

For each variant (a fresh model, `torch.compile` default mode, three warm-up steps) one more step
runs under the CUDA caching allocator's history (`torch.cuda.memory._record_memory_history`).
Replaying its alloc / free events gives the moment of the step's peak and the blocks alive then,
which are listed by size (a size names a shape here: 16 MiB is 8192 x 2048 in one byte, 32 MiB in
two) with the source line that allocated them; what was allocated before the step (parameters,
grads, optimizer state, the allocator's cache of earlier steps) is one line.
"""
from __future__ import annotations

import gc
import linecache
import os
import sys
from collections import defaultdict

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import bench_llama  # noqa: E402
import torch  # noqa: E402

MIB = 2 ** 20


def _where(frames) -> str:
    """The innermost frame outside torch's own files (the model, our library, inductor's code)."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" in name and "torchinductor" not in name:
            continue
        text = linecache.getline(name, f.get("line") or 0).strip()  # generated code: the kernel or op
        return f"{os.path.basename(name)}:{f.get('line')} {f.get('name')}" + (f" `{text[:60]}`" if text else "")
    return "torch"


def peak_blocks(trace):
    """(peak bytes over the step's allocations, {addr: (size, frames)} alive at the peak, the
    frames of the allocation that reached it)."""
    live, total, peak, peak_at = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
            if total > peak:
                peak, peak_at = total, i
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
    alive = {}
    for e in trace[:peak_at + 1]:
        if e["action"] == "alloc":
            alive[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_completed":
            alive.pop(e["addr"], None)
    return peak, alive, trace[peak_at].get("frames", []) if peak_at >= 0 else []


def breakdown(variant, args, device):
    import transformer_engine_proto as te  # noqa: F401

    C.reset_compile_state(device)
    gc.collect()
    torch.cuda.empty_cache()
    model, recipe = bench_llama.make_variant(variant, args, device, torch.bfloat16)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    fwd = torch.compile(model)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)

    def step():
        with C.te_autocast(recipe, variant):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, alive, peak_frames = peak_blocks(snap["device_traces"][device.index or 0])
    by_size = defaultdict(lambda: [0, set()])
    for size, frames in alive.values():
        entry = by_size[round(size / MIB, 1)]
        entry[0] += 1
        entry[1].add(_where(frames))
    rows = [["before the step (params, grads, optimizer state)", "", f"{before / MIB:.0f}", ""]]
    for mib, (count, where) in sorted(by_size.items(), key=lambda kv: -kv[0] * kv[1][0]):
        if mib * count < args.min_mib:
            continue
        rows.append([f"{mib} MiB", str(count), f"{mib * count:.0f}", "; ".join(sorted(where))[:160]])
    rest = sum(s for s, _ in alive.values()) / MIB - sum(float(r[2]) for r in rows[1:])
    rows.append([f"smaller than {args.min_mib} MiB in all", "", f"{rest:.0f}", ""])
    print(f"\n## {variant}: peak {(before + peak) / 2**30:.2f} GiB (max_memory_allocated "
          f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB), reached at {_where(peak_frames)}\n")
    print(C.markdown_table(["blocks", "count", "MiB", "allocated at"], rows), flush=True)
    return {"variant": variant, "peak_gib": (before + peak) / 2**30, "before_mib": before / MIB,
            "rows": rows}


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--variants", default="bf16,torchao:tensorwise,te:current")
    C.add_model_args(p, hidden=2048, ffn=5632, layers=4, heads=16, vocab=32768, seq=2048, batch=4)
    p.add_argument("--min-mib", type=float, default=8.0, help="list block sizes holding at least this much")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("memory_breakdown: needs CUDA (the caching allocator's history); on CPU, "
                         "benchmarks/saved_tensors.py lists what backward keeps")
    device = torch.device("cuda")
    results = [breakdown(v, args, device) for v in args.variants.split(",") if v]
    if args.out:
        C.write_json(args.out, "memory_breakdown", {"results": results})


if __name__ == "__main__":
    main()
