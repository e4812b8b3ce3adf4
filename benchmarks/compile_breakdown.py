"""Where the first compiled step's seconds go, per variant, with cold and then warm caches.

    python benchmarks/compile_breakdown.py --out out/                       # the bench_llama Llama (CUDA)
    python benchmarks/compile_breakdown.py --smoke --variants bf16,te:current   # tiny, CPU

Each variant runs the first training step of bench_llama's model (`torch.compile`, default mode) in
a fresh process with empty inductor and Triton caches ("cold"), then once more in another fresh
process on the caches the first left ("warm"). Each process reports its first step's seconds,
dynamo's per-phase compile times (`torch._dynamo.utils.compilation_time_metrics`: tracing, AOT autograd,
inductor lowering / codegen, waiting for Triton compiles), the size of the graphs inductor compiled
(post-grad nodes; of them, nodes on tiny tensors, calls of user Triton kernels and how many of
those were swapped for their launch without a retrace; the kernels inductor generated, its
`metrics.generated_kernel_count`, which on the CPU backend counts several per fused loop; a warm run
compiles none), the Triton kernels it compiled (entries it added to Triton's cache; a warm run on
a GPU must add none), the kernel definitions in the generated code it cached (after a cold run: each
kernel defined with several sources, one compile and one load per source, with a line that differs:
the specializations a warm start loads) and, with `--cprofile`, the library functions with the most
cumulative time while compiling. With several warm runs (`--caches cold,warm,warm2,...`) a table gives each variant's
medians over them: the first step, its ratio to bf16's, and dynamo's tracing, its guards and the
loading of the cached graphs, where a warm first step's compile time goes. With `--out` the JSON is
written after every process (`"complete": false` until the last), so a run cut short by a time
limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import bench_llama  # noqa: E402

TINY = 16  # elements: scales, amaxes, delayed scaling's history rows and counters


def count_graph_nodes(counts: dict):
    """Install a post-grad pass (cache-safe: a fixed uuid) that adds each graph inductor compiles
    to `counts`: graphs, nodes, user Triton kernel calls, nodes whose result has at most `TINY`
    elements (the per-GEMM scaling state's small ops)."""
    import torch
    from torch._inductor import config
    from torch._inductor.custom_graph_pass import CustomGraphPass

    def tiny(node) -> bool:
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) and val.numel() <= TINY

    class Count(CustomGraphPass):
        def __call__(self, graph):
            calls = [n for n in graph.nodes if n.op == "call_function"]
            counts["graphs"] = counts.get("graphs", 0) + 1
            counts["nodes"] = counts.get("nodes", 0) + len(calls)
            hop = torch.ops.higher_order.triton_kernel_wrapper_functional
            counts["triton_calls"] = counts.get("triton_calls", 0) + sum(n.target is hop for n in calls)
            counts["tiny_nodes"] = counts.get("tiny_nodes", 0) + sum(tiny(n) for n in calls)

        def uuid(self):
            return "compile_breakdown.count_graph_nodes"

    config.post_grad_custom_pre_pass = Count()


def first_step(variant: str, args) -> dict:
    """This process: build the variant, run its first compiled step, report the times."""
    import cProfile
    import pstats
    import time

    import torch
    from torch._dynamo.utils import compilation_time_metrics

    device = C.device_from_arg(args.device)
    C.configure_dynamo()
    model, recipe = bench_llama.make_variant(variant, args, device, torch.bfloat16)
    graph = {}
    count_graph_nodes(graph)
    fwd = torch.compile(model)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(device)
    prof = cProfile.Profile() if args.cprofile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    with C.te_autocast(recipe, variant):
        loss = fwd(input_ids=ids, labels=ids).loss
    loss.backward()
    C.synchronize(device)
    if prof:
        prof.disable()
    from torch._inductor import metrics
    graph["generated_kernels"] = metrics.generated_kernel_count  # the kernels inductor wrote (this process)
    # launches of our kernels inductor swapped without a retrace
    from transformer_engine_proto.kernels.triton.direct_swap import DIRECT_SWAPS
    graph["direct_swaps"] = DIRECT_SWAPS[0]
    res = {"variant": variant, "first_step_s": time.perf_counter() - t0,
           "phases_s": {name: sum(ts) for name, ts in compilation_time_metrics.items()}, "graph": graph}
    if prof:
        if args.cprofile_dump:  # the whole profile, for pstats / snakeviz
            os.makedirs(args.cprofile_dump, exist_ok=True)
            prof.dump_stats(os.path.join(args.cprofile_dump, f"{variant.replace(':', '_')}_{os.getpid()}.prof"))
        stats = pstats.Stats(prof)
        where = {key: f"{os.path.basename(key[0])}:{key[2]}" for key in stats.stats}
        library = [(where[k], v[3]) for k, v in stats.stats.items() if "transformer_engine_proto" in k[0]]
        res["library_cumulative_s"] = sorted(library, key=lambda r: -r[1])[:args.top]
        res["self_s"] = sorted(((where[k], v[2]) for k, v in stats.stats.items()), key=lambda r: -r[1])[:args.top]
        res["cumulative_s"] = sorted(((where[k], v[3]) for k, v in stats.stats.items()),
                                     key=lambda r: -r[1])[:args.top]
    return res


