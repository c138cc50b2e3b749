"""Count the reads of tensor values on the host (each one a synchronisation on a GPU).

Two nets, because on a CPU some reads never reach the dispatcher: a dispatch mode catches
`aten::_local_scalar_dense` (what `.item()`, `float()` and `bool()` dispatch) and the ops whose
output shape depends on values (`nonzero`, `masked_select`, boolean indexing), and the Python
methods that read values (`item`, `tolist`, `numpy`, `__bool__`, `__float__`, `__int__`) are
wrapped, since on a CPU `.tolist()` and `.numpy()` dispatch nothing.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READ_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2"}
_READ_METHODS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")
# Frames worth naming: the project's and the libraries a step runs through.
_OWNERS = ("/training/", "/tasks/", "/deepspeed/", "/transformers/")


@dataclass(frozen=True)
class HostRead:
    """One read: what read (an op or a method) and the innermost named frame that asked."""

    kind: str
    where: str

    @property
    def owner(self) -> str:
        """`lmpipe`, `deepspeed` or `transformers`: whose code asked for the read."""
        for name in ("deepspeed", "transformers"):
            if f"/{name}/" in self.where:
                return name
        return "lmpipe"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename
        if "/torch/" in path or path.endswith("host_reads.py"):
            continue
        if any(owner in path for owner in _OWNERS):
            return f"{path}:{frame.lineno} ({frame.name})"
    return "?"


def _boolean_index(func: Any, args: tuple[Any, ...]) -> bool:
    if func._schema.name != "aten::index" or len(args) < 2:
        return False
    return any(
        isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in args[1]
    )


class _Mode(TorchDispatchMode):
    def __init__(self, reads: list[HostRead]) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        if name in _READ_OPS or _boolean_index(func, args):
            self.reads.append(HostRead(name, _caller()))
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_reads() -> Iterator[list[HostRead]]:
    """Collect every host read made inside the block (all threads' Python reads included)."""
    reads: list[HostRead] = []
    originals = {name: getattr(torch.Tensor, name) for name in _READ_METHODS}

    def wrap(name: str) -> Any:
        original = originals[name]

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.append(HostRead(f"Tensor.{name}", _caller()))
            return original(self, *args, **kwargs)

        return read

    for name in _READ_METHODS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        with _Mode(reads):
            yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
