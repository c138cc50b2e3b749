"""Local Prefect and MLflow servers for a one-machine deployment (`lmpipe up` / `lmpipe down`).

Each server runs as its own process group with its log, its SQLite databases and a JSON state
file (pid, pgid, port, URL, command) under the state directory, `<workspace>/.servers` by
default. Secrets (database URLs, passwords) reach the servers through their environment, never
their command line, so neither `ps` nor the state file shows them.

Not here: the command line (`pipelines.cli.servers`) and the docker-compose stack
(`infra/docker-compose.yml`).
"""

from __future__ import annotations

import configparser
import contextlib
import importlib.util
import logging
import os
import secrets
import signal
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
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

log = logging.getLogger(__name__)

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
SERVER_NAMES = ("prefect", "mlflow")
_LOG_TAIL_LINES = 40


class ServersError(RuntimeError):
    """A server could not be started or stopped; the message says which and why."""


# The admin password of the basic_auth.ini older MLflow versions shipped: no authentication.
MLFLOW_LEGACY_DEFAULT_PASSWORD = "password1234"


def exposure_problem(host: str, auth: dict[str, Any]) -> str | None:
    """Say why binding `host` with these auth settings is refused; None when it is not.

    A loopback host needs no authentication; any other needs both `prefect_auth_string` and
    `mlflow_admin_password` (set, not None) among `auth`, whatever else it holds.
    """
    if host in LOOPBACK_HOSTS:
        return None
    keys = ("prefect_auth_string", "mlflow_admin_password")
    missing = [f"servers.{key}" for key in keys if auth.get(key) is None]
    if not missing:
        return None
    return (
        "not a loopback address (127.0.0.1, ::1, localhost), so both servers need "
        f"authentication: set {' and '.join(missing)}"
    )


# Field -> (accepted URL prefixes, whether a local path is accepted too).
_URL_PREFIXES: dict[str, tuple[tuple[str, ...], bool]] = {
    "prefect_database_url": (("postgresql+asyncpg://", "sqlite+aiosqlite:///"), False),
    "prefect_ui_api_url": (("http://", "https://"), False),
    "mlflow_backend_store_uri": (("postgresql://", "postgresql+", "sqlite:///"), False),
    "mlflow_artifacts_destination": (("s3://", "file://"), True),
    "mlflow_s3_endpoint_url": (("http://", "https://"), False),
}


