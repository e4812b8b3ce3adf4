"""Train a small TransformerLayer stack on synthetic tokens with a low-precision recipe.

    python -m transformer_engine_proto.examples.train                       # delayed FP8, compiled
    python -m transformer_engine_proto.examples.train --recipe mxfp8 --no-compile
    python -m transformer_engine_proto.examples.train --compare --plot loss.png   # all recipes vs bf16

The data is a fixed random Markov chain over the vocabulary, so the loss falls towards the
chain's entropy (printed) and recipes can be compared on a target that is really learnable.
Runs on CUDA when present, else on CPU (where the model defaults to something small).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass

import torch
from torch import nn

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R

RECIPES = {
    "none": lambda: None,
    "delayed": lambda: R.DelayedScaling(amax_history_len=16),
    "current": R.Float8CurrentScaling,
    "mxfp8": R.MXFP8BlockScaling,
    "blockwise": R.Float8BlockScaling,
    "nvfp4": R.NVFP4BlockScaling,
}


@dataclass
class Config:
    vocab: int = 256
    hidden: int = 128
    ffn: int = 512
    heads: int = 4
    layers: int = 2
    seq: int = 64
    batch: int = 8
    steps: int = 60
    lr: float = 3e-3
    seed: int = 0


class TinyLM(nn.Module):
    def __init__(self, cfg: Config, dtype: torch.dtype, device):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            te.TransformerLayer(cfg.hidden, cfg.ffn, cfg.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                attn_input_format="bshd", params_dtype=dtype, device=device)
            for _ in range(cfg.layers))
        self.norm = te.LayerNorm(cfg.hidden, params_dtype=dtype, device=device)
        self.head = te.Linear(cfg.hidden, cfg.vocab, bias=False, params_dtype=dtype, device=device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class MarkovData:
    """Tokens from a fixed random first-order Markov chain (a few likely successors per token)."""

    def __init__(self, cfg: Config, device):
        g = torch.Generator().manual_seed(1234)
        logits = torch.randn(cfg.vocab, cfg.vocab, generator=g) * 3.0
        self.probs = torch.softmax(logits, -1)
        p = self.probs
        self.entropy = float(-(p * p.clamp_min(1e-30).log()).sum(-1).mean())
        self.cfg, self.device, self.gen = cfg, device, torch.Generator().manual_seed(cfg.seed)

    def batch(self) -> torch.Tensor:
        cfg = self.cfg
        tok = torch.randint(cfg.vocab, (cfg.batch,), generator=self.gen)
        seq = [tok]
        for _ in range(cfg.seq):
            tok = torch.multinomial(self.probs[tok], 1, generator=self.gen).squeeze(1)
            seq.append(tok)
        return torch.stack(seq, 1).to(self.device)


def train(recipe_name: str, cfg: Config, compile_mode, device, dtype, progress: bool = True):
    """Returns (losses, seconds per step after warm-up)."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(cfg, dtype, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    recipe = RECIPES[recipe_name]()
    if compile_mode is None:
        step_fn_model = model
    elif compile_mode == "cudagraphs":  # CUDA-graph trees without inductor: eager's kernels, replayed
        step_fn_model = torch.compile(model, fullgraph=True, backend="cudagraphs")
    else:
        step_fn_model = torch.compile(model, fullgraph=True, mode=compile_mode)
    data = MarkovData(cfg, device)
    losses, times = [], []
    for step in range(cfg.steps):
        tokens = data.batch()
        t0 = time.perf_counter()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            logits = step_fn_model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the sync also makes the step time honest on CUDA
        times.append(time.perf_counter() - t0)
        losses.append(loss_value)
        if progress:
            _progress(recipe_name, step + 1, cfg.steps, loss_value, times)
    if progress:
        print(file=sys.stderr)
    warm = times[min(3, len(times) - 1):]
    return losses, sum(warm) / len(warm), data.entropy


def _progress(name, step, total, loss, times):
    width = 30
    filled = int(width * step / total)
    rate = times[-1] * 1000
    sys.stderr.write(f"\r{name:>9s} [{'#' * filled}{'.' * (width - filled)}] {step}/{total} "
                     f"loss {loss:.4f} step {rate:7.1f} ms")
    sys.stderr.flush()


def _plot(results, path, entropy):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (losses, _) in results.items():
        ax.plot(losses, label="bf16/fp32 (no recipe)" if name == "none" else name)
    ax.axhline(entropy, color="k", ls=":", label="data entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=sorted(RECIPES), default="delayed")
    p.add_argument("--compare", action="store_true", help="train every recipe and bf16, print a table")
    p.add_argument("--no-compile", action="store_true", help="run eagerly")
    p.add_argument("--mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs); "
                   "'cudagraphs': the cudagraphs backend (CUDA graphs over eager's kernels)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plot", default=None, help="write a loss-curve PNG (needs matplotlib)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cfg = Config() if device.type == "cpu" else Config(hidden=1024, ffn=4096, heads=16, layers=4, seq=512, batch=4, lr=1e-3)
    if args.steps is not None:
        cfg.steps = args.steps
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    compile_mode = None if args.no_compile else (args.mode or "default")
    names = list(RECIPES) if args.compare else [args.recipe]
    print(f"device {device}, params {dtype}, {'eager' if compile_mode is None else 'torch.compile(' + compile_mode + ')'}, "
          f"{cfg.layers} layers hidden {cfg.hidden}, {cfg.batch}x{cfg.seq} tokens/step, {cfg.steps} steps")
    results = {}
    entropy = math.nan
    for name in names:
        losses, step_s, entropy = train(name, cfg, compile_mode, device, dtype, progress=not args.quiet)
        results[name] = (losses, step_s)
    base = results.get("none")
    print(f"{'recipe':>10s} {'final loss':>11s} {'vs none':>8s} {'ms/step':>8s}   (data entropy {entropy:.3f})")
    for name, (losses, step_s) in results.items():
        final = sum(losses[-5:]) / min(5, len(losses))
        rel = "" if base is None else f"{(final / (sum(base[0][-5:]) / min(5, len(base[0]))) - 1) * 100:+7.2f}%"
        print(f"{name:>10s} {final:11.4f} {rel:>8s} {step_s * 1000:8.1f}")
    if args.plot:
        _plot(results, args.plot, entropy)


if __name__ == "__main__":
    main()
