"""`GroupedLinear`: TE's grouped GEMM layer for MoE experts (one weight per expert).

`forward(inp, m_splits)`: `inp` is [sum(m_splits), in_features] with the tokens grouped by
expert; expert i multiplies its `m_splits[i]` rows by `weight{i}`. Two paths:

- high precision with `torch._grouped_mm` (bf16, on CPU or CUDA sm90+, feature dims
  whose rows are 16-byte multiples): one grouped GEMM over an int32 offsets tensor. The splits
  stay data: no host sync, nothing for torch.compile to specialize on. With
  `fuse_wgrad_accumulation` the stacked weights' gradient is added into each weight's
  `main_grad` (`_IntoMainGrad`) instead of `.grad`, as the expert loop's GEMMs do.
- every recipe (and high precision where the grouped kernel does not apply): a loop over the
  experts, each through its own `QuantizedGemm` (so delayed scaling keeps per-expert amax
  history and scales), exactly what a loop of per-expert `te.Linear` computes. The loop slices
  the input by the split sizes, so it needs them as Python numbers: a list is used as given; a
  tensor is read to the host (`tolist()`, one device-to-host copy, as TE's own split-quantize
  path does).

Under torch.compile the expert loop reads a tensor's sizes as unbacked SymInts
(`torch._dynamo.config.capture_scalar_outputs = True` is required), so a new split of the same
total reuses the graph, with no recompile and no graph break. A list becomes such a tensor in
the graph too, but dynamo bakes a list's ints into the first graph: the first new split
recompiles once, with the ints that changed made dynamic, and later splits reuse that graph
(an int that had not changed yet recompiles once when it does). (Without
`capture_scalar_outputs` for the loop, or on CUDA with a recipe, a list's values stay ints or
SymInts and new splits recompile.)

TE's `single_grouped_weight` / `single_grouped_bias` (experimental in TE, honoured only with
`NVTE_GROUPED_LINEAR_SINGLE_PARAM=1`, as there) keep all experts in one parameter, `weight`
[num_gemms, out, in] / `bias` [num_gemms, out], TE's names and layout: `torch._grouped_mm` reads
the weight as it is (no stacking copy) and the expert loop reads its per-expert views.

The FP8 grouped GEMM (`torch._scaled_grouped_mm`, rowwise scales, Hopper) is not wired yet:
`_scaled_grouped_gemm` is the place (see its docstring).
"""
from __future__ import annotations

import collections
import functools
import os
import warnings
from typing import List, Optional, Sequence, Union

import torch
from torch import nn

from .. import kernels
from ..autocast import get_fp8_recipe
from ..capabilities import default_device
from ..errors import raise_error, shape_str
from ..quantization import param_init_state
from ..tensor import QuantizedTensor
from .base import TransformerEngineBaseModule
from .delayed_wgrad import defer_param_grads
from .fp8_state import FP8StateCheckpoint
from .linear import _init_weight
from .quantized_gemm import QuantizedGemm, mark_grad_added_to_main_grad
from .quantized_params import quantize_new_weights

__all__ = ["GroupedLinear", "grouped_mm_supported"]

_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int) -> bool:
    """Whether `torch._grouped_mm` takes these operands: bf16 (its meta function, which compile
    uses, takes nothing else; CPU eager also runs fp32), on CPU or CUDA compute capability 9.0+,
    both feature dims' rows a multiple of 16 bytes (its stride rule)."""
    if not _HAS_GROUPED_MM or dtype != torch.bfloat16:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    if (in_features * size) % 16 or (out_features * size) % 16:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 9
    return device.type == "cpu"


def _check_split_values(name: str, sizes: Sequence, tokens) -> None:
    """Every size >= 0 and their sum the token count. On dynamo's dynamic ints (SymInts) these
    comparisons become guards that any valid split passes."""
    if not any(s < 0 for s in sizes) and sum(sizes) == tokens:
        return
    if not all(v.__class__ is int for v in (tokens, *sizes)):
        # SymInts: a message cannot format them while dynamo traces (v.__class__ tells them apart
        # there, where type(v) and isinstance report int)
        raise_error(ValueError, f"{name}: GroupedLinear m_splits have a negative size or do not sum to the "
                                "input's token count (rows)")
    if any(s < 0 for s in sizes):
        raise_error(ValueError, f"{name}: GroupedLinear m_splits has a negative size: {list(sizes)}")
    raise_error(ValueError, f"{name}: GroupedLinear m_splits sum to {sum(sizes)} but the input has {tokens} "
                            f"tokens (rows); splits {list(sizes)}")