class ServersConfig(BaseModel):
    """The local Prefect server and MLflow tracking server that `lmpipe up` starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    # The auth fields come before `host`: pydantic validates in field order, so host's
    # validator sees them and the refusal is reported under the key `host`.
    prefect_auth_string: SecretStr | None = Field(
        None, description="Basic auth 'user:password' for the Prefect API and UI."
    )
    mlflow_admin_password: SecretStr | None = Field(
        None, description="Turns on MLflow basic auth (needs mlflow[auth]): the admin password."
    )
    host: str = Field(
        "127.0.0.1",
        description="Bind address of both servers; one other than 127.0.0.1, ::1 or localhost "
        "needs prefect_auth_string and mlflow_admin_password.",
    )
    prefect_port: int = Field(4200, ge=1, le=65535, description="Prefect server port.")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="MLflow server port.")
    state_dir: Path | None = Field(
        None, description="Logs, state files, SQLite databases; None = <workspace>/.servers."
    )
    prefect_database_url: SecretStr | None = Field(
        None, description="None = SQLite in the state dir, or postgresql+asyncpg://U:P@HOST/DB."
    )
    prefect_ui_api_url: str | None = Field(
        None, description="API URL the UI calls if browsers use another name: http://HOST:PORT/api"
    )
    mlflow_backend_store_uri: SecretStr | None = Field(
        None, description="None = SQLite in the state dir, or postgresql://U:P@HOST/DB (psycopg2)."
    )
    mlflow_artifacts_destination: str | None = Field(
        None, description="None = a directory in the state dir, or s3://BUCKET/PREFIX (boto3)."
    )
    mlflow_s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO), exported as MLFLOW_S3_ENDPOINT_URL."
    )
    mlflow_admin_username: str = Field("admin", min_length=1, description="MLflow admin user.")
    mlflow_workers: int = Field(1, ge=1, le=64, description="MLflow server worker processes.")
    mlflow_allowed_hosts: str | None = Field(
        None, description="MLflow --allowed-hosts; None = localhost and private addresses."
    )
    startup_timeout_s: float = Field(120.0, gt=0, description="How long `up` waits for health.")
    stop_timeout_s: float = Field(20.0, gt=0, description="`down`: SIGTERM, this wait, SIGKILL.")

    @field_validator("host")
    @classmethod
    def _loopback_or_authenticated(cls, value: str, info: ValidationInfo) -> str:
        problem = exposure_problem(value, info.data)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("prefect_auth_string")
    @classmethod
    def _user_colon_password(cls, value: SecretStr | None) -> SecretStr | None:
        user, sep, password = (value.get_secret_value() if value else "x:x").partition(":")
        if not (user and sep and password):
            raise ValueError("must look like 'user:password'")
        return value

    @field_validator("mlflow_admin_password")
    @classmethod
    def _mlflow_password_policy(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 12:
            raise ValueError("must be at least 12 characters (MLflow's password policy)")
        if value is not None and value.get_secret_value() == MLFLOW_LEGACY_DEFAULT_PASSWORD:
            raise ValueError(
                "must not be the default password older MLflow versions shipped "
                "(publicly known: GHSA-gq3w-7jj3-x7gr)"
            )
        return value

    @field_validator(*_URL_PREFIXES)
    @classmethod
    def _url_scheme(cls, value: SecretStr | str | None, info: ValidationInfo) -> Any:
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        prefixes, local_ok = _URL_PREFIXES[str(info.field_name)]
        if text is not None and not (text.startswith(prefixes) or (local_ok and "://" not in text)):
            raise ValueError(
                f"must start with {' or '.join(prefixes)}" + local_ok * " or be a path"
            )
        return value

    @field_validator("mlflow_port")
    @classmethod
    def _distinct_ports(cls, value: int, info: ValidationInfo) -> int:
        if value == info.data.get("prefect_port"):
            raise ValueError("must differ from servers.prefect_port")
        return value


class ServerState(BaseModel):
    """One running server as its state file records it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    pid: int
    pgid: int
    create_time: float  # with pid, identifies the process (pids are reused)
    host: str
    port: int
    url: str  # what a browser opens
    api_url: str  # what clients use: PREFECT_API_URL / MLFLOW_TRACKING_URI
    health_url: str
    command: list[str]
    log: Path


@dataclass(frozen=True)
class ServerStatus:
    """What `start_servers` did with one server."""

    state: ServerState
    action: Literal["started", "already running"]


@dataclass(frozen=True)
class StoppedServer:
    """What `stop_servers` did with one server."""

    name: str
    pid: int
    processes: int  # how many were alive when `down` began
    signal: Literal["SIGTERM", "SIGKILL", "none (not running)"]


@dataclass(frozen=True)
class _Launch:
    name: str
    command: list[str]
    env: dict[str, str]
    port_key: str
    state: dict[str, Any]  # the ServerState fields known before the process exists


def resolve_state_dir(cfg: ServersConfig, workspace: Path) -> Path:
    """The absolute state directory: `cfg.state_dir`, or `<workspace>/.servers`."""
    return Path(os.path.abspath(cfg.state_dir or Path(workspace) / ".servers"))


def read_states(cfg: ServersConfig, workspace: Path) -> dict[str, ServerState]:
    """The state files present under the state directory, by server name."""
    state_dir = resolve_state_dir(cfg, workspace)
    found = {name: _read_state(state_dir / f"{name}.json") for name in SERVER_NAMES}
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
    for launch in _plan(cfg, state_dir):
        path = state_dir / f"{launch.name}.json"
        state = _read_state(path)
        if state is not None and _leader(state) is not None:
            done[launch.name] = ServerStatus(state, "already running")
            continue
        if state is not None:
            log.info("removing the stale state file %s (pid %d is gone)", path, state.pid)
            _stop_group(state, cfg.stop_timeout_s)
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
            _stop_group(state, cfg.stop_timeout_s)
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
        stopped.append(_stop_group(state, cfg.stop_timeout_s))
        (state_dir / f"{name}.json").unlink()
        log.info("stopped %s server (pid %d)", name, state.pid)
    return stopped


