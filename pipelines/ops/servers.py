"""Local Prefect and MLflow servers for a one-machine deployment (`lmpipe up` / `lmpipe down`).

Each server runs as its own process group with its log, its SQLite databases and a JSON state
file (pid, pgid, port, URL, command) under the state directory, `<workspace>/.servers` by
default. Secrets (database URLs, passwords) reach the servers through their environment, never
their command line, so neither `ps` nor the state file shows them.

Not here: the `servers:` section (`pipelines.config.servers`), the state record and process
groups (`pipelines.ops.server_processes`), the command line (`pipelines.cli.servers`) and the
docker-compose stack (`infra/docker-compose.yml`).
"""

from __future__ import annotations

import configparser
import contextlib
import importlib.util
import logging
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil

from pipelines.config.servers import ServersConfig, exposure_problem
from pipelines.ops.prefect_api import prefect_home, seed_prefect_home
from pipelines.ops.runtime import cache_dir
from pipelines.ops.server_processes import (
    ServersError,
    ServerState,
    StoppedServer,
    answers,
    live_leader,
    read_state,
    stop_group,
)
from pipelines.ops.server_processes import resolve_state_dir as state_dir_of
from training.tracking.local_store import ARTIFACTS_DIR, open_local_store

log = logging.getLogger(__name__)

SERVER_NAMES = ("prefect", "mlflow")
_LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class ServerStatus:
    """What `start_servers` did with one server."""

    state: ServerState
    action: Literal["started", "already running"]


@dataclass(frozen=True)
class _Launch:
    name: str
    command: list[str]
    env: dict[str, str]
    port_key: str
    state: dict[str, Any]  # the ServerState fields known before the process exists


def resolve_state_dir(cfg: ServersConfig, workspace: Path) -> Path:
    """The absolute state directory: `cfg.state_dir`, or `<workspace>/.servers`."""
    return state_dir_of(cfg.state_dir, workspace)


def read_states(cfg: ServersConfig, workspace: Path) -> dict[str, ServerState]:
    """The state files present under the state directory, by server name."""
    state_dir = resolve_state_dir(cfg, workspace)
    found = {name: read_state(state_dir / f"{name}.json") for name in SERVER_NAMES}
    return {name: state for name, state in found.items() if state is not None}


def start_servers(cfg: ServersConfig, workspace: Path) -> dict[str, ServerStatus]:
    """Start the Prefect and MLflow servers not already running and wait until both are healthy.

    A server whose state file names a live process is left alone; a stale state file (its
    process is gone) is removed first, with any leftover of its process group. Every check
    (ports free, drivers installed) runs before anything starts, and a failed start stops
    what this call started.

    Raises:
        ServersError: a non-loopback host without both auth settings, a port is taken, a
            driver is missing, or a server did not get healthy within `cfg.startup_timeout_s`
            (the message shows the tail of its log).
    """
    # Validation refuses this already; a config built with `model_construct` skips validation.
    problem = exposure_problem(cfg.host, dict(cfg))
    if problem is not None:
        raise ServersError(f"servers.host={cfg.host!r} is {problem}")
    state_dir = resolve_state_dir(cfg, workspace)
    state_dir.mkdir(parents=True, exist_ok=True)
    state_dir.chmod(0o700)  # holds the databases and logs
    done: dict[str, ServerStatus] = {}
    todo: list[_Launch] = []
    for launch in _plan(cfg, state_dir, Path(os.path.abspath(workspace))):
        path = state_dir / f"{launch.name}.json"
        state = read_state(path)
        if state is not None and live_leader(state) is not None:
            done[launch.name] = ServerStatus(state, "already running")
            continue
        if state is not None:
            log.info("removing the stale state file %s (pid %d is gone)", path, state.pid)
            stop_group(state, cfg.stop_timeout_s)
            path.unlink()
        _require_free_port(cfg.host, launch.state["port"], launch.port_key)
        _require_drivers(cfg, launch.name)
        todo.append(launch)
    started: list[ServerState] = []
    try:
        for launch in todo:
            started.append(_launch(launch, state_dir))
        _wait_healthy(started, cfg.startup_timeout_s)
    except BaseException:
        for state in started:
            stop_group(state, cfg.stop_timeout_s)
            (state_dir / f"{state.name}.json").unlink(missing_ok=True)
        raise
    for state in started:
        log.info("%s server: %s (pid %d, log %s)", state.name, state.url, state.pid, state.log)
        done[state.name] = ServerStatus(state, "started")
    return {name: done[name] for name in SERVER_NAMES if name in done}