@torch.library.custom_op("te_proto::grouped_linear_host_splits", mutates_args=())
def _host_splits(splits: torch.Tensor, tokens: int, name: str) -> torch.Tensor:
    """A checked int64 CPU copy of the splits, which the compiled graph then reads its sizes from
    (`tolist()`). An op, so that the check runs, with the values in its message, before the graph's
    asserts on the sizes (torch._check's message does not reach those asserts, torch 2.13)."""
    host = splits.to("cpu", torch.int64, copy=True)
    _check_split_values(name, host.tolist(), tokens)
    return host


@_host_splits.register_fake
def _(splits, tokens, name):
    return torch.empty(splits.shape, dtype=torch.int64, device="cpu")


def _at_least_one_row(x: torch.Tensor, m) -> torch.Tensor:
    """x (m rows, m an unbacked SymInt) with a zero row appended when m == 0 (its GEMM's output
    rows past m are sliced off), so that the row count the GEMM pads to is provably >= one block.

    Works around torch 2.13 inductor, which otherwise fails to lower NVFP4 ("LoweringException:
    AssertionError: target: aten.reshape.default"): a reshape of the transposed operand
    [K, 16c] -> [Kc, 16] (c = ceil(m / 16), the RHT / block quantize of the wgrad operand) first
    tries `View._dynamic_reshape_indexer` (torch/_inductor/ir.py), which checks the size it
    guessed with `sizevars.check_equals`; for an unbacked c that records the runtime assert
    Eq(16Kc, 16c), i.e. c == 0, as a fact instead of failing. The attempt is then abandoned, but
    the fallback indexer reasons from that "fact" and asserts. With c >= 1 the guess is
    provably false and nothing is recorded."""
    return torch.nn.functional.pad(x, (0, 0, 0, torch.sym_max(m, 1) - m))


class _IntoMainGrad(torch.autograd.Function):
    """The identity on the experts' weights stacked [n, out, in]; the other arguments are each
    expert's `main_grad` (None for a weight that needs no gradient). Backward adds each expert's
    gradient into its `main_grad` and gives the weights none: `fuse_wgrad_accumulation` as a
    `Linear` backward does it (`.grad` stays None), for the one grouped GEMM over all experts."""

    @staticmethod
    def forward(ctx, stacked, *main_grads):
        ctx.main_grads = main_grads
        return stacked.view_as(stacked)

    @staticmethod
    def backward(ctx, grad):
        for main_grad, g in zip(ctx.main_grads, grad.unbind(0)):
            if main_grad is not None:
                main_grad.add_(g)
        return (None,) * (1 + len(ctx.main_grads))


def _single_param_flags(name: str, weight: bool, bias: bool):
    """TE's gate on its experimental single grouped parameters: without
    NVTE_GROUPED_LINEAR_SINGLE_PARAM=1 a request falls back to per-expert parameters with a
    warning, so the same code and environment give TE's parameter layout."""
    if (weight or bias) and int(os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "0")) <= 0:
        warnings.warn(f"{name}: GroupedLinear was constructed with single_grouped_weight={weight} and "
                      f"single_grouped_bias={bias}, but NVTE_GROUPED_LINEAR_SINGLE_PARAM is not set: using "
                      "per-expert parameters, as TE does", UserWarning, stacklevel=3)
        return False, False
    return weight, bias


