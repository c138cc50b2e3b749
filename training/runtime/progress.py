"""Live progress of training and evaluation: rank 0's step records, drawn or logged by the driver.

Worker side: `connect_progress` gives a loop its `Progress`. On rank 0 of a Ray Train run it is
a `ProgressSender`: each step becomes a small `ProgressRecord` made of what the host already
knows (the step counter, sample and token counts from batch shapes, the wall clock), handed to
the driver's `ProgressSink` actor by a fire-and-forget call. It never reads a device tensor and
never waits: step records closer than `min_interval_s` are coalesced (the newest wins), and
while `max_in_flight` sends are unanswered records are held. Records with metrics (the losses
the loop reads at `train.log_every_steps`, an evaluation) are never coalesced away. Other ranks,
and a loop without a driver (the GPU benchmark's plain process), get a `NullProgress`.

Driver side: `driver_progress` creates the sink, drains it from a thread while `fit()` runs and
feeds a `ProgressView` (tasks/common/progress.py): a rich progress line when stderr is a
terminal (each log interval's metrics printed above it), else one log line per log interval;
inside a Prefect flow or task run it also keeps a Prefect progress artifact up to date.
`local_progress` feeds a view from work that runs in the driver itself (evaluation), and
`in_process_progress` gives a training loop that the driver runs itself (`train.scale.launcher`
in_process) an address that `connect_progress` resolves to the view, with no actor or thread.

Ray, rich and Prefect are imported where they are used: the worker side runs without them.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast
from uuid import UUID

from tasks.common.progress import Logger, ProgressRecord, ProgressView, stderr_is_terminal

log = logging.getLogger(__name__)

#: The Ray namespace of the sinks: workers find theirs by name, whatever their job's namespace.
NAMESPACE = "lmpipe-progress"
#: The prefix of an address that names a view in this process (`in_process_progress`).
IN_PROCESS = "in-process"
_IN_PROCESS_VIEWS: dict[str, ProgressView] = {}


class Progress(Protocol):
    """What a loop tells about its progress; every call returns at once."""

    def step(self, step: int, samples: int = 0, tokens: int = 0, phase: str = "") -> None: ...  # noqa: D102
    def log(self, step: int, metrics: Mapping[str, float], phase: str = "") -> None: ...  # noqa: D102
    def close(self) -> None: ...  # noqa: D102


class NullProgress:
    """No display: other ranks, and loops that run without a driver."""

    def step(self, step: int, samples: int = 0, tokens: int = 0, phase: str = "") -> None:
        """Do nothing."""

    def log(self, step: int, metrics: Mapping[str, float], phase: str = "") -> None:
        """Do nothing."""

    def close(self) -> None:
        """Do nothing."""


Send = Callable[[list[ProgressRecord]], Any]
Unanswered = Callable[[list[Any], float], list[Any]]


class ProgressSender:
    """Rank 0's `Progress`: coalesces records and hands them to `send` without waiting.

    `send(records)` starts one delivery and returns its handle; `unanswered(handles,
    timeout_s)` returns the handles not yet delivered (at once when `timeout_s` is 0). At most
    `max_held` records with metrics are kept while the driver is behind (the oldest go first).
    """

    def __init__(
        self,
        send: Send,
        unanswered: Unanswered,
        total: int,
        *,
        min_interval_s: float = 0.2,
        max_in_flight: int = 4,
        max_held: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Report steps out of `total`, at most one step record per `min_interval_s`."""
        self.send, self.unanswered, self.total = send, unanswered, total
        self.min_interval_s, self.clock = min_interval_s, clock
        self.max_in_flight, self.max_held = max_in_flight, max_held
        self.samples = self.tokens = 0
        self.held: list[ProgressRecord] = []
        self.in_flight: list[Any] = []
        self.sent_at = -math.inf

    def step(self, step: int, samples: int = 0, tokens: int = 0, phase: str = "") -> None:
        """Count one finished step (`samples` and `tokens` are all ranks' for it)."""
        self.samples += samples
        self.tokens += tokens
        record = self._record(step, phase, {})
        if self.held and not self.held[-1].metrics:
            self.held[-1] = record  # coalesce: only the newest plain step is worth sending
        else:
            self.held.append(record)
        self._send(urgent=step >= self.total)

    def log(self, step: int, metrics: Mapping[str, float], phase: str = "") -> None:
        """Report values the loop has read anyway (a log interval's loss, an evaluation)."""
        self.held.append(self._record(step, phase, dict(metrics)))
        if len(self.held) > self.max_held:
            del self.held[: len(self.held) - self.max_held]
        self._send(urgent=True)

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is held and wait (at most `timeout_s`) until the driver has it."""
        deadline = self.clock() + timeout_s
        while self.held and self.clock() < deadline:
            self._send(urgent=True)
            if self.held:
                self.in_flight = self.unanswered(self.in_flight, 0.1)
        if self.in_flight:
            self.in_flight = self.unanswered(self.in_flight, max(0.0, deadline - self.clock()))

    def _record(self, step: int, phase: str, metrics: dict[str, float]) -> ProgressRecord:
        return ProgressRecord(
            step, self.total, time.time(), self.samples, self.tokens, phase, metrics
        )

    def _send(self, urgent: bool) -> None:
        if not self.held or (not urgent and self.clock() - self.sent_at < self.min_interval_s):
            return
        if self.in_flight:
            self.in_flight = self.unanswered(self.in_flight, 0.0)
        if len(self.in_flight) >= self.max_in_flight:
            return  # the driver is behind: hold (and coalesce) until it catches up
        self.in_flight.append(self.send(self.held))
        self.held, self.sent_at = [], self.clock()


def connect_progress(address: str | None, rank: int, total: int) -> Progress:
    """A loop's `Progress`: a sender to the driver's sink on rank 0, else a `NullProgress`.

    `address` is what `driver_progress` yielded; None (no driver display, a plain process)
    gives `NullProgress` without importing Ray, and a process without Ray never starts one.
    """
    if address is not None and address.startswith(f"{IN_PROCESS}/"):
        view = _IN_PROCESS_VIEWS.get(address)
        if view is None or rank != 0:
            return NullProgress()
        return ProgressSender(view.update, _delivered, total)
    ray = sys.modules.get("ray")  # not imported: certainly not connected
    if address is None or rank != 0 or ray is None or not ray.is_initialized():
        return NullProgress()
    namespace, _, name = address.partition("/")
    try:
        sink = ray.get_actor(name, namespace=namespace)
    except ValueError:
        log.warning("progress sink %s not found: no live progress for this run", address)
        return NullProgress()

    def unanswered(handles: list[Any], timeout_s: float) -> list[Any]:
        # Our own calls' results are local: with timeout 0 this asks no other process.
        _, waiting = ray.wait(
            handles, num_returns=len(handles), timeout=timeout_s, fetch_local=False
        )
        return list(waiting)

    return ProgressSender(lambda records: sink.push.remote(records), unanswered, total)


class ProgressSink:
    """The actor between rank 0 and the driver: keeps records until the driver drains them."""

    def __init__(self, capacity: int = 4096) -> None:
        """Keep at most `capacity` records (the oldest go first)."""
        self.records: deque[ProgressRecord] = deque(maxlen=capacity)

    def push(self, records: list[ProgressRecord]) -> None:
        """Take a worker's records."""
        self.records.extend(records)

    def drain(self) -> list[ProgressRecord]:
        """Hand over everything received since the last drain."""
        out = list(self.records)
        self.records.clear()
        return out


