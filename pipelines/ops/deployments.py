"""Prefect deployments of lmpipe: one per flow, built from a recipe, with example schedules.

Here: the recipe as a deployment parameter (`recipe_parameters`), `build_deployments` (what
`lmpipe serve` serves) and the failure-notification automation (`failure_automation`,
`ensure_failure_automation`). The recipe's `deployments` section (`DeploymentsConfig`: which
flows, their schedules, serve's concurrency) is in `pipelines/config/deployments.py`.
Not here: the work-pool route, which is `prefect.yaml` at the repository root plus
`infra/prefect/`, and the command line (`pipelines/cli/serve.py`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pydantic import BaseModel, SecretBytes, SecretStr
from pydantic_core import to_jsonable_python

from pipelines.config import ConfigError, RunConfig, load_config
from pipelines.config.deployments import (
    AUTOMATION_NAME,
    FAILED_EVENTS,
    FLOWS,
    LMPIPE_TAG,
    DeploymentsConfig,
    ScheduleConfig,
)

if TYPE_CHECKING:
    from prefect.automations import Automation
    from prefect.blocks.core import Block
    from prefect.deployments.runner import RunnerDeployment


def recipe_parameters(cfg: RunConfig) -> dict[str, Any]:
    """The recipe as a deployment's `cfg` parameter: the keys the recipe set, never a secret.

    Only fields set in the recipe (or by overrides) are kept, so the parameter is the recipe
    as written and Prefect's form shows every default as a default. Secrets (`SecretStr`) are
    left out: a flow run takes them from its environment.
    """
    data = _set_fields(cfg)
    assert isinstance(data, dict)
    return data


def _set_fields(value: Any) -> Any:
    secret = (SecretStr, SecretBytes)
    if isinstance(value, BaseModel):
        fields = [name for name in type(value).model_fields if name in value.model_fields_set]
        return {
            name: _set_fields(getattr(value, name))
            for name in fields
            if not isinstance(getattr(value, name), secret)
        }
    if isinstance(value, dict):
        return {str(k): _set_fields(v) for k, v in value.items() if not isinstance(v, secret)}
    if isinstance(value, list | tuple):
        return [_set_fields(v) for v in value if not isinstance(v, secret)]
    if isinstance(value, Path):
        return str(value)
    return to_jsonable_python(value)


def _load_flow(name: str) -> Any:
    module, attr = FLOWS[name]
    return getattr(importlib.import_module(module), attr)


def _schedule_recipe(path: Path, overrides: list[str], spec: ScheduleConfig) -> dict[str, Any]:
    """The recipe with the schedule's overrides applied, as a `cfg` parameter."""
    # JSON is YAML, so each value reads back exactly as load_config parses an override.
    extra = [f"{key}={json.dumps(value)}" for key, value in spec.overrides.items()]
    try:
        return recipe_parameters(load_config(path, [*overrides, *extra]))
    except ConfigError as exc:
        raise ConfigError(f"schedule {spec.name!r} of flow {spec.flow!r}: {exc}") from None


def build_deployments(
    path: Path, overrides: list[str], section: DeploymentsConfig
) -> list[RunnerDeployment]:
    """Build one deployment per `section.flows` entry from the recipe at `path` plus overrides.

    Each deployment is named after the recipe (`<flow>/<recipe name>`), takes the recipe as its
    `cfg` parameter, carries the tags `lmpipe`, `stage:<flow>` and `section.tags`, and gets
    the schedules of its flow; a schedule with overrides carries its own `cfg`. Flow runs load
    the flow by module path, so they run wherever lmpipe is installed.

    Raises:
        ConfigError: the recipe, or a schedule's overrides, do not validate.
    """
    from prefect.types.entrypoint import EntrypointType

    cfg = load_config(path, overrides)
    params = recipe_parameters(cfg)
    deployments = []
    for name in section.flows:
        flow = _load_flow(name)
        specs = [s for s in section.schedules if s.flow == name]
        schedules = [
            s.schedule({"cfg": _schedule_recipe(path, overrides, s)} if s.overrides else {})
            for s in specs
        ]
        summary = (inspect.getdoc(flow.fn) or name).splitlines()[0]
        when = ", ".join(s.name for s in specs) or "on demand"
        deployments.append(
            flow.to_deployment(
                name=cfg.name,
                parameters={"cfg": params},
                schedules=schedules,
                description=f"{summary}\n\nRecipe `{path}` ({cfg.name}); schedules: {when}.",
                tags=[LMPIPE_TAG, f"stage:{name}", *section.tags],
                entrypoint_type=EntrypointType.MODULE_PATH,
            )
        )
    return deployments


def failure_automation(block_document_id: str, tag: str = LMPIPE_TAG) -> Automation:
    """The automation that sends a notification when a flow run tagged `tag` fails or crashes.

    The trigger is Prefect's own flow-run-notification shape: any `prefect.flow-run.Failed` or
    `.Crashed` event whose related resources include the tag, once per flow run.
    """
    from uuid import UUID

    from prefect.automations import Automation, EventTrigger, SendNotification

    if not re.fullmatch(r"[\w.:-]+", tag):
        raise ValueError(f"tag {tag!r}: use letters, digits, '_', '.', ':' or '-'")
    trigger = EventTrigger(
        expect=set(FAILED_EVENTS),
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.id": f"prefect.tag.{tag}", "prefect.resource.role": "tag"},
        for_each={"prefect.resource.id"},
        posture="Reactive",
        threshold=1,
        within=timedelta(seconds=0),
    )
    body = (
        "Flow run {{ flow.name }}/{{ flow_run.name }} entered {{ flow_run.state.name }} at "
        "{{ flow_run.state.timestamp }}.\nMessage: {{ flow_run.state.message }}\n"
        "Parameters: {{ flow_run.parameters }}\nOpen: {{ flow_run|ui_url }}"
    )
    return Automation(
        name=AUTOMATION_NAME if tag == LMPIPE_TAG else f"{AUTOMATION_NAME}-{tag}",
        description=f"Notify when a flow run tagged {tag!r} fails or crashes.",
        trigger=trigger,
        actions=[
            SendNotification(
                block_document_id=UUID(block_document_id),
                subject="lmpipe: flow run {{ flow_run.name }} {{ flow_run.state.name }}",
                body=body,
            )
        ],
    )


def ensure_failure_automation(block: str, tag: str = LMPIPE_TAG) -> Automation:
    """Create, or update in place, the failure automation that notifies through `block`.

    Args:
        block: A saved notification block, `<block-type-slug>/<name>` (e.g. `slack-webhook/ops`).
        tag: The flow-run tag to watch.

    Raises:
        ValueError: no such block on the current Prefect API.
    """
    from prefect.automations import Automation
    from prefect.blocks.core import Block

    # Both are sync here: `async_dispatch` runs the blocking variant outside an event loop.
    try:
        loaded = cast("Block", Block.load(block))
    except ValueError as exc:
        raise ValueError(f"notification block {block!r}: {exc}") from None
    automation = failure_automation(str(loaded._block_document_id), tag)
    try:
        existing = cast("Automation", Automation.read(name=automation.name))
    except ValueError:  # not found: create it
        return cast("Automation", automation.create())
    automation.id = existing.id
    automation.update()
    return automation
