"""Submit an lmpipe command to a Ray cluster as a Ray job, and follow it to its end.

The job runs `python -m pipelines.cli.main <stage> RECIPE KEY=VALUE...` on the cluster, with this
project directory as its `working_dir`, so the code and the recipes that run are the ones here.
This module holds what a submission needs: the dashboard address, the checks a recipe passes
before it leaves this machine, the entrypoint, the runtime environment, and following the job.
The `lmpipe submit` command line is `pipelines/cli/submit.py`; the cluster side (how stages
connect, the shared-storage rule) is `tasks/common/ray_runtime.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from pipelines.config import ConfigError, RunConfig, load_config
from tasks.common.ray_runtime import scoped_environ, storage_problem

log = logging.getLogger(__name__)

STAGES = ("run", "ingest", "tokenizer", "encode", "examples", "pretrain", "finetune", "evaluate")

# Kept out of the uploaded package: environments, VCS, caches, outputs. Ray's own `.gitignore`
# handling is switched off (see `_gitignore_off`), so this list repeats what .gitignore keeps
# out of git, minus the compiled extension, which the job needs.
WORKING_DIR_EXCLUDES = (
    ".git/",
    ".venv/",
    "venv/",
    "workspace/",
    "__pycache__/",
    "*.pyc",
    "*.egg-info/",
    ".mypy_cache/",
    ".ruff_cache/",
    ".pytest_cache/",
    "bench/results/",
    "build/",
    "mlruns/",
    "mlartifacts/",
    "*.db",
    "tests/",
    "test-artifacts/",
    ".hypothesis/",
    ".gpudata/",
    "infra/.env",  # the servers' secrets (docs/operations.md): never shipped to a cluster
)

# Service endpoints the job inherits when set here. Secrets (PREFECT_API_KEY,
# MLFLOW_TRACKING_PASSWORD) are never forwarded: a job's runtime_env is shown in the dashboard.
_FORWARDED_ENV = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")
# An override key that sets a secret: its last part names one (`tracking.password`,
# `prefect.api_key`, `x.auth_token`; not `tokenizer.vocab_size` or `mask.mask_token_prob`),
# or it lies under fsspec `storage_options` (credentials).
_SECRET_NAME = re.compile(r"(\w*_)?(password|api_key|secret|token)", re.IGNORECASE)


class SubmitError(ValueError):
    """The submission cannot go ahead; the message says what to change."""


def resolve_address(address: str | None, env: Mapping[str, str]) -> str:
    """Pick the dashboard URL: `--address`, else RAY_API_SERVER_ADDRESS, else an http RAY_ADDRESS.

    Raises:
        SubmitError: no address, or one that is not an http(s) URL.
    """
    ray_address = env.get("RAY_ADDRESS", "")
    candidates = (
        ("--address", address),
        ("RAY_API_SERVER_ADDRESS", env.get("RAY_API_SERVER_ADDRESS")),
        ("RAY_ADDRESS", ray_address if re.match(r"https?://", ray_address) else None),
    )
    for origin, value in candidates:
        if value:
            if not re.match(r"https?://[^/\s]+", value):
                raise SubmitError(
                    f"{origin}={value!r} is not the dashboard URL of a Ray head "
                    "(http://HEAD:8265; a GCS address host:6379 is not a job server)"
                )
            return value.rstrip("/")
    raise SubmitError(
        "no Ray cluster to submit to: pass --address http://HEAD:8265 or set "
        "RAY_API_SERVER_ADDRESS (the head's dashboard URL)"
    )


def project_root() -> Path:
    """The lmpipe checkout this module runs from: the directory that becomes the working_dir.

    Raises:
        SubmitError: lmpipe runs from an installed package, not a source checkout.
    """
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").is_file() or not (root / "pipelines").is_dir():
        raise SubmitError(
            f"{root} is not an lmpipe source checkout: `lmpipe submit` ships the project "
            "directory as the job's working_dir, so run it from a checkout (pip install -e .)"
        )
    return root


def recipe_in_project(config: Path, root: Path) -> str:
    """Return the recipe's path relative to `root`, as the job on the cluster will name it.

    Raises:
        SubmitError: the recipe is missing or outside the project directory, so it would not
            travel with the working_dir.
    """
    path = config.resolve()
    if not path.is_file():
        raise SubmitError(f"config file {config} does not exist")
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        raise SubmitError(
            f"config file {config} is outside the project directory {root}: only the project "
            f"travels to the cluster. Copy it under {root / 'configs'} and submit that copy"
        ) from None


def refused_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that set a secret: they would be readable in the job's entrypoint."""
    secret = []
    for override in overrides:
        parts = override.partition("=")[0].split(".")
        if _SECRET_NAME.fullmatch(parts[-1]) or "storage_options" in parts:
            secret.append(override)
    return secret