def stop_servers(cfg: ServersConfig, workspace: Path) -> list[StoppedServer]:
    """Stop every server with a state file: SIGTERM its process group, then SIGKILL if needed.

    The state file is removed once no process of the group (or a descendant that left it) is
    alive.

    Raises:
        ServersError: a process survived SIGKILL (the state file is kept).
    """
    state_dir = resolve_state_dir(cfg, workspace)
    stopped = []
    for name, state in read_states(cfg, workspace).items():
        stopped.append(stop_group(state, cfg.stop_timeout_s))
        (state_dir / f"{name}.json").unlink()
        log.info("stopped %s server (pid %d)", name, state.pid)
    return stopped


def client_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to `host`."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _plan(cfg: ServersConfig, state_dir: Path, workspace: Path) -> list[_Launch]:
    base = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # 10 -> 2 processes (docs/stack.md, "The MLflow server")
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    return [
        _plan_prefect(cfg, state_dir, base, workspace),
        _plan_mlflow(cfg, state_dir, base, workspace),
    ]


def _plan_prefect(
    cfg: ServersConfig, state_dir: Path, base: dict[str, str], workspace: Path
) -> _Launch:
    # The home and database the workspace's commands record their flow runs in.
    home = prefect_home(workspace)
    home.mkdir(parents=True, exist_ok=True)
    # A client's PREFECT_API_URL would become the UI's API address (Prefect's default), and
    # a profile could point the server at another database: the server gets neither.
    env = {k: v for k, v in base.items() if k not in _PREFECT_CLIENT_VARS}
    env["PREFECT_HOME"] = str(home)
    if cfg.prefect_database_url:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = cfg.prefect_database_url.get_secret_value()
    elif not any(env.get(key) for key in _PREFECT_DATABASE_VARS):  # else as the commands'
        seed_prefect_home(home, cache_dir())
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{home / 'prefect.db'}"
    if cfg.prefect_auth_string is not None:
        env["PREFECT_SERVER_API_AUTH_STRING"] = cfg.prefect_auth_string.get_secret_value()
    # The UI's API address comes from these settings, not from `--port`: without them the UI
    # of a server on another port calls the default 127.0.0.1:4200 (see test_browser.py).
    env["PREFECT_SERVER_API_HOST"] = cfg.host
    env["PREFECT_SERVER_API_PORT"] = str(cfg.prefect_port)
    if cfg.prefect_ui_api_url:
        env["PREFECT_UI_API_URL"] = cfg.prefect_ui_api_url
    url = f"http://{client_host(cfg.host)}:{cfg.prefect_port}"
    command = [_script("prefect"), "server", "start", "--host", cfg.host]
    state = {"host": cfg.host, "port": cfg.prefect_port, "url": url, "api_url": f"{url}/api"}
    return _Launch(
        "prefect",
        [*command, "--port", str(cfg.prefect_port)],
        env,
        "servers.prefect_port",
        {**state, "health_url": f"{url}/api/health"},
    )


