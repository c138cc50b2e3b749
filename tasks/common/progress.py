"""Progress you can see: a rich bar or line on a terminal, plain log lines otherwise.

Data stages report `(phase, done, total)` through `make_reporter`. Training and evaluation
report `ProgressRecord`s (step of total, cumulative samples and tokens, the worker's clock, and
the metrics of a log interval); a `ProgressView` turns them into a live line with throughput
and time left, or one log line per log interval. How the records travel from Ray Train's rank 0
to the driver is `training/runtime/progress.py`. Everything goes to stderr, where the logs go.
rich is imported where it draws: the training workers import this module without drawing.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress as RichProgress
    from rich.progress import TaskID

Logger = logging.Logger | logging.LoggerAdapter[logging.Logger]
Reporter = Callable[[str, int, int], None]


def stderr_is_terminal() -> bool:
    """Whether progress is drawn live: stderr is a terminal (not a pipe, a file or `TERM=dumb`).

    Bars and lines go to stderr, where the logs go, so stdout stays the command's output.
    """
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def make_reporter(logger: Logger) -> Reporter:
    """Return a `(phase, done, total)` callback: a rich bar on a TTY, else a log line per 10%."""
    if stderr_is_terminal():
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )

        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
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


@dataclass(frozen=True)
class ProgressRecord:
    """One point of a run's progress, as rank 0 saw it on the host."""

    step: int
    total: int
    wall_s: float  # time.time() on the worker when the record was made
    samples: int = 0  # all ranks' samples since this worker started
    tokens: int = 0  # all ranks' token positions since this worker started
    phase: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)  # only values read anyway


class ProgressState:
    """What the driver knows of a run: the latest record and metrics, the rates, the time left.

    Rates are over the records of the last `window_s` seconds, timed by the worker's clock: on
    a GPU the host runs ahead of the device between log intervals, not over a window.
    """

    def __init__(self, title: str, window_s: float = 60.0) -> None:
        """Start with nothing received."""
        self.title, self.window_s = title, window_s
        self.points: deque[ProgressRecord] = deque()
        self.first_wall_s: float | None = None
        self.metrics: dict[str, float] = {}

    @property
    def last(self) -> ProgressRecord | None:
        """The newest record."""
        return self.points[-1] if self.points else None

    def add(self, record: ProgressRecord) -> None:
        """Take one record; a restart (fewer steps or samples than before) resets the rates."""
        last = self.last
        if last is not None and (record.step < last.step or record.samples < last.samples):
            self.points.clear()
        self.points.append(record)
        while len(self.points) > 2 and record.wall_s - self.points[1].wall_s >= self.window_s:
            self.points.popleft()
        self.first_wall_s = record.wall_s if self.first_wall_s is None else self.first_wall_s
        self.metrics.update(record.metrics)

    def rates(self) -> tuple[float, float, float] | None:
        """(steps/s, samples/s, tokens/s), or None until two records a step apart are in."""
        first, last = self.points[0] if self.points else None, self.last
        if first is None or last is None or last.step == first.step:
            return None
        elapsed = last.wall_s - first.wall_s
        if elapsed <= 0:
            return None
        done = (last.step - first.step, last.samples - first.samples, last.tokens - first.tokens)
        steps, samples, tokens = (count / elapsed for count in done)
        return steps, samples, tokens

    def seconds_left(self) -> float | None:
        """Time to the last step at the current rate; None before there is a rate."""
        rates, last = self.rates(), self.last
        if rates is None or last is None:
            return None
        return max(0, last.total - last.step) / rates[0]

    def percent(self) -> float:
        """Steps done, in percent of the total."""
        last = self.last
        return 0.0 if last is None or last.total <= 0 else min(100.0, 100 * last.step / last.total)

    def _rates(self, compact: bool = False) -> list[str]:
        rates = self.rates()
        if rates is None:
            return []
        steps, samples, tokens = rates
        parts = [f"{format_count(steps)} it/s"]
        if samples > 0 and not (compact and tokens > 0):
            parts.append(f"{format_count(samples)} samples/s")
        return parts + ([f"{format_count(tokens)} tok/s"] if tokens > 0 else [])

    def _elapsed(self) -> str:
        last, first = self.last, self.first_wall_s
        return format_duration(0 if last is None or first is None else last.wall_s - first)

    def _left(self) -> str:
        left = self.seconds_left()
        return "?" if left is None else format_duration(left)

    def status(self) -> str:
        """The live line after the bar: steps, rates, elapsed<left, phase, the latest losses.

        Short enough for a 100-column terminal; the log lines printed above it carry the rest.
        """
        last = self.last
        if last is None:
            return "starting"
        losses = {k: v for k, v in self.metrics.items() if k.endswith("loss")}
        parts = [f"{last.step}/{last.total}", *self._rates(compact=True)]
        parts += [f"{self._elapsed()}<{self._left()}", last.phase, format_metrics(losses)]
        return " · ".join(p for p in parts if p)

    def log_line(self, record: ProgressRecord) -> str:
        """One log interval's line: where the run is, how fast, and that interval's metrics."""
        parts = [f"step {record.step}/{record.total} ({self.percent():.0f}%)", *self._rates()]
        parts += [f"{self._left()} left", record.phase, format_metrics(record.metrics)]
        return f"{self.title}: " + " · ".join(p for p in parts if p)

    def final_line(self) -> str:
        """The closing line: where the run ended, after how long, how fast, the last metrics."""
        last = self.last
        if last is None:
            return f"{self.title}: no progress reported"
        ended = "done" if last.step >= last.total else "ended"
        parts = [f"{ended} at step {last.step}/{last.total}", *self._rates()]
        parts += [f"in {self._elapsed()}", format_metrics(self.metrics)]
        return f"{self.title}: " + " · ".join(p for p in parts if p)


