"""The next step's batches, built on the host while the device runs this one.

A step's host work (its global indices, its share split into micro-batches, each micro-batch
gathered from the shards, masked and, for a GPU, copied into pinned memory) depends only on
the step number and the data cursor, so it can be done one step ahead in a background thread
and the step never waits on NumPy. The plan for a step is built by one function whether it
comes from the thread or not, so prefetching changes when the work is done, never its result.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from training.pretrain.data import Cursor


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step reads: its epoch, this rank's micro-batches and the cursor after."""

    step: int  # the step this plan is for (1-based: the step it completes)
    cursor: Cursor  # the cursor it starts from
    epoch: int
    after: Cursor
    length: int  # the sequence length of the step
    micro: list[np.ndarray]  # this rank's micro-batches of global indices
    batches: list[dict[str, torch.Tensor]]  # on the host (pinned for a GPU)


class Prefetcher:
    """Builds `plan(step, cursor)` for the next step in a thread while this one runs.

    `take(step, cursor)` returns the plan for that step: the one built ahead if it was built
    for the same step and cursor, else one built now. With `ahead` False nothing runs in a
    thread (a CPU worker: its cores are busy with the step itself).
    """

    def __init__(self, plan: Callable[[int, Cursor], StepPlan], ahead: bool) -> None:
        """Build plans with `plan`; one step ahead in a thread when `ahead`."""
        self.plan, self.ahead = plan, ahead
        self.pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lmpipe-batches")
            if ahead
            else None
        )
        self.pending: tuple[int, Cursor, concurrent.futures.Future[StepPlan]] | None = None

    def take(self, step: int, cursor: Cursor) -> StepPlan:
        """The plan for `step` from `cursor`, then start building the step after it."""
        plan = None
        if self.pending is not None:
            pending_step, pending_cursor, future = self.pending
            self.pending = None
            if (pending_step, pending_cursor) == (step, cursor):
                plan = future.result()  # re-raises what the thread raised
            else:
                future.cancel()
        if plan is None:
            plan = self.plan(step, cursor)
        if self.pool is not None:
            self.pending = (step + 1, plan.after, self.pool.submit(self.plan, step + 1, plan.after))
        return plan

    def close(self) -> None:
        """Stop the thread (a plan being built is finished and dropped)."""
        self.pending = None
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
