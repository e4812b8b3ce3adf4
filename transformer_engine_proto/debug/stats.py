"""Statistics buffers of LogTensorStats / LogFp8TensorStats / LogNvfp4TensorStats.

Each inspect call computes a few helper values of its tensor (count, sum, centred sum of squares,
min, max, ...; one column per `max_blockwise_dynamic_range` stat) as one float64 row on the
tensor's device -- no host sync. Rows of micro-batches are combined in place (weights: the first
micro-batch only, as TE). At `debug_api.step()` the rows
are gathered across ranks (the debug reduction group; a weight over the TP group its layer is
sharded over, as TE's `tp_group`, so the stats are those of the full weight -- or per rank without
TP or after `set_weight_tensor_tp_group_reduce(False)`), combined and turned into the requested
stats, logged through nvdlfw_inspect's MetricLogger as `{layer}_{tensor}_{stat}` with the
iteration they were fed in.
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from . import quant_view

__all__ = ["BUFFERS", "HP_STATS", "FP8_BASE_STATS", "NVFP4_STATS", "parse_fp8_stat", "parse_hp_stat", "tensor_row",
           "fp8_row", "Buffer", "set_weight_tensor_tp_group_reduce", "weight_tensor_tp_group_reduce",
           "BlockwiseDynamicRangeStat", "compute_max_blockwise_dynamic_range", "MAX_OVER_ORIENTATIONS_TENSORS"]

_WEIGHT_TP_GROUP_REDUCE = [True]


def set_weight_tensor_tp_group_reduce(enabled: bool) -> None:
    """TE's switch: reduce weight stats over the layer's TP group (default), or keep them per rank."""
    _WEIGHT_TP_GROUP_REDUCE[0] = bool(enabled)


def weight_tensor_tp_group_reduce() -> bool:
    """The switch's current value."""
    return _WEIGHT_TP_GROUP_REDUCE[0]

HP_STATS = ("min", "max", "mean", "std", "l1_norm", "l2_norm", "cur_amax", "dynamic_range")
FP8_BASE_STATS = ("underflows%", "overflows%", "scale_inv_min", "scale_inv_max", "mse")
NVFP4_STATS = ("underflows%", "mse")  # LogNvfp4TensorStats, logged as nvfp4_<stat>

# helper values of a row: base part, then 5 per quantized variant, then one per blockwise stat
_BASE = ("n", "sum", "m2", "min", "max", "l1", "sumsq", "amax", "nz_amin")
_VAR = ("under", "over", "sqerr", "si_min", "si_max")
_ADD, _MIN, _MAX = {"n", "sum", "l1", "sumsq", "under", "over", "sqerr"}, {"min", "nz_amin", "si_min"}, \
    {"max", "amax", "si_max", "block_max"}

# tensors a GEMM reads in both orientations (TE's rule for max_blockwise_dynamic_range)
MAX_OVER_ORIENTATIONS_TENSORS = ("activation", "weight")
_BLOCKWISE = "max_blockwise_dynamic_range"
_BLOCKWISE_KEYS = {"block_size": 32, "dims": 1}


class BlockwiseDynamicRangeStat(NamedTuple):
    """TE's `max_blockwise_dynamic_range` stat with its parameters; `str()` is its logged name."""

    block_size: int
    dims: int
    max_over_orientations: bool

    def __str__(self) -> str:
        tail = "_max_over_orientations" if self.max_over_orientations else ""
        return f"{_BLOCKWISE}_block_size_{self.block_size}_dims_{self.dims}{tail}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_hp_stat(stat, tensor_name: str = ""):
    """A LogTensorStats `stats` entry -> the stat: a name of HP_STATS, or a BlockwiseDynamicRangeStat
    for `{max_blockwise_dynamic_range: {block_size: 32, dims: 1}}` (both keys optional; measured in
    both orientations for the tensors of MAX_OVER_ORIENTATIONS_TENSORS). ValueError otherwise."""
    if isinstance(stat, str):
        if stat in HP_STATS:
            return stat
        hint = (f"; {_BLOCKWISE} takes its parameters as a mapping: "
                f"`- {_BLOCKWISE}: {{block_size: 32, dims: 1}}`" if stat == _BLOCKWISE else "")
        raise ValueError(f"unsupported stat {stat!r}; supported: {list(HP_STATS)} and {_BLOCKWISE}{hint}")
    if not (isinstance(stat, dict) and list(stat) == [_BLOCKWISE]):
        raise ValueError(f"unsupported stat {stat!r}: a stat with parameters must be a mapping with the "
                         f"one key {_BLOCKWISE!r}")
    params = stat[_BLOCKWISE]
    if not isinstance(params, dict):
        raise ValueError(f"{_BLOCKWISE}: parameters must be a mapping of block_size / dims, got {params!r}")
    extra = sorted(set(params) - set(_BLOCKWISE_KEYS))
    if extra:
        raise ValueError(f"{_BLOCKWISE}: unknown keys {extra}; allowed: {sorted(_BLOCKWISE_KEYS)}")
    block_size, dims = params.get("block_size", 32), params.get("dims", 1)
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"{_BLOCKWISE}: block_size must be a positive int, got {block_size!r}")
    if dims not in (1, 2) or not _is_int(dims):
        raise ValueError(f"{_BLOCKWISE}: dims must be 1 (blocks of block_size consecutive elements) or 2 "
                         f"(block_size x block_size tiles), got {dims!r}")
    return BlockwiseDynamicRangeStat(block_size, dims, tensor_name in MAX_OVER_ORIENTATIONS_TENSORS)


