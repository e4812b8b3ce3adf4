"""The library's norm kernels against the kernel inductor generates for the same norm (CUDA).

    python benchmarks/bench_norm.py --out out/     # the Llama's activations: 8192 x 2048 and 8192 x 4096
    python benchmarks/bench_norm.py --smoke        # tiny, CPU check of the wiring
    python benchmarks/bench_norm.py --sweep --out out/   # also time the kernels' launch configurations

Rows: RMSNorm and LayerNorm, forward, backward, and forward fused with per-tensor FP8 current
scaling of its output (both usages, as the Linear after the norm reads them). `inductor` is the
library's reference of the same computation (`kernels/reference/norm.py`, torch ops) under
`torch.compile`: the kernels inductor generates for it, amax, scale and casts fused where it can.
`te` is the kernel `te.RMSNorm` / `te.LayerNorm` (and a LayerNormLinear's fused norm + quantize)
run, the same one eager and compiled (`kernels/triton/norm.py`). Both are timed on the device
(`_common.device_ms`: replays of a CUDA graph, as a compiled step's launches run ahead of the GPU);
ratio: inductor us / te us. "te eager call" is one eager call timed with its host work
(`do_bench`), which bounds short kernels. Each te output is first checked against inductor's (the
normalized output to about one ulp).
"""
from __future__ import annotations

import importlib
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402
from bench_quantize import close  # noqa: E402

from transformer_engine_proto.kernels import kernel  # noqa: E402
from transformer_engine_proto.kernels.reference import norm as ref  # noqa: E402

E4M3 = torch.float8_e4m3fn
SHAPES = ((8192, 2048), (8192, 4096))


