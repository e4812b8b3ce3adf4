"""Validation of debug config files (YAML path or dict) with errors naming the config entry.

Checks the `transformer_engine` features this package provides: unknown features and keys, value
types, tensor/gemm/stat names and `start_end_list` windows (pairs, in order, non-overlapping).
Features of other namespaces and custom features registered in nvdlfw_inspect are left to their
owners. Runs from `transformer_engine_proto.debug.initialize` (before nvdlfw_inspect loads the
file) and, for sessions started with `debug_api.initialize`, at the first routing call.
"""
from __future__ import annotations

import ast
from typing import Any, Dict, List

from . import stats

__all__ = ["DebugConfigError", "validate_config", "check_session_config", "FEATURE_KEYS"]

GEMMS = ("fprop", "dgrad", "wgrad")
ALL_TENSORS = ("activation", "gradient", "weight", "output", "wgrad", "dgrad")
IN_TENSORS = ("activation", "gradient", "weight")
_WINDOW = ("freq", "start_step", "end_step", "start_end_list")
_DUMP = ("dump_hp", "dump_quant", "dump_quantized_internals", "high_precision_tensor", "quantized_tensor")
_DISABLE_GEMM = {"structure": "gemms", "tensors": None, "params": ()}
_DISABLE_LAYER = {"structure": None, "tensors": None, "params": ()}
# feature -> gemm/tensor structure, allowed tensor names, per-entry parameters
FEATURE_KEYS: Dict[str, Dict[str, Any]] = {
    "LogTensorStats": {"structure": "tensors", "tensors": ALL_TENSORS, "params": ("stats",) + _WINDOW},
    "LogFp8TensorStats": {"structure": "tensors", "tensors": IN_TENSORS, "params": ("stats",) + _WINDOW},
    "LogNvfp4TensorStats": {"structure": "tensors", "tensors": IN_TENSORS, "params": ("stats",) + _WINDOW},
    "DumpTensors": {"structure": "tensors", "tensors": ALL_TENSORS, "params": _DUMP + _WINDOW},
    "DisableFp8Gemm": _DISABLE_GEMM, "DisableFP8GEMM": _DISABLE_GEMM, "DisableQuantizationGEMM": _DISABLE_GEMM,
    "DisableFp8Layer": _DISABLE_LAYER, "DisableFP8Layer": _DISABLE_LAYER, "DisableQuantizationLayer": _DISABLE_LAYER,
    "PerTensorScaling": {"structure": "both", "tensors": IN_TENSORS, "params": ("margin",)},
    "FakeQuant": {"structure": "both", "tensors": ALL_TENSORS, "params": ("quant_format", "margin")},
}
_LAYER_KEYS = ("layer_numbers", "layer_types", "exact_layer_names", "layer_name_regex_pattern")
_QUANT_FORMATS = ("FP8E4M3", "FP8E5M2", "MXFP8E4M3", "MXFP8E5M2")


class DebugConfigError(ValueError):
    """A debug config entry is wrong; the message names it (section > namespace > feature > key)."""


