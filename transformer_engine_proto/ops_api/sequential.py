"""`Sequential`: TE's container for fusible operations (a drop-in for `torch.nn.Sequential`).

It runs its modules in order with TE's calling convention: `model(x, *extra_inputs)` hands the
extra inputs to the operations that take them (`AddExtraInput`, ...) in order, and returns `y`,
or `(y, *extra_outputs)` in the order the operations make them (`MakeExtraOutput`, ...). Plain
`nn.Module`s run on the main tensor only. There is no fuser: under torch.compile the loop unrolls
into one graph, where inductor fuses the element-wise work; eagerly each op runs on its own.
"""
from __future__ import annotations

from typing import Iterable, Iterator, Union

import torch
from torch import nn

from ..errors import raise_error
from .op import FusibleOperation, split_extra_outputs

__all__ = ["Sequential"]


class Sequential(nn.Module):
    """Runs fusible operations and other modules in order (TE's `ops.Sequential`). Indexing,
    slicing (a new `Sequential` of the same modules), assignment, deletion, `len`, iteration,
    `append`, `extend`, `insert`, `pop`, `+` and `+=` behave as on a list of modules.

    Parameters
    ----------
    args : FusibleOperation or torch.nn.Module
        The modules, in order (positional); or a single dict / OrderedDict of name -> module.
    """

    def __init__(self, *args: Union[FusibleOperation, nn.Module]) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], dict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for module in args:
                self.append(module)

    def add_module(self, name: str, module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Sequential: entries must be torch.nn.Module instances, got {type(module).__name__}")
        super().add_module(name, module)

    # ---- list behaviour ---------------------------------------------------------------------------
    def _keys(self, idx: Union[int, slice]) -> list:
        keys = list(self._modules.keys())
        if isinstance(idx, slice):
            return keys[idx]
        if not isinstance(idx, int):
            raise TypeError(f"Sequential indices must be ints or slices, got {type(idx).__name__}")
        if not -len(keys) <= idx < len(keys):
            raise IndexError(f"Sequential index {idx} is out of range for {len(keys)} modules")
        return [keys[idx]]

    def _next_key(self) -> str:
        """One more than the largest integer key (TE's numbering, kept after deletions)."""
        numbers = [int(k) for k in self._modules if k.isdigit()]
        return str(max(numbers) + 1 if numbers else 0)

    def __getitem__(self, idx: Union[int, slice]):
        keys = self._keys(idx)
        if isinstance(idx, slice):
            return Sequential(*(self._modules[k] for k in keys))
        return self._modules[keys[0]]

    def __setitem__(self, idx: int, module: nn.Module) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"Sequential: entries must be torch.nn.Module instances, got {type(module).__name__}")
        self._modules[self._keys(idx)[0]] = module

    def __delitem__(self, idx: Union[int, slice]) -> None:
        for key in self._keys(idx):
            del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def append(self, module: nn.Module) -> "Sequential":
        """Add `module` at the end."""
        self.add_module(self._next_key(), module)
        return self

    def extend(self, modules: Iterable[nn.Module]) -> "Sequential":
        """Add `modules` at the end, in order."""
        for module in modules:
            self.append(module)
        return self

    def insert(self, idx: int, module: nn.Module) -> "Sequential":
        """Put `module` at position `idx`, moving the later ones back by one."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"Sequential: entries must be torch.nn.Module instances, got {type(module).__name__}")
        n = len(self)
        if not -n <= idx <= n:
            raise IndexError(f"Sequential insert index {idx} is out of range for {n} modules")
        idx = idx + n if idx < 0 else idx
        # as TE: the modules from idx on move one key later; the last gets a new key
        keys = [*self._modules.keys(), self._next_key()]
        modules = list(self._modules.values())
        modules.insert(idx, module)
        self._modules.clear()
        self._modules.update(zip(keys, modules))
        return self

    def pop(self, idx: Union[int, slice]):
        """Remove and return the module at `idx`."""
        out = self[idx]
        del self[idx]
        return out

    def __iadd__(self, modules: Iterable[nn.Module]) -> "Sequential":
        return self.extend(modules)

    def __add__(self, modules: Iterable[nn.Module]) -> "Sequential":
        return Sequential(*self).extend(modules)

    # ---- forward ------------------------------------------------------------------------------------
    @property
    def num_extra_inputs(self) -> int:
        """How many extra inputs `forward` takes (those of the operations, in order)."""
        return sum(m.num_extra_inputs for m in self if isinstance(m, FusibleOperation))

    def forward(self, input: torch.Tensor, *extra_inputs: torch.Tensor):  # noqa: A002 (TE's name)
        """The modules in order; `y`, or `(y, *extra_outputs)` when an operation makes any.

        Parameters
        ----------
        input : torch.Tensor
            The first module's input; `extra_inputs` (positional) go to the operations that take
            extra inputs, in order, one group per operation.
        """
        want = self.num_extra_inputs
        if len(extra_inputs) != want:
            raise_error(ValueError, f"Sequential: its operations take {want} extra input(s), "
                                    f"got {len(extra_inputs)}")
        x, pending, extra_outputs = input, list(extra_inputs), []
        for module in self:
            if isinstance(module, FusibleOperation):
                taken, pending = pending[:module.num_extra_inputs], pending[module.num_extra_inputs:]
                x, extra = split_extra_outputs(module, module(x, *taken))
                extra_outputs.extend(extra)
            else:
                x = module(x)
        return (x, *extra_outputs) if extra_outputs else x
