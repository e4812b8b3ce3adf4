"""LogTensorStats' `max_blockwise_dynamic_range` stat (TE's): the largest log2(amax / smallest
non-zero |x|) of one block, blocks of block_size elements (dims 1) or block_size x block_size
tiles (dims 2), over both orientations for activation and weight; its values, logged names,
accumulation and config checks."""
import math
import textwrap

import nvdlfw_inspect.api as debug_api
import pytest
import torch
from test_debug_common import debug_session

import transformer_engine_proto as te
from transformer_engine_proto.debug import last_logged_stats, validate_config
from transformer_engine_proto.debug.config_check import DebugConfigError
from transformer_engine_proto.debug.stats import (
    BlockwiseDynamicRangeStat,
    compute_max_blockwise_dynamic_range,
    parse_hp_stat,
)

A, B, EPS = 1000.0, 50.0, 0.01
R_AB, R_AE = math.log2(A / B), math.log2(A / EPS)


def _rows_tensor(n=64):
    """Row 0 = A, rows 1-3 = B, the rest EPS: rows are uniform, columns are not."""
    t = torch.full((n, n), EPS)
    t[0], t[1:4] = A, B
    return t


def _range(t, block_size, dims, both):
    return compute_max_blockwise_dynamic_range(t, BlockwiseDynamicRangeStat(block_size, dims, both)).item()


# ---- the computation ----------------------------------------------------------------------------
def test_rows_are_uniform_columns_are_not():
    t = _rows_tensor()
    assert _range(t, 4, 1, False) == pytest.approx(0.0, abs=1e-6)
    assert _range(t, 4, 1, True) == pytest.approx(R_AB, abs=1e-5)  # a column block holds A, B, B, B
    assert _range(t, 8, 1, True) == pytest.approx(R_AE, abs=1e-5)  # ... and EPS from row 4 on
    assert _range(t, 4, 2, False) == pytest.approx(R_AB, abs=1e-5)  # a 4x4 tile spans rows 0-3


def test_tiles_follow_the_2d_layout_and_leading_dims_flatten():
    t = torch.tensor([[1.0, 1.0, 10.0, 10.0], [1.0, 2.0, 10.0, 10.0],
                      [100.0, 100.0, 1000.0, 1000.0], [100.0, 100.0, 1000.0, 8000.0]])
    assert _range(t, 2, 2, False) == pytest.approx(3.0, abs=1e-6)  # the tile 1000..8000
    assert _range(t.reshape(2, 2, 4), 2, 2, False) == _range(t, 2, 2, False)
    assert _range(t, 2, 1, False) == pytest.approx(3.0, abs=1e-6)  # the pair 1000, 8000
    assert _range(t, 4, 1, False) == pytest.approx(math.log2(80.0), abs=1e-6)  # the row 100 .. 8000
    assert _range(t, 4, 1, True) == pytest.approx(math.log2(800.0), abs=1e-6)  # the column 10 .. 8000


def test_zeros_are_ignored_and_zero_blocks_count_zero():
    t = torch.zeros(8, 8)
    assert _range(t, 4, 1, True) == 0.0
    t[0, 0], t[0, 1] = 3.0, -0.75  # block [3, -0.75, 0, 0]: range log2(4); the other blocks are zeros
    assert _range(t, 4, 1, False) == pytest.approx(2.0, abs=1e-6)
    assert _range(t, 4, 2, True) == pytest.approx(2.0, abs=1e-6)


def test_blocks_must_divide_the_tensor():
    with pytest.raises(ValueError, match="not a whole number of blocks of 32"):
        _range(torch.ones(3, 10), 32, 1, False)
    with pytest.raises(ValueError, match=r"a 6x8 tensor does not split into 4x4 tiles"):
        _range(torch.ones(6, 8), 4, 2, False)


def test_parsing_defaults_and_orientations():
    stat = {"max_blockwise_dynamic_range": {}}
    assert parse_hp_stat(stat, "activation") == BlockwiseDynamicRangeStat(32, 1, True)
    assert parse_hp_stat(stat, "weight").max_over_orientations
    for name in ("gradient", "output", "wgrad", "dgrad"):
        assert not parse_hp_stat(stat, name).max_over_orientations
    parsed = parse_hp_stat({"max_blockwise_dynamic_range": {"block_size": 16, "dims": 2}}, "gradient")
    assert str(parsed) == "max_blockwise_dynamic_range_block_size_16_dims_2"
    weight = str(parse_hp_stat(stat, "weight"))
    assert weight == "max_blockwise_dynamic_range_block_size_32_dims_1_max_over_orientations"
    assert parse_hp_stat("dynamic_range") == "dynamic_range"


