"""Prefect's task cache for the data stages, keyed on the stage scaffold's fingerprint.

A data stage task is declared with `stage_task`: its cache policy (`StageCache`) plans the
call's output with the same function the stage's driver uses (`plan_<stage>`, over
`tasks.common.stage.plan_output`), so the Prefect cache key and the workspace check cannot
disagree. The key is `<stage>-<fingerprint>-<8 hex of where the output is>`; where is the
workspace's id and the output's path inside it (`tasks.common.workspace.location_key`), never
an absolute path, so a copied or moved workspace keeps its keys. The workspace stays the guard:
when the planned output is missing or incomplete, the policy expires the task's cache record
before Prefect looks it up, so the task runs, rebuilds the output and writes a fresh record; a
cache hit therefore always names a complete output.

Results are JSON (`result_serializer="json"`), never pickled: the summary dict a stage task
returns (stage, path, fingerprint, `reused`, ...). `in_workspace` stores them under
`<workspace>/prefect-results/`, beside the outputs they describe, so they last across flow runs
and processes and go with the workspace. A record names its output by the absolute path it had
when written; `stage_summary` relocates it into the workspace where it is read (a copy's record
names the copy's output). `refresh_cache=True` on the task, or
`PREFECT_TASKS_REFRESH_CACHE=true`, makes Prefect skip the record; the task then asks the
driver to rebuild (`refresh_requested`), which builds the output aside and swaps it in whole
(`tasks.common.stage.StageOutput.build_aside`).

Not here: the fingerprint and completeness checks (`tasks/common/stage.py`), the stages' own
plans (each `tasks/<stage>/stage.py`), and the steps that call the tasks (`pipelines/flows`).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from prefect import Task, task
from prefect.cache_policies import CachePolicy
from prefect.client.schemas.objects import State
from prefect.context import TaskRunContext
from prefect.settings import PREFECT_TASKS_REFRESH_CACHE
from prefect.types._datetime import DateTime

from tasks.common.stage import StageOutput
from tasks.common.workspace import location_key, open_workspace, relocate_record

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")
#: Where `in_workspace` keeps a workspace's task results (JSON cache records).
RESULTS_DIR = "prefect-results"
#: What Prefect names the state of a task run that a cache record answered.
CACHED = "Cached"


def cache_key(out: StageOutput) -> str:
    """The Prefect cache key of a planned output: stage, fingerprint, where it lives.

    Where: the workspace's id and the output's path inside it (`location_key`), so a copy or a
    move of the workspace keeps the key, while two workspaces that share a result store
    (Prefect's default one) stay apart; an output in no workspace, by its absolute path.
    """
    target = out.target or out.path
    where = location_key(target) or str(target)
    digest = hashlib.sha256(where.encode()).hexdigest()[:8]
    return f"{out.stage}-{out.fingerprint}-{digest}"


def _fingerprint_of(manifest: object) -> object:
    if isinstance(manifest, dict):
        return manifest.get("fingerprint")
    return getattr(manifest, "fingerprint", None)


@dataclass
class StageCache(CachePolicy):
    """Key a stage task on its planned output's fingerprint, while that output is complete.

    Attributes:
        plan: The stage's plan of one call (`plan_<stage>`), called with the task's arguments
            it names; None when the call makes no output of its own (the stage is off).
        complete: The stage's completeness check: a complete output's manifest, else None.
    """

    plan: Callable[..., StageOutput | None] | None = None
    complete: Callable[[Path], object] | None = None

    def compute_key(
        self,
        task_ctx: TaskRunContext,
        inputs: dict[str, Any],
        flow_parameters: dict[str, Any],
        **kwargs: Any,
    ) -> str | None:
        """The call's cache key; a record for an output that is not complete is expired first.

        None (Prefect neither reads nor writes a record) when planning fails: the task runs and
        reports the problem itself.
        """
        if self.plan is None or self.complete is None:
            return None
        named = inspect.signature(self.plan).parameters
        try:
            out = self.plan(**{k: v for k, v in inputs.items() if k in named})
            manifest = None if out is None else out.reuse(self.complete)
        except Exception:  # the task raises it with its own message when it runs
            log.debug("no cache key: planning %s failed", task_ctx.task.name, exc_info=True)
            return None
        if out is None:
            return None
        key = cache_key(out)
        if manifest is None or _fingerprint_of(manifest) != out.fingerprint:
            expire_record(task_ctx, key)
        return key


def expire_record(task_ctx: TaskRunContext, key: str) -> None:
    """Make the task's cache record under `key` (if any) a miss: rewrite it as expired.

    Prefect has no delete for result records; an expired one is not found, on any storage.
    """
    store = task_ctx.result_store
    if store.exists(key):
        # A plain datetime: the record's pydantic metadata converts it to Prefect's own type.
        past = cast(DateTime, datetime.now(UTC) - timedelta(seconds=1))
        store.write(None, key=key, expiration=past)


def stage_task(
    name: str, plan: Callable[..., StageOutput | None], complete: Callable[[Path], object]
) -> Callable[[Callable[P, R]], Task[P, R]]:
    """Declare a data stage's Prefect task: cached on its output (`StageCache`), JSON results.

    Args:
        name: The task's name (the stage's).
        plan: The stage's plan of one call: its output, from the task's arguments it names.
        complete: The stage's completeness check of an output directory.
    """
    return task(
        name=name,
        cache_policy=StageCache(plan=plan, complete=complete),
        result_serializer="json",
        persist_result=True,
    )


def refresh_requested() -> bool:
    """Whether the running task's cache is being refreshed (its output must be rebuilt).

    True under `refresh_cache=True` (`Task.with_options`), or with the task's own setting
    unset and `PREFECT_TASKS_REFRESH_CACHE` true; False outside a task run (`.fn()`).
    """
    ctx = TaskRunContext.get()
    if ctx is None:
        return False
    if ctx.task.refresh_cache is not None:
        return bool(ctx.task.refresh_cache)
    return bool(PREFECT_TASKS_REFRESH_CACHE.value())


def results_dir(workspace: Path | str) -> Path:
    """Where a workspace's stage task results (the cache records) are stored."""
    return Path(workspace) / RESULTS_DIR


def in_workspace(stage: Task[P, R], workspace: Path | str) -> Task[P, R]:
    """The stage task with its results stored under `results_dir(workspace)`.

    Opens the workspace first (`open_workspace`): its id is part of the cache keys.
    """
    open_workspace(workspace)
    return stage.with_options(result_storage=results_dir(workspace))


def stage_summary(
    state: State[dict[str, Any]], workspace: Path | str | None = None
) -> dict[str, Any]:
    """A stage task's summary from its final state; a cache hit says `reused`, as a reuse does.

    With `workspace`, the paths a record wrote where the workspace was before a copy or a move
    name the same files where it is now (`relocate_record`).

    Raises:
        Exception: the task's own, when it failed.
    """
    summary: dict[str, Any] = relocate_record(state.result(), workspace)
    return summary | {"reused": True} if state.name == CACHED else summary
