"""Inductor sees through the library's ops (custom_ops/inductor_lowering.py): a compiled training step
runs no library Python per Linear, and the opaque fallback still works."""
import gc
import importlib
import os
import subprocess
import sys

import pytest
import torch
from compile_cases import assert_matches_eager
from linear_cases import RECIPES, fresh_dynamo, recipe_ctx
from subprocess_env import package_env

import transformer_engine_proto as te
from transformer_engine_proto.custom_ops import inductor_lowering

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from bench_host import library_calls  # noqa: E402

LAYERS = 2


def _compiled_step_calls(recipe):
    """(library Python calls in one compiled step, those of them delayed scaling's eager update)"""
    fresh_dynamo()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[te.Linear(32, 32) for _ in range(LAYERS)])
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(32, 32, requires_grad=True)

    def step():
        with recipe_ctx(recipe):
            y = compiled(x)
        y.sum().backward()

    for _ in range(2):
        step()
    gc.collect()  # modules other tests left in reference cycles would be prepared at autocast entry
    calls = library_calls(step)
    # delayed scaling's update runs eagerly at autocast's exit and entry: the step again without it
    autocast_mod = importlib.import_module("transformer_engine_proto.autocast")  # the package exports the function
    update = autocast_mod._update_delayed_scaling
    autocast_mod._update_delayed_scaling = lambda *a, **k: None
    try:
        without_update = library_calls(step)
    finally:
        autocast_mod._update_delayed_scaling = update
    return calls, calls - without_update


@pytest.mark.parametrize("rid", ["delayed", "current", "mxfp8"])
def test_compiled_step_runs_no_library_python_per_linear(rid):
    """The ops' bodies ran at compile time only: what is left per step is the eager code around
    the compiled region (autocast entry), not the Linear ops (about 220 calls per Linear fwd+bwd
    when inductor calls the opaque ops)."""
    calls, update_calls = _compiled_step_calls(RECIPES[rid])
    assert calls - update_calls <= 10 * LAYERS, \
        f"{calls} library Python calls ({update_calls} the delayed update) in one compiled step of {LAYERS} Linears"


def test_inlining_off_runs_the_op_bodies_every_step():
    """`set_inductor_inlining(False)`: inductor calls the opaque ops, whose bodies run per step."""
    recipe = RECIPES["current"]
    inductor_lowering.set_inductor_inlining(False)
    try:
        assert not inductor_lowering.inductor_inlining_enabled()
        opaque, _ = _compiled_step_calls(recipe)
    finally:
        inductor_lowering.set_inductor_inlining(True)
    inlined, _ = _compiled_step_calls(recipe)
    assert opaque > 50 * LAYERS > inlined, (opaque, inlined)


def _last_line_printed(code: str, **env) -> str:
    """Run `code` in a fresh interpreter with the package importable (and `env` set); the last
    line it printed."""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**package_env(), **env}, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.splitlines()[-1]


def test_eager_use_imports_no_inductor_passes():
    """An eager Linear (and the kernel backends it loads) does not import inductor's post-grad
    passes (seconds of import): the library's compile-time setup waits for inductor's first trace."""
    code = ("import sys, torch, transformer_engine_proto as te\n"
            "m = te.Linear(32, 32, device='cuda' if torch.cuda.is_available() else 'cpu')\n"
            "with te.autocast(recipe=te.recipe.DelayedScaling()):\n"
            "    y = m(torch.randn(16, 32, device=m.weight.device, requires_grad=True))\n"
            "y.sum().backward()\n"
            "print('torch._inductor.fx_passes.post_grad' in sys.modules)\n")
    assert _last_line_printed(code) == "False"


def test_cpu_inlining_env_variable_is_read_at_import():
    """`TE_PROTO_INLINE_CPU=0` turns CPU inlining off when the package is imported, and a compiled
    Linear runs under it."""
    code = ("import torch, transformer_engine_proto as te\n"
            "from transformer_engine_proto.custom_ops import inductor_lowering as il\n"
            "m = te.Linear(32, 32)\n"
            "with te.autocast(recipe=te.recipe.Float8CurrentScaling()):\n"
            "    y = torch.compile(m, fullgraph=True)(torch.randn(16, 32))\n"
            "print(il.cpu_inlining_enabled(), tuple(y.shape))\n")
    assert _last_line_printed(code, TE_PROTO_INLINE_CPU="0") == "False (16, 32)"


def test_cpu_inlining_off_keeps_cpu_ops_opaque_and_matches_eager():
    """`set_cpu_inlining(False)`: ops on CPU tensors stay opaque (their bodies run per step), and
    the compiled step gives eager's results (bits, up to inductor's float32 reduction order in the
    glue around the ops)."""
    recipe = RECIPES["mxfp8"]
    inductor_lowering.set_cpu_inlining(False)
    try:
        assert not inductor_lowering.cpu_inlining_enabled()
        assert _compiled_step_calls(recipe)[0] > 50 * LAYERS
        fresh_dynamo()
        torch.manual_seed(0)
        model = te.LayerNormMLP(64, 128)
        x, g = torch.randn(32, 64), torch.randn(32, 64)
        outs = []
        for m in (model, torch.compile(model, fullgraph=True)):
            xx = x.clone().requires_grad_()
            with recipe_ctx(recipe):
                y = m(xx)
            y.backward(g)
            outs.append([y, xx.grad] + [p.grad.clone() for p in model.parameters()])
            model.zero_grad()
        names = ["y", "x.grad"] + [n for n, _ in model.named_parameters()]
        for name, c, e in zip(names, *outs[::-1]):
            assert_matches_eager(c, e, "inductor", name)
    finally:
        inductor_lowering.set_cpu_inlining(True)
