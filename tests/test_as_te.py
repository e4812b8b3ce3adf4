"""The opt-in `transformer_engine` alias (transformer_engine_proto/as_te.py).

Everything that installs the alias runs in a subprocess, so this session's sys.modules never
holds a `transformer_engine` entry."""
import importlib
import importlib.util
import subprocess
import sys
import types

import pytest
from subprocess_env import package_env

import transformer_engine_proto as proto
from transformer_engine_proto import as_te

REAL_TE = [n for n in ("transformer_engine", "transformer_engine_torch") if importlib.util.find_spec(n)]
needs_no_real_te = pytest.mark.skipif(bool(REAL_TE), reason=f"a real {REAL_TE} is installed: install() refuses")


def _python(args, cwd, pythonpath=None, check=True):
    env = package_env(*filter(None, [pythonpath]))
    res = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert res.returncode == 0, res.stdout + res.stderr
    return res


ALIASES_RESOLVE = r"""
import functools, importlib, sys
import transformer_engine_proto as proto
from transformer_engine_proto import as_te

root = as_te.install()
snapshot = dict(sys.modules)
assert as_te.install() is root and as_te.installed()  # idempotent: nothing re-registered
assert dict(sys.modules) == snapshot
assert sum(type(f).__name__ == "_Finder" for f in sys.meta_path) == 1

import transformer_engine
import transformer_engine.pytorch as te
from transformer_engine.common import recipe
from transformer_engine.common.recipe import DelayedScaling, Format
import transformer_engine.debug
import transformer_engine_torch as tex
assert transformer_engine is root
assert te is proto and te.Linear is proto.Linear and te.fp8_autocast is proto.fp8_autocast
assert recipe is proto.recipe and DelayedScaling is proto.recipe.DelayedScaling and Format is proto.recipe.Format
assert transformer_engine.debug is proto.debug
from transformer_engine.debug import set_weight_tensor_tp_group_reduce
assert set_weight_tensor_tp_group_reduce is proto.debug.set_weight_tensor_tp_group_reduce

# the imports TE user code writes, by TE's module paths
from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
from transformer_engine.pytorch.quantization import autocast, fp8_model_init
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor, Float8Quantizer
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer
from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer
from transformer_engine.pytorch.float8_tensor import Float8Tensor as OldPathFloat8Tensor
from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.module.layernorm import LayerNorm
from transformer_engine.pytorch.module.rmsnorm import RMSNorm
from transformer_engine.pytorch.attention import DotProductAttention, MultiheadAttention, RotaryPositionEmbedding
from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb
from transformer_engine.pytorch.transformer import TransformerLayer
from transformer_engine.pytorch.graph import make_graphed_callables
from transformer_engine.debug.features.log_tensor_stats import LogTensorStats
from transformer_engine.debug.features.disable_quantization_gemm import DisableQuantizationGEMM
import transformer_engine.pytorch.tensor.float8_tensor
assert transformer_engine.pytorch.tensor.float8_tensor.Float8Tensor is proto.Float8Tensor  # dotted access
assert FP8GlobalStateManager is proto.quantization.FP8GlobalStateManager
assert (autocast, fp8_model_init) == (proto.autocast, proto.fp8_model_init)
assert Float8Tensor is OldPathFloat8Tensor is proto.Float8Tensor and Float8Quantizer is proto.Float8Quantizer
assert (MXFP8Quantizer, NVFP4Quantizer, Float8BlockQuantizer) == (
    proto.MXFP8Quantizer, proto.NVFP4Quantizer, proto.Float8BlockQuantizer)
assert (QuantizedTensor, Quantizer) == (proto.QuantizedTensor, proto.Quantizer)
assert QuantizedTensorStorage is proto.tensor.QuantizedTensorStorage
assert TransformerEngineBaseModule is proto.module.base.TransformerEngineBaseModule
assert (LayerNorm, RMSNorm, TransformerLayer) == (proto.LayerNorm, proto.RMSNorm, proto.TransformerLayer)
assert (DotProductAttention, MultiheadAttention, RotaryPositionEmbedding, apply_rotary_pos_emb) == (
    proto.DotProductAttention, proto.MultiheadAttention, proto.RotaryPositionEmbedding, proto.apply_rotary_pos_emb)
assert make_graphed_callables is proto.make_graphed_callables
assert LogTensorStats is proto.debug.features.log_tensor_stats.LogTensorStats
assert DisableQuantizationGEMM is proto.debug.features.disable_fp8_gemm.DisableQuantizationGEMM

# tex.DType: TE's names, with the C++ enum's values, taken where a dtype is
assert tex.DType is te.DType
want = dict(kByte=0, kInt32=2, kFloat32=4, kFloat16=5, kBFloat16=6, kFloat8E4M3=7, kFloat8E5M2=8,
            kFloat8E8M0=9, kFloat4E2M1=10)
assert {n: int(getattr(tex.DType, n)) for n in want} == want
import torch
q = te.Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3)
assert q(torch.randn(32, 32))._data.dtype == torch.float8_e4m3fn

# every alias: the same module by import and by attribute path
for name, target in as_te.ALIASES.items():
    mod = importlib.import_module(name)
    assert mod is importlib.import_module(target), name
    assert functools.reduce(getattr, name.split(".")[1:], sys.modules[name.split(".")[0]]) is mod, name

# TE modules not implemented here, and our own files under a TE name: an error, never a second load
for missing in ("transformer_engine.pytorch.ops.fused", "transformer_engine.jax",
                "transformer_engine.pytorch.module.normalization", "transformer_engine.pytorch.custom_ops"):
    try:
        importlib.import_module(missing)
    except ModuleNotFoundError as e:
        assert e.name == missing and "maps only" in str(e), e
    else:
        raise AssertionError(missing)
pkg_dir = proto.__path__[0]
for name, mod in list(sys.modules.items()):
    if (getattr(mod, "__file__", None) or "").startswith(pkg_dir) and not name.startswith("transformer_engine_proto"):
        assert name in as_te.ALIASES and mod is sys.modules[as_te.ALIASES[name]], name
print("ALIASES OK")
"""


