"""Training step of a Hugging Face Llama with every `nn.Linear` swapped: bf16 vs torchao float8 vs te recipes.

    python benchmarks/bench_llama.py --out out/          # hidden 2048, 4 layers, 4 x 2048 tokens (CUDA)
    python benchmarks/bench_llama.py --preset wide --out out/   # hidden 4096, ffn 11008, 2 layers
    python benchmarks/bench_llama.py --preset llama,wide --profile --out out/   # both, one table each
    python benchmarks/bench_llama.py --profile --out out/       # + device time per step by kernel family
    python benchmarks/bench_llama.py --smoke             # tiny, CPU-friendly check

The model is `transformers.LlamaForCausalLM` (random init, bf16 params; hidden 2048, 4 layers, 16
heads, intermediate 5632, vocab 32768 by default). A te variant is `te.convert_model(model, recipe=...)`:
every `nn.Linear` the recipe can take (lm_head included) becomes a `te.Linear` holding the same
weights; torchao's variant is `convert_to_float8_training` with its recipe. A step is forward with
the labels (the model's own loss), backward, grad-norm clipping to 1.0 and a foreach AdamW step,
with `te.autocast` entered every step around the forward, as a training loop does. Compiled variants are
`torch.compile(model)` (default mode, or reduce-overhead with `cudagraph_mark_step_begin`), each on a
fresh model after `torch._dynamo.reset()`; graph breaks are counted and reported. A te variant
name may add `+policy` (`te.GemmPolicy()`; its choices are printed) and `+soi` (every Linear with
`save_original_input=True`: the raw input saved, quantized in backward; `+soi-attn`: all but
down_proj and lm_head; `+rc`: `custom_ops.recompute_tags.set_recompute_saved_input(True)`) and
`+norms` (the RMSNorms swapped for `te.RMSNorm` too), `+op` (eager Linear calls always through the op, no
eager programs: `custom_ops/eager_program.py`) and `+fuse` / `+fuse-amax` (inductor fuses the aten
reference of the per-tensor FP8 quantize, or of its amax only, instead of launching the library's Triton
kernels: `te.kernels.set_fusible_quantize`).
Every variant runs in this process, so the ratios compare like with like.

`--profile` runs a few more steps of each variant under torch.profiler and splits the device time
per step (CPU: the ops' self time) into kernel families by name (`kernel_family`): GEMM, quantize
(amax / cast / transpose, our Triton kernels and inductor's fused casts), norm, other. A kernel
that fuses a norm with its quantize counts as quantize. On CUDA it also lists the quantize and norm
launches by (kernel, grid): launches per step and mean time, i.e. what each tensor shape costs; and
the GPU's idle time between kernels, with the places of the longest gaps (where the GPU waits for
the host: a step whose wall time exceeds its kernels' time has them).
"""
from __future__ import annotations

import gc
import os
import sys
import time
from typing import Callable, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402

DEFAULT_VARIANTS = ["bf16", "torchao:tensorwise", "te:current", "te:delayed", "te:blockwise", "te:mxfp8"]
DEFAULT_MODES = ["eager", "default", "reduce-overhead"]
PRESETS = {"llama": dict(hidden=2048, ffn=5632, layers=4, heads=16),
           "wide": dict(hidden=4096, ffn=11008, layers=2, heads=32)}
FAMILIES = ("gemm", "quantize", "norm", "other")
_FAMILY_WORDS = (("gemm", ("gemm", "matmul", "cutlass", "xmma", "nvjet", "scaled_mm", "cublas", "aten::mm",
                           "aten::addmm", "aten::bmm", "grouped_mm", "aten::linear")),
                 ("quantize", ("quantize", "cast_transpose", "amax", "fp8", "float8", "mxfp8", "nvfp4", "e4m3",
                               "e5m2", "scale_inv", "clamp")),  # inductor's fused casts: ..._clamp_..._to_copy
                 ("norm", ("norm", "rsqrt")))


def kernel_family(name: str) -> str:
    """GEMM, quantize, norm or other, from a kernel's (or CPU op's) name; the first family whose
    words it contains. Inductor's own kernels (`triton_...`) are never GEMMs: one named after
    `_scaled_mm` is the cast fused in front of it."""
    low = name.lower()
    generated = low.startswith("triton_")
    for family, words in _FAMILY_WORDS:
        if generated and family == "gemm":
            continue
        if any(w in low for w in words):
            return family
    return "other"


