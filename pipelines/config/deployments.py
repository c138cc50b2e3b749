"""The `deployments` section of a recipe: which flows are deployed, their schedules, serving.

Kept apart from `pipelines/ops/deployments.py` (which builds the Prefect deployments and imports
the root config) so that the root config (`pipelines/config/__init__.py`) can compose it: the
config sub-package imports nothing of `ops/`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from prefect.schedules import Schedule

FlowName = Literal[
    "pipeline",
    "ingest",
    "tokenizer",
    "encode",
    "examples",
    "pretrain",
    "finetune",
    "evaluate",
    "compare",
]
# Flow name -> the module and attribute that define it (imported only when deploying).
FLOW_NAMES: tuple[FlowName, ...] = get_args(FlowName)
FLOWS: dict[str, tuple[str, str]] = {
    name: (f"pipelines.flows.{name}_flow", f"{name}_flow") for name in FLOW_NAMES
}
LMPIPE_TAG = "lmpipe"  # on every deployment, hence every flow run; the failure automation's key
AUTOMATION_NAME = "lmpipe-flow-run-failed"
FAILED_EVENTS = ("prefect.flow-run.Failed", "prefect.flow-run.Crashed")
_SLUG = r"[a-z0-9][a-z0-9-]{0,62}"


class ScheduleConfig(BaseModel):
    """One schedule of one flow's deployment: cron or interval, and its own recipe overrides."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    flow: FlowName = Field(description="The flow whose deployment gets this schedule.")
    name: str = Field(pattern=_SLUG, description="Schedule slug, unique per deployment.")
    cron: str | None = Field(None, description="Cron expression, e.g. '0 2 * * *'.")
    interval_seconds: int | None = Field(None, gt=0, description="Run every N seconds instead.")
    timezone: str = Field("UTC", description="IANA timezone of the cron expression.")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted recipe keys set for this schedule's runs, e.g. "
        "{'ingest.incremental': true}; applied like command-line overrides.",
    )
    active: bool = Field(True, description="False: the schedule exists but makes no runs.")

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleConfig:
        if (self.cron is None) == (self.interval_seconds is None):
            raise ValueError(f"schedule {self.name!r}: set exactly one of cron, interval_seconds")
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(
                f"schedule {self.name!r}: timezone {self.timezone!r} is not an IANA name"
            ) from None
        self.schedule({})  # a malformed cron expression stops here, not at serve time
        return self

    def schedule(self, parameters: dict[str, Any]) -> Schedule:
        """The Prefect schedule, carrying `parameters` for its runs (empty: the deployment's)."""
        from prefect.schedules import Cron, Interval

        if self.cron is not None:
            try:
                return Cron(
                    self.cron,
                    timezone=self.timezone,
                    active=self.active,
                    parameters=parameters,
                    slug=self.name,
                )
            except ValueError as exc:
                raise ValueError(f"schedule {self.name!r}: cron {self.cron!r}: {exc}") from None
        assert self.interval_seconds is not None
        return Interval(
            timedelta(seconds=self.interval_seconds),
            timezone=self.timezone,
            active=self.active,
            parameters=parameters,
            slug=self.name,
        )


def _default_schedules() -> list[ScheduleConfig]:
    # Built unvalidated: checking a cron expression imports Prefect (seconds), which every
    # recipe load would pay for these constants; tests/pipelines/test_cli_answers.py validates
    # them. A schedule a recipe sets is validated as before.
    return [
        # A growing corpus: read only the new files each night, then refresh the token shards.
        ScheduleConfig.model_construct(
            flow="encode",
            name="nightly-ingest-encode",
            cron="0 2 * * *",
            overrides={"ingest.incremental": True},
        ),
        ScheduleConfig.model_construct(flow="pretrain", name="weekly-pretrain", cron="0 3 * * 0"),
    ]


class DeploymentsConfig(BaseModel):
    """The Prefect deployments of a recipe: one per flow, their schedules, how they are served.

    The pipeline and every flow without a schedule run on demand (from the UI, the API or
    `prefect deployment run`).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    flows: list[FlowName] = Field(
        default_factory=lambda: list(FLOW_NAMES),
        description="Flows to deploy; each deployment is named after the recipe.",
    )
    tags: list[str] = Field(
        default_factory=list, description=f"Tags added to every deployment besides {LMPIPE_TAG!r}."
    )
    schedules: list[ScheduleConfig] = Field(
        default_factory=_default_schedules,
        description="Example schedules: nightly incremental ingest and encode at 02:00 UTC, "
        "weekly pretraining on Sundays at 03:00 UTC.",
    )
    limit: int | None = Field(
        1, ge=1, description="Flow runs `lmpipe serve` runs at once; null: no limit."
    )
    pause_on_shutdown: bool = Field(
        False,
        description="Pause the deployments' schedules when `lmpipe serve` stops (Prefect's "
        "default). False: they keep making runs, which wait as Late until serve is back.",
    )
    notify_block: str | None = Field(
        None,
        description="Notification block ('<block-type-slug>/<name>', e.g. 'slack-webhook/ops') "
        "that the failure automation uses; same as `lmpipe serve --notify`.",
    )

    @model_validator(mode="after")
    def _schedules_fit(self) -> DeploymentsConfig:
        seen: set[tuple[str, str]] = set()
        for spec in self.schedules:
            if spec.flow not in self.flows:
                raise ValueError(f"schedule {spec.name!r}: flow {spec.flow!r} is not in `flows`")
            if (spec.flow, spec.name) in seen:
                raise ValueError(f"schedule {spec.name!r} appears twice for flow {spec.flow!r}")
            seen.add((spec.flow, spec.name))
        return self
