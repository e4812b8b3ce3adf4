"""A GEMM module's delayed-scaling state in Transformer Engine's layout: `fp8_meta` and `_extra_state`.

TE keeps a module's FP8 state outside its parameters: `module.fp8_meta["scaling_fwd"]` /
`["scaling_bwd"]` hold `scale` and `amax_history` with three forward slots per GEMM (input,
weight, output) and two backward slots (grad_output, grad_input), and checkpoints carry them in
the module's `_extra_state` (a pickled dict in a uint8 tensor). Here each GEMM's state lives in its
`QuantizedGemm` (two non-persistent buffers, custom_ops/delayed_scaling.py); this mixin presents it in
TE's layout, so a TE checkpoint loads here, ours loads in TE, and a converted model's state dict
(without its `_extra_state` entries) loads into the unconverted model with `strict=True`.
"""
from __future__ import annotations

import dataclasses
import io
import pickle

import torch

from .. import recipe as R
from ..constants import FP8TensorMeta

__all__ = ["FP8StateCheckpoint"]

_FWD, _BWD = 3, 2  # TE's per-GEMM slots: (input, weight, output), (grad_output, grad_input)
_OURS = ("grad_amax_pending", "grad_amax_seen", "nonfinite_amax_count", "amax_recorded")  # no TE counterpart