def _max_block_range(x2d: torch.Tensor, block_size: int, dims: int) -> torch.Tensor:
    """max over blocks of log2(amax) - log2(smallest non-zero |x|); all-zero blocks count 0."""
    a = x2d.abs().float()
    rows, cols = a.shape
    if dims == 1:
        if a.numel() % block_size:
            raise ValueError(f"{_BLOCKWISE}: {a.numel()} elements are not a whole number of blocks of "
                             f"{block_size}")
        blocks = a.reshape(-1, block_size)
    else:
        if rows % block_size or cols % block_size:
            raise ValueError(f"{_BLOCKWISE}: a {rows}x{cols} tensor does not split into {block_size}x{block_size} "
                             "tiles")
        blocks = a.reshape(rows // block_size, block_size, cols // block_size, block_size) \
            .permute(0, 2, 1, 3).reshape(-1, block_size * block_size)
    amax = blocks.amax(dim=1)
    amin = blocks.masked_fill(blocks == 0, math.inf).amin(dim=1)
    ranges = torch.where(amax != 0, torch.log2(amax) - torch.log2(amin), torch.zeros_like(amax))
    return ranges.max()


def compute_max_blockwise_dynamic_range(tensor: torch.Tensor, stat: BlockwiseDynamicRangeStat) -> torch.Tensor:
    """The largest dynamic range of one block of `tensor` (seen as 2D: leading dims flattened).
    dims 1: blocks of block_size consecutive elements of the row-major data (rows when the last dim
    is a multiple of block_size); dims 2: block_size x block_size tiles. With max_over_orientations
    the transposed tensor's blocks count too (the worst block whichever way a GEMM reads it)."""
    x2d = tensor.detach().reshape(-1, tensor.shape[-1]) if tensor.dim() else tensor.detach().reshape(1, 1)
    out = _max_block_range(x2d, stat.block_size, stat.dims)
    if stat.max_over_orientations:
        out = torch.maximum(out, _max_block_range(x2d.t(), stat.block_size, stat.dims))
    return out


def parse_fp8_stat(stat: str, current: str) -> Tuple[str, str, bool]:
    """'mxfp8_underflows%_columnwise' -> ('mxfp8', 'underflows%', True); a stat without a recipe
    prefix is for the current recipe. Raises ValueError for unknown stats or recipes."""
    if not isinstance(stat, str):
        raise ValueError(f"stat {stat!r} is not a string")
    columnwise = stat.endswith("_columnwise")
    body = stat[: -len("_columnwise")] if columnwise else stat
    recipe = next((r for r in quant_view.RECIPE_NAMES if body.startswith(r + "_")), "")
    base = body[len(recipe) + 1:] if recipe else body
    if base not in FP8_BASE_STATS:
        raise ValueError(f"unsupported stat {stat!r}: expected [<recipe>_]<stat>[_columnwise] with <stat> in "
                         f"{FP8_BASE_STATS} and <recipe> in {quant_view.RECIPE_NAMES}")
    recipe = recipe or current
    if not recipe:
        raise ValueError(f"stat {stat!r} names no recipe and the layer runs without a low-precision recipe; "
                         f"prefix it with one of {quant_view.RECIPE_NAMES}")
    return recipe, base, columnwise


# ---- rows -----------------------------------------------------------------------------------------
def tensor_row(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().double().reshape(-1)
    n = x.numel()
    a = x.abs()
    s = x.sum()
    inf = torch.full((), math.inf, dtype=torch.float64, device=x.device)
    vals = [torch.full((), float(n), dtype=torch.float64, device=x.device), s, ((x - s / n) ** 2).sum(), x.min(),
            x.max(), a.sum(), (x * x).sum(), a.max(), torch.where(x != 0, a, inf).min()]
    return torch.stack(vals)


def fp8_row(x: torch.Tensor, q, columnwise: bool) -> torch.Tensor:
    v = quant_view.usage_view(q, x, columnwise)
    xd, dq = v.x.double(), v.dq.double()
    under = ((xd != 0) & (dq == 0)).sum()
    # clipped: the code saturated and x lies beyond the largest value (a few ulps of slack absorb the
    # rounding of scale_inv, e.g. the amax element of current scaling lands exactly on the max)
    over = (v.saturated & (xd.abs() > dq.abs() * (1 + 2.0 ** -18))).sum()
    return torch.stack([under.double(), over.double(), ((xd - dq) ** 2).sum(), v.scale_inv.double().min(),
                        v.scale_inv.double().max()])


def _idx(nvariants: int, width: int) -> Dict[str, List[int]]:
    names = list(_BASE) + [f for _ in range(nvariants) for f in _VAR]
    names += ["block_max"] * (width - len(names))
    return {kind: [i for i, f in enumerate(names) if f in fields] for kind, fields in
            (("add", _ADD), ("min", _MIN), ("max", _MAX))}


def combine(a: torch.Tensor, b: torch.Tensor, nvariants: int) -> torch.Tensor:
    """Combined helper values of two rows (Chan et al. for the centred sum of squares)."""
    idx = _idx(nvariants, a.numel())
    out = a.clone()
    na, nb = a[0], b[0]
    n = na + nb
    delta = b[1] / nb - a[1] / na
    out[2] = a[2] + b[2] + delta * delta * na * nb / n
    out[idx["add"]] = a[idx["add"]] + b[idx["add"]]
    out[idx["min"]] = torch.minimum(a[idx["min"]], b[idx["min"]])
    out[idx["max"]] = torch.maximum(a[idx["max"]], b[idx["max"]])
    return out


def _value(row: torch.Tensor, stat, variant: Optional[int]) -> float:
    if isinstance(stat, BlockwiseDynamicRangeStat):
        return float(row[variant])  # variant: the stat's column of the row
    v = {f: float(row[i]) for i, f in enumerate(_BASE)}
    n = v["n"]
    if variant is not None:
        base = len(_BASE) + 5 * variant
        q = {f: float(row[base + i]) for i, f in enumerate(_VAR)}
        return {"underflows%": 100.0 * q["under"] / n, "overflows%": 100.0 * q["over"] / n, "mse": q["sqerr"] / n,
                "scale_inv_min": q["si_min"], "scale_inv_max": q["si_max"]}[stat]
    if stat == "dynamic_range":
        if v["amax"] == 0 or math.isinf(v["nz_amin"]):
            return 0.0
        return math.log2(v["amax"]) - math.log2(v["nz_amin"])
    return {"min": v["min"], "max": v["max"], "mean": v["sum"] / n,
            "std": math.sqrt(max(v["m2"], 0.0) / (n - 1)) if n > 1 else float("nan"),
            "l1_norm": v["l1"], "l2_norm": math.sqrt(v["sumsq"]), "cur_amax": v["amax"]}[stat]


# ---- buffers ------------------------------------------------------------------------------------
class Buffer:
    """Stats of one (layer, tensor, feature); `stats` are (logged name, base stat, variant index or None;
    for a BlockwiseDynamicRangeStat its column); rows are `width` wide (default: base + variants)."""

    def __init__(self, layer: str, tensor: str, stats: Sequence[Tuple[str, object, Optional[int]]], nvariants: int,
                 width: Optional[int] = None):
        self.layer, self.tensor, self.stats, self.nvariants = layer, tensor, tuple(stats), nvariants
        self.width = len(_BASE) + 5 * nvariants if width is None else width
        self.reduce_within_microbatch = tensor != "weight"
        self.row: Optional[torch.Tensor] = None
        self.iteration = 0
        self.tp_group = None  # the TP group a weight is sharded over (from the inspect call)

    def feed(self, row: torch.Tensor, iteration: int, tp_group=None) -> None:
        self.tp_group = tp_group
        if self.row is not None and self.iteration != iteration:
            self.row = None  # a step() was skipped: start over rather than mix iterations
        self.iteration = iteration
        if self.row is None:
            self.row = row
        elif self.reduce_within_microbatch:
            self.row = combine(self.row, row, self.nvariants)

    def _gathered(self) -> Optional[torch.Tensor]:
        dist = torch.distributed
        weight_group = self.tp_group if _WEIGHT_TP_GROUP_REDUCE[0] else None
        if (self.tensor == "weight" and weight_group is None) or not (dist.is_available() and dist.is_initialized()):
            return None if self.row is None else self.row.unsqueeze(0)
        if self.tensor == "weight":
            group = weight_group  # TP shards of one weight: stats of the whole weight
        else:
            import nvdlfw_inspect.api as debug_api

            group = debug_api.get_tensor_reduction_group()
        mine = torch.zeros(self.width + 1, dtype=torch.float64, device=self.row.device if self.row is not None else
                           ("cuda" if dist.get_backend(group) == "nccl" else "cpu"))
        if self.row is not None:
            mine[0], mine[1:] = 1, self.row
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, mine, group=group)
        fed = [r[1:] for r in rows if r[0] > 0]
        return torch.stack(fed) if fed else None

    def log(self) -> Dict[str, float]:
        rows = self._gathered()
        out = {}
        if rows is not None:
            from nvdlfw_inspect.logging import MetricLogger

            row = rows[0]
            for other in rows[1:]:
                row = combine(row, other, self.nvariants)
            for name, stat, variant in self.stats:
                value = _value(row, stat, variant)
                full = f"{self.layer}_{self.tensor}_{name}"
                MetricLogger.log_scalar(full, value, self.iteration)
                out[full] = value
        self.row = None
        return out


class Buffers:
    def __init__(self):
        self.buffers: Dict[Tuple[str, str, str], Buffer] = {}
        self.last: Dict[str, float] = {}  # the values logged at the last step (for tests and users)

    def reset(self) -> None:
        self.buffers.clear()

    def get(self, layer: str, tensor: str, kind: str, stats, nvariants: int, width: Optional[int] = None) -> Buffer:
        key = (layer, tensor, kind)
        buf = self.buffers.get(key)
        if buf is None or buf.stats != tuple(stats) or buf.nvariants != nvariants or \
                (width is not None and buf.width != width):
            buf = self.buffers[key] = Buffer(layer, tensor, stats, nvariants, width)
        return buf

    def log_all(self) -> Dict[str, float]:
        """Called by debug_api.step(): every rank must hold the same buffers (same config)."""
        out = {}
        for key in sorted(self.buffers):
            buf = self.buffers[key]
            if buf.row is not None or torch.distributed.is_initialized():
                out.update(buf.log())
        self.last = out
        return out


BUFFERS = Buffers()


def feed_tensor(layer: str, tensor_name: str, stats: Sequence, x: torch.Tensor, iteration: int,
                tp_group=None) -> None:
    """`stats`: LogTensorStats config entries (names, or `{max_blockwise_dynamic_range: {...}}`)."""
    if x.numel() == 0:
        return
    entries, blockwise = [], []
    for s in stats:
        parsed = parse_hp_stat(s, tensor_name)
        if isinstance(parsed, BlockwiseDynamicRangeStat):
            if parsed not in blockwise:
                blockwise.append(parsed)
            entries.append((str(parsed), parsed, len(_BASE) + blockwise.index(parsed)))
        else:
            entries.append((parsed, parsed, None))
    row = tensor_row(x)
    if blockwise:
        row = torch.cat([row, torch.stack([compute_max_blockwise_dynamic_range(x, b) for b in blockwise]).double()])
    buf = BUFFERS.get(layer, tensor_name, "hp", entries, 0, row.numel())
    buf.feed(row, iteration, tp_group)


def feed_quantized(layer: str, tensor_name: str, stats: Sequence[Tuple[str, str, int]],
                   x: torch.Tensor, variants: Sequence[Tuple[object, bool]], iteration: int, tp_group=None,
                   kind: str = "quantized") -> None:
    """`stats`: (logged name, base stat, variant index); `variants`: (quantized tensor, columnwise);
    `kind`: the feature's own buffer (features logging the same tensor keep separate ones)."""
    if x.numel() == 0:
        return
    row = torch.cat([tensor_row(x)] + [fp8_row(x, q, col) for q, col in variants])
    BUFFERS.get(layer, tensor_name, kind, stats, len(variants)).feed(row, iteration, tp_group)
