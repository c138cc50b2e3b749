"""Entry-point plumbing: environment variables in, resolved settings out.

This is the only place (with `infra/`) that reads environment variables: the usual ones
(`RAY_ADDRESS`, `MLFLOW_TRACKING_URI`, `PREFECT_API_URL`, ...) fill config keys left unset.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pipelines.config import RunConfig
from tasks.common.ray_runtime import check_storage
from tasks.common.workspace import open_workspace
from training.tracking.local_store import local_store_uri, open_local_store, seed_local_store

log = logging.getLogger(__name__)


# Seconds a command waits for the temporary Prefect API to answer (no `prefect.api_url`).
TEMPORARY_API_STARTUP_S = 120


def patient_temporary_api() -> None:
    """Give the temporary Prefect API `TEMPORARY_API_STARTUP_S` to start, unless set already.

    It starts in about 14 s on a quiet 2-core machine and took over 20 s, Prefect's default
    wait, while other jobs kept the cores busy: the command then failed before any stage ran.
    Must run before Prefect is imported (its settings are read once, at import).
    """
    os.environ.setdefault(
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(TEMPORARY_API_STARTUP_S)
    )


def no_prefect_telemetry() -> None:
    """Default Prefect's usage telemetry to off (`PREFECT_SERVER_ANALYTICS_ENABLED`, if unset).

    The temporary Prefect API a command starts posts a heartbeat to prefect.io; offline, each
    run printed `ERROR | prefect.server.services.telemetry - Failed to send telemetry`. The
    servers `lmpipe up` starts have it off already (docs/operations.md). The client's own
    analytics are off too (`DO_NOT_TRACK=1`, if unset). Must run before Prefect is imported
    (its settings are read once, at import) and before the temporary API starts (it inherits
    the environment).
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The client's own analytics heed only DO_NOT_TRACK: on a terminal, each new Prefect home
    # (every new workspace) printed a notice and tried to post a first-import event.
    os.environ.setdefault("DO_NOT_TRACK", "1")


def cache_dir() -> Path:
    """The per-user cache of lmpipe: `LMPIPE_CACHE_DIR`, else `$XDG_CACHE_HOME/lmpipe`.

    It holds the Prefect and MLflow database templates a new workspace's stores are copied from.
    """
    explicit = os.environ.get("LMPIPE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lmpipe"


def resolve_environment(cfg: RunConfig) -> RunConfig:
    """Fill unset service addresses from the environment and export what clients read.

    Ray 2.60 clients that name an address need `RAY_AUTH_MODE=token` (docs/stack.md, "Ray token
    authentication"); a Prefect API URL and MLflow credentials from the config are exported for
    their clients. The workspace is opened where it is now (`open_workspace`: a copied or moved
    workspace records its new root), and so is its own MLflow store when it is the one in use
    (`open_local_store`: artifact locations re-rooted to the new place).

    Raises:
        StorageError: the workspace is a local path, the cluster has several nodes and
            `ray.shared_storage` is false (`tasks.common.ray_runtime.check_storage`).
    """
    env = os.environ
    ray = (
        cfg.ray
        if cfg.ray.address or not env.get("RAY_ADDRESS")
        else cfg.ray.model_copy(update={"address": env["RAY_ADDRESS"]})
    )
    tracking = cfg.tracking
    if tracking.tracking_uri is None:
        uri = env.get("MLFLOW_TRACKING_URI") or local_store_uri(cfg.workspace)
        tracking = tracking.model_copy(update={"tracking_uri": uri})
    env.setdefault("HF_HUB_OFFLINE", "1")
    if cfg.prefect.api_url:
        env["PREFECT_API_URL"] = cfg.prefect.api_url
    if cfg.prefect.api_key is not None:
        env["PREFECT_API_KEY"] = cfg.prefect.api_key.get_secret_value()
    if tracking.username:
        env["MLFLOW_TRACKING_USERNAME"] = tracking.username
    if tracking.password is not None:
        env["MLFLOW_TRACKING_PASSWORD"] = tracking.password.get_secret_value()
    workspace = Path(os.path.abspath(cfg.workspace))
    # A local workspace on a multi-node cluster is refused unless the config says it is shared.
    check_storage(ray, str(workspace))
    workspace.mkdir(parents=True, exist_ok=True)
    open_workspace(workspace)
    if tracking.tracking_uri == local_store_uri(workspace):
        if tracking.enabled:  # a copy of MLflow's new store, not its migrations per workspace
            seed_local_store(workspace, cache_dir())
        open_local_store(workspace)
    return cfg.model_copy(update={"ray": ray, "tracking": tracking, "workspace": workspace})