def client_host(host: str) -> str:
    """The address a client on this machine uses for a server bound to `host`."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"[{host}]" if ":" in host else host


def _plan(cfg: ServersConfig, state_dir: Path) -> list[_Launch]:
    base = {
        **os.environ,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # 10 -> 2 processes (docs/stack.md, "The MLflow server")
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    return [_plan_prefect(cfg, state_dir, base), _plan_mlflow(cfg, state_dir, base)]


def _plan_prefect(cfg: ServersConfig, state_dir: Path, base: dict[str, str]) -> _Launch:
    home = state_dir / "prefect"
    home.mkdir(exist_ok=True)
    # A client's PREFECT_API_URL would become the UI's API address (Prefect's default), and
    # a profile could point the server at another database: the server gets neither.
    env = {k: v for k, v in base.items() if k not in _PREFECT_CLIENT_VARS}
    env["PREFECT_HOME"] = str(home)
    env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = (
        cfg.prefect_database_url.get_secret_value()
        if cfg.prefect_database_url
        else f"sqlite+aiosqlite:///{home / 'prefect.db'}"
    )
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


def _plan_mlflow(cfg: ServersConfig, state_dir: Path, base: dict[str, str]) -> _Launch:
    home = state_dir / "mlflow"
    home.mkdir(exist_ok=True)
    env = dict(base)
    env["MLFLOW_BACKEND_STORE_URI"] = (
        cfg.mlflow_backend_store_uri.get_secret_value()
        if cfg.mlflow_backend_store_uri
        else f"sqlite:///{home / 'mlflow.db'}"
    )
    if cfg.mlflow_s3_endpoint_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = cfg.mlflow_s3_endpoint_url
    command = [_script("mlflow"), "server", "--host", cfg.host, "--port", str(cfg.mlflow_port)]
    command += ["--workers", str(cfg.mlflow_workers), "--artifacts-destination"]
    destination = cfg.mlflow_artifacts_destination or str(home / "artifacts")
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
            if _answers(opener, state.health_url):
                pending.remove(state)
            elif _leader(state) is None:
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


def _answers(opener: urllib.request.OpenerDirector, url: str) -> bool:
    try:
        with opener.open(url, timeout=2) as response:
            return int(response.status) == 200
    except OSError:  # refused, reset, timed out, HTTP errors
        return False


def _tail(path: Path) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-_LOG_TAIL_LINES:])


def _read_state(path: Path) -> ServerState | None:
    if not path.exists():
        return None
    try:
        return ServerState.model_validate_json(path.read_text())
    except ValueError as exc:
        raise ServersError(
            f"{path} is not a valid server state file ({exc}); check that no server of this "
            "workspace runs, then delete it"
        ) from None


def _leader(state: ServerState) -> psutil.Process | None:
    """The recorded process if it still runs (same pid *and* start time), else None."""
    try:
        proc = psutil.Process(state.pid)
        same = abs(proc.create_time() - state.create_time) < 0.01
        return proc if same and proc.status() != psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return None


def group_processes(state: ServerState) -> list[psutil.Process]:
    """Live processes of the server: its process group plus descendants that left it."""
    try:
        leader: psutil.Process | None = psutil.Process(state.pid)
    except psutil.NoSuchProcess:
        leader = None  # members of its group may still run: Linux keeps the id for them
    if leader is not None and abs(leader.create_time() - state.create_time) >= 0.01:
        # The pid belongs to another process now, so no group of that id was left to reuse.
        return []
    found = {p.pid: p for p in leader.children(recursive=True)} if leader else {}
    for proc in [*([leader] if leader else []), *psutil.process_iter()]:
        with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
            if proc is leader or os.getpgid(proc.pid) == state.pgid:
                found.setdefault(proc.pid, proc)
    return [p for p in found.values() if _running(p)]


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _stop_group(state: ServerState, timeout_s: float) -> StoppedServer:
    procs = group_processes(state)
    if not procs:
        return StoppedServer(state.name, state.pid, 0, "none (not running)")
    sent: Literal["SIGTERM", "SIGKILL"] = "SIGTERM"
    _signal_all(state.pgid, procs, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)  # also reaps our own children
    if alive:
        sent = "SIGKILL"
        _signal_all(state.pgid, alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    left = group_processes(state)
    if left:
        raise ServersError(
            f"{state.name} server: processes {[p.pid for p in left]} survived SIGKILL; "
            f"kept {state.name}.json"
        )
    return StoppedServer(state.name, state.pid, len(procs), sent)


def _signal_all(pgid: int, procs: list[psutil.Process], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # an empty group; descendants may be left
        os.killpg(pgid, sig)
    for proc in procs:  # those that called setsid() are outside the group
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            continue


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
