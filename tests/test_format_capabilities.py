"""The format capability interface (tensor/format_api.py, docs/adding_a_format.md).

A toy sixth format -- FP8 with one fp32 scale per row (rowwise) and per column (columnwise) --
is defined here, in one place, and used through a CustomRecipe: the Linear op, the GEMM, the
FSDP2 / sequence-parallel gather decisions and the debug decoding all take it without a change
anywhere else. A format that leaves a capability undeclared gets a NotImplementedError naming
the class and the capability, never a quiet fallback.
"""
from dataclasses import dataclass

import pytest
import torch

import transformer_engine_proto as te
from transformer_engine_proto import recipe as R
from transformer_engine_proto.custom_ops.recipe_key import RecipeKey
from transformer_engine_proto.debug import quant_view
from transformer_engine_proto.distributed.fsdp import gather_format
from transformer_engine_proto.distributed.sp_gather import HP, input_gather_format
from transformer_engine_proto.gemm import gemm
from transformer_engine_proto.tensor import QuantizedTensor, QuantizedTensorStorage, Quantizer
from transformer_engine_proto.tensor.format_api import GatherRule, UsageView
from transformer_engine_proto.tensor.quantizer import BufferSpec, flat_2d

E4M3_MAX = 448.0


def _rows_fp8(x2d):
    """(fp8 data, (rows, 1) fp32 scale_inv): one scale per row."""
    amax = x2d.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, E4M3_MAX / amax, torch.ones_like(amax))
    return (x2d.float() * scale).to(torch.float8_e4m3fn), scale.reciprocal()


class RowScaledStorage(QuantizedTensorStorage):
    _FLATTEN_TENSOR_BUFFERS = (("_data", "data"), ("_scale_inv", "scale_inv"),
                               ("_col_data", "col_data"), ("_col_scale_inv", "col_scale_inv"))
    _LOGICAL_SHAPE_BUFFERS = ("_data",)
    FORMAT_NAME = "toy_row_scaled"

    def has_rowwise(self):
        return self._data is not None

    def has_columnwise(self):
        return self._col_data is not None

    def _dequantize(self, dtype):
        if self._data is not None:
            return (self._data.float().reshape(-1, self._shape[-1]) * self._scale_inv).reshape(self._shape).to(dtype)
        return (self._col_data.float() * self._col_scale_inv).t().reshape(self._shape).to(dtype)

    def _drop_usage(self, rowwise, columnwise):
        if not rowwise:
            self._data = self._scale_inv = None
        if not columnwise:
            self._col_data = self._col_scale_inv = None

    def gemm_native(self):
        return None  # no scaled-GEMM kernel: always emulated

    def debug_usage_view(self, x2d, columnwise):
        if columnwise:
            data, s = self._col_data, self._col_scale_inv
        else:
            data, s = self._data.reshape(x2d.shape), self._scale_inv
        xs = x2d.t() if columnwise else x2d
        return UsageView(xs, data.float() * s, data.float().abs() == E4M3_MAX, s.float())

    def debug_internals(self):
        return {"rowwise_data": None if self._data is None else self._data.reshape(-1, self._shape[-1]),
                "rowwise_scale_inv": self._scale_inv, "columnwise_data": self._col_data,
                "columnwise_scale_inv": self._col_scale_inv}

    @classmethod
    def debug_reconstruct(cls, d, usage):
        return d[f"{usage}_data"].float() * d[f"{usage}_scale_inv"].float(), usage == "columnwise"


class RowScaledTensor(RowScaledStorage, QuantizedTensor):
    pass


@dataclass(frozen=True)
class RowScaledQuantizer(Quantizer):
    DEBUG_RECIPE = "toy_row_scaled"

    @property
    def tensor_class(self):
        return RowScaledTensor

    def buffer_layout(self, shape):
        m, k = flat_2d(shape)
        out = {}
        if self.rowwise_usage:
            out["_data"] = BufferSpec(tuple(shape), torch.float8_e4m3fn)
            out["_scale_inv"] = BufferSpec((m, 1), torch.float32)
        if self.columnwise_usage:
            out["_col_data"] = BufferSpec((k, m), torch.float8_e4m3fn)
            out["_col_scale_inv"] = BufferSpec((k, 1), torch.float32)
        return out

    def _quantize_buffers(self, x):
        x2d = x.reshape(-1, x.shape[-1])
        out = {}
        if self.rowwise_usage:
            data, out["_scale_inv"] = _rows_fp8(x2d)
            out["_data"] = data.reshape(x.shape)
        if self.columnwise_usage:
            out["_col_data"], out["_col_scale_inv"] = _rows_fp8(x2d.t().contiguous())
        return {name: out[name] for name in self.buffer_layout(tuple(x.shape))}

    def row_block(self):
        return 1

    def has_scale_state(self):
        return False

    def fsdp_gather_rule(self):
        return GatherRule(None, reason="toy_row_scaled: the columnwise scales span all rows")

    def sp_gather_rule(self):
        return GatherRule(None, reason="toy_row_scaled: the columnwise scales span all rows")

    @classmethod
    def debug_quantizer(cls, fp8_dtype, tensor_name):
        return RowScaledQuantizer()