class ProgressArtifact:
    """A Prefect progress artifact of the current run, updated at most every `every_s`."""

    def __init__(self, artifact_id: UUID, every_s: float = 5.0) -> None:
        """Update the artifact `artifact_id`."""
        self.artifact_id, self.every_s = artifact_id, every_s
        self.updated_at, self.percent = time.monotonic(), 0.0

    @classmethod
    def for_current_run(cls, key: str | None, description: str) -> ProgressArtifact | None:
        """Create one at 0% inside a Prefect flow or task run; None outside one or on error."""
        if "prefect" not in sys.modules:  # not imported: certainly not in a run
            return None
        from prefect.context import get_run_context
        from prefect.exceptions import MissingContextError

        try:
            get_run_context()
        except MissingContextError:
            return None
        from prefect.artifacts import create_progress_artifact

        try:
            # `_sync`: Prefect's dispatcher runs the blocking form even inside an event loop.
            made = create_progress_artifact(0.0, key=key, description=description, _sync=True)  # type: ignore[call-arg]
            return cls(cast(UUID, made))
        except Exception as exc:  # progress must never fail the run
            log.warning("no Prefect progress artifact: %s", exc)
            return None

    def update(self, percent: float, final: bool = False) -> None:
        """Set the artifact to `percent` (throttled unless `final`)."""
        now = time.monotonic()
        if percent == self.percent or (not final and now - self.updated_at < self.every_s):
            return
        from prefect.artifacts import update_progress_artifact

        self.updated_at, self.percent = now, percent
        try:
            update_progress_artifact(self.artifact_id, percent, _sync=True)  # type: ignore[call-arg]
        except Exception as exc:  # progress must never fail the run
            log.warning("Prefect progress artifact not updated: %s", exc)


