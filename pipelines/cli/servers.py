"""`lmpipe up` / `lmpipe down`: start and stop the local Prefect and MLflow servers.

The servers' settings are the recipe's `servers:` section
(`pipelines.config.servers.ServersConfig`) and its `workspace`; `servers_from_recipe` reads
them until `servers` joins `RunConfig`.
The servers themselves are managed in `pipelines.ops.servers`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr, ValidationError
from rich.console import Console
from rich.markup import escape

from pipelines.config import ConfigError, _apply_override, read_recipe
from pipelines.config.servers import ServersConfig
from pipelines.ops.server_processes import ServersError
from pipelines.ops.servers import ServerStatus, resolve_state_dir, start_servers, stop_servers

console = Console(highlight=False, soft_wrap=True)  # long paths stay on one line

_SECRET_KEYS = frozenset(
    name
    for name, field in ServersConfig.model_fields.items()
    if SecretStr in getattr(field.annotation, "__args__", (field.annotation,))
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `up` and `down` subcommands."""
    up = sub.add_parser(
        "up",
        help="start the local Prefect and MLflow servers (127.0.0.1 by default)",
        description="Start a Prefect server (SQLite, or Postgres with "
        "servers.prefect_database_url) and an MLflow tracking server (SQLite and local "
        "artifacts, or servers.mlflow_backend_store_uri / servers.mlflow_artifacts_destination), "
        "each as its own process group with its log and state under <workspace>/.servers; wait "
        "until both answer their health checks, and print their URLs. Servers already running "
        "are left alone. A bind address other than loopback needs servers.prefect_auth_string "
        "and servers.mlflow_admin_password.",
    )
    down = sub.add_parser(
        "down",
        help="stop the servers `lmpipe up` started",
        description="SIGTERM each server's process group, SIGKILL what is left after "
        "servers.stop_timeout_s, check that none of its processes runs, and remove its state.",
    )
    for parser, func in ((up, _up), (down, _down)):
        parser.add_argument(
            "config", nargs="?", default=None, help="YAML recipe (its workspace and servers:)"
        )
        parser.add_argument(
            "overrides", nargs="*", metavar="KEY=VALUE", help="e.g. servers.prefect_port=4300"
        )
        parser.set_defaults(func=func)


def servers_from_recipe(
    path: Path | None, overrides: Sequence[str] = ()
) -> tuple[ServersConfig, Path]:
    """Read the `servers:` section and `workspace` of a recipe, apply overrides, validate.

    Without a recipe: the defaults, with workspace `workspace`. Only `servers.*` and
    `workspace` overrides are accepted.

    Returns:
        The servers config and the workspace directory (relative to the current directory).

    Raises:
        ConfigError: unreadable YAML, another override, or an invalid key or value.
    """
    data: dict[str, Any] = read_recipe(path) if path is not None else {}
    data = {"workspace": data.get("workspace", "workspace"), "servers": data.get("servers") or {}}
    for override in overrides:
        if not override.startswith(("servers.", "workspace=")):
            raise ConfigError(f"override {override!r}: up/down take servers.* and workspace only")
        _apply_override(data, override)
    if not isinstance(data["workspace"], str):
        raise ConfigError(f"{path}: workspace = {data['workspace']!r}: must be a path")
    try:
        cfg = ServersConfig.model_validate(data["servers"])
    except ValidationError as exc:
        raise ConfigError(_describe(exc, str(path or "servers"))) from None
    return cfg, Path(data["workspace"])


def _describe(exc: ValidationError, origin: str) -> str:
    lines = [f"{origin}: invalid servers configuration ({exc.error_count()} error(s))"]
    for error in exc.errors():
        key = ".".join(["servers", *(str(p) for p in error["loc"])])
        # The whole section (an error without a field) may hold secrets too.
        secret = key.removeprefix("servers.") in _SECRET_KEYS or not error["loc"]
        shown = "<hidden>" if secret else repr(error.get("input"))[:120]
        if error["type"] == "extra_forbidden":
            valid = ", ".join(ServersConfig.model_fields)
            lines.append(f"  {key}: unknown key (misspelled?); valid keys: {valid}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"  {key} = {shown}: {message}")
    return "\n".join(lines)


def _load(args: argparse.Namespace) -> tuple[ServersConfig, Path] | None:
    # `lmpipe up servers.x=y` (no recipe): argparse puts the first override in `config`.
    if args.config is not None and "=" in args.config and not Path(args.config).exists():
        args.config, args.overrides = None, [args.config, *args.overrides]
    try:
        return servers_from_recipe(Path(args.config) if args.config else None, args.overrides)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return None


def _up(args: argparse.Namespace) -> int:
    loaded = _load(args)
    if loaded is None:
        return 2
    cfg, workspace = loaded
    try:
        status = start_servers(cfg, workspace)
    except ServersError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 1
    for name, entry in status.items():
        state = entry.state
        console.print(
            f"{name:8} {state.url}  ({entry.action}, pid {state.pid}, log {state.log})",
            markup=False,
        )
    # `down` needs only where the state is; other overrides could hold secrets.
    where = [o for o in args.overrides if o.startswith(("workspace=", "servers.state_dir="))]
    again = " ".join([args.config or "", *where]).strip()
    console.print(_client_help(cfg, status, again), markup=False)
    return 0


def _client_help(cfg: ServersConfig, status: dict[str, ServerStatus], args: str) -> str:
    prefect, mlflow = status["prefect"].state, status["mlflow"].state
    lines = [
        "",
        "They serve this workspace's own stores: its commands use them with nothing set.",
        "Point other clients at them (environment, or the config keys on the right):",
        f"  export PREFECT_API_URL={prefect.api_url}        # prefect.api_url",
        f"  export MLFLOW_TRACKING_URI={mlflow.api_url}     # tracking.tracking_uri",
    ]
    if cfg.prefect_auth_string is not None:
        lines.append(
            "  export PREFECT_API_AUTH_STRING='USER:PASSWORD'  # = servers.prefect_auth_string"
        )
    if cfg.mlflow_admin_password is not None:
        lines.append(
            f"  export MLFLOW_TRACKING_USERNAME={cfg.mlflow_admin_username} "
            "MLFLOW_TRACKING_PASSWORD=...  # tracking.username / tracking.password"
        )
    lines.append(f"Stop them with: lmpipe down {args}".rstrip())
    return "\n".join(lines)


def _down(args: argparse.Namespace) -> int:
    loaded = _load(args)
    if loaded is None:
        return 2
    cfg, workspace = loaded
    try:
        stopped = stop_servers(cfg, workspace)
    except ServersError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}")
        return 1
    if not stopped:
        console.print(f"no servers recorded in {resolve_state_dir(cfg, workspace)}", markup=False)
    for entry in stopped:
        if entry.processes:
            what = f"stopped {entry.name} (pid {entry.pid}: {entry.processes} process(es), "
            console.print(f"{what}{entry.signal})", markup=False)
        else:
            console.print(f"{entry.name} was not running; removed its stale state", markup=False)
    return 0
