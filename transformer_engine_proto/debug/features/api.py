"""The `transformer_engine` namespace API: TE's calls, their defaults, config parsing and routing.

Calls a transformer_engine_proto layer makes (see `transformer_engine_proto.debug.debug_gemm`):

* routing calls, once per layer and iteration, at forward start: `inspect_tensor_enabled`,
  `inspect_tensor_postquantize_enabled`, `modify_tensor_enabled`, `fp8_gemm_enabled`;
* GEMM calls, at every GEMM: `modify_tensor`, `inspect_tensor`, `inspect_tensor_postquantize`,
  with layer_name, gemm, tensor_name, iteration and tp_group (the process group the layer's
  weights are tensor-parallel shards over; None without TP).

A feature method receives the keyword arguments its signature names (all of them if it takes
`**kwargs`), so features written for older or newer TE signatures both work.
"""
import copy
import inspect

from nvdlfw_inspect.base import BaseConfigAPIMapper, BaseNamespaceAPI
from nvdlfw_inspect.registry import Registry, api_method

from transformer_engine_proto.debug import schedule, state
from transformer_engine_proto.debug.features import loaded_by_nvdlfw

__all__ = ["TEConfigAPIMapper", "ScheduledInspectFeature", "ModifyTensorFeature",
           "TEDefaultFeatures", "TransformerEngineAPI", "REQUIRED_KWARGS"]

GEMM_NAMES = ("fprop", "dgrad", "wgrad")


def _names_as_lists(cfg):
    """`tensors: activation` / `gemms: fprop` (one name, as TE accepts) as one-element lists,
    here and in `gemms_struct` entries (a string would be matched by substring and iterated by
    character)."""
    if isinstance(cfg, dict):
        for key in ("tensors", "gemms"):
            if isinstance(cfg.get(key), str):
                cfg[key] = [cfg[key]]
        for item in cfg.get("gemms_struct") or ():
            _names_as_lists(item)
    return cfg


class TEConfigAPIMapper(BaseConfigAPIMapper):
    """Selects the part of a feature's config for a call's `gemm` and `tensor_name`
    (`gemms`/`gemms_struct`, `tensors`/`tensors_struct`)."""

    def parse_config_and_api(self, config, **kwargs):
        config_copy = _names_as_lists(copy.deepcopy(config))
        if kwargs.get("gemm_parsing", False):
            processed = self._process_transformer_engine_config(config_copy, **kwargs)
        elif kwargs.get("tensor_parsing", False):
            processed = self._process_tensor_config(config_copy, kwargs["tensor_name"])
        else:
            processed = config_copy
        if not processed:
            return False, None
        processed.pop("enabled", None)
        return True, processed

    @staticmethod
    def _validate_gemm(gemm):
        if gemm not in GEMM_NAMES:
            raise ValueError(f"[transformer_engine_proto debug] invalid gemm {gemm!r}; expected one of {GEMM_NAMES}")

    def _process_transformer_engine_config(self, config, **kwargs):
        if "gemms_struct" in config:
            for cfg in config["gemms_struct"]:
                self._validate_gemm(cfg["gemm"])
                if cfg["gemm"] == kwargs["gemm"]:
                    if kwargs.get("tensor_parsing"):
                        cfg = self._process_tensor_config(cfg, kwargs["tensor_name"])
                        if not cfg:
                            return None
                    if "enabled" in cfg:
                        raise ValueError("[transformer_engine_proto debug] `enabled` must not be part of gemms_struct")
                    config.pop("gemms_struct")
                    config.update(copy.deepcopy(cfg))
                    return config
            return None
        if "gemms" in config:
            for gemm in config["gemms"]:
                self._validate_gemm(gemm)
            if kwargs["gemm"] not in config["gemms"]:
                return None
            if kwargs.get("tensor_parsing"):
                config = self._process_tensor_config(config, kwargs["tensor_name"])
                if not config:
                    return None
            config["gemm"] = kwargs["gemm"]
            config.pop("gemms")
            return config
        raise ValueError("[transformer_engine_proto debug] provide 'gemms_struct: List[Dict]' or 'gemms: List[str]' "
                         "in the feature's config")


class ScheduledInspectFeature(TEConfigAPIMapper):
    """A feature that inspects tensors on the iterations its config's `freq` / `start_step` /
    `end_step` select (`debug/schedule.py`)."""

    @api_method
    def inspect_tensor_enabled(self, config, layer_name: str, tensor_name: str, iteration: int):
        return schedule.enabled_at(config, iteration)


class ModifyTensorFeature(TEConfigAPIMapper):
    """Base of the features that replace the chosen tensors (`modify_tensor`) at every iteration;
    a subclass names the config keys it reads in `CONFIG_KEYS`."""

    CONFIG_KEYS = ("gemm", "tensor")

    @api_method
    def modify_tensor_enabled(self, config, layer_name: str, gemm: str, tensor_name: str, iteration: int):
        return True, iteration + 1

    def _check_keys(self, config) -> None:
        for key in config:
            if key not in self.CONFIG_KEYS:
                raise ValueError(f'[transformer_engine_proto debug] {self.__class__.__name__}: unexpected key '
                                 f'"{key}" in config')

    def _log_modify(self, layer_name: str, gemm: str, tensor_name: str) -> None:
        state.log_message(f"Feature={self.__class__.__name__}, API=modify_tensor: {gemm}, {tensor_name}", layer_name)


