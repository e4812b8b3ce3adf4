"""Opt-in alias: unchanged Transformer Engine code imports this package as `transformer_engine`.

    import transformer_engine_proto.as_te
    transformer_engine_proto.as_te.install()
    import transformer_engine.pytorch as te              # this package
    from transformer_engine.common import recipe         # transformer_engine_proto.recipe

or, with no change to the script at all:

    python -m transformer_engine_proto.as_te train.py --its --args
    python -m transformer_engine_proto.as_te -m my_pkg.train --its --args

`install()` puts the TE module names of `ALIASES` into `sys.modules`, each naming one of our real
modules (the same objects, not copies), and sets a TE child name on its parent where our parent
lacks it (`transformer_engine_proto.tensor.float8_tensor`) so dotted access works too. Only
`transformer_engine` and `transformer_engine.common` are new (empty) packages: TE's top levels,
which have no counterpart here. Every other `transformer_engine...` name, and everything under
`transformer_engine_torch`, is a ModuleNotFoundError naming what is mapped: TE modules this
package does not implement are not faked, and our own submodules are never loaded a second time
under a TE name. A real Transformer Engine on the path is never shadowed: `install()` refuses.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types

__all__ = ["ALIASES", "install", "installed", "main"]

_PKG = "transformer_engine_proto"
_MARK = "__transformer_engine_proto_alias__"
_ROOTS = ("transformer_engine", "transformer_engine_torch")
_NAMESPACES = ("transformer_engine", "transformer_engine.common")

_FEATURES = ("api", "log_tensor_stats", "log_fp8_tensor_stats", "log_nvfp4_tensor_stats", "disable_fp8_gemm",
             "disable_fp8_layer", "per_tensor_scaling", "fake_quant", "dump_tensors", "_test_dummy_feature")

# TE module name -> the module of this package that holds TE's names from it
ALIASES = {
    "transformer_engine.common.recipe": f"{_PKG}.recipe",
    "transformer_engine.pytorch": _PKG,
    "transformer_engine.pytorch.constants": f"{_PKG}.constants",
    "transformer_engine.pytorch.quantization": f"{_PKG}.quantization",
    "transformer_engine.pytorch.fp8": f"{_PKG}.quantization",  # TE's older path for the same names
    "transformer_engine.pytorch.graph": f"{_PKG}.graph",
    "transformer_engine.pytorch.utils": f"{_PKG}.utils",
    "transformer_engine.pytorch.cpp_extensions": f"{_PKG}.cpp_extensions",
    "transformer_engine.pytorch.ops": f"{_PKG}.ops_api",  # the fusible operations (te.ops)
    "transformer_engine.pytorch.ops.basic": f"{_PKG}.ops_api.basic",
    "transformer_engine.pytorch.module": f"{_PKG}.module",
    "transformer_engine.pytorch.module.base": f"{_PKG}.module.base",
    "transformer_engine.pytorch._extra_state": f"{_PKG}.extra_state_policy",
    "transformer_engine.pytorch.module.linear": f"{_PKG}.module.linear",
    "transformer_engine.pytorch.module.layernorm_linear": f"{_PKG}.module.layernorm_linear",
    "transformer_engine.pytorch.module.layernorm_mlp": f"{_PKG}.module.layernorm_mlp",
    "transformer_engine.pytorch.module.grouped_linear": f"{_PKG}.module.grouped_linear",
    "transformer_engine.pytorch.module.layernorm": f"{_PKG}.module.normalization",
    "transformer_engine.pytorch.module.rmsnorm": f"{_PKG}.module.normalization",
    "transformer_engine.pytorch.attention": f"{_PKG}.module",  # DotProductAttention, MultiheadAttention, RoPE
    "transformer_engine.pytorch.attention.rope": f"{_PKG}.module.rope",
    "transformer_engine.pytorch.transformer": f"{_PKG}.module.transformer_layer",
    "transformer_engine.pytorch.tensor": f"{_PKG}.tensor",
    "transformer_engine.pytorch.tensor.float8_tensor": f"{_PKG}.tensor.float8",
    "transformer_engine.pytorch.tensor.mxfp8_tensor": f"{_PKG}.tensor.mxfp8",
    "transformer_engine.pytorch.tensor.float8_blockwise_tensor": f"{_PKG}.tensor.float8_blockwise",
    "transformer_engine.pytorch.tensor.nvfp4_tensor": f"{_PKG}.tensor.nvfp4",
    "transformer_engine.pytorch.tensor.identity_tensor": f"{_PKG}.tensor.identity",
    "transformer_engine.pytorch.tensor.storage": f"{_PKG}.tensor.storage",  # the storage base classes
    "transformer_engine.pytorch.tensor.storage.identity_tensor_storage": f"{_PKG}.tensor.identity",
    "transformer_engine.pytorch.tensor.hybrid_tensor": f"{_PKG}.tensor.hybrid",
    "transformer_engine.pytorch.tensor.storage.hybrid_tensor_storage": f"{_PKG}.tensor.hybrid",
    "transformer_engine.pytorch.quantized_tensor": f"{_PKG}.tensor",  # Quantizer, QuantizedTensor(Storage)
    "transformer_engine.pytorch.float8_tensor": f"{_PKG}.tensor.float8",  # TE's older path for Float8Tensor
    "transformer_engine.pytorch.custom_recipes": f"{_PKG}.custom_recipes",
    "transformer_engine.pytorch.custom_recipes.quantizer_factories": f"{_PKG}.custom_recipes.quantizer_factories",
    "transformer_engine.pytorch.custom_recipes.quantizer_factory_zoo": f"{_PKG}.custom_recipes.quantizer_factory_zoo",
    "transformer_engine.debug": f"{_PKG}.debug",
    "transformer_engine.debug.features": f"{_PKG}.debug.features",
    **{f"transformer_engine.debug.features.{f}": f"{_PKG}.debug.features.{f}" for f in _FEATURES},
    "transformer_engine.debug.features.disable_quantization_gemm": f"{_PKG}.debug.features.disable_fp8_gemm",
    "transformer_engine.debug.features.disable_quantization_layer": f"{_PKG}.debug.features.disable_fp8_layer",
    "transformer_engine.debug.pytorch": f"{_PKG}.debug.pytorch",
    "transformer_engine.debug.pytorch.debug_state": f"{_PKG}.debug.pytorch.debug_state",  # TEDebugState
    "transformer_engine_torch": f"{_PKG}.constants",  # `tex.DType`: TE's dtype tags, same values
}


def _is_ours(name: str) -> bool:
    return name in sys.modules and getattr(sys.modules[name], _MARK, False)


def installed() -> bool:
    """Whether `install()` has run in this process."""
    return _is_ours("transformer_engine")


def _real_location(name: str):
    """Where a module `name` other than our alias would be imported from, or None."""
    mod = sys.modules.get(name)
    if mod is not None:
        return getattr(mod, "__file__", None) or repr(mod)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.origin not in (None, "namespace"):
        return spec.origin
    return os.pathsep.join(spec.submodule_search_locations or ()) or repr(spec)


class _Finder(importlib.abc.MetaPathFinder):
    """Answers every `transformer_engine*` name not in sys.modules with a ModuleNotFoundError, so
    the path finder never loads our files a second time under a TE name."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] not in _ROOTS:
            return None
        parent = fullname.rpartition(".")[0]
        siblings = sorted(n.rpartition(".")[2] for n in (*ALIASES, *_NAMESPACES) if n.rpartition(".")[0] == parent)
        where = f"under {parent}: {', '.join(siblings)}" if siblings else "nothing under it"
        raise ModuleNotFoundError(
            f"No module named {fullname!r}: transformer_engine_proto's Transformer Engine alias maps only "
            f"the TE modules this package implements ({where})", name=fullname)