def kernel_ms(prof, steps: int, cuda: bool) -> dict:
    """Milliseconds per step of each kernel name: device kernels' time on CUDA, ops' self CPU time on CPU."""
    out = {}
    for e in prof.key_averages():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.self_device_time_total
        elif not cuda and e.device_type == torch.autograd.DeviceType.CPU:
            us = e.self_cpu_time_total
        else:
            continue
        out[e.key] = out.get(e.key, 0.0) + us / 1e3 / steps
    return out


def kernel_events(prof) -> list:
    """The device kernels of a CUDA profile (its chrome trace's "kernel" events), in start order."""
    import json
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def launches_by_grid(events: list, steps: int, families=("quantize", "norm")) -> list:
    """The launches of `families`' kernels grouped by (kernel, grid), largest time first: [name,
    grid, launches per step, mean us, ms per step]. Shows whether a family's time is bytes (few
    large grids) or per-launch cost (many small ones)."""
    groups = {}
    for e in events:
        if kernel_family(e["name"]) in families:
            groups.setdefault((e["name"], str(e.get("args", {}).get("grid"))), []).append(e["dur"])
    rows = [[name, grid, len(d) / steps, sum(d) / len(d), sum(d) / 1e3 / steps] for (name, grid), d in groups.items()]
    return sorted(rows, key=lambda r: -r[4])


def idle_gaps(events: list, steps: int, longer_than_us: float = 30.0, top: int = 10) -> dict:
    """Where the GPU ran no kernel between the first and the last of `events`: the idle ms per
    step, those of gaps longer than `longer_than_us` (the GPU waiting for the host rather than for
    one launch), and the longest places as [kernel before, kernel after, gaps per step, us per step]."""
    idle = long_idle = 0.0
    places = {}
    end = None
    prev = None
    for e in events:
        if end is not None and e["ts"] > end:
            gap = e["ts"] - end
            idle += gap
            if gap > longer_than_us:
                long_idle += gap
                where = (prev["name"][:60], e["name"][:60])
                n, total = places.get(where, (0, 0.0))
                places[where] = (n + 1, total + gap)
        if end is None or e["ts"] + e["dur"] >= end:
            end, prev = e["ts"] + e["dur"], e
    rows = sorted(([a, b, n / steps, total / steps] for (a, b), (n, total) in places.items()), key=lambda r: -r[3])
    return dict(idle_ms=idle / 1e3 / steps, long_idle_ms=long_idle / 1e3 / steps, places=rows[:top])


def family_ms(per_kernel: dict) -> dict:
    """Milliseconds per step by kernel family (`kernel_family`)."""
    out = dict.fromkeys(FAMILIES, 0.0)
    for name, ms in per_kernel.items():
        out[kernel_family(name)] += ms
    return out