class FP8StateCheckpoint:
    """Mixin of a module with `gemm_weights()`: TE's `fp8_meta` view and `_extra_state` form."""

    _last_recipe = None  # the recipe autocast last prepared this module for (TE's fp8_meta["recipe"])

    @property
    def fp8_meta(self) -> dict:
        """TE's view of the state, as copies (writes do not reach the module: load a state dict)."""
        state = self._te_fp8_state()
        meta = {"recipe": self._last_recipe, "num_gemms": len(self.gemm_weights())}
        for way in ("fwd", "bwd"):
            scale = state[f"scale_{way}"]
            meta[f"scaling_{way}"] = FP8TensorMeta(scale=scale, scale_inv=1.0 / scale,
                                                   amax_history=state[f"amax_history_{way}"])
        return meta

    @property
    def quantizers(self) -> dict:
        """TE's `module.quantizers`: the quantizers of the recipe autocast last prepared this module
        for, per GEMM `scaling_fwd` (input, weight, output) and `scaling_bwd` (grad_output,
        grad_input); empty lists before any. The output and grad-input slots hold quantizers of the
        recipe's formats that nothing uses here (no GEMM output is quantized)."""
        from ..tensor.recipe_quantizers import quantizers_for_recipe

        if self._last_recipe is None:
            return {"scaling_fwd": [], "scaling_bwd": []}
        q = quantizers_for_recipe(self._last_recipe)
        n = len(self.gemm_weights())
        return {"scaling_fwd": [q.input, q.weight, q.input] * n, "scaling_bwd": [q.grad_output, q.grad_output] * n}

    def _te_fp8_state(self) -> dict:
        fwd_scale, fwd_hist, bwd_scale, bwd_hist = [], [], [], []
        ours = {name: [] for name in _OURS}
        for gemm, _ in self.gemm_weights():
            # each way's last slot (output, grad_input) is TE's and unused here: scale 1, amax 0
            for scales, hists, scale, hist in ((fwd_scale, fwd_hist, gemm.fp8_scale, gemm.amax_history),
                                               (bwd_scale, bwd_hist, gemm.grad_fp8_scale, gemm.grad_amax_history)):
                scales += [scale, scale.new_ones(1)]
                hists += [hist, hist.new_zeros(hist.shape[0], 1)]
            for name in _OURS:
                ours[name].append(getattr(gemm, name))
        cpu = lambda ts, dim=0: torch.cat([t.detach() for t in ts], dim).cpu()  # noqa: E731
        return {"scale_fwd": cpu(fwd_scale), "amax_history_fwd": cpu(_same_rows(fwd_hist), 1),
                "scale_bwd": cpu(bwd_scale), "amax_history_bwd": cpu(_same_rows(bwd_hist), 1),
                "te_proto": {name: _checkpoint_form(name, torch.stack([t.detach() for t in ts]).cpu())
                             for name, ts in ours.items()}}

    def get_extra_state(self) -> torch.Tensor:
        if any(g.fp8_scale.is_meta for g, _ in self.gemm_weights()):
            return torch.empty(0, dtype=torch.uint8)  # no values yet (a model built on "meta")
        state = self._te_fp8_state()
        state["recipe"] = _data_only(self._last_recipe)
        state["extra_fp8_variables"] = {"num_gemms": len(self.gemm_weights())}
        buf = io.BytesIO()
        _Pickler(buf).dump(state)
        return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint without FP8 state (a plain model's, or one written when the state was the
        # GEMMs' own entries) loads with strict=True: the state starts fresh, or from those entries
        state_dict.setdefault(prefix + "_extra_state", torch.empty(0, dtype=torch.uint8))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_extra_state(self, state) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        if isinstance(state, io.BytesIO):  # TE's older form: torch.save of the dict
            state.seek(0)
            state = torch.load(state, map_location="cpu", weights_only=True)
        elif isinstance(state, torch.Tensor):
            state = _Unpickler(io.BytesIO(state.detach().cpu().numpy().tobytes())).load()
        if state is None or "scale_fwd" not in state:
            return  # TE writes None (or no scales) for a module that never ran delayed scaling
        self._load_te_fp8_state(state)

    def _load_te_fp8_state(self, state: dict) -> None:
        gemms = [g for g, _ in self.gemm_weights()]
        n = len(gemms)
        if state["scale_fwd"].numel() != _FWD * n or state["scale_bwd"].numel() != _BWD * n:
            raise ValueError(
                f"{getattr(self, 'name', type(self).__name__)}: the checkpoint's FP8 state has "
                f"{state['scale_fwd'].numel()} forward / {state['scale_bwd'].numel()} backward scaling slots, "
                f"this module's {n} GEMM(s) need {_FWD * n} / {_BWD * n} (another module type or num_gemms?)")
        recipe = state.get("recipe")
        if isinstance(recipe, R.Recipe) and all(f.name in recipe.__dict__ for f in dataclasses.fields(recipe)):
            self._last_recipe = recipe  # TE's fp8_meta["recipe"]; one from TE's classes may lack our fields
        ours = state.get("te_proto", {})
        for i, gemm in enumerate(gemms):
            gemm.load_state("fp8_scale", state["scale_fwd"][_FWD * i:_FWD * i + 2])
            gemm.load_state("grad_fp8_scale", state["scale_bwd"][_BWD * i:_BWD * i + 1])
            gemm.load_state("amax_history", state["amax_history_fwd"][:, _FWD * i:_FWD * i + 2])
            gemm.load_state("grad_amax_history", state["amax_history_bwd"][:, _BWD * i:_BWD * i + 1])
            for name in _OURS:
                if name in ours:
                    gemm.load_state(name, ours[name][i])


def _checkpoint_form(name: str, t: torch.Tensor) -> torch.Tensor:
    """The counters are kept as float32 in the packed state (exact to 2**24) and checkpointed as int64."""
    return t.to(torch.int64) if name == "nonfinite_amax_count" else t


def _data_only(recipe):
    """The recipe, or None where it holds a function (a callable `amax_compute_algo`, a
    CustomRecipe factory): a checkpoint carries data, which the loader accepts, not code."""
    if recipe is None or any(callable(getattr(recipe, f.name)) for f in dataclasses.fields(recipe)):
        return None
    return recipe


def _same_rows(histories):
    """Histories padded with zero rows to the longest (GEMMs of one module grow together; a loaded
    checkpoint may have left them apart)."""
    rows = max(h.shape[0] for h in histories)
    return [h if h.shape[0] == rows else torch.cat([h, h.new_zeros(rows - h.shape[0], h.shape[1])]) for h in histories]


class _Pickler(pickle.Pickler):
    """Tensors as `torch.FloatTensor(values)` / `torch.LongTensor(values)` (the state's dtypes):
    the same state gives the same bytes (torch's own tensor pickling names storages by address),
    and plain `pickle.loads` (TE's reader) rebuilds them."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            cls = torch.FloatTensor if obj.dtype == torch.float32 else torch.LongTensor
            return cls, (obj.detach().cpu().to(cls.dtype).tolist(),)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    """Reads the pickled `_extra_state` dict of this package or of TE, and nothing else: tensors,
    plain containers, and recipe classes (TE's `transformer_engine.common.recipe` names map to
    ours). A checkpoint is data: any other global is refused."""

    _ALLOWED = {("collections", "OrderedDict"), ("torch._utils", "_rebuild_tensor_v2"), ("torch", "Size"),
                ("torch", "FloatTensor"), ("torch", "LongTensor"), ("copyreg", "_reconstructor"),
                ("builtins", "object"), ("builtins", "set"), ("builtins", "frozenset")}

    def find_class(self, module, name):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if module in ("transformer_engine_proto.recipe", "transformer_engine.common.recipe"):
            found = getattr(R, name, None)
            if isinstance(found, type):
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"FP8 checkpoint state (_extra_state): {module}.{name} is not allowed in it")


def _storage_from_bytes(b: bytes):
    return torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)