def triton_cache_entries(env) -> set:
    """The compiled kernels in the Triton cache of `env` (one group file per kernel)."""
    root = env["TRITON_CACHE_DIR"]
    return {os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.startswith("__grp__")}


_KERNEL_DEF = re.compile(r"^\w+ = async_compile\.triton\('(\w+)', '''(.*?)'''", re.S | re.M)


def kernel_definitions(inductor_dir: str) -> dict:
    """{kernel: distinct sources} of the Triton kernels defined in the generated code an inductor
    cache dir holds (`async_compile.triton` definitions; inductor's own kernels, named
    `triton_<kind>_fused_..._<n>`, counted by name without the number; the numbered names of the
    definitions are not a difference). A kernel with several sources is compiled and loaded once
    per source at least: the specializations of its arguments (constants, divisibility) and
    constexprs."""
    defs = collections.defaultdict(set)
    for d, _, files in os.walk(inductor_dir):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f), errors="ignore") as fh:
                    src = fh.read()
                for name, body in _KERNEL_DEF.findall(src):
                    base = re.sub(r"_\d+$", "", name) if name.startswith("triton_") else name
                    defs[base].add(_unnumbered(body, base))
    return defs


def _unnumbered(body: str, base: str) -> str:
    """`body` with the numbered names inductor gives each definition (`<base>_<n>`, in the def
    line or the `kernel_name` of its metadata) made one: two definitions that differ only there
    are one source (Triton compiles it once)."""
    return re.sub(rf"\b{re.escape(base)}_\d+\b", f"{base}_N", body)


def definition_rows(defs: dict, top: int) -> list:
    """[kernel, sources, a line that differs between them] for the kernels with several sources."""
    rows = []
    for name, bodies in sorted(defs.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        if len(bodies) < 2:
            continue
        lines = [set(b.splitlines()) for b in bodies]
        differ = sorted(line.strip() for line in set.union(*lines) - set.intersection(*lines))
        rows.append([name, len(bodies), _where_they_differ(differ)])
    return rows[:top]


def _where_they_differ(lines: list, width: int = 140) -> str:
    """The first of `lines`, from a little before the first character where it differs from the
    next one when that lies beyond `width` (long metadata lines differ far from their start)."""
    if not lines:
        return ""
    first = lines[0]
    if len(lines) == 1:
        return first[:width]
    same = len(os.path.commonprefix(lines[:2]))
    start = same - 20 if same > width - 40 else 0
    return ("..." if start else "") + first[start:start + width]


def run_child(variant: str, argv, env) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", variant, *argv], env=env, capture_output=True,
                         text=True)
    for line in out.stdout.splitlines()[::-1]:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    lines = (out.stderr or out.stdout).strip().splitlines()
    return {"variant": variant, "error": lines[-1] if lines else f"exit code {out.returncode}"}


