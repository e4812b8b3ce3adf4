"""A second process compiling the same model hits AOT autograd's cache and inductor's FX graph cache
(and, on a GPU, Triton's kernel cache: it compiles no kernel, the library's own quantize kernels
included, `triton_ptxas.py`): its first step traces no joint graph, skips codegen and gives the same
numbers as the cold process."""
import json
import subprocess
import sys

import pytest
from subprocess_env import package_env

STEP = r"""
import json, sys, time
import torch
import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from torch._dynamo.utils import counters

recipe = {"current": R.Float8CurrentScaling(), "delayed": R.DelayedScaling(),
          "mxfp8": R.MXFP8BlockScaling(), "nvfp4": R.NVFP4BlockScaling()}[sys.argv[1]]
device = sys.argv[2]
torch.manual_seed(0)
m = te.Linear(128, 128, device=device)
x = torch.randn(64, 128, device=device, requires_grad=True)
start = time.perf_counter()
with te.autocast(recipe=recipe):
    loss = torch.compile(m, fullgraph=True)(x).float().square().sum()
loss.backward()
print(json.dumps({"seconds": time.perf_counter() - start, "loss": loss.item(), "xgrad": x.grad.sum().item(),
                  "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"],
                  "aot": {k: v for k, v in counters["aot_autograd"].items() if k.startswith("autograd_cache")}}))
"""

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def _first_step(tmp_path, rid, device):
    """The child's report, and the Triton kernels it compiled (new groups in Triton's cache)."""
    triton_cache = tmp_path / "triton"
    before = set(triton_cache.rglob("__grp__*")) if triton_cache.exists() else set()
    env = package_env()
    env.pop("TRITON_PTXAS_PATH", None)  # the child chooses its ptxas itself (this process set one on import)
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               TORCHINDUCTOR_FX_GRAPH_CACHE="1")
    res = subprocess.run([sys.executable, "-c", STEP, rid, device], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    after = set(triton_cache.rglob("__grp__*")) if triton_cache.exists() else set()
    report["triton_compiled"] = sorted(p.name for p in after - before)
    return report


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rid", ["current", pytest.param("delayed", marks=pytest.mark.slow),
                                 pytest.param("mxfp8", marks=pytest.mark.slow),
                                 pytest.param("nvfp4", marks=pytest.mark.slow)])
def test_second_process_hits_the_compile_cache(tmp_path, rid, device):
    cold = _first_step(tmp_path, rid, device)
    warm = _first_step(tmp_path, rid, device)
    assert cold["miss"] > 0 and cold["hit"] == 0, cold
    assert warm["miss"] == 0 and warm["hit"] == cold["miss"], warm  # every graph (forward, backward) hit
    # AOT autograd's cache too, or the warm process would trace the joint graph again (seconds)
    assert cold["aot"].get("autograd_cache_saved", 0) == 1, cold
    assert warm["aot"].get("autograd_cache_hit") == 1, warm
    assert not {"autograd_cache_miss", "autograd_cache_bypass"} & set(warm["aot"]), warm
    assert (warm["loss"], warm["xgrad"]) == (cold["loss"], cold["xgrad"])
    if device == "cuda":
        assert cold["triton_compiled"], cold  # the cold process did compile (the check below can fail)
        assert warm["triton_compiled"] == [], warm
