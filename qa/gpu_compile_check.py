"""GPU check of the inlined ops under inductor: every recipe, a 2-layer TransformerLayer stack,
default compile and reduce-overhead, 6 steps each against eager; prints the losses, counters and
the first error line of any failure (a quick triage script; the tests assert the same)."""
import sys
import traceback

import torch
from torch._dynamo.utils import counters

from transformer_engine_proto.examples.train import Config, train

modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["default", "reduce-overhead"]
recipes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["none", "delayed", "current", "blockwise", "mxfp8", "nvfp4"]
cfg = Config(hidden=256, ffn=1024, heads=4, layers=2, seq=128, batch=4, steps=6, lr=1e-3)
dev = torch.device("cuda")
for recipe in recipes:
    eager, _, _ = train(recipe, cfg, None, dev, torch.bfloat16, progress=False)
    for mode in modes:
        torch._dynamo.reset()
        counters.clear()
        try:
            graphed, _, _ = train(recipe, cfg, mode, dev, torch.bfloat16, progress=False)
            worst = max(abs(a - b) / abs(b) for a, b in zip(graphed, eager))
            print(f"{recipe:10s} {mode:16s} ok  max rel loss diff {worst:.2e}  breaks "
                  f"{sum(counters['graph_break'].values())}  cudagraph skips {counters['inductor']['cudagraph_skips']}",
                  flush=True)
        except Exception as e:
            lines = [l for l in traceback.format_exception(e) if "Error" in l or "error" in l]
            print(f"{recipe:10s} {mode:16s} FAIL {type(e).__name__}: {str(e)[:600]}", flush=True)
            print("   ", "".join(traceback.format_exception(e)[-6:])[:3000], flush=True)