def _grouped_gemm(offsets, inp, weights, biases, stacked=None) -> torch.Tensor:
    """inp's rows times their expert's weight (`stacked`: the weights stacked, [n, out, in]), plus
    their expert's bias where `biases` are given."""
    stacked = torch.stack(weights) if stacked is None else stacked
    out = torch._grouped_mm(inp, stacked.transpose(-2, -1), offs=offsets)
    if not biases:
        return out
    # each row's expert: the first offset past the row
    rows = torch.arange(inp.shape[0], device=inp.device, dtype=torch.int32)
    expert = torch.searchsorted(offsets, rows, right=True).clamp_(max=len(biases) - 1)
    # added in fp32, so the bias grad (a per-expert sum over its rows) accumulates in fp32 as in Linear
    return (out.float() + torch.stack(biases).float()[expert]).to(out.dtype)


class GroupedLinear(FP8StateCheckpoint, TransformerEngineBaseModule):
    """Drop-in for `transformer_engine.pytorch.GroupedLinear`: `num_gemms` experts, each
    y_i = x_i W_i^T + b_i on its own rows. Parameters `weight0..weight{n-1}` ([out, in]) and
    `bias0..bias{n-1}` as TE names them (or one `weight` / `bias`: `single_grouped_weight`).
    Arguments after `out_features` are keyword-only.

    Parameters
    ----------
    num_gemms : int
        Number of experts (GEMMs), each with its own weight and bias.
    in_features : int
        Size of the input's last dimension.
    out_features : int
        Size of the output's last dimension.
    bias : bool, default = True
        Learn a bias per expert, initialized to zero.
    return_bias : bool, default = False
        Leave the biases out of the output and return `(out, [bias0, ..., bias{n-1}])` (with
        `single_grouped_bias`, `(out, bias)`: the [num_gemms, out] parameter, as TE).
    params_dtype : torch.dtype, default = None
        dtype of the parameters; None is `torch.get_default_dtype()`.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    init_method : Callable, default = None
        Called as `init_method(weight)` on each expert's weight (its [out, in] slice with
        `single_grouped_weight`). None is `nn.Linear`'s Kaiming-uniform init (TE's: a normal
        with std 0.023).
    fuse_wgrad_accumulation : bool, default = False
        Add each expert's weight gradient into its `main_grad` (an fp32 buffer the caller sets;
        forward raises a RuntimeError without it; with `single_grouped_weight` one
        [num_gemms, out, in] buffer on `weight`) instead of producing `.grad`, on both paths.
        The `torch._grouped_mm` path adds the grouped GEMM's bf16 weight gradient; the per-expert
        loop, like `Linear`, computes it in fp32. A weight with a `grad_added_to_main_grad`
        attribute (Megatron-LM's) gets it set to True once backward has added into `main_grad`.
    save_original_input : bool, default = False
        Save each expert's high-precision input for backward instead of its quantized copy (the
        per-expert loop).
    name : str, default = None
        The layer's name in the debug tools' configs; None gives `grouped_linear_<n>`.
    sequence_parallel : bool, default = False
        Only False: tensor parallelism is not supported (`NotImplementedError`), as TE leaves
        the MoE communication to the token dispatcher.
    tp_group : torch.distributed.ProcessGroup, default = None
        Only None (`NotImplementedError` otherwise).
    tp_size : int, default = 1
        Only 1 (`NotImplementedError` otherwise).
    parallel_mode : {None}, default = None
        Only None (`NotImplementedError` otherwise).
    get_rng_state_tracker : Callable, default = None
        Only None (`NotImplementedError` otherwise).
    rng_tracker_name : str, default = None
        Only None (`NotImplementedError` otherwise).
    delay_wgrad_compute : bool, default = False
        Each expert's weight (and, unquantized, bias) gradient waits for `backward_dw()`, as
        `Linear`'s, on both paths (the grouped GEMM's from its own autograd graph).
    use_grouped_tensor : bool, default = None
        High precision only: None or True run all experts in one `torch._grouped_mm` where it
        applies (bf16 input and weights, CPU or CUDA compute capability 9.0+, feature rows that are
        16-byte multiples); False always runs the per-expert loop. Recipes always loop. TE also
        ties its single grouped parameters to its native grouped path; here they run on either.
    single_grouped_weight : bool, default = False
        All experts' weights in one parameter `weight` [num_gemms, out, in] (TE's name and
        layout; `weight0..` are None), each expert initialized as its own weight would be. As in
        TE, only with the environment variable NVTE_GROUPED_LINEAR_SINGLE_PARAM=1; otherwise a
        warning and per-expert weights. Not inside `quantized_model_init` (`NotImplementedError`).
    single_grouped_bias : bool, default = False
        All experts' biases in one parameter `bias` [num_gemms, out], under the same variable.

    Any other keyword (`ub_*`, ...) is a `TypeError`."""

    single_grouped_weight = single_grouped_bias = False

    def __init__(self, num_gemms: int, in_features: int, out_features: int, *, bias: bool = True,
                 return_bias: bool = False, params_dtype: Optional[torch.dtype] = None, device=None,
                 init_method=None, fuse_wgrad_accumulation: bool = False, save_original_input: bool = False,
                 name: Optional[str] = None, sequence_parallel: bool = False, tp_group=None, tp_size: int = 1,
                 parallel_mode: Optional[str] = None, get_rng_state_tracker=None, rng_tracker_name=None,
                 delay_wgrad_compute: bool = False, use_grouped_tensor: Optional[bool] = None,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False, **unsupported):
        super().__init__(name)
        if unsupported:
            raise TypeError(f"{self.name}: GroupedLinear: unsupported arguments {sorted(unsupported)}")
        if num_gemms <= 0 or in_features <= 0 or out_features <= 0:
            raise ValueError(f"{self.name}: GroupedLinear needs positive num_gemms and features, got "
                             f"({num_gemms}, {in_features}, {out_features})")
        if tp_group is not None or (tp_size or 1) != 1 or parallel_mode is not None or sequence_parallel:
            raise NotImplementedError(f"{self.name}: GroupedLinear with tensor parallelism is not supported "
                                      "(TE leaves the MoE communication to the dispatcher; use tp_size=1)")
        if get_rng_state_tracker is not None or rng_tracker_name is not None:
            raise NotImplementedError(f"{self.name}: get_rng_state_tracker / rng_tracker_name are not supported")
        single_grouped_weight, single_grouped_bias = _single_param_flags(self.name, single_grouped_weight,
                                                                         single_grouped_bias)
        if single_grouped_weight and param_init_state().enabled:
            raise NotImplementedError(f"{self.name}: GroupedLinear(single_grouped_weight=True) inside "
                                      "quantized_model_init is not supported (each expert's weight is stored "
                                      "quantized on its own): use single_grouped_weight=False")
        if delay_wgrad_compute and (single_grouped_weight or single_grouped_bias):
            raise NotImplementedError(f"{self.name}: delay_wgrad_compute=True with single grouped parameters is "
                                      "not supported (backward_dw adds each expert's gradient into its own "
                                      "parameter): use per-expert parameters")
        self.single_grouped_weight, self.single_grouped_bias = single_grouped_weight, single_grouped_bias and bias
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.return_bias, self.use_bias = return_bias, bias
        self.fuse_wgrad_accumulation, self.save_original_input = fuse_wgrad_accumulation, save_original_input
        # None: torch._grouped_mm wherever it applies (high precision); False: always the expert loop
        self.use_grouped_tensor = use_grouped_tensor
        dtype, device = params_dtype or torch.get_default_dtype(), default_device(device)
        for i in range(num_gemms):
            w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            _init_weight(w, init_method)
            self.register_parameter(f"weight{i}", w)
            b = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
            self.register_parameter(f"bias{i}", b)
        if single_grouped_weight:
            self._pack_parameters("weight")
        if self.single_grouped_bias:
            self._pack_parameters("bias")
        self.gemms = nn.ModuleList(QuantizedGemm(device) for _ in range(num_gemms))
        quantize_new_weights(self)  # inside quantized_model_init: each expert's weight is stored quantized
        self._grouped_wgrads = collections.deque()  # the grouped GEMM's queued parameter gradients
        self._init_delay_wgrad(delay_wgrad_compute)

    def _pack_parameters(self, kind: str) -> None:
        """TE's packing into a single grouped parameter: the experts' initialized `<kind>{i}`
        stacked into one parameter `<kind>` [num_gemms, ...], the per-expert names kept as None."""
        names = [f"{kind}{i}" for i in range(self.num_gemms)]
        with torch.no_grad():
            packed = torch.stack([getattr(self, n) for n in names])
        for n in names:
            self.register_parameter(n, None)
        self.register_parameter(kind, nn.Parameter(packed))

    @property
    def weights(self) -> List[torch.Tensor]:
        """Each expert's weight [out, in] (views of `weight` with `single_grouped_weight`)."""
        if self.single_grouped_weight:
            return list(self.weight.unbind(0))
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    @property
    def biases(self) -> List[Optional[torch.Tensor]]:
        """Each expert's bias [out] or None (views of `bias` with `single_grouped_bias`)."""
        if self.single_grouped_bias:
            return list(self.bias.unbind(0))
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    def _stacked_weight(self) -> torch.Tensor:
        """The experts' weights as one [n, out, in] tensor: the parameter itself when single."""
        return self.weight if self.single_grouped_weight else torch.stack(self.weights)

    def gemm_weights(self):
        return list(zip(self.gemms, self.weights))

    def _wgrad_queues(self):
        names = [f"weight{i}" for i in range(self.num_gemms)], [f"bias{i}" for i in range(self.num_gemms)]
        return [(g.pending_wgrads, [w], [b]) for g, w, b in zip(self.gemms, *names)] + [(self._grouped_wgrads, *names)]

    # ---- the splits ---------------------------------------------------------------------------
    def _check_splits(self, m_splits, tokens, grouped: bool, refusal):
        """(the splits as a tensor or None, as host ints or None). A list / tuple of ints, or a 1-D
        integer tensor of length num_gemms: read and checked on the host in eager (one sync, as
        TE's `tolist()`). Under compile they stay data, so a new split does not recompile: a
        tensor as it is for `_grouped_mm` (checked there, on its device), else a checked host copy
        (`_host_splits`) that the expert loop reads the sizes from. `refusal` (compiling only): why
        the loop cannot read sizes from data here; then a tensor is an error and a list stays
        dynamo's ints, checked while tracing."""
        n, compiling = self.num_gemms, torch.compiler.is_dynamo_compiling()
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dim() != 1 or m_splits.shape[0] != n or m_splits.dtype.is_floating_point \
                    or m_splits.dtype == torch.bool:
                raise_error(ValueError, f"{self.name}: m_splits must be {n} split sizes (a list of ints or a 1-D "
                                        f"integer tensor), got a tensor of shape {shape_str(m_splits)} and dtype "
                                        f"{m_splits.dtype}")
            if not compiling:
                sizes = m_splits.tolist()
                _check_split_values(self.name, sizes, tokens)
                return m_splits, sizes
            if grouped:
                return m_splits, None
            if refusal is not None:
                raise_error(*refusal)
            return torch.ops.te_proto.grouped_linear_host_splits(m_splits, tokens, self.name), None
        if not isinstance(m_splits, (list, tuple)) or len(m_splits) != n:
            raise_error(ValueError, f"{self.name}: m_splits must be {n} split sizes, got {m_splits!r}")
        if not compiling:
            sizes = [int(s) for s in m_splits]
            _check_split_values(self.name, sizes, tokens)
            return None, sizes
        sizes = list(m_splits)  # no int(): it would specialize a dynamic int
        if grouped or refusal is None:
            return torch.ops.te_proto.grouped_linear_host_splits(torch.tensor(sizes), tokens, self.name), None
        _check_split_values(self.name, sizes, tokens)
        return None, sizes

    def _graph_sizes_refusal(self, device: torch.device, quantized: bool):
        """Why the expert loop cannot read tensor splits into the graph here (an exception type
        and message), or None."""
        if not torch._dynamo.config.capture_scalar_outputs:
            return RuntimeError, (
                f"{self.name}: GroupedLinear with a tensor of m_splits under torch.compile reads the sizes into the "
                "graph as data: set torch._dynamo.config.capture_scalar_outputs = True (or pass m_splits as a list "
                "of ints: each new split then recompiles)")
        if quantized and device.type == "cuda" and kernels.get_backend() == "triton":
            return NotImplementedError, (
                f"{self.name}: GroupedLinear with a tensor of m_splits under torch.compile with a recipe on CUDA: the "
                "Triton quantize kernels' launch checks need each expert's token count at trace time; pass m_splits "
                "as a list of ints (each new split recompiles)")
        return None

    @staticmethod
    def _sizes_in_graph(host_splits: torch.Tensor, tokens) -> list:
        """The split sizes as unbacked SymInts, read from the checked host copy (a bad split failed
        there, naming the layer and the sizes, before the graph's own assert on the SymInts, which
        names only symbols: Eq(u0 + u1, 96)), with what the loop needs of them asserted."""
        sizes = host_splits.tolist()
        for s in sizes:
            torch._check(s >= 0)
        torch._check(sum(sizes) == tokens)
        return sizes

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, inp: torch.Tensor, m_splits: Union[Sequence[int], torch.Tensor],
                is_first_microbatch: Optional[bool] = None):
        """Each expert's rows times its weight; `out` [tokens, out_features], or
        `(out, biases)` with `return_bias`.

        Parameters
        ----------
        inp : torch.Tensor
            [tokens, in_features], the tokens grouped by expert, float32, bfloat16 or float16. An
            input of more dims is split along its flattened leading dims, as in TE: the output is
            [-1, *inp.shape[1:-1], out_features].
        m_splits : list of int or torch.Tensor
            `num_gemms` row counts summing to `tokens` (the flattened rows; empty experts allowed):
            a list (TE's API) or a 1-D integer tensor (under torch.compile, with
            `torch._dynamo.config.capture_scalar_outputs = True`, a new split then reuses the
            graph). A wrong count or sum is a `ValueError` naming the layer.
        is_first_microbatch : {None, True, False}, default = None
            Weight caching over gradient-accumulation micro-batches, per expert, as in
            `Linear.forward`.
        """
        self._check_input(inp, self.in_features)
        self._check_gemm_module()
        if inp.dim() != 2:
            if inp.dim() < 2:
                raise_error(ValueError, f"{self.name}: GroupedLinear takes an input [tokens, in_features], got shape "
                                        f"{shape_str(inp)}")
            out = self.forward(inp.reshape(-1, self.in_features), m_splits, is_first_microbatch)
            unflatten = lambda t: t.view(-1, *inp.shape[1:-1], self.out_features)  # noqa: E731
            return (unflatten(out[0]), out[1]) if self.return_bias else unflatten(out)
        tokens = inp.shape[0]
        recipe = get_fp8_recipe()
        # weights stored quantized (quantized_model_init) are read by the per-expert GEMMs
        grouped = (recipe is None and self.use_grouped_tensor is not False
                   and not isinstance(self._weight_params()[0], QuantizedTensor)
                   and grouped_mm_supported(inp.device, inp.dtype, self.in_features, self.out_features)
                   and inp.dtype == self._weight_params()[0].dtype)
        refusal = None
        if torch.compiler.is_dynamo_compiling() and not grouped:
            refusal = self._graph_sizes_refusal(inp.device, recipe is not None)
        splits, sizes = self._check_splits(m_splits, tokens, grouped, refusal)
        bias_in_gemm = self.use_bias and not self.return_bias
        out = None
        if recipe is not None:
            out = self._scaled_grouped_gemm(inp, splits, sizes, recipe)
        elif grouped:
            out = self._grouped_mm(inp, splits, sizes, tokens, bias_in_gemm)
        if out is None:
            out = self._expert_loop(inp, splits, sizes, tokens, bias_in_gemm, is_first_microbatch)
        if self.return_bias:
            return out, (self.bias if self.single_grouped_bias else self.biases)
        return out

    def _grouped_mm(self, inp, splits, sizes, tokens, with_bias: bool) -> torch.Tensor:
        """High precision: one `torch._grouped_mm` over the cumulative offsets (int32)."""
        if splits is not None:
            if sizes is None:  # compiling: the splits are data, checked in the graph
                torch._assert_async(splits.sum() == tokens,
                                    f"{self.name}: m_splits do not sum to the input's token count")
            offsets = splits.to(device=inp.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        else:
            ends, total = [], 0
            for s in sizes:
                total += s
                ends.append(total)
            offsets = torch.tensor(ends, dtype=torch.int32, device=inp.device)
        weights, biases = self.weights, self.biases if with_bias else []
        if self.delay_wgrad_compute and torch.is_grad_enabled():  # backward_dw adds into main_grad with fuse
            return defer_param_grads(self._grouped_wgrads, functools.partial(_grouped_gemm, offsets), inp, weights,
                                     biases)
        stacked = self._stacked_weight()  # [n, out, in]
        if self.fuse_wgrad_accumulation and stacked.requires_grad:
            stacked = _IntoMainGrad.apply(stacked, *self._main_grads())
            mark_grad_added_to_main_grad(self._weight_params(), stacked)
        return _grouped_gemm(offsets, inp, weights, biases, stacked)

    def _weight_params(self) -> List[torch.Tensor]:
        """The weight parameters: `weight`, or `weight0..`."""
        return [self.weight] if self.single_grouped_weight else self.weights

    def _main_grads(self) -> List[Optional[torch.Tensor]]:
        """Each expert's `main_grad`, None where its weight needs no gradient (`fuse_wgrad_accumulation`):
        with `single_grouped_weight`, the slices of `weight.main_grad`."""
        names = ["weight"] if self.single_grouped_weight else [f"weight{i}" for i in range(self.num_gemms)]
        main_grads = []
        for name, w in zip(names, self._weight_params()):
            main_grad = getattr(w, "main_grad", None) if w.requires_grad else None
            if w.requires_grad and main_grad is None:
                raise_error(RuntimeError, f"{self.name}: fuse_wgrad_accumulation=True needs {name}.main_grad "
                                          "(an fp32 buffer) to be set")
            main_grads.append(main_grad)
        if self.single_grouped_weight:
            return [None] * self.num_gemms if main_grads[0] is None else list(main_grads[0].unbind(0))
        return main_grads

    def _expert_loop(self, inp, splits, sizes, tokens, with_bias: bool, is_first_microbatch) -> torch.Tensor:
        """One quantized GEMM per expert on its slice of the tokens (what a loop of te.Linear does)."""
        recipe = get_fp8_recipe()
        # with unbacked sizes, a block-scaled recipe gets at least one (zero) row per expert: see _at_least_one_row
        one_row = sizes is None and recipe is not None and not recipe.float8_per_tensor_scaling()
        if sizes is None:
            sizes = self._sizes_in_graph(splits, tokens)
        fuse = self.fuse_wgrad_accumulation
        main_grads = self._main_grads() if fuse else [None] * self.num_gemms
        outs = []
        for gemm, x, w, b, m, main_grad in zip(self.gemms, torch.split(inp, sizes), self.weights, self.biases, sizes,
                                               main_grads):
            if one_row:
                x = _at_least_one_row(x, m)
            y = gemm.forward(x, w, b if with_bias else None, is_first_microbatch=is_first_microbatch,
                             save_original_input=self.save_original_input, fuse_wgrad_accumulation=fuse,
                             main_grad=main_grad)
            if fuse and self.single_grouped_weight and main_grad is not None:
                mark_grad_added_to_main_grad([self.weight], y)  # the GEMM sees a view, not the parameter
            outs.append(y[:m] if one_row else y)
        return torch.cat(outs)

    def _scaled_grouped_gemm(self, inp, splits, sizes, recipe) -> Optional[torch.Tensor]:
        """The hook for an FP8 grouped GEMM: return the output, or None for the expert loop.

        Not wired yet. On Hopper, `torch._scaled_grouped_mm(a_fp8, b_fp8_t, scale_a, scale_b,
        offs=offsets, out_dtype=bf16)` takes rowwise (per-row, fp32) scales for e4m3 operands with
        offsets that are multiples of 16: that fits a per-token / per-channel current-scaling
        recipe, which this package does not have (Float8CurrentScaling is per tensor, and delayed
        scaling's per-expert state would need an amax per expert segment). Until then every
        recipe runs the expert loop, which matches per-expert te.Linear bit for bit."""
        return None

    def extra_repr(self) -> str:
        return (f"num_gemms={self.num_gemms}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, name={self.name!r}")