def format_count(value: float) -> str:
    """About three significant digits and a k/M/G suffix: 1234 -> 1.23k, 0.5 -> 0.50."""
    suffix, scale = next(
        ((s, x) for s, x in (("G", 1e9), ("M", 1e6), ("k", 1e3)) if value >= x), ("", 1.0)
    )
    scaled = value / scale
    return f"{scaled:.{0 if scaled >= 100 else 1 if scaled >= 10 else 2}f}{suffix}"


def format_duration(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour (rounded to the second)."""
    hours, rest = divmod(round(max(seconds, 0.0)), 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_metrics(metrics: Mapping[str, float]) -> str:
    """`loss 5.213 · lr 0.001`: four significant digits each."""
    return " · ".join(f"{key} {value:.4g}" for key, value in metrics.items())


class ProgressView:
    """Shows a run's progress: a live rich line on `console`, else log lines."""

    def __init__(
        self,
        title: str,
        logger: Logger,
        console: Console | None = None,
        on_percent: Callable[[float, bool], None] | None = None,
    ) -> None:
        """Draw on `console` (a terminal) or, without one, log to `logger`.

        `on_percent(percent, final)` hears the steps done in percent (e.g. a Prefect artifact).
        """
        self.state, self.logger = ProgressState(title), logger
        self.console, self.on_percent = console, on_percent
        self.bar: RichProgress | None = None
        self.task: TaskID | None = None
        self.lock = threading.Lock()
        self._restore_logs: Callable[[], None] = lambda: None

    def update(self, records: Sequence[ProgressRecord]) -> None:
        """Take records in order; log each log interval's line; redraw (if any came)."""
        if not records:
            return  # nothing moved: the line shows the worker's clock, not this one's
        with self.lock:
            for record in records:
                self.state.add(record)
                if record.metrics:
                    self._draw()  # the line reprinted below the log line is the current one
                    self._emit(self.state.log_line(record))
            self._draw()
        if self.on_percent is not None:
            self.on_percent(self.state.percent(), False)

    def close(self) -> None:
        """Draw the last state, stop the live line, write the closing line."""
        with self.lock:
            self._draw()
            if self.bar is not None:
                self.bar.stop()
                self._restore_logs()
            self.bar = None
            if self.state.last is not None:
                self._emit(self.state.final_line())
        if self.on_percent is not None:
            self.on_percent(self.state.percent(), True)

    def _emit(self, line: str) -> None:
        if self.console is not None:  # above the live line
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            self.logger.info("%s", line)

    def _draw(self) -> None:
        last = self.state.last
        if self.console is None or last is None:
            return
        if self.bar is None:
            from rich.progress import BarColumn, Progress, TextColumn

            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(bar_width=30),
                TextColumn("{task.fields[status]}"),
                console=self.console,
                auto_refresh=False,
            )
            self.task = self.bar.add_task(self.state.title, total=last.total, status="")
            self.bar.start()
            self._restore_logs = route_logs_through(self.console)
        assert self.task is not None
        status = self.state.status()
        self.bar.update(self.task, completed=last.step, total=last.total, status=status)
        self.bar.refresh()


def route_logs_through(console: Console) -> Callable[[], None]:
    """Print what log handlers write to this terminal above `console`'s live line; return undo.

    A handler keeps the stream it was made with, so a live display's redirect of `sys.stderr`
    misses it and its lines would land inside the live line (tqdm's `logging_redirect_tqdm`
    for the same problem). Prefect's console handler prints with a rich console of its own.
    """
    from rich.console import Console as RichConsole
    from rich.file_proxy import FileProxy

    undo: list[Callable[[], object]] = []
    for handler in _terminal_handlers():
        stream = handler.stream
        proxy = cast(IO[str], FileProxy(console, stream))
        handler.setStream(proxy)
        undo.append(functools.partial(handler.setStream, stream))
        own = getattr(handler, "console", None)
        if isinstance(own, RichConsole) and own.file is stream:
            own.file = proxy
            undo.append(functools.partial(setattr, own, "file", stream))

    def restore() -> None:
        for step in reversed(undo):
            step()

    return restore


def _terminal_handlers() -> list[logging.StreamHandler[IO[str]]]:
    """The stream handlers of every logger that write to a terminal."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    found = []
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            stream_handler = isinstance(handler, logging.StreamHandler)
            if stream_handler and _is_tty(handler.stream) and handler not in found:
                found.append(handler)
    return found


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (ValueError, AttributeError):  # closed, or not a file
        return False