def cluster_problems(cfg: RunConfig) -> list[str]:
    """Say which settings cannot work from a job's temporary working_dir on a cluster."""
    problems = []
    workspace = str(cfg.workspace)
    if not cfg.workspace.is_absolute():
        problems.append(
            f"workspace={workspace!r} is relative: on the cluster it would resolve inside the "
            "job's temporary copy of the project and vanish with it; set workspace= to an "
            "absolute path that every node mounts (e.g. workspace=/mnt/shared/lmpipe)"
        )
    uri = cfg.tracking.tracking_uri or ""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        problems.append(
            f"tracking.tracking_uri={uri!r} is a relative SQLite path; use sqlite:////ABS/PATH "
            "on shared storage, or an MLflow server's http:// URI"
        )
    return problems


def validate_recipe(root: Path, recipe: str, overrides: Sequence[str]) -> RunConfig:
    """Load and validate the recipe here, as the job will (relative paths from `root`).

    Raises:
        SubmitError: an invalid recipe or override, a secret override, or a setting that
            cannot work on a cluster.
    """
    secrets = refused_overrides(overrides)
    if secrets:
        keys = ", ".join(o.partition("=")[0] for o in secrets)
        raise SubmitError(
            f"override {keys} sets a secret, which the Ray dashboard would show in the job's "
            "entrypoint; set it in the cluster nodes' environment instead "
            "(MLFLOW_TRACKING_PASSWORD, PREFECT_API_KEY, or a Kubernetes Secret)"
        )
    with contextlib.chdir(root):
        try:
            cfg = load_config(recipe, list(overrides), remote=True)
        except ConfigError as exc:
            raise SubmitError(str(exc)) from None
    problems = cluster_problems(cfg)
    if problems:
        raise SubmitError(f"{recipe}: " + "; ".join(problems))
    return cfg


def build_entrypoint(stage: str, recipe: str, overrides: Sequence[str]) -> str:
    """The job's shell command: the lmpipe CLI from the working_dir, with the cluster's Python.

    `python -m` imports `pipelines` from the working_dir (the current directory of the job),
    so the code that runs is the code submitted, whatever version the nodes have installed.
    """
    if stage not in STAGES:
        raise SubmitError(f"stage {stage!r} is not one of {', '.join(STAGES)}")
    return shlex.join(["python", "-m", "pipelines.cli.main", stage, recipe, *overrides])


def build_runtime_env(
    root: Path,
    env: Mapping[str, str],
    extra_env: Mapping[str, str] | None = None,
    excludes: Sequence[str] = (),
) -> dict[str, Any]:
    """The job's runtime_env: the project as working_dir, plus the environment it needs."""
    env_vars = {
        # Driver and cluster must agree on auth (docs/stack.md, "Ray token authentication"); the
        # token stays on the nodes.
        "RAY_AUTH_MODE": env.get("RAY_AUTH_MODE", "token"),
        "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
        "OMP_NUM_THREADS": "1",
        # `ensure_ray` passes env_vars to ray.init too; without this, Ray refuses the same key
        # in the job's and the driver's runtime_env instead of letting the driver's win.
        "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
    }
    env_vars |= {key: env[key] for key in _FORWARDED_ENV if env.get(key)}
    env_vars |= dict(extra_env or {})
    return {
        "working_dir": str(root),
        "excludes": [*WORKING_DIR_EXCLUDES, *excludes],
        "env_vars": env_vars,
    }


