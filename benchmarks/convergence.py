"""Does FP8 train as well as bf16? A GPT-style model on real text, per recipe and seed.

    python benchmarks/convergence.py --out out/ --recipes bf16,current,delayed --seeds 0,1,2
    python benchmarks/convergence.py --size tiny --steps 20 --out out/   # CPU smoke run

Data: the source of Python's standard library on this machine (no download), as bytes (a
byte-level vocabulary of 256), in file order; the last `--val-fraction` of the bytes is the
held-out validation split. Model: token embedding, `te.TransformerLayer` blocks (RMSNorm, SwiGLU,
causal attention), a final `te.RMSNorm` and a `te.Linear` head, under `torch.compile`. AdamW with
linear warmup and cosine decay, gradient clipping at 1. Each run writes `<recipe>-seed<k>.json`
(train / validation losses, step times); the summary (`convergence.md`, `convergence.json`, and
`convergence.png` with matplotlib) gives each recipe's final validation loss as mean +- std over
seeds and its difference to bf16 in units of bf16's seed std.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import sysconfig
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _common as C  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import transformer_engine_proto as te  # noqa: E402

SIZES = {  # hidden, layers, heads, ffn, sequence, batch
    "tiny": (64, 2, 4, 192, 64, 4),
    "small": (768, 12, 12, 2048, 512, 32),  # about 85M parameters
}


def stdlib_bytes(limit_mb: float) -> torch.Tensor:
    """The standard library's .py files, concatenated in sorted path order, as uint8 tokens."""
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data)
        total += len(data)
        if total >= limit_mb * 2**20:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


class GPT(nn.Module):
    def __init__(self, hidden, layers, heads, ffn, device):
        super().__init__()
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


def train(recipe_name: str, seed: int, args, train_data, val_data, device) -> dict:
    hidden, layers, heads, ffn, seq, batch = SIZES[args.size]
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = GPT(hidden, layers, heads, ffn, device).to(dtype)
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
    return out


def summarize(runs: list) -> dict:
    """Final validation loss per recipe (mean, std over seeds) and its distance to bf16's."""
    by_recipe = {}
    for r in runs:
        by_recipe.setdefault(r["recipe"], []).append(r["val"][-1][1] if r["val"] else float("nan"))
    table = {}
    for name, finals in by_recipe.items():
        table[name] = {"mean": statistics.fmean(finals), "std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                       "seeds": len(finals)}
    base = table.get("bf16") or table.get("none")
    for row in table.values():
        if base is not None:
            row["diff_to_bf16"] = row["mean"] - base["mean"]
            row["diff_in_bf16_std"] = row["diff_to_bf16"] / base["std"] if base["std"] > 0 else float("nan")
    return table


def write_summary(table: dict, runs: list, out_dir: str, device: torch.device) -> None:
    rows = []
    for name, row in table.items():
        times = [t for r in runs if r["recipe"] == name for t in r["step_ms"][1:]]  # the first compiles
        rows.append([name, row["seeds"], f"{row['mean']:.4f} +- {row['std']:.4f}",
                     f"{row.get('diff_to_bf16', float('nan')):+.4f}",
                     f"{row.get('diff_in_bf16_std', float('nan')):+.2f}",
                     f"{statistics.median(times):.1f}" if times else "-"])
    text = C.markdown_table(["recipe", "seeds", "final val loss", "diff to bf16", "in bf16 seed std",
                             "median step ms"], rows)
    with open(os.path.join(out_dir, "convergence.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    C.write_json(out_dir, "convergence", {"table": table, "env": C.environment(device)})
    plt = C.try_pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in table:
        curves = [r["val"] for r in runs if r["recipe"] == name and r["val"]]
        n = min(len(c) for c in curves)
        steps = [s for s, _ in curves[0][:n]]
        ax.plot(steps, [statistics.fmean(c[i][1] for c in curves) for i in range(n)], label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per byte)")
    ax.legend()
    C.save_figure(fig, out_dir, "convergence")


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
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--data-mb", type=float, default=64.0)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="convergence_out")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    data = stdlib_bytes(args.data_mb)
    split = int(data.numel() * (1 - args.val_fraction))
    train_data, val_data = data[:split], data[split:]
    runs = []
    for name in args.recipes.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            torch._dynamo.reset()
            run = train(name, seed, args, train_data, val_data, device)
            runs.append(run)
            with open(os.path.join(args.out, f"{name}-seed{seed}.json"), "w") as f:
                json.dump(run, f)
            print(f"{name} seed {seed}: final val {run['val'][-1][1] if run['val'] else float('nan'):.4f}", flush=True)
    write_summary(summarize(runs), runs, args.out, device)
    return runs


if __name__ == "__main__":
    main()