@needs_no_real_te
def test_te_imports_resolve_to_our_objects(tmp_path):
    assert "ALIASES OK" in _python(["-c", ALIASES_RESOLVE], cwd=tmp_path).stdout


TE_SCRIPT = r"""
import sys

import torch
import transformer_engine.pytorch as te
from transformer_engine.common import recipe

import helper_next_to_script  # the script's directory is on sys.path, as for `python script.py`

assert __name__ == "__main__"
steps = int(sys.argv[sys.argv.index("--steps") + 1])
torch.manual_seed(0)
model = te.Linear(64, 32)
x = torch.randn(16, 64, requires_grad=True)
fp8_recipe = recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=4)
for _ in range(steps):
    with te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe):
        y = model(x)
    y.sum().backward()
with te.autocast(recipe=recipe.Float8CurrentScaling()):
    loss = model(x).sum()
loss.backward()
assert model.weight.grad is not None and torch.isfinite(x.grad).all()
print("TE SCRIPT RAN", sys.argv[0].endswith("train_te.py"), steps, type(model).__module__)
"""


@needs_no_real_te
@pytest.mark.parametrize("how", ["script", "module"])
def test_a_te_script_runs_through_the_alias(tmp_path, how):
    (tmp_path / "train_te.py").write_text(TE_SCRIPT)
    (tmp_path / "helper_next_to_script.py").write_text("")
    run = tmp_path / "elsewhere"
    run.mkdir()
    if how == "script":
        args = ["-m", "transformer_engine_proto.as_te", str(tmp_path / "train_te.py"), "--steps", "2"]
        out = _python(args, cwd=run).stdout
    else:  # `-m`: the module is found from the working directory, as with `python -m`
        out = _python(["-m", "transformer_engine_proto.as_te", "-m", "train_te", "--steps", "2"], cwd=tmp_path).stdout
    assert "TE SCRIPT RAN True 2 transformer_engine_proto.module.linear" in out


def _fake_real_te(root, kind):
    """A `transformer_engine` the alias must not shadow; importing it would fail loudly."""
    if kind == "transformer_engine_torch":
        path = root / "transformer_engine_torch.py"
        path.write_text("raise SystemExit('the fake transformer_engine_torch was imported')\n")
        return path
    path = root / "transformer_engine"
    path.mkdir()
    if kind == "package":
        path = path / "__init__.py"
        path.write_text("raise SystemExit('the fake transformer_engine was imported')\n")
    else:  # a namespace package: a directory without __init__.py
        (path / "pytorch.py").write_text("")
    return path


@pytest.mark.parametrize("kind", ["package", "namespace", "transformer_engine_torch"])
def test_refuses_to_shadow_a_real_te(tmp_path, kind):
    fake_root = tmp_path / "site"
    fake_root.mkdir()
    path = _fake_real_te(fake_root, kind)
    code = ("import sys\nfrom transformer_engine_proto import as_te\n"
            "try:\n    as_te.install()\nexcept RuntimeError as e:\n    print('REFUSED:', e)\n"
            "assert not as_te.installed() and 'transformer_engine' not in sys.modules\n")
    out = _python(["-c", code], cwd=tmp_path, pythonpath=fake_root).stdout
    assert "REFUSED:" in out and str(path) in out and "shadow" in out, out
    if kind != "package":
        return  # the runner goes through the same check: once is enough
    (tmp_path / "script.py").write_text("print('SCRIPT RAN')\n")
    res = _python(["-m", "transformer_engine_proto.as_te", "script.py"], cwd=tmp_path, pythonpath=fake_root,
                  check=False)
    assert res.returncode != 0 and "SCRIPT RAN" not in res.stdout
    assert "RuntimeError" in res.stderr and str(path) in res.stderr, res.stderr


def test_refuses_when_a_te_is_already_imported(monkeypatch):
    fake = types.ModuleType("transformer_engine")
    monkeypatch.setitem(sys.modules, "transformer_engine", fake)
    meta_path = list(sys.meta_path)
    with pytest.raises(RuntimeError, match="real 'transformer_engine' is importable"):
        as_te.install()
    assert sys.modules["transformer_engine"] is fake and sys.meta_path == meta_path


def test_alias_table_agrees_with_our_attributes():
    """A TE child name that our parent module already has must be the same module, or dotted
    access and `import` would disagree (TE's `pytorch.distributed` is not mapped for that reason)."""
    for name, target in as_te.ALIASES.items():
        parent, _, child = name.rpartition(".")
        if parent in as_te.ALIASES:
            ours = getattr(importlib.import_module(as_te.ALIASES[parent]), child, None)
            assert ours is None or ours is importlib.import_module(target), name
    assert "transformer_engine.pytorch.distributed" not in as_te.ALIASES and proto.distributed


def test_usage_without_a_script(capsys):
    with pytest.raises(SystemExit) as e:
        as_te.main([])
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err
    assert "transformer_engine" not in sys.modules