def cases(m: int, k: int, normalization: str, device):
    """(name, inputs, reference fn, library kernel name) of one normalization at (m, k)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(k, generator=g)).to(device, torch.bfloat16)
    b = (0.1 * torch.randn(k, generator=g)).to(device, torch.bfloat16) if normalization == "LayerNorm" else None
    fwd = (x, w, b, 1e-5, normalization, False)
    _, mu, rs = ref.norm_fwd(*fwd)
    bwd = (torch.randn_like(x), x, mu, rs, w, normalization, False, b is not None)
    fused = fwd + (E4M3, True, True)
    return [("fwd", fwd, ref.norm_fwd, "norm_fwd"), ("bwd", bwd, ref.norm_bwd, "norm_bwd"),
            ("fwd + fp8 current rw+cw", fused, ref.norm_fp8_current_quantize, "norm_fp8_current_quantize")]


def shapes(args):
    """The (M, K) shapes a run times: one tiny shape with --smoke."""
    return ((64, 128),) if args.smoke else SHAPES


def run(args, device) -> list:
    results = []
    for m, k in shapes(args):
        for normalization in ("RMSNorm", "LayerNorm"):
            for what, inputs, reference, name in cases(m, k, normalization, device):
                torch._dynamo.reset()
                compiled = torch.compile(reference, fullgraph=True)
                lib = kernel(name, device)
                ok = close(lib(*inputs), compiled(*inputs))
                timing = dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, cpu_warmup=args.cpu_warmup,
                              cpu_reps=args.cpu_reps)
                ind_fn, te_fn = (lambda f=compiled, a=inputs: f(*a)), (lambda f=lib, a=inputs: f(*a))
                ind_ms, te_ms = C.device_ms(ind_fn, device, **timing), C.device_ms(te_fn, device, **timing)
                te_call_ms = C.bench_ms(te_fn, device, **timing)
                results.append(dict(shape=f"{m}x{k}", norm=normalization, op=what, inductor_ms=ind_ms, te_ms=te_ms,
                                    te_eager_call_ms=te_call_ms, close=ok))
                print(f"{m}x{k} {normalization:9s} {what:24s} inductor {ind_ms * 1e3:8.1f} us  te {te_ms * 1e3:8.1f} us"
                      f"  te eager call {te_call_ms * 1e3:8.1f} us  {'close' if ok else 'DIFFERENT'}", flush=True)
    return results


# launch configurations `--sweep` tries (entries of `kernels/triton/norm.CONFIG` per direction)
SWEEP = {
    "fwd": [dict(TILE=t, WARP_ELEMS=w) for t in (1024, 2048, 4096, 8192) for w in (512, 1024, 2048)],
    "bwd": [dict(TILE=t, WARP_ELEMS=w, MAX_PROGRAMS=p) for t in (2048, 4096, 8192) for w in (512, 1024)
            for p in (132, 264, 528)],
}


def sweep(args, device) -> list:
    """Device time of te's forward and backward norm kernels per launch configuration (`SWEEP`),
    at the benchmark's shapes: the library's configuration against the fastest one tried. The
    library's CONFIG is left as it was. (On CPU the kernels are the reference's, which have no
    configuration: a check of the wiring.)"""
    try:
        tri_norm = importlib.import_module("transformer_engine_proto.kernels.triton.norm")
    except ImportError as e:
        print(f"--sweep needs the Triton kernels: {e}")
        return []
    rows = []
    for m, k in shapes(args):
        for normalization in ("RMSNorm", "LayerNorm"):
            for what, inputs, _, name in cases(m, k, normalization, device)[:2]:
                lib, default = kernel(name, device), tri_norm.CONFIG[what]
                fn = (lambda f=lib, a=inputs: f(*a))
                timed = []
                for candidate in SWEEP[what][:2] if args.smoke else SWEEP[what]:
                    tri_norm.CONFIG[what] = {**default, **candidate}
                    try:
                        timed.append((C.device_ms(fn, device, rep_ms=args.rep_ms / 2), candidate))
                    except Exception as e:  # noqa: BLE001 (a tile the device cannot hold: skipped)
                        print(f"  {m}x{k} {normalization} {what} {candidate}: failed ({type(e).__name__})")
                    finally:
                        tri_norm.CONFIG[what] = default
                library_ms = C.device_ms(fn, device, rep_ms=args.rep_ms / 2)
                best_ms, best = min(timed, key=lambda t: t[0])
                rows.append(dict(shape=f"{m}x{k}", norm=normalization, op=what, library_ms=library_ms,
                                 best_ms=best_ms, best=best))
                print(f"{m}x{k} {normalization:9s} {what} library {library_ms * 1e3:8.1f} us  best "
                      f"{best_ms * 1e3:8.1f} us  {best}", flush=True)
    return rows


def main(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="one tiny shape (CPU check of the wiring)")
    p.add_argument("--sweep", action="store_true", help="also time the kernels' launch configurations")
    C.add_run_args(p, "bench_norm", warmup_ms=25.0, rep_ms=100.0)
    args = p.parse_args(argv)
    device = C.device_from_arg(args.device)
    results = run(args, device)
    rows = [[r["shape"], r["norm"], r["op"], f"{r['inductor_ms'] * 1e3:.1f}", f"{r['te_ms'] * 1e3:.1f}",
             f"{r['inductor_ms'] / r['te_ms']:.2f}x", f"{r['te_eager_call_ms'] * 1e3:.1f}",
             "yes" if r["close"] else "NO"] for r in results]
    print(f"\n## te norm kernels vs inductor's ({device})\n")
    print(C.markdown_table(["shape", "norm", "op", "inductor us", "te us", "te speed vs inductor",
                            "te eager call us", "close"], rows))
    swept = sweep(args, device) if args.sweep else []
    if swept:
        print(f"\n## te norm kernels: launch configurations ({device}, `kernels/triton/norm.CONFIG`)\n")
        print(C.markdown_table(["shape", "norm", "op", "library us", "best us", "best vs library", "best"],
                               [[r["shape"], r["norm"], r["op"], f"{r['library_ms'] * 1e3:.1f}",
                                 f"{r['best_ms'] * 1e3:.1f}", f"{r['library_ms'] / r['best_ms']:.2f}x",
                                 ", ".join(f"{k}={v}" for k, v in r["best"].items())] for r in swept]))
    if args.out:
        C.write_json(args.out, args.name, dict(env=C.environment(device), results=results, sweep=swept))
    return results + swept


if __name__ == "__main__":
    main()
