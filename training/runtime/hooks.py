"""Callbacks at named points of a training loop: what runs beside the step without being in it.

A loop calls `hooks.run(point, step)` where the point is reached (`HookPoint`: right after an
optimizer step, and the phases of a checkpoint save); whoever wants to act there adds a
callback (`hooks.add(point, fn)`). The reliability suite's fault injection is one such
callback (`training/runtime/faults.py`, `fault_hooks`); profiling or extra logging would be
others. A point with no callback costs a dict lookup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

#: The named points of the pretraining loop, in the order a step and a save reach them.
HookPoint = Literal[
    "step", "after_shard", "before_meta", "before_latest", "after_latest", "during_purge"
]


class Hooks:
    """Callbacks by point; each takes the step the loop is at (the steps done)."""

    def __init__(self) -> None:
        """No callbacks yet."""
        self._at: dict[str, list[Callable[[int], None]]] = {}

    def add(self, point: HookPoint, callback: Callable[[int], None]) -> None:
        """Call `callback(step)` every time the loop reaches `point`."""
        self._at.setdefault(point, []).append(callback)

    def run(self, point: HookPoint, step: int) -> None:
        """Call the callbacks of `point`, in the order they were added."""
        for callback in self._at.get(point, ()):
            callback(step)
