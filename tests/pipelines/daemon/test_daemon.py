"""The command daemon: `lmpipe` stage commands run in forks of one warm process.

The commands run as a user runs them (`python -m pipelines.daemon.client`, what the `lmpipe`
entry point calls) with the daemon on, a cache folder of their own and no `PREFECT_HOME`, so the
workspace's own Prefect home and the daemon's temporary API for it are used. Each test stops the
daemon it started by its pid (`lmpipe daemon stop`, then SIGTERM if it is still there).
"""

from __future__ import annotations

import ast
import ipaddress
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pipelines.daemon.client import daemon_enabled, daemon_key

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def lmpipe(
    env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run `lmpipe ARGS` as its entry point does; its exit code and output."""
    command = [sys.executable, "-m", "pipelines.daemon.client", *args]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def status(env: dict[str, str]) -> dict[str, str]:
    """`lmpipe daemon status` as a dict of its lines (empty when no daemon runs)."""
    out = lmpipe(env, "daemon", "status").stdout
    return dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state


@pytest.fixture
def daemon_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """An environment with the daemon on; the daemon it started is stopped afterwards."""
    env = {**os.environ, "LMPIPE_DAEMON": "1", "LMPIPE_CACHE_DIR": str(tmp_path / "cache")}
    env["LMPIPE_DAEMON_IDLE_S"] = "300"  # a safety net only: the test stops it
    env.pop("PREFECT_HOME", None)
    yield env
    pid = status(env).get("pid")
    if pid is not None:
        lmpipe(env, "daemon", "stop")
        deadline = time.monotonic() + 15
        while alive(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if alive(int(pid)):
            os.kill(int(pid), signal.SIGTERM)


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n\n".join(
            f"Document {i} says that the river {i % 7} runs past the mill. It rained on day {i}."
            for i in range(200)
        )
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: daemon\nworkspace: {tmp_path / 'ws'}\n"
        f"ingest: {{sources: [{{path: {corpus}, format: txt}}]}}\n"
    )
    return path


def flow_runs(home: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(home / "prefect.db") as db:
        return db.execute("SELECT name, state_name FROM flow_run").fetchall()


def test_stage_commands_run_in_one_daemon_recording_in_the_workspace(
    daemon_env: dict[str, str], recipe: Path, tmp_path: Path
) -> None:
    first = lmpipe(daemon_env, "ingest", str(recipe))
    assert first.returncode == 0, first.stderr
    assert "documents" in first.stdout  # the stage table, on the client's own stdout
    daemon = status(daemon_env)
    home = tmp_path / "ws" / ".prefect"
    assert str(home) in daemon["prefect_apis"]

    again = lmpipe(daemon_env, "ingest", str(recipe))
    assert again.returncode == 0, again.stderr
    assert "cache hit" in again.stdout + again.stderr
    assert status(daemon_env)["pid"] == daemon["pid"]  # the same daemon answered
    runs = flow_runs(home)
    assert len(runs) == 2
    assert {state for _, state in runs} == {"Completed"}

    refused = lmpipe(daemon_env, "ingest", str(recipe), "ingest.no_such_key=1")
    assert refused.returncode == 2  # the child's exit code is the client's
    assert "no_such_key" in refused.stderr

    port = int(daemon["prefect_apis"].rsplit(": ", 1)[1].rstrip("}"))
    assert lmpipe(daemon_env, "daemon", "stop").returncode == 0
    deadline = time.monotonic() + 15
    while alive(int(daemon["pid"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(int(daemon["pid"]))
    with pytest.raises(urllib.error.URLError):  # its Prefect API stopped with it
        urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)


@pytest.mark.parametrize(
    ("signum", "client_exit"),
    [(signal.SIGINT, 130), (signal.SIGKILL, -signal.SIGKILL)],
    ids=["ctrl-c-forwarded", "client-killed"],
)
def test_a_command_ends_with_its_client(
    daemon_env: dict[str, str], recipe: Path, signum: int, client_exit: int
) -> None:
    assert lmpipe(daemon_env, "ingest", str(recipe)).returncode == 0  # the daemon is warm
    fresh = "ingest.clean.collapse_whitespace=false"  # not cached: a new ingest
    client = subprocess.Popen(
        [sys.executable, "-m", "pipelines.daemon.client", "ingest", str(recipe), fresh],
        env=daemon_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while (running := status(daemon_env).get("commands", "[]")) == "[]":
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    child = int(running.strip("[]").split(",")[0])
    # Ctrl-C reaches the client only, which passes it on; a killed client's child gets SIGTERM.
    client.send_signal(signum)
    _, err = client.communicate(timeout=60)
    assert client.returncode == client_exit, err
    deadline = time.monotonic() + 30
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child)


def test_the_key_follows_what_a_command_sees_not_the_shell() -> None:
    env = {"PATH": "/usr/bin", "HOME": "/home/u"}
    key = daemon_key(env)
    assert daemon_key({**env, "PWD": "/elsewhere", "LMPIPE_DAEMON": "1", "SHLVL": "3"}) == key
    # Prefect's home and API are settled per command, and its settings read again in the fork.
    assert daemon_key({**env, "PREFECT_HOME": "/w/.prefect", "PREFECT_API_URL": "http://x"}) == key
    assert daemon_key({**env, "HF_HUB_OFFLINE": "1"}) != key
    assert daemon_key({**env, "HOME": "/home/v"}) != key


def test_lmpipe_daemon_0_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMPIPE_DAEMON", "0")
    assert not daemon_enabled()
    monkeypatch.setenv("LMPIPE_DAEMON", "1")
    assert daemon_enabled() == (sys.platform == "linux")


def test_a_daemon_of_other_code_is_stopped_by_the_next(
    daemon_env: dict[str, str], recipe: Path, tmp_path: Path
) -> None:
    stale = subprocess.Popen(
        [sys.executable, "-m", "pipelines.daemon", "0123456789abcdef", "older-code"],
        env=daemon_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        registered = tmp_path / "cache" / "daemon" / "0123456789abcdef.json"
        deadline = time.monotonic() + 60
        while not registered.is_file():
            assert time.monotonic() < deadline, "the stale daemon never registered"
            time.sleep(0.05)
        assert lmpipe(daemon_env, "ingest", str(recipe)).returncode == 0
        assert stale.wait(timeout=60) == 0  # the new daemon asked it to stop; it had no command
        assert not registered.exists()
    finally:
        if stale.poll() is None:
            stale.terminate()
            stale.wait()


def node_processes(pid: int) -> list[psutil.Process]:
    """The `ray start --block` process `pid` and every process under it."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def loopback(ip: str) -> bool:
    """Whether `ip` is a loopback address, an IPv4 one mapped into IPv6 included."""
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def driver_pids(address: str, env: dict[str, str]) -> set[int]:
    """The pids of the drivers (other than the asking one) the Ray node at `address` has seen."""
    code = (
        "import os, ray; from ray._private import ray_constants as c; "
        "c.ENABLE_RAY_CLUSTER = False; "
        f"ray.init(address={address!r}, log_to_driver=False); "
        "from ray._private.state import jobs; "
        "print(*[j['DriverPid'] for j in jobs() if j['DriverPid'] != os.getpid()])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return {int(pid) for pid in out.stdout.split()}


def test_commands_join_the_daemons_ray_node_which_stops_with_it(
    daemon_env: dict[str, str], tmp_path: Path
) -> None:
    """Stage commands join one local Ray node the daemon keeps, bound to loopback only.

    A corpus within `ray.local_max_mb` is ingested in the command's process: no node starts.
    """
    sources = []
    for part in range(2):  # two files: two work units, so ingestion runs on Ray
        corpus = tmp_path / f"part{part}.txt"
        corpus.write_text("\n\n".join(f"Part {part}, document {i} runs on." for i in range(50)))
        sources.append(f"{{path: {corpus}, format: txt}}")
    recipe = tmp_path / "ray.yaml"
    recipe.write_text(f"name: ray\ningest: {{sources: [{', '.join(sources)}]}}\n")
    done = lmpipe(daemon_env, "ingest", str(recipe), f"workspace={tmp_path / 'small'}")
    assert done.returncode == 0, done.stderr
    assert ast.literal_eval(status(daemon_env)["ray_nodes"]) == {}  # small: no Ray at all
    for workspace in ("a", "b"):  # the same corpus, sent to Ray
        where = f"workspace={tmp_path / workspace}"
        done = lmpipe(daemon_env, "ingest", str(recipe), where, "ray.local_max_mb=0")
        assert done.returncode == 0, done.stderr
    nodes = ast.literal_eval(status(daemon_env)["ray_nodes"])  # {address: pid}
    assert len(nodes) == 1, nodes
    ((address, pid),) = nodes.items()
    assert len(driver_pids(address, daemon_env)) == 2  # each command joined it as a driver
    processes = node_processes(pid)
    names = {p.name() for p in processes}
    assert {"gcs_server", "raylet"} <= names, names
    listening = [
        conn.laddr.ip
        for p in processes
        for conn in p.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    ]
    assert listening
    assert all(loopback(ip) for ip in listening), listening

    (temp_dir,) = [
        Path(arg.split("=", 1)[1])
        for arg in psutil.Process(pid).cmdline()
        if arg.startswith("--temp-dir=")
    ]
    assert temp_dir.is_dir()

    assert lmpipe(daemon_env, "daemon", "stop").returncode == 0
    deadline = time.monotonic() + 60
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes):
        assert time.monotonic() < deadline, [p for p in processes if p.is_running()]
        time.sleep(0.2)
    while temp_dir.exists():  # the daemon deletes its nodes' folder once they are stopped
        assert time.monotonic() < deadline, sorted(temp_dir.iterdir())
        time.sleep(0.2)