_PREFECT_CLIENT_VARS = frozenset(
    {"PREFECT_API_URL", "PREFECT_API_KEY", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"}
)
_PREFECT_DATABASE_VARS = (
    "PREFECT_SERVER_DATABASE_CONNECTION_URL",
    "PREFECT_API_DATABASE_CONNECTION_URL",
)


def _plan_mlflow(
    cfg: ServersConfig, state_dir: Path, base: dict[str, str], workspace: Path
) -> _Launch:
    home = state_dir / "mlflow"  # the auth config, when basic auth is on
    home.mkdir(exist_ok=True)
    env = dict(base)
    if cfg.mlflow_backend_store_uri:
        env["MLFLOW_BACKEND_STORE_URI"] = cfg.mlflow_backend_store_uri.get_secret_value()
    else:  # the workspace's own store, as local runs write it (re-rooted if it moved)
        env["MLFLOW_BACKEND_STORE_URI"] = open_local_store(workspace)
    if cfg.mlflow_s3_endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = cfg.mlflow_s3_endpoint_url
    command = [_script("mlflow"), "server", "--host", cfg.host, "--port", str(cfg.mlflow_port)]
    command += ["--workers", str(cfg.mlflow_workers), "--artifacts-destination"]
    destination = cfg.mlflow_artifacts_destination or str(workspace / ARTIFACTS_DIR)
    # The server runs in the state dir: a relative path is meant from where `up` ran.
    command.append(destination if "://" in destination else os.path.abspath(destination))
    if cfg.mlflow_allowed_hosts:
        command += ["--allowed-hosts", cfg.mlflow_allowed_hosts]
    if cfg.mlflow_admin_password is not None:
        command += ["--app-name", "basic-auth"]
        env["MLFLOW_AUTH_CONFIG_PATH"] = str(_write_auth_ini(cfg, home))
        env["MLFLOW_AUTH_ADMIN_PASSWORD"] = cfg.mlflow_admin_password.get_secret_value()
        # Signs the UI's session cookies; a new one per start only logs browsers out.
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(32)
    url = f"http://{client_host(cfg.host)}:{cfg.mlflow_port}"
    state = {"host": cfg.host, "port": cfg.mlflow_port, "url": url, "api_url": url}
    return _Launch(
        "mlflow", command, env, "servers.mlflow_port", {**state, "health_url": f"{url}/health"}
    )


def _write_auth_ini(cfg: ServersConfig, home: Path) -> Path:
    """MLflow's auth config: its user store under the state dir; no secret in the file."""
    ini = configparser.ConfigParser()
    ini["mlflow"] = {
        "default_permission": "READ",
        "database_uri": f"sqlite:///{home / 'basic_auth.db'}",
        "admin_username": cfg.mlflow_admin_username,
        "authorization_function": "mlflow.server.auth:authenticate_request_basic_auth",
    }
    path = home / "basic_auth.ini"
    with _atomic(path) as tmp, tmp.open("w") as fh:
        ini.write(fh)
    return path


def _script(name: str) -> str:
    """The console script installed next to this interpreter (the project's environment)."""
    path = Path(sys.executable).with_name(name)
    if not path.exists():
        raise ServersError(f"{path} not found: install the project (`pip install -e .`)")
    return str(path)


def _require_free_port(host: str, port: int, key: str) -> None:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as sock:
        # As the servers' own bind does; a socket in TIME_WAIT does not count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise ServersError(
                f"port {port} on {host} is in use ({key}={port}): stop what listens there "
                f"or choose another port ({exc.strerror})"
            ) from None


def _require_drivers(cfg: ServersConfig, name: str) -> None:
    needs: dict[str, tuple[str, str]] = {}  # module -> (config key, what to install)
    if name == "mlflow":
        uri = cfg.mlflow_backend_store_uri
        if uri is not None and uri.get_secret_value().startswith("postgresql"):
            needs["psycopg2"] = ("servers.mlflow_backend_store_uri", "psycopg2-binary")
        if (cfg.mlflow_artifacts_destination or "").startswith("s3://"):
            needs["boto3"] = ("servers.mlflow_artifacts_destination", "boto3")
        if cfg.mlflow_admin_password is not None:
            needs["flask_wtf"] = ("servers.mlflow_admin_password", "'mlflow[auth]'")
    for module, (key, package) in needs.items():
        if importlib.util.find_spec(module) is None:
            raise ServersError(f"{key} needs the Python package {package}: pip install {package}")


def _launch(launch: _Launch, state_dir: Path) -> ServerState:
    log_path = state_dir / f"{launch.name}.log"
    with log_path.open("ab") as log_file:
        log_file.write(f"\n=== lmpipe up {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(
            launch.command,
            env=launch.env,
            cwd=state_dir,  # relative defaults of either server land in the state dir
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, so `down` can signal all of it
        )
    state = ServerState(
        name=launch.name,
        pid=proc.pid,
        pgid=proc.pid,  # a new session's leader leads its process group
        create_time=psutil.Process(proc.pid).create_time(),
        command=launch.command,
        log=log_path,
        **launch.state,
    )
    with _atomic(state_dir / f"{launch.name}.json") as tmp:
        tmp.write_text(state.model_dump_json(indent=2) + "\n")
    return state


def _wait_healthy(states: list[ServerState], timeout_s: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    deadline = time.monotonic() + timeout_s
    pending = list(states)
    while pending:
        for state in list(pending):
            if answers(opener, state.health_url):
                pending.remove(state)
            elif live_leader(state) is None:
                raise ServersError(
                    f"the {state.name} server exited during start-up; "
                    f"the end of {state.log}:\n{_tail(state.log)}"
                )
        if pending and time.monotonic() > deadline:
            state = pending[0]
            raise ServersError(
                f"the {state.name} server did not answer {state.health_url} within "
                f"{timeout_s:g} s (servers.startup_timeout_s); the end of {state.log}:\n"
                f"{_tail(state.log)}"
            )
        time.sleep(0.25 if pending else 0)


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-_LOG_TAIL_LINES:])


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write, then rename it over `path`.

    Readers see the old file or the whole new one, never half of it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
