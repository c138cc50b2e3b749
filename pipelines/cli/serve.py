"""`lmpipe serve` (every deployment of a recipe, served from one process) and `lmpipe notify`.

`serve` builds the deployments (`pipelines/ops/deployments.py`), optionally sets up the failure
notification, and runs `prefect.serve` until it is stopped; flow runs execute as
subprocesses in the current directory, so start it where the recipe's relative paths hold
(the repository root). `notify` only sets up the failure notification, for the work-pool route.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console

from pipelines.config import ConfigError, RunConfig, load_config
from pipelines.config.deployments import LMPIPE_TAG, DeploymentsConfig

console = Console(stderr=False)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `serve` and `notify` subcommands."""
    serve = sub.add_parser(
        "serve",
        help="serve every flow of a recipe as Prefect deployments, with their schedules",
        description="Build one deployment per flow (pipeline and each stage) from the recipe, "
        "named after it, with the example schedules (nightly incremental ingest and encode, "
        "weekly pretraining), and serve them all from this process until Ctrl-C. Flow runs "
        "started from the UI, the API or a schedule run here, in the current directory. "
        "Stopping does not pause the schedules (deployments.pause_on_shutdown).",
    )
    serve.add_argument("config", type=Path, help="YAML recipe (see configs/)")
    serve.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    serve.add_argument(
        "--notify",
        metavar="BLOCK",
        default=None,
        help="notification block ('slack-webhook/ops') to alert on failed or crashed runs",
    )
    serve.set_defaults(func=run_serve)
    notify = sub.add_parser(
        "notify",
        help="create or update the automation that notifies on failed lmpipe flow runs",
        description="Create (or update in place) the Prefect automation that sends BLOCK's "
        "notification whenever a flow run tagged 'lmpipe' enters Failed or Crashed.",
    )
    notify.add_argument("block", help="a saved notification block, e.g. slack-webhook/ops")
    notify.add_argument("--tag", default=LMPIPE_TAG, help="the flow-run tag to watch")
    notify.set_defaults(func=run_notify)


def deployments_section(cfg: RunConfig) -> DeploymentsConfig:
    """The recipe's `deployments` section (its defaults where the recipe has none)."""
    return cfg.deployments


def run_serve(args: argparse.Namespace) -> int:
    """Serve the recipe's deployments until interrupted; return the exit code.

    As every command, it settles its Prefect home and API before Prefect is imported
    (`open_prefect_api`): `<workspace>/.prefect`, and the Prefect server `lmpipe up` runs for
    the workspace when no API is named.
    """
    from pipelines.ops.prefect_api import await_prefect_api, open_prefect_api

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    open_prefect_api(cfg)
    await_prefect_api()  # a temporary API (nothing named, no `lmpipe up`) must answer first
    from prefect import serve

    from pipelines.ops.deployments import build_deployments, ensure_failure_automation

    try:
        section = deployments_section(cfg)
        deployments = build_deployments(args.config, args.overrides, section)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    block = args.notify or section.notify_block
    with prefect_api(cfg):
        if block:
            try:
                automation = ensure_failure_automation(block)
            except ValueError as exc:
                console.print(f"[red]error:[/red] {exc}", highlight=False)
                return 2
            console.print(f"failure notifications: automation {automation.name!r} via {block}")
        serve(*deployments, limit=section.limit, pause_on_shutdown=section.pause_on_shutdown)
    return 0


@contextmanager
def prefect_api(cfg: RunConfig) -> Iterator[None]:
    """Point this process's Prefect client at `prefect.api_url` (and key) when the recipe sets it.

    Prefect reads its settings when it is imported, before the recipe is: exporting the
    variables (for the flow-run subprocesses) is not enough for this process's own client.
    """
    from prefect.settings import PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

    from pipelines.ops.runtime import resolve_environment

    resolve_environment(cfg)  # exports PREFECT_API_URL / PREFECT_API_KEY for subprocesses
    updates: dict[Any, Any] = {}
    if cfg.prefect.api_url:
        updates[PREFECT_API_URL] = cfg.prefect.api_url
    if cfg.prefect.api_key is not None:
        updates[PREFECT_API_KEY] = cfg.prefect.api_key.get_secret_value()
    with temporary_settings(updates=updates):
        yield


def run_notify(args: argparse.Namespace) -> int:
    """Create or update the failure automation; return the exit code."""
    from pipelines.ops.deployments import ensure_failure_automation

    try:
        automation = ensure_failure_automation(args.block, args.tag)
    except ValueError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    console.print(f"automation {automation.name!r} ({automation.id}) notifies via {args.block}")
    return 0
