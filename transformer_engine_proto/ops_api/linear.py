"""`BasicLinear` (y = x W^T), `Bias` (y = x + b) and `Linear`, the two as one operation.

`BasicLinear` runs its GEMM through a `QuantizedGemm`, as `te.Linear` does, so it runs every
recipe, keeps delayed-scaling state (checkpointed in `te.Linear`'s `_extra_state` layout), takes
`quantized_model_init` weights and traces under torch.compile the same way. `Linear` hands its bias
to that GEMM, so `ops.Linear` and `te.Linear` with the same weights give the same bits.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..capabilities import default_device
from ..errors import raise_error
from ..module.base import TransformerEngineBaseModule
from ..module.fp8_state import FP8StateCheckpoint
from ..module.quantized_gemm import QuantizedGemm
from ..module.quantized_params import quantize_new_weights
from .op import BasicOperation, FusedOperation, compute_dtype

__all__ = ["BasicLinear", "Bias", "Linear"]

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def param_dtype(owner: str, dtype: Optional[torch.dtype]) -> torch.dtype:
    """`dtype`, or torch's default; one of the dtypes the GEMMs take."""
    dtype = dtype or torch.get_default_dtype()
    if dtype not in PARAM_DTYPES:
        raise ValueError(f"{owner}: dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def check_no_tensor_parallelism(owner: str, mode, group, sequence_parallel: bool) -> None:
    """TE's tensor-parallel arguments: accepted when they ask for no communication (no mode, or a
    group of one rank, which TE also treats as no parallelism); te.Linear has the real thing."""
    if mode not in (None, "column", "row"):
        raise ValueError(f'{owner}: tensor_parallel_mode must be None, "column" or "row", got {mode!r}')
    if mode is None:
        return
    if group is not None:
        size = dist.get_world_size(group)
    else:
        size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if size > 1:
        raise NotImplementedError(
            f"{owner}: tensor parallelism (tensor_parallel_mode={mode!r}, sequence_parallel="
            f"{sequence_parallel}) is not built in te.ops yet; use te.Linear(parallel_mode=...)")


class BasicLinear(FP8StateCheckpoint, TransformerEngineBaseModule, BasicOperation):
    """y = x W^T, TE's `ops.BasicLinear` (a linear layer without bias), one quantized GEMM.

    Under `te.autocast` the GEMMs run in the recipe's format, in the parameters' precision outside
    one. The weight `weight` [out_features, in_features] is initialized as `nn.Linear`'s (Kaiming
    uniform), as TE's. Delayed-scaling state is checkpointed in `_extra_state` in `te.Linear`'s
    layout (one GEMM); a state written by TE's op (its own layout) is not read: it starts fresh.

    Parameters
    ----------
    in_features : int
        Size of the input's last dimension.
    out_features : int
        Size of the output's last dimension.
    device : torch.device or str, default = None
        Where the weight is created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    dtype : torch.dtype, default = None
        The weight's dtype (float32, float16 or bfloat16); None is `torch.get_default_dtype()`.
    tensor_parallel_mode : {None, "column", "row"}, default = None
        TE's tensor parallelism: only without communication here (None, or a group of one rank);
        more ranks are a `NotImplementedError` (`te.Linear` has tensor parallelism).
    tensor_parallel_group : torch.distributed.ProcessGroup, default = None
        The tensor-parallel group (see `tensor_parallel_mode`).
    sequence_parallel : bool, default = False
        TE's sequence parallelism (see `tensor_parallel_mode`).
    rng_state_tracker_function : Callable, default = None
        Returns an RNG tracker whose `fork()` context the weight is initialized in (Megatron's
        model-parallel RNG); None initializes with torch's generator.
    accumulate_into_main_grad : bool, default = False
        Add the weight gradient into `weight.main_grad` (an fp32 buffer the caller sets) instead of
        producing `weight.grad`. TE's `weight.overwrite_main_grad` is a `NotImplementedError`.
    userbuffers_options : dict, default = None
        TE's communication overlap; anything but None is a `NotImplementedError`.
    """

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype: Optional[torch.dtype] = None,
                 tensor_parallel_mode: Optional[str] = None, tensor_parallel_group=None,
                 sequence_parallel: bool = False, rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False, userbuffers_options: Optional[dict] = None) -> None:
        super().__init__(None)
        owner = type(self).__name__
        if not (isinstance(in_features, int) and isinstance(out_features, int)) or min(in_features, out_features) <= 0:
            raise ValueError(f"{owner}: in_features and out_features must be positive ints, "
                             f"got ({in_features!r}, {out_features!r})")
        check_no_tensor_parallelism(owner, tensor_parallel_mode, tensor_parallel_group, sequence_parallel)
        if userbuffers_options is not None:
            raise NotImplementedError(f"{owner}: userbuffers_options (communication overlap) is not supported")
        self.in_features, self.out_features = in_features, out_features
        self.accumulate_into_main_grad = bool(accumulate_into_main_grad)
        self._rng_state_tracker_function = rng_state_tracker_function
        dtype, device = param_dtype(owner, dtype), default_device(device)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()
        self.gemm = QuantizedGemm(device)
        quantize_new_weights(self)  # inside quantized_model_init: the weight is stored quantized

    def reset_parameters(self) -> None:
        """Kaiming-uniform weight, as `nn.Linear` (inside the RNG tracker's fork when given)."""
        fork = contextlib.nullcontext()
        if self._rng_state_tracker_function is not None:
            fork = self._rng_state_tracker_function().fork()
        with fork, torch.no_grad():
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def gemm_weights(self):
        return [(self.gemm, self.weight)]

    def linear(self, input: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: A002
        """x W^T (+ `bias`, added by the GEMM as `te.Linear` adds its own), in the weight's dtype
        (torch.autocast's under it), as TE's op: the input is cast to it."""
        self._check_input(input, self.in_features)
        input = input.to(compute_dtype(input, self.weight.dtype))  # noqa: A001
        if self.accumulate_into_main_grad and getattr(self.weight, "overwrite_main_grad", False):
            raise_error(NotImplementedError, f"{self.name}: weight.overwrite_main_grad is not supported "
                                             "(the weight gradient is added into main_grad)")
        return self.gemm.forward(input, self.weight, bias, fuse_wgrad_accumulation=self.accumulate_into_main_grad,
                                 owner=self)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """y = x W^T.

        Parameters
        ----------
        input : torch.Tensor
            [..., in_features], float32, bfloat16 or float16.
        """
        return self.linear(input)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, name={self.name!r}"


class Bias(BasicOperation):
    """y = x + b over the last dimension, TE's `ops.Bias` (`nn.Linear`'s additive bias).

    Parameters
    ----------
    size : int
        Size of the input's last dimension; the bias `bias` [size] starts at zero.
    device : torch.device or str, default = None
        Where the bias is created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    dtype : torch.dtype, default = None
        The bias's dtype; None is `torch.get_default_dtype()`.
    tensor_parallel : bool, default = False
        TE's tensor parallelism: only without communication here (False, or a group of one rank).
    tensor_parallel_group : torch.distributed.ProcessGroup, default = None
        The tensor-parallel group (see `tensor_parallel`).
    """

    def __init__(self, size: int, *, device=None, dtype: Optional[torch.dtype] = None,
                 tensor_parallel: bool = False, tensor_parallel_group=None) -> None:
        super().__init__()
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"Bias: size must be a positive int, got {size!r}")
        check_no_tensor_parallelism("Bias", "column" if tensor_parallel else None, tensor_parallel_group, False)
        self.local_size = size
        self.bias = nn.Parameter(torch.zeros(size, device=default_device(device), dtype=param_dtype("Bias", dtype)))

    def reset_parameters(self) -> None:
        """Zero bias."""
        with torch.no_grad():
            self.bias.zero_()

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """y = x + b.

        Parameters
        ----------
        input : torch.Tensor
            [..., size].
        """
        if input.dim() < 1 or input.shape[-1] != self.local_size:
            raise_error(ValueError, f"Bias: the input's last dim must be {self.local_size}")
        return input + self.bias

    def extra_repr(self) -> str:
        return f"size={self.local_size}"