def _toy_recipe():
    return R.CustomRecipe(qfactory=lambda role: RowScaledQuantizer())


def test_a_sixth_format_trains_a_linear_through_a_custom_recipe():
    torch.manual_seed(0)
    lin = te.Linear(64, 32, bias=True)
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict({k: v for k, v in lin.state_dict().items() if k in ("weight", "bias")})
    x = torch.randn(3, 8, 64, requires_grad=True)
    with te.autocast(recipe=_toy_recipe()):
        y = lin(x)
    y.sum().backward()
    x2 = x.detach().clone().requires_grad_()
    y2 = ref(x2)
    y2.sum().backward()
    assert y.shape == (3, 8, 32)
    assert (y - y2).abs().max() / y2.abs().max() < 0.05
    assert (x.grad - x2.grad).abs().max() / x2.grad.abs().max() < 0.05
    assert (lin.weight.grad - ref.weight.grad).abs().max() / ref.weight.grad.abs().max() < 0.05


def test_a_sixth_format_gemm_gathers_and_debug_decoding():
    torch.manual_seed(0)
    q = RowScaledQuantizer()
    a, b = q(torch.randn(16, 64)), q(torch.randn(24, 64))
    out = gemm(a, b, out_dtype=torch.float32, trans_b=True)
    assert torch.equal(out, a.dequantize(dtype=torch.float32) @ b.dequantize(dtype=torch.float32).t())

    key = RecipeKey.of(_toy_recipe())
    kind, why = gather_format(key, (64, 64), 2)
    assert kind == "hp" and "toy_row_scaled" in why
    with pytest.warns(UserWarning, match="toy_row_scaled"):
        got = input_gather_format(key, (8, 4, 64), 2, True)
    assert got == (HP, "toy_row_scaled: the columnwise scales span all rows")

    assert quant_view.recipe_name(q) == "toy_row_scaled" and "toy_row_scaled" in quant_view.RECIPE_NAMES
    assert isinstance(quant_view.new_quantizer("toy_row_scaled", None, "weight"), RowScaledQuantizer)
    x = torch.randn(2, 8, 64)
    t = q(x)
    d = quant_view.internals(t)
    assert d["format"] == "toy_row_scaled"
    columnwise_only = q.with_usage(rowwise=False)(x)
    for usage, want in (("rowwise", t), ("columnwise", columnwise_only)):
        assert torch.equal(quant_view.reconstruct(d, usage), want.dequantize(dtype=torch.float32))
        v = quant_view.usage_view(t, x, usage == "columnwise")
        assert v.x.shape == v.dq.shape


class _Undeclared(RowScaledQuantizer):
    """Declares nothing of its own except being a different class."""


class _BareQuantizer(Quantizer):
    pass


class _BareStorage(QuantizedTensorStorage):
    pass


@pytest.mark.parametrize("call, capability", [
    (lambda: _BareQuantizer().row_block(), "row_block"),
    (lambda: _BareQuantizer().has_scale_state(), "has_scale_state"),
    (lambda: _BareQuantizer().with_scale_state(None, None), "has_scale_state"),
    (lambda: _BareQuantizer().fsdp_gather_rule(), "fsdp_gather_rule"),
    (lambda: _BareQuantizer().fsdp_quantize_shard(None, None, None), "fsdp_quantize_shard"),
    (lambda: _BareQuantizer().fsdp_rebuild((), (), 0), "fsdp_rebuild"),
    (lambda: _BareQuantizer().sp_gather_rule(), "sp_gather_rule"),
    (lambda: _BareQuantizer().sp_quantize_shard(None, None, None), "sp_quantize_shard"),
    (lambda: _BareQuantizer().sp_finish_gather({}), "sp_finish_gather"),
    (lambda: _BareQuantizer().debug_recipe_name(), "DEBUG_RECIPE"),
    (lambda: _BareQuantizer.debug_quantizer(None, "weight"), "debug_quantizer"),
    (lambda: _BareStorage.format_name(), "format_name"),
    (lambda: _BareStorage.__new__(_BareStorage).gemm_native(), "gemm_native"),
    (lambda: _BareStorage.__new__(_BareStorage).gemm_operand(True), "gemm_operand"),
    (lambda: _BareStorage.__new__(_BareStorage).debug_usage_view(None, False), "debug_usage_view"),
    (lambda: _BareStorage.__new__(_BareStorage).debug_internals(), "debug_internals"),
    (lambda: _BareStorage.debug_reconstruct({}, "rowwise"), "debug_reconstruct"),
    (lambda: _BareQuantizer().with_existing_amax(torch.ones(1)), "with_existing_amax"),
])
def test_an_undeclared_capability_raises_naming_format_and_capability(call, capability):
    with pytest.raises(NotImplementedError, match=rf"_Bare\w+ does not declare the format capability '{capability}'"):
        call()