@dataclass(frozen=True)
class ProgressSpec:
    """How the driver shows a run's progress."""

    title: str
    logger: Logger | None = None  # for the lines without a terminal; default this module's
    artifact_key: str | None = None  # the Prefect artifact's key (inside a Prefect run)
    terminal: bool | None = None  # draw a live line; None: whether stderr is a terminal
    poll_s: float = 0.25  # how often the driver drains the sink


def open_view(spec: ProgressSpec) -> ProgressView:
    """The view `spec` asks for: live on a terminal, else logged; in Prefect, with an artifact."""
    console = None
    if spec.terminal if spec.terminal is not None else stderr_is_terminal():
        from rich.console import Console

        console = Console(stderr=True)
    artifact = ProgressArtifact.for_current_run(spec.artifact_key, f"{spec.title} progress")
    on_percent = artifact.update if artifact is not None else None
    return ProgressView(spec.title, spec.logger or log, console, on_percent)


def artifact_key(name: str) -> str:
    """A Prefect artifact key from `name`: lowercase letters, digits and dashes."""
    key = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return key[:60] or "progress"


class _Poller:
    """The driver's thread that drains the sink into the view every `poll_s` seconds."""

    def __init__(self, sink: Any, view: ProgressView, poll_s: float) -> None:
        self.sink, self.view, self.poll_s = sink, view, poll_s
        self.stopped = threading.Event()
        # The caller's context (Prefect's settings and run) goes with the thread.
        context = contextvars.copy_context()
        self.thread = threading.Thread(
            target=context.run, args=(self._run,), name="lmpipe-progress", daemon=True
        )

    def drain(self, timeout_s: float) -> None:
        import ray

        try:
            self.view.update(ray.get(self.sink.drain.remote(), timeout=timeout_s))
        except Exception as exc:  # a slow or lost sink costs the display only
            log.debug("progress not drained: %s", exc)

    def _run(self) -> None:
        while not self.stopped.wait(self.poll_s):
            self.drain(timeout_s=30.0)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.drain(timeout_s=5.0)  # what the workers sent last


@contextlib.contextmanager
def driver_progress(spec: ProgressSpec | None) -> Iterator[str | None]:
    """Show the progress rank 0 sends while the block runs; yield the address for the workers.

    Creates the run's `ProgressSink` actor (no CPU), drains it from a thread and kills it at
    the end. Needs a connected Ray; with `spec` None nothing is created and None is yielded.
    """
    if spec is None:
        yield None
        return
    import ray

    name = f"run-{uuid.uuid4().hex}"
    try:
        view = open_view(spec)
        sink = ray.remote(num_cpus=0)(ProgressSink).options(name=name, namespace=NAMESPACE)
        sink = sink.remote()
    except Exception as exc:  # progress must never stop a run
        log.warning("no live progress for %s: %s", spec.title, exc)
        yield None
        return
    poller = _Poller(sink, view, spec.poll_s)
    poller.thread.start()
    try:
        yield f"{NAMESPACE}/{name}"
    finally:
        poller.stop()
        view.close()
        with contextlib.suppress(Exception):  # already gone with its job: nothing to stop
            ray.kill(sink)


def _delivered(_handles: list[Any], _timeout_s: float) -> list[Any]:
    return []  # a view in this process has taken its records when `update` returns


@contextlib.contextmanager
def in_process_progress(spec: ProgressSpec | None) -> Iterator[str | None]:
    """`driver_progress` for a loop this process runs itself: yield the loop's address.

    `connect_progress` resolves the address to this process's view, so rank 0's records reach
    it by a plain call (still coalesced, never a device read). With `spec` None: None.
    """
    if spec is None:
        yield None
        return
    address = f"{IN_PROCESS}/{uuid.uuid4().hex}"
    _IN_PROCESS_VIEWS[address] = view = open_view(spec)
    try:
        yield address
    finally:
        del _IN_PROCESS_VIEWS[address]
        view.close()


@contextlib.contextmanager
def local_progress(spec: ProgressSpec | None, total: int) -> Iterator[Progress]:
    """A `Progress` shown by this process, for work that runs in the driver (evaluation)."""
    if spec is None:
        yield NullProgress()
        return
    view = open_view(spec)
    sender = ProgressSender(view.update, _delivered, total, min_interval_s=0)
    try:
        yield sender
    finally:
        sender.close()
        view.close()
