"""Progress reporting for long stage work: a rich bar on a terminal, log lines otherwise."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

Reporter = Callable[[str, int, int], None]


def make_reporter(logger: logging.Logger | logging.LoggerAdapter[logging.Logger]) -> Reporter:
    """Return a `(phase, done, total)` callback: a rich bar on a TTY, else a log line per 10%."""
    if sys.stderr.isatty():
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            transient=False,
        )
        tasks: dict[str, TaskID] = {}

        def show(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                bar.start()
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)
            if all(t.finished for t in bar.tasks):
                bar.stop()

        return show

    def log(phase: str, done: int, total: int) -> None:
        step = max(total // 10, 1)
        if done == total or done % step == 0:
            logger.info("%s: %d/%d", phase, done, total)

    return log


def ticker(progress: Reporter | None, phase: str, total: int) -> Callable[[int, Any], None]:
    """An `on_done` callback for `map_bounded` that reports `phase` progress out of `total`."""
    done = [0]

    def tick(_index: int, _result: Any) -> None:
        done[0] += 1
        if progress is not None:
            progress(phase, done[0], total)

    return tick
