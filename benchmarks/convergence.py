"""Does FP8 train as well as bf16? A GPT-style model on real text, per recipe and seed.

    python benchmarks/convergence.py --out out/ --recipes bf16,current,delayed --seeds 0,1,2
    python benchmarks/convergence.py --out out/ --recipes bf16,current --seeds 0,1,2 --parallel
    python benchmarks/convergence.py --out out/ --summarize    # tables and plot from out/'s runs
    python benchmarks/convergence.py --recipes current+bf16head  # the output projection not in FP8
    python benchmarks/convergence.py --size tiny --steps 20 --out out/   # CPU smoke run

Data: the source of Python's standard library on this machine (no download, no site-packages), as
bytes (a byte-level vocabulary of 256); every 20th file is the held-out validation split. Model:
token embedding, `te.TransformerLayer` blocks (RMSNorm, SwiGLU, causal attention), a final
`te.RMSNorm` and a `te.Linear` head, under `torch.compile`. AdamW with linear warmup and cosine
decay, gradient clipping at 1. Each run writes `<recipe>-seed<k>.json` (train / validation
losses, step times); the summary of every run file in `--out` (`convergence.md`,
`convergence.json`, and `convergence.png` with matplotlib) gives each recipe's final validation
loss as mean +- std over seeds, its difference to bf16 in percent and in units of bf16's seed
std, whether bf16 had flattened, and curves of the loss and of its difference to bf16.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import gemm_sensitivity as gemm_sensitivity_lib  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import transformer_engine_proto as te  # noqa: E402

SIZES = {  # hidden, layers, heads, ffn, sequence, batch
    "tiny": (64, 2, 4, 192, 64, 4),
    "small": (768, 12, 12, 2048, 512, 32),  # about 85M parameters
}


def stdlib_sources(limit_mb: float, val_every: int) -> tuple:
    """The standard library's .py files (not site-packages) in sorted path order, as uint8 tokens.

    Every `val_every`-th file goes to the validation split, so both splits sample the same mix of
    modules rather than the validation split being the alphabetically last packages.
    """
    train, val, total = [], [], 0
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if not any(part in ("site-packages", "dist-packages") for part in p.split(os.sep)))
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            data = f.read()
        (val if i % val_every == val_every - 1 else train).append(data)
        total += len(data)
        if total >= limit_mb * 2**20:
            break
    as_tokens = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return as_tokens(train), as_tokens(val), {"root": root, "files": i + 1, "bytes": total}


class GPT(nn.Module):
    def __init__(self, hidden, layers, heads, ffn, device, fp8_head=True):
        super().__init__()
        self.fp8_head = fp8_head  # False: the output projection stays in high precision under autocast
        self.embed = nn.Embedding(256, hidden, device=device)
        self.blocks = nn.ModuleList(
            te.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0, attention_dropout=0.0,
                                normalization="RMSNorm", activation="swiglu", bias=False,
                                attn_input_format="bshd", self_attn_mask_type="causal", device=device)
            for _ in range(layers))
        self.norm = te.RMSNorm(hidden, device=device)
        self.head = te.Linear(hidden, 256, bias=False, device=device)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        with contextlib.nullcontext() if self.fp8_head else te.autocast(enabled=False):
            return self.head(self.norm(x))


def batches(data: torch.Tensor, seq: int, batch: int, generator: torch.Generator, device):
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=generator)
    rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()]).long().to(device)
    return rows[:, :-1], rows[:, 1:]


def lr_at(step: int, steps: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))  # cosine down to 10%


def train(recipe_name: str, seed: int, args, train_data, val_data, device, save=lambda run: None) -> dict:
    """One run; `save(run)` after each evaluation keeps a partial record if the run is cut off."""
    hidden, layers, heads, ffn, seq, batch = SIZES[args.size]
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = GPT(hidden, layers, heads, ffn, device, fp8_head="+bf16head" not in recipe_name).to(dtype)
    compiled = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    recipe = C.make_recipe(recipe_name)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1000 + seed)
    val_gen = torch.Generator().manual_seed(7)
    val_batches = [batches(val_data, seq, batch, val_gen, device) for _ in range(args.val_batches)]

    def step_loss(x, y):
        with C.te_autocast(recipe, recipe_name):
            logits = compiled(x)
        return loss_fn(logits.float().reshape(-1, 256), y.reshape(-1))

    out = {"recipe": recipe_name, "seed": seed, "size": args.size, "steps": args.steps,
           "params": sum(p.numel() for p in model.parameters()), "train": [], "val": [], "step_ms": []}
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.warmup, args.lr)
        t0 = time.perf_counter()
        loss = step_loss(*batches(train_data, seq, batch, gen, device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()  # one sync per step: the timing below includes the step's device work
        out["step_ms"].append((time.perf_counter() - t0) * 1e3)
        out["train"].append(value)
        if not math.isfinite(value):
            out["diverged_at"] = step
            break
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            with torch.no_grad():
                val = statistics.fmean(step_loss(x, y).item() for x, y in val_batches)
            out["val"].append((step + 1, val))
            save(out)
    if recipe_name == "bf16" and args.gemm_sensitivity:
        out["gemm_sensitivity"] = gemm_sensitivity(model, val_batches, loss_fn, args.gemm_sensitivity.split(","))
    return out


def gemm_sensitivity(model, val_batches, loss_fn, recipe_names) -> dict:
    """gemm_sensitivity.py on the trained bf16 model, eager, for each named recipe."""
    def loss_of(m):
        return statistics.fmean(loss_fn(m(x).float().reshape(-1, 256), y.reshape(-1)).item() for x, y in val_batches)

    results = {}
    for name in recipe_names:
        results[name] = gemm_sensitivity_lib.sensitivity(model, loss_of, C.make_recipe(name), model.head)
        print(gemm_sensitivity_lib.markdown(results[name], name), flush=True)
    return results


def final_val(run: dict) -> float:
    return run["val"][-1][1] if run["val"] and "diverged_at" not in run else float("nan")


def summarize(runs: list) -> dict:
    """Final validation loss per recipe (mean, std over seeds), its distance to bf16's, and whether
    bf16 had stopped improving: how much its seed-mean validation loss fell over the last 10% of steps."""
    by_recipe = {}
    for r in runs:
        by_recipe.setdefault(r["recipe"], []).append(r)
    table = {}
    for name, group in by_recipe.items():
        finals = [final_val(r) for r in group]
        times = [t for r in group for t in r["step_ms"][1:]]  # the first step compiles
        table[name] = {"mean": statistics.fmean(finals), "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                       "seeds": len(finals), "finals": finals,
                       "diverged": [r["seed"] for r in group if "diverged_at" in r],
                       "median_step_ms": statistics.median(times) if times else float("nan"),
                       "runs_sharing_gpu": max(r.get("runs_sharing_gpu", 1) for r in group)}
    base = table.get("bf16")
    for row in table.values():
        if base is not None:
            row["diff_to_bf16"] = row["mean"] - base["mean"]
            row["diff_pct"] = 100 * row["diff_to_bf16"] / base["mean"]
            row["diff_in_bf16_std"] = row["diff_to_bf16"] / base["std"] if base["std"] > 0 else float("nan")
    if base is not None:
        curves = mean_curve([r for r in runs if r["recipe"] == "bf16"])
        before = [v for s, v in curves[:-1] if s <= 0.9 * curves[-1][0]]  # the last evaluation 10% before the end
        base["last_10pct_change_pct"] = 100 * (before[-1] - curves[-1][1]) / curves[-1][1] if before else float("nan")
    return table


def mean_curve(group: list) -> list:
    """[(step, mean validation loss over the group's seeds)] up to the shortest run's last point."""
    curves = [r["val"] for r in group if r["val"]]
    n = min(len(c) for c in curves)
    return [(curves[0][i][0], statistics.fmean(c[i][1] for c in curves)) for i in range(n)]


def write_summary(table: dict, runs: list, out_dir: str, device: torch.device) -> None:
    shared = max(row["runs_sharing_gpu"] for row in table.values())
    rows = [[name, row["seeds"], f"{row['mean']:.4f} +- {row['std']:.4f}",
             f"{row.get('diff_to_bf16', float('nan')):+.4f}", f"{row.get('diff_pct', float('nan')):+.2f}%",
             f"{row.get('diff_in_bf16_std', float('nan')):+.2f}", ",".join(map(str, row["diverged"])) or "none",
             f"{row['median_step_ms']:.1f}" + (f" ({row['runs_sharing_gpu']})" if shared > 1 else "")]
            for name, row in table.items()]
    step_header = "median step ms" + (" (runs sharing the GPU)" if shared > 1 else "")
    text = C.markdown_table(["recipe", "seeds", "final val loss", "diff to bf16", "diff %", "in bf16 seed std",
                             "diverged seeds", step_header], rows)
    if "bf16" in table:
        text += (f"\n\nbf16 validation loss over the last 10% of steps fell by "
                 f"{table['bf16']['last_10pct_change_pct']:.2f}% (flat means under 1%).")
    with open(os.path.join(out_dir, "convergence.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    envs = {json.dumps({k: v for k, v in r["env"].items() if k != "time"}, sort_keys=True) for r in runs if "env" in r}
    C.write_json(out_dir, "convergence", {"table": table, "data": runs[0].get("data"),
                                          "runs_env": [json.loads(e) for e in sorted(envs)],
                                          "summarized_on": C.environment(device)})
    plt = C.try_pyplot()
    if plt is not None:
        plot(plt, table, runs, out_dir, step_header)


def plot(plt, table: dict, runs: list, out_dir: str, step_header: str) -> None:
    """Validation loss (seed mean, min-max band), its difference to bf16's mean, and step time."""
    fig, (ax_loss, ax_diff, ax_time) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [3, 3, 2]})
    base = dict(mean_curve([r for r in runs if r["recipe"] == "bf16"])) if "bf16" in table else None
    for name in table:
        group = [r for r in runs if r["recipe"] == name and r["val"]]
        n = min(len(r["val"]) for r in group)
        steps = [s for s, _ in group[0]["val"][:n]]
        per_step = [[r["val"][i][1] for r in group] for i in range(n)]
        mean = [statistics.fmean(v) for v in per_step]
        line, = ax_loss.plot(steps, mean, label=f"{name} ({len(group)} seeds)")
        ax_loss.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], alpha=0.2,
                             color=line.get_color())
        if base is not None:
            keep = [i for i, s in enumerate(steps) if s in base]
            ax_diff.plot([steps[i] for i in keep], [mean[i] - base[steps[i]] for i in keep], color=line.get_color())
            ax_diff.fill_between([steps[i] for i in keep], [min(per_step[i]) - base[steps[i]] for i in keep],
                                 [max(per_step[i]) - base[steps[i]] for i in keep], alpha=0.2, color=line.get_color())
        bar = ax_time.bar(name, table[name]["median_step_ms"], color=line.get_color())
        if table[name]["runs_sharing_gpu"] > 1:
            ax_time.bar_label(bar, labels=[f"{table[name]['runs_sharing_gpu']} sharing"], fontsize=7)
    ax_loss.set(xlabel="step", ylabel="validation loss (nats per byte)", title="validation loss")
    ax_loss.set_ylim(top=min(ax_loss.get_ylim()[1], 2 * min(row["mean"] for row in table.values())))
    ax_loss.legend()
    ax_diff.axhline(0.0, color="black", linewidth=0.5)
    ax_diff.set(xlabel="step", ylabel="minus bf16 seed mean", title="difference to bf16")
    ax_time.set(ylabel="ms", title=step_header)
    plt.setp(ax_time.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    C.save_figure(fig, out_dir, "convergence")


def load_runs(out_dir: str) -> list:
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*-seed*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    return runs


def run_one(name: str, seed: int, args, train_data, val_data, data_info, device) -> dict:
    env = C.environment(device)

    def save(run):
        run["data"], run["runs_sharing_gpu"], run["env"] = data_info, args.sharing, env
        path = os.path.join(args.out, f"{name}-seed{seed}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(run, f)
        os.replace(path + ".tmp", path)  # a reader never sees half a file

    torch._dynamo.reset()
    run = train(name, seed, args, train_data, val_data, device, save)
    save(run)
    if run.get("gemm_sensitivity"):
        tables = [gemm_sensitivity_lib.markdown(r, recipe) for recipe, r in run["gemm_sensitivity"].items()]
        with open(os.path.join(args.out, f"gemm_sensitivity-seed{seed}.md"), "w") as f:
            f.write("\n\n".join(tables) + "\n")
    print(f"{name} seed {seed}: final val {final_val(run):.4f}", flush=True)
    return run


def launch_parallel(jobs: list, argv: list) -> None:
    """One process per (recipe, seed), all at once on the same device: compiles overlap on the host
    and small models fill each other's launch gaps. Step times then measure a shared GPU."""
    base = [a for a in argv if a != "--parallel"]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *base, "--recipes", name, "--seeds",
                               str(seed), "--sharing", str(len(jobs)), "--no-summary"]) for name, seed in jobs]
    failed = [job for job, proc in zip(jobs, procs) if proc.wait() != 0]
    if failed:
        raise SystemExit(f"convergence: runs {failed} exited with an error")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", default="bf16,current,delayed,blockwise,mxfp8,nvfp4")
    p.add_argument("--seeds", default="0")
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--val-every-file", type=int, default=20, help="every n-th source file is validation data")
    p.add_argument("--data-mb", type=float, default=64.0)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="convergence_out")
    p.add_argument("--parallel", action="store_true", help="one process per run, all sharing the device")
    p.add_argument("--gemm-sensitivity", default="", help="recipes whose per-GEMM loss sensitivity is measured on "
                   "each trained bf16 model (benchmarks/gemm_sensitivity.py)")
    p.add_argument("--summarize", action="store_true", help="only rebuild the summary from --out's run files")
    p.add_argument("--sharing", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--no-summary", dest="summary", action="store_false", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    jobs = [(name, int(seed)) for name in args.recipes.split(",") for seed in args.seeds.split(",")]
    if args.parallel:
        launch_parallel(jobs, argv)
    elif not args.summarize:
        train_data, val_data, data_info = stdlib_sources(args.data_mb, args.val_every_file)
        for name, seed in jobs:
            run_one(name, seed, args, train_data, val_data, data_info, device)
    if not args.summary:
        return []
    runs = load_runs(args.out)
    if runs:
        write_summary(summarize(runs), runs, args.out, device)
    return runs


if __name__ == "__main__":
    main()