def parse_args(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--variants", default="bf16,torchao:tensorwise,te:current,te:delayed")
    p.add_argument("--preset", choices=sorted(bench_llama.PRESETS), default="llama")
    C.add_model_args(p, **bench_llama.PRESETS["llama"], vocab=32768, seq=2048, batch=4)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the wiring)")
    p.add_argument("--cprofile", action="store_true", help="list the library functions compile time goes to")
    p.add_argument("--cprofile-dump", default="", help="with --cprofile: also write each process's profile here")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--caches", default="cold,warm",
                   help="the runs, in order, each a fresh process on the variant's cache directories: the "
                        "first finds them empty (cold), later ones (warm, warm2, ...) what the runs before "
                        "wrote (a second warm run shows how much the warm first step varies)")
    C.add_run_args(p, "compile_breakdown", warmup_ms=0.0, rep_ms=0.0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the variant a child process runs
    preset, _ = p.parse_known_args(argv)
    p.set_defaults(**bench_llama.PRESETS[preset.preset])
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.ffn, args.layers, args.heads, args.vocab, args.seq, args.batch = 64, 128, 2, 4, 256, 32, 2
    return args


# the phases a warm first step spends its compile time in (a cache hit skips AOT and inductor)
WARM_PHASES = {"bytecode_tracing": "dynamo tracing s", "build_guards": "guards s",
               "OutputGraph.call_user_compiler": "loading cached graphs s"}


def warm_summary(results) -> list:
    """Per variant, over its warm runs (every run after the cold one): the count, the median first
    step, its ratio to bf16's median, the median of each `WARM_PHASES` phase. Empty without warm runs."""
    def median(values):
        v = sorted(values)
        return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2

    runs = {}
    for r in results:
        if r["caches"] != "cold" and "first_step_s" in r:
            runs.setdefault(r["variant"], []).append(r)
    med = {v: median([r["first_step_s"] for r in rs]) for v, rs in runs.items()}
    rows = []
    for v, rs in runs.items():
        ratio = f"{med[v] / med['bf16']:.2f}x" if "bf16" in med else "-"
        rows.append([v, len(rs), f"{med[v]:.2f}", ratio,
                     *(f"{median([r.get('phases_s', {}).get(k, 0.0) for r in rs]):.2f}" for k in WARM_PHASES)])
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(first_step(args.child, args)), flush=True)
        return None
    child_argv = argv + ["--out", ""]  # children print their result; only this process writes
    results = []
    for variant in C.names(args.variants):
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                       TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            for state in C.names(args.caches):
                before = triton_cache_entries(env)
                r = run_child(variant, child_argv, env)
                r["caches"] = state
                r.setdefault("graph", {})["triton_compiled"] = len(triton_cache_entries(env) - before)
                defs = kernel_definitions(env["TORCHINDUCTOR_CACHE_DIR"])
                r["graph"]["kernel_definitions"] = sum(len(b) for b in defs.values())
                if state == "cold":
                    r["kernel_specializations"] = definition_rows(defs, args.top)
                results.append(r)
                print(process_line(r), flush=True)
                if args.out:  # after every process: a run cut short by a time limit keeps what it measured
                    save(args, results, complete=False)
    base = {r["caches"]: r["first_step_s"] for r in results if r["variant"] == "bf16" and "first_step_s" in r}
    phases = sorted({k for r in results for k in r.get("phases_s", {})},
                    key=lambda k: -max(r.get("phases_s", {}).get(k, 0) for r in results))[:args.top]
    print("\n## First compiled step, seconds (ratio to bf16 with the same caches)\n")
    rows = []
    for r in results:
        s = r.get("first_step_s")
        ratio = f"{s / base[r['caches']]:.2f}x" if s is not None and r["caches"] in base else "-"
        rows.append([r["variant"], r["caches"], r["error"] if s is None else f"{s:.1f}", ratio])
    print(C.markdown_table(["variant", "caches", "first step s", "vs bf16"], rows))
    warm = warm_summary(results)
    if warm:
        print("\n## Warm processes: medians (a warm first step moves by tens of % between processes)\n")
        print(C.markdown_table(["variant", "runs", "first step s", "vs bf16", *WARM_PHASES.values()], warm))
    print("\n## Graphs inductor compiled (post-grad; a cache hit compiles none)\n")
    columns = {"graphs": "graphs", "nodes": "nodes", "tiny_nodes": f"nodes of <= {TINY} elements",
               "generated_kernels": "kernels inductor generated", "triton_calls": "user Triton kernel calls",
               "direct_swaps": "swapped directly", "triton_compiled": "Triton kernels compiled",
               "kernel_definitions": "distinct kernel sources in the cached generated code"}
    print(C.markdown_table(["variant", "caches", *columns.values()],
                           [[r["variant"], r["caches"], *(r.get("graph", {}).get(k, 0) for k in columns)]
                            for r in results]))
    print("\n## Compile phases, seconds (dynamo_timed phases, summed; nested phases overlap)\n")
    print(C.markdown_table(["phase", *(f"{r['variant']} {r['caches']}" for r in results)],
                           [[k, *(f"{r.get('phases_s', {}).get(k, 0):.1f}" for r in results)] for k in phases]))
    for r in results:
        if r.get("kernel_specializations"):
            print(f"\n### {r['variant']} ({r['caches']}): kernels defined with several sources "
                  "(compiled and loaded once each)\n")
            print(C.markdown_table(["kernel", "sources", "a line that differs"], r["kernel_specializations"]))
    for r in results:
        for key, what in (("library_cumulative_s", "library functions, cumulative"),
                          ("cumulative_s", "all functions, cumulative"), ("self_s", "all functions, self")):
            if r.get(key):
                print(f"\n### {r['variant']} ({r['caches']}): {what} s while compiling\n")
                print(C.markdown_table(["function", "s"], [[n, f"{s:.1f}"] for n, s in r[key]]))
    if args.out:
        save(args, results, complete=True)
    return results


def process_line(r: dict) -> str:
    """One process's first step and its warm phases, printed as it ends."""
    phases = r.get("phases_s", {})
    spent = ", ".join(f"{what} {phases.get(k, 0.0):.2f}" for k, what in WARM_PHASES.items())
    return f"{r['variant']:22s} {r['caches']}: {r.get('first_step_s', float('nan')):7.1f} s ({spent})"


def save(args, results, complete: bool) -> None:
    """`compile_breakdown.json`: the results so far; `complete` once every process has run."""
    C.write_json(args.out, "compile_breakdown", dict(args=vars(args), complete=complete, results=results))


if __name__ == "__main__":
    main()