def _namespace(name: str) -> types.ModuleType:
    mod = types.ModuleType(name, "Transformer Engine's package name, aliased by transformer_engine_proto.as_te.")
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    mod.__path__ = []
    mod.__package__ = name
    setattr(mod, _MARK, True)
    return mod


def install() -> types.ModuleType:
    """Register the aliases (once; a second call returns the same `transformer_engine`). A real
    Transformer Engine (or `transformer_engine_torch`) importable here is a RuntimeError."""
    if installed():
        return sys.modules["transformer_engine"]
    for root in _ROOTS:
        where = _real_location(root)
        if where is not None:
            raise RuntimeError(
                f"transformer_engine_proto.as_te: a real {root!r} is importable ({where}); the alias "
                "would shadow it. Uninstall it or remove it from sys.path, or import "
                "transformer_engine_proto directly.")
    targets = {name: importlib.import_module(target) for name, target in ALIASES.items()}  # all before any alias
    modules = {name: _namespace(name) for name in _NAMESPACES}
    modules.update(targets)
    for name in sorted(modules, key=lambda n: n.count(".")):
        parent, _, child = name.rpartition(".")
        if parent and not hasattr(modules[parent], child):
            setattr(modules[parent], child, modules[name])
    sys.meta_path.insert(0, _Finder())
    sys.modules.update(modules)
    return modules["transformer_engine"]


_USAGE = """usage: python -m transformer_engine_proto.as_te script.py [args ...]
       python -m transformer_engine_proto.as_te -m module [args ...]
Runs a Transformer Engine script (or module) with `transformer_engine` aliased to this package."""


def main(argv=None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args == ["-m"]:
        print(_USAGE, file=sys.stderr)
        raise SystemExit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    install()
    if args[0] == "-m":
        sys.argv = args[1:]  # run_module replaces argv[0] with the module's file, as `python -m` does
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))  # as `python script.py` sets it
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
