"""Train a Hugging Face Llama converted by `te.convert_model` against the unconverted model.

    python -m transformer_engine_proto.examples.hf_llama                     # Float8CurrentScaling, compiled
    python -m transformer_engine_proto.examples.hf_llama --recipe mxfp8 --steps 40 --no-compile

Builds a small randomly initialised `LlamaForCausalLM` (no download), deep-copies it, converts one
copy in place (every nn.Linear and LlamaRMSNorm), and trains both on the same Markov-chain tokens
(see examples/train.py), each under `torch.compile(fullgraph=True)` unless --no-compile. Prints
the loss and the ms/step after warm-up (compilation excluded) of each. CUDA when present, else CPU
(where the model is tiny). Needs transformers: pip install -e ".[hf]".

The compile backend defaults to inductor on CUDA and to aot_eager on CPU: inductor's C++ code
generation for the converted model's inlined quantize ops takes about a minute on a small CPU,
while aot_eager traces the same full graph (same ops, zero graph breaks) in seconds. CPU step
times show the emulated FP8 GEMMs (float32 emulation), not FP8 speed: measure speed on a GPU.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch

import transformer_engine_proto as te
from transformer_engine_proto.examples.train import RECIPES, Config, MarkovData

WARMUP = 3  # steps excluded from ms/step: compilation and first-call allocations


def build_llama(cfg: Config, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(hidden_size=cfg.hidden, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
                         num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads, vocab_size=cfg.vocab,
                         max_position_embeddings=cfg.seq)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def train(model, recipe, cfg: Config, backend, device):
    """(losses, ms per step after WARMUP steps); `backend` None: eager."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    fwd = model if backend is None else torch.compile(model, fullgraph=True, backend=backend)
    data = MarkovData(cfg, device)  # same seed: both models see the same batches
    losses, times = [], []
    for _ in range(cfg.steps):
        tokens = data.batch()[:, :-1]  # seq tokens: batch x seq rows, as block recipes want (HF shifts labels)
        t0 = time.perf_counter()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = fwd(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the sync keeps the CUDA step time honest
        times.append(time.perf_counter() - t0)
    warm = times[min(WARMUP, len(times) - 1):]
    return losses, 1000 * sum(warm) / len(warm)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=sorted(RECIPES), default="current")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--no-compile", action="store_true", help="run eagerly")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: inductor on CUDA, "
                   "aot_eager on CPU)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit('hf_llama needs Hugging Face transformers: pip install -e ".[hf]"')
    device = torch.device(args.device)
    if device.type == "cpu":
        cfg, dtype = Config(hidden=64, ffn=128, heads=4, layers=2, seq=32, batch=4, steps=10), torch.float32
    else:
        cfg = Config(vocab=32000, hidden=1024, ffn=2816, heads=16, layers=4, seq=512, batch=4, steps=30, lr=1e-3)
        dtype = torch.bfloat16
    if args.steps is not None:
        cfg.steps = args.steps
    backend = None if args.no_compile else (args.backend or ("inductor" if device.type == "cuda" else "aot_eager"))
    recipe = RECIPES[args.recipe]()
    baseline = build_llama(cfg, device, dtype)
    model = copy.deepcopy(baseline)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", te.ConversionWarning)
        te.convert_model(model, convert_norms=True, recipe=recipe)
    for w in caught:
        print(w.message)
    swapped = sum(isinstance(m, (te.Linear, te.RMSNorm)) for m in model.modules())
    how = "eager" if backend is None else f"torch.compile(fullgraph=True, backend={backend!r})"
    print(f"device {device}, params {dtype}, {how}, "
          f"Llama {cfg.layers} layers hidden {cfg.hidden}, {cfg.batch}x{cfg.seq} tokens/step, {cfg.steps} steps; "
          f"{swapped} modules converted, recipe {args.recipe}")
    results = {}
    for name, m, r in (("unconverted", baseline, None), (f"te + {args.recipe}", model, recipe)):
        losses, ms = train(m, r, cfg, backend, device)
        results[name] = (losses, ms)
    print(f"{'model':>16s} {'first loss':>11s} {'final loss':>11s} {'ms/step':>8s}   (data entropy "
          f"{MarkovData(cfg, device).entropy:.3f}; ms/step excludes the first {WARMUP} steps)")
    for name, (losses, ms) in results.items():
        print(f"{name:>16s} {losses[0]:11.4f} {losses[-1]:11.4f} {ms:8.1f}")
    return results


if __name__ == "__main__":
    main()
