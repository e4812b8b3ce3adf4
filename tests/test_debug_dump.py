"""DumpTensors: per format, a dump reloads with weights_only=True and its decoded internals rebuild the
quantized tensor exactly; file names are sanitised, writes atomic, sessions re-initialisable; the
offline inspect_dump tool."""
import glob
import os
import subprocess
import sys

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from test_debug_common import debug_session

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
from transformer_engine_proto.debug import dump, inspect_dump
from transformer_engine_proto.debug.quant_view import reconstruct

RECIPES = {"delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling(), "mxfp8": R.MXFP8BlockScaling(),
           "block": R.Float8BlockScaling(), "nvfp4": R.NVFP4BlockScaling(disable_stochastic_rounding=True)}
FORMATS = {"delayed": "fp8_per_tensor", "current": "fp8_per_tensor", "mxfp8": "mxfp8", "block": "fp8_block_scaling",
           "nvfp4": "nvfp4"}


def _dump_config(**extra):
    cfg = {"enabled": True, "tensors": ["activation", "weight", "gradient", "output"], "dump_quantized_internals": True}
    cfg.update(extra)
    return {"dump": {"enabled": True, "layers": {"layer_name_regex_pattern": ".*"},
                     "transformer_engine": {"DumpTensors": cfg}}}


def _dumps(log_dir):
    return sorted(glob.glob(os.path.join(log_dir, "tensor_dumps", "rank_0", "*.pt")))