class Linear(FusedOperation):
    """y = x W^T + b, TE's `ops.Linear` (a drop-in for `nn.Linear`): a `BasicLinear` and, with
    `bias`, a `Bias`, held in `basic_ops` (state-dict keys `basic_ops.0.weight`,
    `basic_ops.1.bias`, as TE's). The bias is added by the GEMM, as `te.Linear` adds its own, so
    both give the same bits. `weight` / `bias` read (and assign) the basic ops' parameters.

    Parameters
    ----------
    in_features : int
        Size of the input's last dimension.
    out_features : int
        Size of the output's last dimension.
    bias : bool, default = True
        Learn an additive bias, initialized to zero.
    device : torch.device or str, default = None
        Where the parameters are created; None: CUDA when available, as in TE
        (a default device the user set wins), else the CPU.
    dtype : torch.dtype, default = None
        The parameters' dtype (float32, float16 or bfloat16); None is `torch.get_default_dtype()`.
    tensor_parallel_mode : {None, "column", "row"}, default = None
        As `BasicLinear`'s: no communication here.
    tensor_parallel_group : torch.distributed.ProcessGroup, default = None
        As `BasicLinear`'s.
    sequence_parallel : bool, default = False
        As `BasicLinear`'s.
    rng_state_tracker_function : Callable, default = None
        As `BasicLinear`'s: the RNG tracker the weight is initialized under.
    accumulate_into_main_grad : bool, default = False
        Add the weight gradient into `weight.main_grad` instead of producing `weight.grad`.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, device=None,
                 dtype: Optional[torch.dtype] = None, tensor_parallel_mode: Optional[str] = None,
                 tensor_parallel_group=None, sequence_parallel: bool = False,
                 rng_state_tracker_function: Optional[Callable] = None,
                 accumulate_into_main_grad: bool = False) -> None:
        ops = [BasicLinear(in_features, out_features, device=device, dtype=dtype,
                           tensor_parallel_mode=tensor_parallel_mode, tensor_parallel_group=tensor_parallel_group,
                           sequence_parallel=sequence_parallel, rng_state_tracker_function=rng_state_tracker_function,
                           accumulate_into_main_grad=accumulate_into_main_grad)]
        if bias:
            ops.append(Bias(out_features, device=device, dtype=dtype,
                            tensor_parallel=tensor_parallel_mode is not None,
                            tensor_parallel_group=tensor_parallel_group))
        super().__init__(ops)
        self.in_features, self.out_features = in_features, out_features

    @property
    def weight(self) -> nn.Parameter:
        return self.basic_ops[0].weight

    @property
    def bias(self) -> Optional[nn.Parameter]:
        return self.basic_ops[1].bias if len(self.basic_ops) > 1 else None

    def __setattr__(self, name, value):
        # `op.weight = p` / `op.bias = p` set the basic ops' parameters (TE registers them on both)
        if name in ("weight", "bias") and "basic_ops" in self._modules:
            if name == "bias" and len(self.basic_ops) < 2:
                if value is None:
                    return
                raise ValueError("Linear: this Linear was built with bias=False; it has no bias to set")
            setattr(self.basic_ops[0 if name == "weight" else 1], name, value)
            return
        super().__setattr__(name, value)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (TE's name)
        """y = x W^T + b.

        Parameters
        ----------
        input : torch.Tensor
            [..., in_features], float32, bfloat16 or float16.
        """
        return self.basic_ops[0].linear(input, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
