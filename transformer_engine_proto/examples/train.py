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
from transformer_engine_proto.custom_ops import inductor_lowering

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


WARMUP = 3  # steps left out of the step time: compilation (step 0) and allocator / autotune warm-up


def train(recipe_name: str, cfg: Config, compile_mode, device, dtype, progress: bool = True, gemm_policy=None):
    """Returns (losses, seconds per step after the first WARMUP steps (nan if there are none),
    the data's entropy). `gemm_policy`: a te.GemmPolicy (each GEMM in FP8 only where predicted
    faster); its choices are printed after training."""
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
        if progress and step == 0 and compile_mode is not None:
            print(f"{recipe_name}: compiling (torch.compile, first step) ...", flush=True)
        t0 = time.perf_counter()
        with te.autocast(enabled=recipe is not None, recipe=recipe, gemm_policy=gemm_policy):
            logits = step_fn_model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()  # the sync also makes the step time honest on CUDA
        times.append(time.perf_counter() - t0)
        losses.append(loss_value)
        if progress and step == 0 and compile_mode is not None:
            print(f"{recipe_name}: compiled in {times[0]:.1f} s", flush=True)
        if progress:
            _progress(recipe_name, step + 1, cfg.steps, loss_value, times)
    if progress and sys.stdout.isatty():
        print()
    if gemm_policy is not None and recipe is not None:
        print(f"{recipe_name}: GEMM precision chosen by te.GemmPolicy (predicted ms per fwd+bwd)\n"
              f"{te.precision_report(model)}")
    warm = times[WARMUP:]
    return losses, (sum(warm) / len(warm) if warm else math.nan), data.entropy


def _progress(name, step, total, loss, times):
    """A bar redrawn in place on a terminal; in a log (not a tty) a plain line every tenth."""
    rate = times[-1] * 1000
    if not sys.stdout.isatty():
        if step % max(1, total // 10) == 0 or step == total:
            print(f"{name:>9s} step {step}/{total} loss {loss:.4f} step {rate:.1f} ms", flush=True)
        return
    width = 30
    filled = int(width * step / total)
    sys.stdout.write(f"\r{name:>9s} [{'#' * filled}{'.' * (width - filled)}] {step}/{total} "
                     f"loss {loss:.4f} step {rate:7.1f} ms")
    sys.stdout.flush()


def loss_deltas(results) -> dict:
    """Each recipe's loss minus the baseline's ("none"), step by step: the curves themselves lie
    on top of each other at this scale."""
    base = results["none"][0]
    return {name: [a - b for a, b in zip(losses, base)] for name, (losses, _) in results.items() if name != "none"}


def _check_plot_deps() -> None:
    """--plot needs matplotlib: fail before training, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: pip install matplotlib "
                         "(from a checkout: pip install -e \".[plot]\")") from None


def _plot(results, path, entropy):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    compare = "none" in results and len(results) > 1
    fig, axes = plt.subplots(1, 2 if compare else 1, figsize=(13 if compare else 7, 4), squeeze=False)
    ax = axes[0, 0]
    for name, (losses, _) in results.items():
        ax.plot(losses, label="bf16/fp32 (no recipe)" if name == "none" else name)
    ax.axhline(entropy, color="k", ls=":", label="data entropy")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.legend()
    if compare:
        ax = axes[0, 1]
        for name, delta in loss_deltas(results).items():
            ax.plot(delta, label=name)
        ax.axhline(0.0, color="k", lw=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("loss - baseline loss (no recipe)")
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
    p.add_argument("--inline-cpu", action="store_true",
                   help="on CPU, let inductor compile the ops' reference kernels to C++ (minutes for MXFP8 / "
                        "NVFP4); by default they stay opaque there and run eager's code")
    p.add_argument("--gemm-policy", action="store_true",
                   help="run each GEMM in FP8 only where predicted faster than bf16 (te.GemmPolicy) "
                        "and print the choices")
    args = p.parse_args(argv)
    if args.plot:
        _check_plot_deps()
    device = torch.device(args.device)
    cfg = Config() if device.type == "cpu" else Config(hidden=1024, ffn=4096, heads=16, layers=4, seq=512, batch=4,
                                                       lr=1e-3)
    if args.steps is not None:
        cfg.steps = args.steps
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    compile_mode = None if args.no_compile else (args.mode or "default")
    names = list(RECIPES) if args.compare else [args.recipe]
    how = "eager" if compile_mode is None else f"torch.compile({compile_mode})"
    if compile_mode is not None and device.type == "cpu" and not args.inline_cpu:
        how += " (the library's ops opaque to inductor on CPU: --inline-cpu compiles them)"
    print(f"device {device}, params {dtype}, {how}, "
          f"{cfg.layers} layers hidden {cfg.hidden}, {cfg.batch}x{cfg.seq} tokens/step, {cfg.steps} steps")
    results = {}
    entropy = math.nan
    inlining = inductor_lowering.cpu_inlining_enabled()
    inductor_lowering.set_cpu_inlining(args.inline_cpu or device.type != "cpu")
    try:
        for name in names:
            losses, step_s, entropy = train(name, cfg, compile_mode, device, dtype, progress=not args.quiet,
                                            gemm_policy=te.GemmPolicy() if args.gemm_policy else None)
            results[name] = (losses, step_s)
    finally:
        inductor_lowering.set_cpu_inlining(inlining)
    base = results.get("none")
    print(f"{'recipe':>10s} {'final loss':>11s} {'vs none':>8s} {'ms/step':>8s}   (data entropy {entropy:.3f}; "
          f"ms/step leaves out the first {WARMUP} steps: compilation and warm-up)")
    for name, (losses, step_s) in results.items():
        final = sum(losses[-5:]) / min(5, len(losses))
        rel = "" if base is None else f"{(final / (sum(base[0][-5:]) / min(5, len(base[0]))) - 1) * 100:+7.2f}%"
        ms = f"{step_s * 1000:8.1f}" if step_s == step_s else f"{'n/a':>8s}"  # nan: no step after warm-up
        print(f"{name:>10s} {final:11.4f} {rel:>8s} {ms}")
    if args.plot:
        _plot(results, args.plot, entropy)


if __name__ == "__main__":
    main()