@pytest.mark.parametrize("rid", list(RECIPES))
def test_dump_reconstructs_every_format(tmp_path, rid):
    recipe = RECIPES[rid]
    torch.manual_seed(0)
    m = te.Linear(128, 64, name="lin", params_dtype=torch.bfloat16)
    x = torch.randn(2, 64, 128, dtype=torch.bfloat16, requires_grad=True)
    with debug_session(tmp_path, _dump_config()) as log_dir:
        with te.autocast(recipe=recipe):
            y = m(x)
        y.float().pow(2).sum().backward()
    files = _dumps(log_dir)
    assert [os.path.basename(f) for f in files] == [f"lin_{t}_iter_000000.pt"
                                                    for t in ("activation", "gradient", "output", "weight")]
    roles = {"activation": "input", "weight": "weight", "gradient": "grad_output"}
    for f in files:
        d = torch.load(f, weights_only=True)
        tensor = d["tensor_name"]
        assert d["layer_name"] == "lin" and d["iteration"] == 0
        if tensor == "output":
            assert torch.equal(d["high_precision"], y.detach().reshape(-1, 64)) and "quantized" not in d
            continue
        qi = d["quantized_internals"]
        assert d["format"] == qi["format"] == FORMATS[rid] and qi["scale_layout"] == "plain"
        hp = d["high_precision"]
        assert tuple(qi["shape"]) == tuple(hp.reshape(-1, hp.shape[-1]).shape) or tuple(qi["shape"]) == tuple(hp.shape)
        # the internals alone rebuild the dequantized tensor the GEMM used, bit for bit
        assert torch.equal(reconstruct(qi), d["quantized"])
        assert torch.equal(d["quantized"].reshape(hp.shape),
                           _requantize(rid, roles[tensor], hp, columnwise=False, scale=qi.get("scale_inv")))
        if "columnwise_data" in qi and "rowwise_data" in qi:
            want = _requantize(rid, roles[tensor], hp, columnwise=True, scale=qi.get("scale_inv"))
            assert torch.equal(reconstruct(qi, "columnwise").reshape(hp.shape), want)
        for k, v in qi.items():
            if isinstance(v, torch.Tensor):
                assert v.is_contiguous(), k
        if rid == "mxfp8":
            assert qi["rowwise_scale_inv"].dtype == torch.float8_e8m0fnu
        if rid == "nvfp4":
            assert qi["rowwise_data"].dtype == torch.float32 and qi["rowwise_scale_inv"].dtype == torch.float8_e4m3fn
            assert qi["amax_rowwise"].shape == (1,)
            assert set(qi["rowwise_data"].abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
        if rid == "block":
            assert qi["rowwise_scale_inv"].dtype == torch.float32


def _requantize(rid, role, hp, columnwise, scale=None):
    q = getattr(RecipeKey.quantizers(RecipeKey.of(RECIPES[rid])), role)
    if rid == "delayed":  # the dump's scale_inv is the scale delayed scaling used
        import dataclasses

        q = dataclasses.replace(q, scale=scale.reciprocal(), amax=torch.zeros(1))
    qt = q.with_usage(rowwise=not columnwise, columnwise=columnwise).quantize(hp)
    return qt.dequantize(dtype=torch.float32)


def test_dump_keys_sanitised_names_atomic_writes_and_reinit(tmp_path, monkeypatch):
    cfg = _dump_config(dump_hp=True, dump_quant=False, dump_quantized_internals=False, tensors=["activation"])
    m = te.Linear(32, 32, name="../../escape/me")
    x = torch.randn(4, 32)
    with debug_session(tmp_path, cfg, name="first") as first:
        m(x)
    files = _dumps(first)
    assert [os.path.basename(f) for f in files] == ["______escape_me_activation_iter_000000.pt"]
    d = torch.load(files[0], weights_only=True)
    assert set(d) == {"high_precision", "layer_name", "tensor_name", "iteration"}
    assert torch.equal(d["high_precision"], x)
    # a second session writes into its own log dir, with its own iterations
    with debug_session(tmp_path, cfg, name="second") as second:
        debug_api.step()
        m(x)
        # a failing write leaves neither a partial file nor a temporary one
        monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
        debug_api.step()
        with pytest.raises(OSError, match="disk full"):
            m(x)
    names = sorted(os.listdir(os.path.join(second, "tensor_dumps", "rank_0")))
    assert names == ["______escape_me_activation_iter_000001.pt"]
    with pytest.raises(ValueError, match="outside"):
        _escape_check(tmp_path)


def _escape_check(tmp_path):
    """Names cannot escape the dump dir; even a symlink planted under the file's name is refused."""
    d = os.path.join(str(tmp_path), "dumps")
    os.makedirs(d, exist_ok=True)
    os.symlink(os.path.join(str(tmp_path), "elsewhere.pt"), os.path.join(d, "lnk_b_iter_000000.pt"))
    return dump.dump_path(d, "lnk", "b", 0)


def test_inspect_dump_tool(tmp_path, capsys):
    torch.manual_seed(1)
    m = te.Linear(64, 32, name="fc")
    with debug_session(tmp_path, _dump_config(tensors=["activation", "weight"])) as log_dir:
        with te.autocast(recipe=R.MXFP8BlockScaling()):
            m(torch.randn(32, 64))
    assert inspect_dump.main([log_dir, "--hist", "--bins", "4"]) == 0
    out = capsys.readouterr().out
    header, *rows = out.splitlines()[:3]
    assert header.split() == list(inspect_dump.COLUMNS)
    assert [r.split()[0] for r in rows] == ["fc_activation_iter_000000.pt", "fc_weight_iter_000000.pt"]
    assert all(r.split()[1] == "mxfp8" and r.split()[-1] == "ok" for r in rows)
    assert "log10 |quantized - high precision|" in out
    d = torch.load(_dumps(log_dir)[0], weights_only=True)
    stats = inspect_dump.error_stats(d["high_precision"], d["quantized"])
    assert stats["max_abs_err"] == (d["quantized"] - d["high_precision"]).abs().max().item()
    assert stats["sqnr_db"] > 25  # MXFP8 E4M3 keeps ~30 dB on Gaussian data
    # the module entry point
    res = subprocess.run([sys.executable, "-m", "transformer_engine_proto.debug.inspect_dump", _dumps(log_dir)[0]],
                         capture_output=True, text=True, check=True)
    assert "fc_activation_iter_000000.pt" in res.stdout and " ok" in res.stdout