def test_optional_capabilities_default_to_none():
    assert _BareQuantizer().fused_norm_quantize(None, None, None, 1e-5, "LayerNorm", False) is None
    assert _BareQuantizer().takes_existing_amax() is False
    assert _BareStorage.__new__(_BareStorage).gemm_emulated(None, False, False, torch.float32, None) is None
    assert _Undeclared().debug_recipe_name() == "toy_row_scaled"  # inherited declarations hold


def test_the_shipped_formats_declare_every_capability():
    from transformer_engine_proto.tensor import (
        Float8BlockQuantizer,
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
        MXFP8Quantizer,
        NVFP4Quantizer,
    )

    x = torch.randn(128, 128)
    for q in (Float8Quantizer(torch.ones(1), torch.zeros(1)), Float8CurrentScalingQuantizer(), MXFP8Quantizer(),
              Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=2), NVFP4Quantizer(),
              NVFP4Quantizer(with_2d_quantization=True)):
        assert q.row_block() >= 1 and isinstance(q.has_scale_state(), bool)
        assert q.debug_recipe_name() in quant_view.RECIPE_NAMES
        for rule in (q.fsdp_gather_rule(), q.sp_gather_rule()):
            assert isinstance(rule, GatherRule) and (rule.layout is not None or rule.reason)
        t = q(x)
        assert t.format_name() and t.gemm_native() in ("tensorwise", "blockwise", "block_scaled")
        for reduce_last in (True, False):
            op = t.gemm_operand(reduce_last)
            assert op is not None and op.data.shape[0] == 128  # (outer, K); NVFP4 packs K
        assert quant_view.internals(t)["format"] == t.format_name()


def test_existing_amax_binds_current_scaling_only():
    """Current scaling takes an amax taken already (TE's use_existing_amax): the bytes of a fresh
    pass; a different amax, a different scale. The other formats, and a current-scaling subclass
    that reduces its amax across ranks, do not take one."""
    from transformer_engine_proto.distributed.amax_reduction import AmaxReducingQuantizer
    from transformer_engine_proto.kernels import kernel
    from transformer_engine_proto.tensor import (
        Float8BlockQuantizer,
        Float8CurrentScalingQuantizer,
        Float8Quantizer,
        MXFP8Quantizer,
        NVFP4Quantizer,
    )

    x = torch.randn(64, 96) * 3
    q = Float8CurrentScalingQuantizer(margin=1)
    assert q.takes_existing_amax()
    fresh = q.quantize(x, internal=True)
    bound = q.with_existing_amax(kernel("amax", x.device)(x))
    assert bound == q and "_existing_amax" not in q.__dict__  # a bound copy, the original untouched
    same = bound.quantize(x, internal=True)
    for name, t in fresh.get_buffers().items():
        assert torch.equal(t.view(torch.uint8), same.get_buffers()[name].view(torch.uint8)), name
    other = q.with_existing_amax(kernel("amax", x.device)(x) * 2).quantize(x, internal=True)
    assert not torch.equal(other._scale_inv, fresh._scale_inv)
    for other_q in (Float8Quantizer(torch.ones(1), torch.zeros(1)), MXFP8Quantizer(),
                    Float8BlockQuantizer(block_scaling_dim=1), NVFP4Quantizer(),
                    AmaxReducingQuantizer.__new__(AmaxReducingQuantizer)):
        assert not other_q.takes_existing_amax(), type(other_q).__name__
        with pytest.raises(NotImplementedError, match="with_existing_amax"):
            other_q.with_existing_amax(torch.ones(1))