def build_llama(args, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads,
                         vocab_size=args.vocab, max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def make_variant(variant: str, args, device, dtype):
    """(model, te recipe or None)."""
    model = build_llama(args, device, dtype)
    if variant == "bf16":
        return model, None
    if variant.startswith("torchao:"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(variant.split(":", 1)[1])
        return convert_to_float8_training(model, config=config), None
    import transformer_engine_proto as te

    recipe = C.make_recipe(variant.split(":", 1)[1])
    model = te.convert_model(model, recipe=recipe, convert_norms="+norms" in variant)
    # +fuse: inductor fuses the aten reference of the per-tensor quantize; +fuse-amax: of its amax only
    te.kernels.set_fusible_quantize("amax" if "+fuse-amax" in variant else "+fuse" in variant)
    # +op: every eager Linear call runs the op (the eager programs off), for an A/B in one process
    te.custom_ops.eager_program.set_enabled("+op" not in variant)
    # +rc: the Linears' quantized inputs (and the norms) recomputed in backward, not saved
    te.custom_ops.recompute_tags.set_recompute_saved_input("+rc" in variant)
    if "+soi" in variant:  # Linears save their raw input; backward quantizes it (save_original_input)
        skip = ("down_proj", "lm_head") if "+soi-attn" in variant else ()  # +soi-attn: attention + gate/up only
        for name, m in model.named_modules():
            if isinstance(m, te.Linear) and not name.endswith(skip):
                m.save_original_input = True
    return model, recipe


STEP_PARTS = ("entry", "forward", "exit", "backward", "clip", "optimizer")


def training_step(model, recipe, variant: str, mode: str, args, device, losses: Optional[list] = None,
                  mark: Optional[Callable[[str], None]] = None):
    """The step every Llama benchmark times (a closure): forward under the variant's autocast on a
    fixed batch, backward, grad clipping, an AdamW step; `mode` "eager" runs `model` itself, else
    `torch.compile(model, mode=...)`. Appends each loss to `losses` when given; calls `mark(part)`
    as the step starts and after each of `STEP_PARTS` (autocast entry, ...)."""
    mark = mark or (lambda part: None)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    fwd = model if mode == "eager" else torch.compile(model, mode=None if mode == "default" else mode)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)

    def step():
        mark("start")
        if mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        with C.te_autocast(recipe, variant):
            mark("entry")
            loss = fwd(input_ids=ids, labels=ids).loss
            mark("forward")
        mark("exit")
        loss.backward()
        mark("backward")
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        mark("clip")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer")
        if losses is not None:
            losses.append(loss.detach())

    return step


def run_variant(variant, mode, args, device, dtype):

    C.reset_compile_state(device)
    if device.type == "cuda":  # peak memory of this variant: what it allocates beyond what is left over
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, recipe = make_variant(variant, args, device, dtype)
    losses = []
    step = training_step(model, recipe, variant, mode, args, device, losses)

    t0 = time.perf_counter()
    step()
    C.synchronize(device)
    res = {"variant": variant, "mode": mode, "first_step_s": time.perf_counter() - t0}
    for _ in range(2):
        step()
    C.synchronize(device)
    res["ms"] = C.bench_ms(step, device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                           cpu_warmup=args.cpu_warmup, cpu_reps=args.cpu_reps)
    res["last_loss"] = float(losses[-1])
    if device.type == "cuda":
        res["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if args.profile:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                step()
            C.synchronize(device)
        per_kernel = kernel_ms(prof, args.profile_steps, device.type == "cuda")
        res["family_ms"] = family_ms(per_kernel)
        res["top_kernels"] = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:args.profile_top]
        if device.type == "cuda":
            events = kernel_events(prof)
            res["launches"] = launches_by_grid(events, args.profile_steps)[:args.profile_top]
            res["idle"] = idle_gaps(events, args.profile_steps)
    res.update(C.compile_stats())
    if variant.endswith("+policy"):  # which GEMMs the policy kept in the recipe's format
        import transformer_engine_proto as te

        print(f"{variant} ({mode}):\n{te.precision_report(model)}", flush=True)
    return res


def parse_args(argv=None):
    p = C.script_parser(__doc__)
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--modes", default=",".join(DEFAULT_MODES))
    p.add_argument("--preset", default="llama",
                   help="model size (llama: hidden 2048, 4 layers; wide: hidden 4096, ffn 11008, 2 layers), or "
                        "several comma-separated, run in turn; --hidden etc. override it")
    C.add_model_args(p, **PRESETS["llama"], vocab=32768, seq=2048, batch=4)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU check of the wiring)")
    p.add_argument("--profile", action="store_true", help="also split each step's time by kernel family")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--profile-top", type=int, default=25, help="kernels listed per variant with --profile")
    C.add_run_args(p, "bench_llama", warmup_ms=100.0, rep_ms=600.0)
    preset, _ = p.parse_known_args(argv)
    names = C.names(preset.preset)
    unknown = [n for n in names if n not in PRESETS]
    if not names or unknown:
        p.error(f"--preset: unknown {unknown or preset.preset!r}; known: {sorted(PRESETS)}")
    p.set_defaults(**PRESETS[names[0]])
    return p.parse_args(argv)


def preset_args(argv=None) -> list:
    """One argument namespace per preset that `--preset` names (sizes given explicitly win in each);
    with several, each writes its outputs under `<name>_<preset>`."""
    args = parse_args(argv)
    names = C.names(args.preset)
    if len(names) == 1:
        return [args]
    argv = list(sys.argv[1:] if argv is None else argv)
    each = [parse_args(argv + ["--preset", n]) for n in names]  # the last --preset wins
    for a, n in zip(each, names):
        a.name = f"{a.name}_{n}"
    return each


def main(argv=None):
    """Every preset's table (and outputs) in turn; the results of all, each with its preset."""
    results = []
    for args in preset_args(argv):
        results += [dict(r, preset=args.preset) for r in run_preset(args)]
    return results