def parse_env(pairs: Sequence[str]) -> dict[str, str]:
    """Turn `KEY=VALUE` strings into a dict.

    Raises:
        SubmitError: an item without `=` or with an invalid variable name.
    """
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise SubmitError(f"--env {pair!r} must look like NAME=VALUE")
        out[key] = value
    return out


def connect(address: str) -> Any:
    """Open a `JobSubmissionClient` on the head's dashboard.

    Raises:
        SubmitError: the dashboard does not answer, or refuses the credentials.
    """
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except _server_errors() as exc:
        reason = str(exc).strip().rstrip(".")
        raise SubmitError(
            f"cannot reach the Ray job server at {address}: {reason}. Is the head's dashboard "
            "running there, and do RAY_AUTH_MODE and the token (RAY_AUTH_TOKEN, "
            "RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) match the cluster's?"
        ) from None


def _server_errors() -> tuple[type[Exception], ...]:
    # What the job client raises for an unreachable, failing or unauthorised job server.
    from ray.exceptions import AuthenticationError

    return (ConnectionError, RuntimeError, ValueError, AuthenticationError)


def alive_cluster_nodes(address: str) -> int | None:
    """Count the cluster's alive nodes through the dashboard's state API; None if it cannot.

    Raises nothing: the job checks its storage again when its stages connect to the cluster.
    """
    from ray.util.state import list_nodes
    from ray.util.state.exception import RayStateApiException

    try:
        nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], timeout=30)
    except (*_server_errors(), RayStateApiException) as exc:
        log.warning("cannot count the nodes of %s (%s); the job checks its storage", address, exc)
        return None
    return len({node.node_id for node in nodes})


def refuse_unshared_storage(cfg: RunConfig, address: str) -> None:
    """Refuse, before submission, a local workspace on a multi-node cluster (`storage_problem`).

    Raises:
        SubmitError: the workspace is local, the cluster has several nodes, and
            `ray.shared_storage` is false.
    """
    nodes = alive_cluster_nodes(address)
    problem = (
        None if nodes is None else storage_problem(cfg.workspace, nodes, cfg.ray.shared_storage)
    )
    if problem is not None:
        raise SubmitError(problem)


def _gitignore_off() -> contextlib.AbstractContextManager[None]:
    # Ray leaves .gitignore'd files out of a working_dir by default, and *.so is ignored:
    # the compiled tasks.ingest._textscan must travel with the code (it matches a same-image
    # cluster).
    return scoped_environ({"RAY_RUNTIME_ENV_IGNORE_GITIGNORE": "1"})


def submit(
    client: Any, entrypoint: str, runtime_env: dict[str, Any], metadata: Mapping[str, str]
) -> str:
    """Upload the working_dir (when the cluster lacks it) and submit the job; return its id.

    Raises:
        SubmitError: the job server refused the upload or the job (its message says why).
    """
    try:
        with _gitignore_off():
            job_id = client.submit_job(
                entrypoint=entrypoint, runtime_env=runtime_env, metadata=dict(metadata)
            )
    except _server_errors() as exc:
        raise SubmitError(f"the Ray job server did not accept the job: {exc}") from None
    return str(job_id)


def follow_job(client: Any, job_id: str, out: TextIO, poll_s: float = 1.0) -> str:
    """Copy the job's logs to `out` as they come, then return its final status.

    A log stream that breaks is not an error: the job keeps running on the cluster, so the
    status is then polled until it is final.
    """
    try:
        asyncio.run(_tail(client, job_id, out))
    except Exception as exc:  # any stream failure: fall back to polling the status
        log.warning("log stream of job %s stopped (%s); waiting for its status", job_id, exc)
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return str(status)
        time.sleep(poll_s)


async def _tail(client: Any, job_id: str, out: TextIO) -> None:
    async for chunk in client.tail_job_logs(job_id):
        out.write(chunk)
        out.flush()


def job_message(client: Any, job_id: str) -> str:
    """The job server's one-line reason for a job's status (e.g. why it failed)."""
    return str(client.get_job_info(job_id).message or "")


def job_commands(address: str, job_id: str) -> list[str]:
    """The `ray job` commands that inspect or stop the job."""
    return [
        f"ray job status --address {address} {job_id}",
        f"ray job logs --address {address} --follow {job_id}",
        f"ray job stop --address {address} {job_id}",
    ]