def _fail(where: List[str], msg: str):
    raise DebugConfigError(f"debug config: {' > '.join(where)}: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _str_list(where, v, allowed, what):
    if isinstance(v, str):  # `tensors: activation`, as TE accepts: one name
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        _fail(where, f"must be a list of {what} names, got {v!r}")
    bad = [s for s in v if allowed is not None and s not in allowed]
    if bad:
        _fail(where, f"unknown {what} {bad}; expected some of {list(allowed)}")


def _check_windows(where, cfg):
    if "freq" in cfg and (not _is_int(cfg["freq"]) or cfg["freq"] < 1):
        _fail(where + ["freq"], f"must be a positive int, got {cfg['freq']!r}")
    for key in ("start_step", "end_step"):
        if key in cfg and cfg[key] is not None and (not _is_int(cfg[key]) or cfg[key] < -1):
            _fail(where + [key], f"must be an int >= 0 (end_step: or -1 for no end), got {cfg[key]!r}")
    start, end = cfg.get("start_step"), cfg.get("end_step")
    if _is_int(start) and _is_int(end) and end != -1 and end < start:
        _fail(where, f"end_step {end} is before start_step {start}")
    if "start_end_list" in cfg and cfg["start_end_list"] is not None:
        sel, w = cfg["start_end_list"], where + ["start_end_list"]
        if not isinstance(sel, list) or not all(isinstance(p, (list, tuple)) and len(p) == 2 and
                                                all(_is_int(x) for x in p) for p in sel):
            _fail(w, f"must be a list of [start, end] int pairs, got {sel!r}")
        prev = None
        for s, e in sel:
            if s < 0 or (e != -1 and e < s):
                _fail(w, f"bad window [{s}, {e}]: need 0 <= start <= end (or end -1 for no end)")
            if prev is not None:
                if prev[1] == -1 or s <= prev[1]:
                    _fail(w, f"windows [{prev[0]}, {prev[1]}] and [{s}, {e}] overlap or are out of order "
                             "(they must be non-overlapping and increasing)")
            prev = (s, e)


def _check_params(where, feature, cfg, spec, tensor=None):
    if "stats" in cfg:
        st = cfg["stats"]
        if feature == "LogTensorStats":  # names, or `{max_blockwise_dynamic_range: {...}}` entries
            if not isinstance(st, list):
                _fail(where + ["stats"], f"must be a list of stats, got {st!r}")
            bad = [s for s in st if isinstance(s, str) and s not in stats.HP_STATS]
            if bad:
                _fail(where + ["stats"], f"unsupported stats {bad}; supported: {list(stats.HP_STATS)} and "
                                         "`max_blockwise_dynamic_range: {block_size: <int>, dims: 1 or 2}`")
            for s in st:
                try:
                    stats.parse_hp_stat(s)
                except ValueError as e:
                    _fail(where + ["stats"], str(e))
        elif not isinstance(st, list) or not all(isinstance(s, str) for s in st):
            _fail(where + ["stats"], f"must be a list of stat names, got {st!r}")
        elif feature == "LogNvfp4TensorStats":
            bad = [s for s in st if s not in stats.NVFP4_STATS]
            if bad:
                _fail(where + ["stats"], f"unsupported stats {bad}; supported: {list(stats.NVFP4_STATS)}")
        else:
            for s in st:
                try:
                    stats.parse_fp8_stat(s, "current")
                except ValueError as e:
                    _fail(where + ["stats"], str(e))
    for key in _DUMP:
        if key in cfg and not isinstance(cfg[key], bool):
            _fail(where + [key], f"must be true or false, got {cfg[key]!r}")
    if "margin" in cfg and not _is_int(cfg["margin"]):
        _fail(where + ["margin"], f"must be an int, got {cfg['margin']!r}")
    if "quant_format" in cfg and cfg["quant_format"] not in _QUANT_FORMATS:
        _fail(where + ["quant_format"], f"{cfg['quant_format']!r} is not one of {list(_QUANT_FORMATS)}")
    _check_windows(where, cfg)


def _not_both(where, cfg, what: str) -> None:
    """`gemms` and `gemms_struct` (or `tensors` and `tensors_struct`) exclude each other."""
    if f"{what}s" in cfg and f"{what}s_struct" in cfg:
        _fail(where, f"give either `{what}s` or `{what}s_struct`, not both")


def _struct_items(where, cfg, what: str, names):
    """(where, item) of each entry of `cfg["<what>s_struct"]`, checked to be a mapping naming one
    `what` out of `names`."""
    items = cfg[f"{what}s_struct"]
    if not isinstance(items, list) or not all(isinstance(t, dict) for t in items):
        _fail(where + [f"{what}s_struct"], f"must be a list of mappings with a `{what}` key, got {items!r}")
    for i, item in enumerate(items):
        w = where + [f"{what}s_struct[{i}]"]
        if what not in item:
            _fail(w, f"missing `{what}`")
        _str_list(w + [what], [item[what]], names, what)
        yield w, item


def _check_tensors(where, feature, cfg, spec, inherited):
    allowed = set(spec["params"]) | {"tensors", "tensors_struct"}
    _not_both(where, cfg, "tensor")
    if "tensors" in cfg:
        _str_list(where + ["tensors"], cfg["tensors"], spec["tensors"], "tensor")
    elif "tensors_struct" in cfg:
        for w, item in _struct_items(where, cfg, "tensor", spec["tensors"]):
            extra = set(item) - set(spec["params"]) - {"tensor"}
            if extra:
                _fail(w, f"unknown keys {sorted(extra)}; allowed: {['tensor', *spec['params']]}")
            _check_params(w, feature, {**inherited, **item}, spec)
    else:
        _fail(where, "missing `tensors` or `tensors_struct`")
    return allowed


def _has_key(cfg, key) -> bool:
    if isinstance(cfg, dict):
        return key in cfg or any(_has_key(v, key) for v in cfg.values())
    return isinstance(cfg, list) and any(_has_key(v, key) for v in cfg)


def _check_feature(where, feature, cfg):
    spec = FEATURE_KEYS[feature]
    if not isinstance(cfg, dict):
        _fail(where, f"must be a mapping, got {cfg!r}")
    if "enabled" not in cfg:
        _fail(where, "missing `enabled`")
    if not isinstance(cfg["enabled"], bool):
        _fail(where + ["enabled"], f"must be true or false, got {cfg['enabled']!r}")
    if not cfg["enabled"]:
        return  # a disabled feature is never parsed (TE accepts `enabled: False` alone)
    body = {k: v for k, v in cfg.items() if k != "enabled"}
    allowed = set(spec["params"])
    structure = spec["structure"]
    if structure == "tensors":
        allowed |= _check_tensors(where, feature, body, spec, body)
    elif structure in ("gemms", "both"):
        allowed |= {"gemms", "gemms_struct"}
        _not_both(where, body, "gemm")
        if "gemms" in body:
            _str_list(where + ["gemms"], body["gemms"], GEMMS, "gemm")
            if structure == "both":
                allowed |= _check_tensors(where, feature, body, spec, body)
        elif "gemms_struct" in body:
            for w, item in _struct_items(where, body, "gemm", GEMMS):
                inner = {k: v for k, v in item.items() if k != "gemm"}
                ok = set(spec["params"])
                if structure == "both":
                    ok |= _check_tensors(w, feature, inner, spec, {**body, **inner})
                extra = set(inner) - ok
                if extra:
                    _fail(w, f"unknown keys {sorted(extra)}; allowed: {sorted(ok | {'gemm'})}")
        else:
            _fail(where, "missing `gemms` or `gemms_struct`")
    extra = set(body) - allowed
    if extra:
        _fail(where, f"unknown keys {sorted(extra)}; allowed: {sorted(allowed | {'enabled'})}")
    if feature == "FakeQuant" and not _has_key(cfg, "quant_format"):
        _fail(where, "missing `quant_format` (one of " + ", ".join(_QUANT_FORMATS) + ")")
    _check_params(where, feature, body, spec)


def _registered(namespace: str):
    try:
        from nvdlfw_inspect.registry import Registry
    except ImportError:  # pragma: no cover
        return set()
    data = Registry.data.get(namespace)
    return set(data.features) if data is not None else set()


def _features_in_dirs(feature_dirs) -> set:
    """Names of the classes registered in the `transformer_engine` namespace by the .py files of the
    user's `feature_dirs`, read with `ast` (nothing is imported: nvdlfw_inspect imports them itself
    when the session starts, after this check). Both of TE's forms count: the decorator
    `@Registry.register_feature(namespace="transformer_engine")` and the call
    `Registry.register_feature(namespace="transformer_engine")(MyFeature)`, also through a name
    bound to the `register_feature(...)` result. A file that does not parse is skipped
    (nvdlfw_inspect reports it when it loads the file)."""
    import os

    dirs = [feature_dirs] if isinstance(feature_dirs, (str, os.PathLike)) else list(feature_dirs)
    names = set()
    for d in dirs:
        for root, _, files in os.walk(d):
            for fname in files:
                if not fname.endswith(".py"):
                    continue
                try:
                    with open(os.path.join(root, fname), encoding="utf-8") as f:
                        tree = ast.parse(f.read(), fname)
                except (SyntaxError, UnicodeDecodeError, ValueError):
                    continue
                names |= _registered_in(tree)
    return names


def _registered_in(tree) -> set:
    """Class names a module's `ast` registers in the `transformer_engine` namespace."""
    registrars = set()  # names bound to a `register_feature(namespace="transformer_engine")` result
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _registers_te(node.value, ()):
            registrars.update(t.id for t in node.targets if isinstance(t, ast.Name))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(_registers_te(dec, registrars) for dec in node.decorator_list):
            names.add(node.name)
        elif isinstance(node, ast.Call) and node.args and _registers_te(node.func, registrars):
            cls = node.args[0]
            name = getattr(cls, "id", getattr(cls, "attr", None))
            if name is not None:
                names.add(name)
    return names


def _registers_te(node, registrars) -> bool:
    """`register_feature(namespace="transformer_engine")` (through any attribute path, a namespace
    given as a literal or not), or a name bound to one (`registrars`)."""
    if isinstance(node, ast.Name) and node.id in registrars:
        return True
    func = getattr(node, "func", None)
    if not (isinstance(node, ast.Call) and getattr(func, "attr", getattr(func, "id", "")) == "register_feature"):
        return False
    spaces = [k.value for k in node.keywords if k.arg == "namespace"] + list(node.args[:1])
    return all(getattr(n, "value", "transformer_engine") == "transformer_engine" for n in spaces)


def _load(path) -> dict:
    """The YAML file's mapping; a missing or empty file is an error naming it (nvdlfw_inspect would
    run without features after a printed warning, or fail with a TypeError)."""
    import os

    import yaml

    if not os.path.isfile(path):
        raise DebugConfigError(f"debug config {path}: file not found")
    with open(path) as f:
        config = yaml.safe_load(f)
    if config is None:
        raise DebugConfigError(f"debug config {path}: the file is empty (it needs at least one section; "
                               "see transformer_engine_proto/debug/README.md)")
    return config


def validate_config(config, feature_dirs=()) -> None:
    """Raise DebugConfigError for the first wrong entry of `config` (a YAML path or a dict).
    `feature_dirs`: the user's feature directories, whose features count as known."""
    path = None
    if not isinstance(config, dict):
        path, config = config, _load(config)
    try:
        _validate(config, feature_dirs)
    except DebugConfigError as e:
        if path is None:
            raise
        raise DebugConfigError(str(e).replace("debug config:", f"debug config {path}:", 1)) from None


def _validate(config, feature_dirs) -> None:
    if not isinstance(config, dict):
        _fail(["<top level>"], "must be a mapping of section names to sections")
    custom = (_registered("transformer_engine") | _features_in_dirs(feature_dirs)) - set(FEATURE_KEYS)
    for section, sec in config.items():
        where = [f"section {section!r}"]
        if not isinstance(sec, dict):
            _fail(where, f"must be a mapping, got {sec!r}")
        if "enabled" not in sec or not isinstance(sec["enabled"], bool):
            _fail(where + ["enabled"], "required, true or false")
        if not sec["enabled"]:
            continue  # a disabled section is never parsed (nor by TE): its features need nothing
        if "layers" not in sec:
            _fail(where, "missing `layers`")
        layers = sec.get("layers")
        if layers is not None:
            if not isinstance(layers, dict) or not layers:
                _fail(where + ["layers"], f"must be a mapping with one of {_LAYER_KEYS}, got {layers!r}")
            extra = set(layers) - set(_LAYER_KEYS)
            if extra:
                _fail(where + ["layers"], f"unknown keys {sorted(extra)}; expected some of {list(_LAYER_KEYS)}")
        te = sec.get("transformer_engine")
        if te is None:
            continue
        if not isinstance(te, dict):
            _fail(where + ["transformer_engine"], f"must be a mapping of feature names, got {te!r}")
        for feature, cfg in te.items():
            w = where + ["transformer_engine", feature]
            if feature in FEATURE_KEYS:
                _check_feature(w, feature, cfg)
            elif feature not in custom:
                _fail(w, f"unknown feature; known: {sorted(FEATURE_KEYS)}"
                         + (f" and custom {sorted(custom)}" if custom else "")
                         + " (a feature of your own: pass its directory in `feature_dirs`)")


def check_session_config(manager) -> None:
    """Validate the config of the running nvdlfw_inspect session (`manager`: its DEBUG_MANAGER)."""
    cfg = getattr(manager, "config_file", None)
    if not cfg:
        return
    validate_config(cfg)  # a missing or empty file raises, naming it