def run_preset(args):
    device = C.device_from_arg(args.device)
    if args.smoke:
        args.hidden, args.ffn, args.layers, args.heads, args.vocab, args.seq, args.batch = 64, 128, 2, 4, 256, 32, 2
    dtype = torch.bfloat16
    C.configure_dynamo()
    variants = C.names(args.variants)
    if device.type != "cuda":  # torchao float8 training and reduce-overhead need CUDA
        variants = [v for v in variants if not v.startswith("torchao:")]
    modes = [m for m in C.names(args.modes) if device.type == "cuda" or m != "reduce-overhead"]
    results = C.measure_grid(modes, variants, lambda v, mode: run_variant(v, mode, args, device, dtype),
                             C.Budget(args.max_minutes), lambda r: f"{r['ms']:8.2f} ms  breaks {r['graph_breaks']}")
    base = {r["mode"]: r["ms"] for r in results if r["variant"] == "bf16" and "ms" in r}
    base_mem = {r["mode"]: r["peak_gib"] for r in results if r["variant"] == "bf16" and "peak_gib" in r}
    rows = []
    for r in results:
        if "ms" in r:
            ratio = f"{base[r['mode']] / r['ms']:.2f}x" if r["mode"] in base else "-"
            mem = f"{r['peak_gib']:.2f}" if "peak_gib" in r else "-"
            has_mem = "peak_gib" in r and r["mode"] in base_mem
            mem_ratio = f"{r['peak_gib'] / base_mem[r['mode']]:.2f}x" if has_mem else "-"
            rows.append([r["mode"], r["variant"], f"{r['ms']:.2f}", ratio, mem, mem_ratio, f"{r['last_loss']:.3f}",
                         r["graph_breaks"], r["cudagraph_skips"]])
        else:
            rows.append([r["mode"], r["variant"], r["error"], "-", "-", "-", "-", "-", "-"])
    print(f"\n## HF Llama train step (hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}, "
          f"{args.batch}x{args.seq} tokens, {device})\n")
    print(C.markdown_table(["mode", "variant", "ms/step", "speed vs bf16", "peak GiB", "memory vs bf16", "loss",
                            "graph breaks", "cudagraph skips"], rows))
    profiled = [r for r in results if "family_ms" in r]
    if profiled:
        print(f"\n### {'device' if device.type == 'cuda' else 'CPU'} ms per step by kernel family "
              f"(torch.profiler, {args.profile_steps} steps)\n")
        print(C.markdown_table(["mode", "variant", *FAMILIES, "total"],
                               [[r["mode"], r["variant"], *(f"{r['family_ms'][f]:.2f}" for f in FAMILIES),
                                 f"{sum(r['family_ms'].values()):.2f}"] for r in profiled]))
        for r in profiled:
            print(f"\n#### {r['mode']} {r['variant']}: top kernels, ms per step\n")
            print(C.markdown_table(["kernel", "family", "ms"], [[name[:110], kernel_family(name), f"{ms:.3f}"]
                                                                 for name, ms in r["top_kernels"]]))
            if r.get("launches"):
                print(f"\n#### {r['mode']} {r['variant']}: quantize and norm launches by grid\n")
                print(C.markdown_table(["kernel", "grid", "launches / step", "mean us", "ms / step"],
                                       [[name[:70], grid, f"{n:.1f}", f"{us:.1f}", f"{ms:.3f}"]
                                        for name, grid, n, us, ms in r["launches"]]))
            if r.get("idle"):
                idle = r["idle"]
                print(f"\n#### {r['mode']} {r['variant']}: GPU idle {idle['idle_ms']:.3f} ms per step, "
                      f"{idle['long_idle_ms']:.3f} of it in gaps > 30 us (the profiler slows the host: "
                      f"more than without it)\n")
                print(C.markdown_table(["kernel before", "kernel after", "gaps / step", "us / step"],
                                       [[a, b, f"{n:.1f}", f"{us:.1f}"] for a, b, n, us in idle["places"]]))
    if args.out:
        C.write_json(args.out, args.name, dict(env=C.environment(device), args=vars(args), results=results))
        plt = C.try_pyplot()
        if plt is not None:
            ms = {(r["variant"], r["mode"]): r["ms"] for r in results if "ms" in r}
            fig, ax = plt.subplots(figsize=(9, 4))
            C.grouped_bars(ax, modes, variants, lambda v, mode: base[mode] / ms[(v, mode)]
                           if (v, mode) in ms and mode in base else None)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_ylabel("speed vs bf16 (same mode)")
            ax.legend(fontsize=7, ncol=2)
            C.save_figure(fig, args.out, args.name)
            if profiled:  # one stacked bar per (mode, variant): where each step's time goes
                fig, ax = plt.subplots(figsize=(9, 0.4 * len(profiled) + 1.5))
                labels = [f"{r['mode']} {r['variant']}" for r in profiled]
                left = [0.0] * len(profiled)
                for family in FAMILIES:
                    widths = [r["family_ms"][family] for r in profiled]
                    ax.barh(labels, widths, left=left, label=family)
                    left = [a + b for a, b in zip(left, widths)]
                ax.invert_yaxis()
                ax.set_xlabel(f"{'device' if device.type == 'cuda' else 'CPU'} ms per step")
                ax.legend(fontsize=7, ncol=4)
                C.save_figure(fig, args.out, f"{args.name}_families")
    return results


if __name__ == "__main__":
    main()