# ---- logged through a session -------------------------------------------------------------------
TE_CONFIG = """
    log:
      layers:
        layer_name_regex_pattern: .*
      enabled:
        True
      transformer_engine:
        LogTensorStats:
          enabled: True
          stats:
            - dynamic_range
            - max_blockwise_dynamic_range:
                block_size: 4
                dims: 1
            - max_blockwise_dynamic_range:
                block_size: 4
                dims: 2
          tensors: [activation, gradient, weight]
          freq: 2
          start_step: 0
          end_step: 10
    """


@pytest.mark.parametrize("tensor_name", ["activation", "weight", "gradient"])
def test_te_config_through_inspect_tensor(tmp_path, tensor_name):
    with debug_session(tmp_path, TE_CONFIG):
        debug_api.transformer_engine.inspect_tensor(
            layer_name="layer_name", tensor_name=tensor_name, iteration=0, tp_group=None,
            tensor=_rows_tensor(), quantizer=None, rowwise_quantized_tensor=None, columnwise_quantized_tensor=None)
        debug_api.step()
        logged = last_logged_stats()
    both = tensor_name in ("activation", "weight")
    sfx = "_max_over_orientations" if both else ""
    prefix = f"layer_name_{tensor_name}_"
    assert set(logged) == {prefix + "dynamic_range", prefix + f"max_blockwise_dynamic_range_block_size_4_dims_1{sfx}",
                           prefix + f"max_blockwise_dynamic_range_block_size_4_dims_2{sfx}"}
    assert logged[prefix + "dynamic_range"] == pytest.approx(R_AE, abs=1e-4)
    assert logged[prefix + f"max_blockwise_dynamic_range_block_size_4_dims_1{sfx}"] == \
        pytest.approx(R_AB if both else 0.0, abs=1e-4)
    assert logged[prefix + f"max_blockwise_dynamic_range_block_size_4_dims_2{sfx}"] == pytest.approx(R_AB, abs=1e-4)


LINEAR_CONFIG = """
    blockwise:
      enabled: True
      layers:
        layer_types: [lin]
      transformer_engine:
        LogTensorStats:
          enabled: True
          tensors_struct:
            - tensor: activation
              stats: [max, {max_blockwise_dynamic_range: {block_size: 8}}]
            - tensor: gradient
              stats:
                - max_blockwise_dynamic_range: {block_size: 8, dims: 2}
    """


def test_on_a_linear_with_micro_batches(tmp_path):
    torch.manual_seed(0)
    m = te.Linear(16, 16, name="lin")
    xs = [torch.randn(8, 16) for _ in range(2)]
    gs = [torch.randn(8, 16) for _ in range(2)]
    with debug_session(tmp_path, textwrap.dedent(LINEAR_CONFIG)):
        for x, g in zip(xs, gs):
            m(x).backward(g)
        debug_api.step()
        logged = last_logged_stats()
    act = max(_range(x, 8, 1, True) for x in xs)  # micro-batches combine by max
    grad = max(_range(g, 8, 2, False) for g in gs)
    assert logged["lin_activation_max_blockwise_dynamic_range_block_size_8_dims_1_max_over_orientations"] == \
        pytest.approx(act, rel=1e-6)
    assert logged["lin_gradient_max_blockwise_dynamic_range_block_size_8_dims_2"] == pytest.approx(grad, rel=1e-6)
    assert logged["lin_activation_max"] == pytest.approx(max(x.max().item() for x in xs), rel=1e-6)


# ---- config checks ------------------------------------------------------------------------------
def _cfg(stat):
    return {"s": {"enabled": True, "layers": {"layer_types": ["lin"]},
                  "transformer_engine": {"LogTensorStats": {"enabled": True, "tensors": ["activation"],
                                                            "stats": ["min", stat]}}}}


def test_the_te_config_passes_the_check(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(textwrap.dedent(TE_CONFIG))
    validate_config(str(path))
    validate_config(_cfg({"max_blockwise_dynamic_range": {}}))


@pytest.mark.parametrize("stat, message", [
    ("max_blockwise_dynamic_range", r"unsupported stats \['max_blockwise_dynamic_range'\]"),
    ({"max_blockwise_dynamic_range": None}, "parameters must be a mapping"),
    ({"max_blockwise_dynamic_range": {"block_size": 0}}, "block_size must be a positive int, got 0"),
    ({"max_blockwise_dynamic_range": {"block_size": True}}, "block_size must be a positive int, got True"),
    ({"max_blockwise_dynamic_range": {"dims": 3}}, "dims must be 1 .* or 2 .*, got 3"),
    ({"max_blockwise_dynamic_range": {"block": 32}}, r"unknown keys \['block'\]"),
    ({"blockwise_range": {"block_size": 32}}, "one key 'max_blockwise_dynamic_range'"),
])
def test_bad_blockwise_stats_name_the_entry(stat, message):
    with pytest.raises(DebugConfigError, match=r"section 's' > transformer_engine > LogTensorStats > stats: .*"
                                               + message):
        validate_config(_cfg(stat))
