"""Exit codes that say what failed, and the one-line cause `lmpipe` prints instead of a traceback.

| code | meaning                                                                          |
|------|----------------------------------------------------------------------------------|
| 0    | success                                                                          |
| 1    | any other failure (a bug, a service down, an export that does not reload, ...)   |
| 2    | the command line or the config is invalid (also: a config the stages refuse)     |
| 3    | input data error: a missing, unreadable or corrupt input or upstream output      |
| 4    | training diverged: the loss guard stopped the run (`train.guard`)               |
| 130  | interrupted by Ctrl-C (SIGINT)                                                   |
| 143  | interrupted by SIGTERM (e.g. a scheduler stopping the job)                       |

The exception is classified by the names of the classes in its MRO (`module.QualName`), so
nothing heavy (torch, Ray) is imported to recognise an error raised where they run. The cause
chain is walked too: Prefect re-raises a task's own exception from the flow, and Ray wraps a
remote one (`RayTaskError(InputError)` subclasses it; a Ray Train worker's error sits in the
`WorkerGroupError` behind the launcher's `RuntimeError`). The exception classes named here are
checked to exist by tests/pipelines/test_cli_answers.py.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import traceback
from collections.abc import Iterator
from enum import IntEnum
from types import FrameType
from typing import TextIO


class ExitCode(IntEnum):
    """The process exit codes of `lmpipe` (docs/cli.md, "Exit codes")."""

    OK = 0
    FAILURE = 1
    CONFIG = 2
    INPUT_DATA = 3
    DIVERGED = 4
    INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
    TERMINATED = 143  # 128 + SIGTERM


#: What each code means, for the one-line cause.
MEANING = {
    ExitCode.FAILURE: "failed",
    ExitCode.CONFIG: "config error",
    ExitCode.INPUT_DATA: "input data error",
    ExitCode.DIVERGED: "training diverged",
    ExitCode.INTERRUPTED: "interrupted",
    ExitCode.TERMINATED: "terminated",
}

#: Exception classes (`module.QualName`) by exit code; a subclass matches too.
CLASSES: dict[ExitCode, tuple[str, ...]] = {
    ExitCode.TERMINATED: (
        "pipelines.cli.failures.Terminated",
        "prefect.exceptions.TerminationSignal",
    ),
    ExitCode.INTERRUPTED: ("builtins.KeyboardInterrupt",),
    ExitCode.DIVERGED: ("training.runtime.guard.TrainingDivergedError",),
    ExitCode.INPUT_DATA: (
        "tasks.ingest.sources.InputError",
        "tasks.downstream.readers.DownstreamDataError",
        "tasks.common.stage.StageInputError",
        "tasks.common.schema.SchemaError",
        "tasks.common.io.UnsafePathError",
        "tasks.encode.encode.SentenceMismatchError",
        "training.pretrain.data.DataError",
        "training.finetune.features.base.FeatureError",
        "training.models.tokens.VocabularyError",
        "training.runtime.checkpoint.CheckpointError",
        "training.models.export.UnsafeWeightsError",
        "training.models.task_models.TaskModelError",
    ),
    ExitCode.CONFIG: (
        "pipelines.config.ConfigError",
        "pipelines.ops.submit.SubmitError",
        "pydantic_core._pydantic_core.ValidationError",
        "tasks.common.schema.ObjectiveMismatchError",
        "tasks.downstream.config.DatasetConfigError",
        "tasks.common.ray_runtime.StorageError",
        "tasks.common.ray_runtime.RayAuthError",
        "training.models.models.ModelConfigError",
        "training.pretrain.pretraining_model.PretrainingModelError",
        "training.models.distill.DistillationError",
        "training.pretrain.length_schedule.LengthScheduleError",
        "training.runtime.launcher.RunStateError",
    ),
}


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: raised in the main thread so that `finally` blocks and Prefect run."""


def classify(exc: BaseException) -> tuple[ExitCode, BaseException]:
    """The exit code for `exc` and the exception it was decided by (in its cause chain).

    The first exception of the chain (outermost first) whose class or a base class is listed
    in `CLASSES` decides; the order of `CLASSES` breaks ties within one exception.
    """
    for link in _chain(exc):
        names = {f"{c.__module__}.{c.__qualname__}" for c in type(link).__mro__}
        for code, classes in CLASSES.items():
            if names.intersection(classes):
                return code, link
    return ExitCode.FAILURE, exc


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what it wraps: causes, contexts and Ray's carriers of a remote error."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        link = todo.pop(0)
        if id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        inner: list[object] = [link.__cause__, link.__context__]
        inner += [
            getattr(link, name, None) for name in ("cause", "_base_exc", "controller_failure")
        ]
        inner += list((getattr(link, "worker_failures", None) or {}).values())
        todo += [e for e in inner if isinstance(e, BaseException)]


def cause_line(exc: BaseException) -> str:
    """`InputError: <the first line of its message>`: the cause in one line."""
    message = str(exc).strip().splitlines()
    name = type(exc).__name__
    return f"{name}: {message[0]}" if message else name


def report_failure(
    exc: BaseException,
    debug: bool,
    out: TextIO | None = None,
    signal_code: ExitCode | None = None,
) -> ExitCode:
    """Print what failed and return the exit code; the last line is the cause, in one line.

    With `debug` the traceback comes first. A message of several lines (a config error lists
    every bad key) has its other lines printed before the last line, which carries its first
    line, so no line is printed twice (the traceback holds them all already). `signal_code`
    (`signalled`): the command was interrupted by a signal, whatever `exc` became.
    """
    out = out or sys.stderr
    code, decided_by = classify(exc)
    code = signal_code or code
    if debug:
        traceback.print_exception(exc, file=out)
    if code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED):
        print(f"lmpipe: {MEANING[code]} (exit {int(code)})", file=out)
        return code
    if not debug:
        for line in str(decided_by).strip().splitlines()[1:]:
            print(line, file=out)
    hint = "" if debug or code == ExitCode.CONFIG else " [--debug shows the traceback]"
    print(f"lmpipe: {MEANING[code]} (exit {int(code)}): {cause_line(decided_by)}{hint}", file=out)
    return code


#: The signals `signals_raise` turned into exceptions in this process, oldest first.
RECEIVED: list[int] = []


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """For the block, in the main thread: SIGTERM raises `Terminated`, SIGINT `KeyboardInterrupt`.

    Each signal is also noted (`RECEIVED`), so that the exit code says the command was
    interrupted even when what it interrupted turned the exception into another failure (a
    library that catches `BaseException` and raises its own). A SIGINT that this process
    ignores (started with it ignored, as `nohup` and background jobs are) stays ignored. The
    handlers are restored after the block.
    """

    def _raise(signum: int, frame: FrameType | None) -> None:
        RECEIVED.append(signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(f"signal {signum}")

    handled = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        handled.append(signal.SIGINT)
    try:
        previous = {signum: signal.signal(signum, _raise) for signum in handled}
    except ValueError:  # not the main thread (a test runner's worker): leave them alone
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def signalled(since: int) -> ExitCode | None:
    """The exit code of the first signal noted after the first `since` (`RECEIVED`), if any."""
    if len(RECEIVED) <= since:
        return None
    return ExitCode.INTERRUPTED if RECEIVED[since] == signal.SIGINT else ExitCode.TERMINATED
