"""A running server's record (its state file) and its process group: alive, and stopping it.

Each server `lmpipe up` starts leads its own process group; `ServerState` identifies the leader
by pid *and* start time (pids are reused), and stopping signals the whole group plus the
descendants that left it. Starting servers is `pipelines.ops.servers`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, ConfigDict


def answers(opener: urllib.request.OpenerDirector, url: str) -> bool:
    """Whether `url` (a server's health check) answers 200 now, within 2 s."""
    try:
        with opener.open(url, timeout=2) as response:
            return int(response.status) == 200
    except OSError:  # refused, reset, timed out, HTTP errors
        return False


def resolve_state_dir(state_dir: Path | None, workspace: Path) -> Path:
    """The absolute state directory: `state_dir`, or `<workspace>/.servers`."""
    return Path(os.path.abspath(state_dir or Path(workspace) / ".servers"))


class ServersError(RuntimeError):
    """A server could not be started or stopped; the message says which and why."""


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
class StoppedServer:
    """What `stop_servers` did with one server."""

    name: str
    pid: int
    processes: int  # how many were alive when `down` began
    signal: Literal["SIGTERM", "SIGKILL", "none (not running)"]


def read_state(path: Path) -> ServerState | None:
    """The server state recorded in the file at `path`; None when there is no such file.

    Raises:
        ServersError: the file is not a state file; the message says what to check first.
    """
    if not path.exists():
        return None
    try:
        return ServerState.model_validate_json(path.read_text())
    except ValueError as exc:
        raise ServersError(
            f"{path} is not a valid server state file ({exc}); check that no server of this "
            "workspace runs, then delete it"
        ) from None


def live_leader(state: ServerState) -> psutil.Process | None:
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


def stop_group(state: ServerState, timeout_s: float) -> StoppedServer:
    """SIGTERM the server's processes, SIGKILL those alive after `timeout_s`; say what was sent.

    Raises:
        ServersError: a process survived SIGKILL.
    """
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
