"""`Prefetcher`: the plan built ahead is used only for the step and cursor it was built for."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from training.pretrain.data import Cursor
from training.pretrain.prefetch import Prefetcher, StepPlan


class Plans:
    """A plan function that records which thread built what."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.built: list[tuple[int, int, bool]] = []  # (step, offset, in the caller's thread)
        self.fail_at = fail_at
        self.caller = threading.get_ident()

    def __call__(self, step: int, cursor: Cursor) -> StepPlan:
        self.built.append((step, cursor.offset, threading.get_ident() == self.caller))
        if step == self.fail_at:
            raise ValueError(f"step {step} cannot be built")
        after = Cursor(cursor.epoch, cursor.offset + 4, cursor.samples + 4)
        micro = [np.arange(cursor.offset, cursor.offset + 4)]
        return StepPlan(step, cursor, cursor.epoch, after, 8, micro, [])


def test_the_next_step_is_built_in_the_thread_and_used_when_it_matches() -> None:
    plans = Plans()
    ahead = Prefetcher(plans, ahead=True)
    first = ahead.take(1, Cursor())
    second = ahead.take(2, first.after)
    ahead.close()
    assert (first.step, second.step, second.cursor) == (1, 2, first.after)
    assert plans.built[:2] == [(1, 0, True), (2, 4, False)]  # step 2 came from the thread


def test_a_plan_for_another_cursor_is_dropped_and_the_step_built_again() -> None:
    plans = Plans()
    ahead = Prefetcher(plans, ahead=True)
    ahead.take(1, Cursor())
    resumed = ahead.take(2, Cursor(0, 40, 40))  # e.g. the run restored another checkpoint
    ahead.close()
    assert resumed.cursor == Cursor(0, 40, 40)
    assert (2, 40, True) in plans.built


def test_an_error_in_the_thread_surfaces_at_its_step() -> None:
    plans = Plans(fail_at=2)
    ahead = Prefetcher(plans, ahead=True)
    first = ahead.take(1, Cursor())
    with pytest.raises(ValueError, match="step 2 cannot be built"):
        ahead.take(2, first.after)
    ahead.close()


def test_without_ahead_every_plan_is_built_in_the_step() -> None:
    plans = Plans()
    inline = Prefetcher(plans, ahead=False)
    inline.take(2, inline.take(1, Cursor()).after)
    inline.close()
    assert plans.built == [(1, 0, True), (2, 4, True)]