class TEDefaultFeatures:
    """What each call does when no feature handles it: nothing, and FP8 GEMMs stay FP8."""

    def fp8_gemm_enabled(self, config, layer_name, gemm=None, iteration=0, **kwargs):
        return True, None

    def modify_tensor_enabled(self, config, layer_name, gemm=None, tensor_name=None, iteration=0, **kwargs):
        return False, None

    def modify_tensor(self, config, layer_name, **kwargs):
        raise NotImplementedError("modify_tensor_enabled() returned True, but no feature handles modify_tensor()")

    def inspect_tensor(self, config, layer_name, **kwargs):
        return None

    def inspect_tensor_postquantize(self, config, layer_name, **kwargs):
        return None

    def inspect_tensor_enabled(self, config, layer_name, tensor_name=None, iteration=0, **kwargs):
        return False, None

    def inspect_tensor_postquantize_enabled(self, config, layer_name, gemm=None, tensor_name=None, iteration=0,
                                            **kwargs):
        return False, None


REQUIRED_KWARGS = {
    "fp8_gemm_enabled": ["gemm"],
    "modify_tensor_enabled": ["tensor_name", "gemm"],
    "modify_tensor": ["tensor_name", "gemm"],
    "inspect_tensor": ["tensor_name"],
    "inspect_tensor_postquantize": ["tensor_name"],
    "inspect_tensor_enabled": ["tensor_name"],
    "inspect_tensor_postquantize_enabled": ["tensor_name"],
    "default": ["tensor_name", "gemm"],
}

_SIGNATURES = {}


def _accepted_kwargs(fn):
    """Names `fn` accepts by keyword, or None when it takes **kwargs."""
    key = getattr(fn, "__func__", fn)
    if key not in _SIGNATURES:
        params = inspect.signature(fn).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            _SIGNATURES[key] = None
        else:
            _SIGNATURES[key] = {p.name for p in params}
    return _SIGNATURES[key]


class TransformerEngineAPI(BaseNamespaceAPI):
    """Default calls, routing and multi-feature rules of the `transformer_engine` namespace.
    Built by nvdlfw_inspect when a session starts; its step()/end_debug() drive our state."""

    def __init__(self):
        BaseNamespaceAPI.__init__(self)
        self._default_api_impl = TEDefaultFeatures()
        # every argument that selects a config entry is part of nvdlfw's cache key
        self._cacheable_api_kwargs_map = {
            "fp8_gemm_enabled": ["gemm"],
            "modify_tensor": ["tensor_name", "gemm"],
            "modify_tensor_enabled": ["tensor_name", "gemm"],
            "inspect_tensor": ["tensor_name"],
            "inspect_tensor_postquantize": ["tensor_name", "gemm"],
            "inspect_tensor_enabled": ["tensor_name"],
            "inspect_tensor_postquantize_enabled": ["tensor_name", "gemm"],
        }
        state.start()

    def is_multiple_feature_invocation_allowed(self, api_name):
        return api_name in {"fp8_gemm_enabled", "inspect_tensor", "inspect_tensor_postquantize",
                            "inspect_tensor_enabled", "inspect_tensor_postquantize_enabled"}

    def input_assertions_hook(self, api_name, **kwargs):
        for kwarg in REQUIRED_KWARGS.get(api_name, REQUIRED_KWARGS["default"]):
            if kwarg not in kwargs:
                raise ValueError(f"[transformer_engine_proto debug] cannot route {api_name}: pass {kwarg}=")

    def routing_condition(self, api_name, config, _layer_name, feature_obj, **kwargs):
        required = REQUIRED_KWARGS.get(api_name, REQUIRED_KWARGS["default"])
        return feature_obj.parse_config_and_api(config, gemm_parsing="gemm" in required,
                                                tensor_parsing="tensor_name" in required, **kwargs)

    def output_assertions_hook(self, api_name, ret, **kwargs):
        if api_name.endswith("_enabled") and not isinstance(ret, (bool, tuple)):
            raise TypeError(f"{api_name} must return a bool or (bool, next_iteration), got {ret!r}")
        if api_name in ("inspect_tensor", "inspect_tensor_postquantize") and ret is not None:
            raise TypeError(f"{api_name} must return None, got {type(ret).__name__}")

    def handle_multi_feature_output(self, api_name, multi_feature_outputs, features_to_invoke, **kwargs):
        outs = list(multi_feature_outputs.values()) if isinstance(multi_feature_outputs, dict) \
            else list(multi_feature_outputs)
        if api_name.endswith("_enabled"):
            flags = [o[0] if isinstance(o, tuple) else o for o in outs]
            run = all(flags) if api_name == "fp8_gemm_enabled" else any(flags)
            if not all(isinstance(o, tuple) for o in outs):
                return bool(run)  # a bare bool names no later iteration: asked again at the next one
            nexts = [o[1] for o in outs if len(o) > 1 and o[1] is not None]
            return bool(run), (min(nexts) if nexts else None)
        if api_name in ("inspect_tensor", "inspect_tensor_postquantize"):
            return None
        return super().handle_multi_feature_output(api_name, multi_feature_outputs, features_to_invoke, **kwargs)

    def call_feature(self, call, feat_config, layer_name, **kwargs):
        accepted = _accepted_kwargs(call)
        if accepted is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
        return call(feat_config, layer_name, **kwargs)

    def step(self):
        state.on_step()

    def end_debug(self):
        state.stop()


if loaded_by_nvdlfw(__name__):
    Registry.register_namespace_api(namespace="transformer_engine")(TransformerEngineAPI)
