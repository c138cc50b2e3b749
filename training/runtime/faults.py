"""Fault injection for the reliability suite: SIGKILL a training worker at a named point.

A `FaultPlan` names one point of the loop (`step`: right after an optimizer step; the phases of
a checkpoint save; the purge of old checkpoints), the step at which it fires and the rank that
dies. The worker kills itself with SIGKILL there, so the fault is the real thing (no exception,
no clean-up, no flushed buffers), placed exactly where a random external kill only lands by luck.
It fires once per plan: the dying process first creates the plan's marker file, and a restarted
attempt that reaches the same point finds the marker and carries on. A plan may name a further
one (`then`, with its own marker), so one run takes several faults, each resumed from.

Plans reach workers inside `WorkerJob` (`pretrain_stage(..., control=RunControl(fault=plan))`);
nothing reads the environment, so a stray variable can never kill a production run. The loop
reaches a plan through its hooks (`fault_hooks`, `training/runtime/hooks.py`), not through calls
of its own.
"""

from __future__ import annotations

import functools
import os
import signal
from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator

from training.runtime.hooks import HookPoint, Hooks

# The save protocol in order (training/pretrain/loop.py `Worker.save`): every rank writes its
# DeepSpeed shards and RNG file; rank 0 writes meta.json (the commit); rank 0 moves the `latest`
# pointer; the checkpoint is reported to Ray; rank 0 purges checkpoints beyond `keep_last`.
SAVE_POINTS = ("after_shard", "before_meta", "before_latest", "after_latest", "during_purge")
#: Where a fault can fire: any of the loop's hook points.
FaultPoint = HookPoint


class FaultPlan(BaseModel):
    """Kill `rank` with SIGKILL when it reaches `point` at `step`, once."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    point: FaultPoint
    step: int
    rank: int = 0
    marker: Path  # created just before the kill; its presence disarms the plan
    then: FaultPlan | None = None  # a further fault of the same run

    @model_validator(mode="after")
    def _markers_differ(self) -> FaultPlan:
        markers = [p.marker for p in chain(self)]
        if len(set(markers)) != len(markers):
            raise ValueError("each fault of a chain needs its own marker file")
        return self


def chain(plan: FaultPlan | None) -> list[FaultPlan]:
    """`plan` and the plans it names (`then`), in order."""
    plans: list[FaultPlan] = []
    while plan is not None:
        plans.append(plan)
        plan = plan.then
    return plans


def fault_hooks(plan: FaultPlan | None, rank: int, hooks: Hooks | None = None) -> Hooks:
    """`hooks` (or new ones) with a callback at each point of `plan`'s chain that fires on `rank`.

    Each callback kills this process when the loop reaches its point at its step, once: the
    marker file it creates first disarms the plan for a restarted attempt.
    """
    hooks = hooks if hooks is not None else Hooks()
    for each in chain(plan):
        if each.rank == rank:
            hooks.add(each.point, functools.partial(_fire_at, each, rank))
    return hooks


def _fire_at(plan: FaultPlan, rank: int, step: int) -> None:
    if step == plan.step:
        _fire(plan, plan.point, step, rank)


def _fire(plan: FaultPlan, point: FaultPoint, step: int, rank: int) -> None:
    try:
        fd = os.open(plan.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return  # fired in an earlier attempt
    os.write(fd, f"{point} step={step} rank={rank} pid={os.getpid()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
