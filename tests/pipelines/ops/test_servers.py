"""`lmpipe up` / `lmpipe down`: real Prefect and MLflow servers on free loopback ports."""

from __future__ import annotations

import argparse
import importlib.util
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from pipelines.cli.servers import register, servers_from_recipe
from pipelines.config import ConfigError
from pipelines.config.servers import ServersConfig
from pipelines.ops.server_processes import ServersError, ServerState, group_processes
from pipelines.ops.servers import read_states, resolve_state_dir, start_servers, stop_servers


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _lmpipe(*argv: str) -> int:
    """Run `lmpipe <argv>` through this module's own subcommands."""
    parser = argparse.ArgumentParser(prog="lmpipe")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return int(args.func(args))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_state(state_dir: Path, state: ServerState) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / f"{state.name}.json"
    path.write_text(state.model_dump_json())
    return path


def _state(name: str, pid: int, create_time: float, log: Path) -> ServerState:
    return ServerState(
        name=name,
        pid=pid,
        pgid=pid,
        create_time=create_time,
        host="127.0.0.1",
        port=1,
        url="http://127.0.0.1:1",
        api_url="http://127.0.0.1:1",
        health_url="http://127.0.0.1:1/health",
        command=["x"],
        log=log,
    )


def _get(url: str) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        return int(response.status)


@pytest.mark.slow
@pytest.mark.integration
def test_up_binds_loopback_only_reuses_running_servers_and_down_leaves_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = tmp_path / "ws"
    ports = {"prefect_port": _free_port(), "mlflow_port": _free_port()}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"workspace": str(workspace), "servers": ports}))
    cfg, _ = servers_from_recipe(recipe)
    # A state file left by a server that died: `up` must clean it, not trust it.
    dead = _dead_pid()
    _write_state(resolve_state_dir(cfg, workspace), _state("prefect", dead, 1.0, tmp_path / "x"))
    try:
        assert _lmpipe("up", str(recipe)) == 0
        out = capsys.readouterr().out
        assert f"PREFECT_API_URL=http://127.0.0.1:{ports['prefect_port']}/api" in out
        assert f"MLFLOW_TRACKING_URI=http://127.0.0.1:{ports['mlflow_port']}" in out
        states = read_states(cfg, workspace)
        assert set(states) == {"prefect", "mlflow"}
        assert states["prefect"].pid != dead
        procs = {p.pid: p for s in states.values() for p in group_processes(s)}
        listening = [
            conn.laddr
            for proc in procs.values()
            for conn in proc.net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN
        ]
        assert {addr.port for addr in listening} >= set(ports.values())
        assert {addr.ip for addr in listening} <= {"127.0.0.1", "::1"}, listening
        assert _get(states["prefect"].health_url) == 200  # /api/health
        assert _get(states["mlflow"].health_url) == 200  # /health

        assert _lmpipe("up", str(recipe)) == 0  # a second `up` starts nothing
        assert capsys.readouterr().out.count("already running") == 2
        again = {p.pid for s in read_states(cfg, workspace).values() for p in group_processes(s)}
        assert again == set(procs)

        assert _lmpipe("down", str(recipe)) == 0
        out = capsys.readouterr().out
        assert "stopped prefect" in out
        assert "stopped mlflow" in out
        assert read_states(cfg, workspace) == {}
        alive = [p.pid for p in procs.values() if p.is_running() and p.status() != "zombie"]
        assert alive == []
        assert all(group_processes(s) == [] for s in states.values())
    finally:
        stop_servers(cfg, workspace)  # a no-op unless an assertion failed above


def test_up_refuses_a_non_loopback_host_without_auth_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = tmp_path / "ws"
    argv = ["up", f"workspace={workspace}", "servers.host=0.0.0.0"]
    assert _lmpipe(*argv, "servers.prefect_auth_string=ops:hunter2hunter2") == 2
    out = capsys.readouterr().out
    assert "servers.host = '0.0.0.0'" in out
    assert "servers.mlflow_admin_password" in out
    assert "hunter2" not in out
    assert not workspace.exists()  # no state dir, so nothing was started


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "127.0.0.2", "example.org"])
def test_a_non_loopback_host_needs_both_auth_settings(host: str) -> None:
    with pytest.raises(
        ValueError, match=r"set servers\.prefect_auth_string and servers\.mlflow_admin_password"
    ):
        ServersConfig(host=host)
    with pytest.raises(ValueError, match=r"set servers\.prefect_auth_string \[type"):
        ServersConfig.model_validate({"host": host, "mlflow_admin_password": "a" * 12})
    cfg = ServersConfig.model_validate(
        {"host": host, "prefect_auth_string": "ops:pw", "mlflow_admin_password": "a" * 12}
    )
    assert cfg.host == host
    assert cfg.prefect_auth_string is not None
    assert cfg.mlflow_admin_password is not None
    assert cfg.prefect_auth_string.get_secret_value() == "ops:pw"
    assert cfg.mlflow_admin_password.get_secret_value() == "a" * 12
    assert "ops:pw" not in repr(cfg)
    assert "a" * 12 not in repr(cfg)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_loopback_hosts_need_no_auth(host: str) -> None:
    cfg = ServersConfig(host=host)
    assert (cfg.host, cfg.prefect_auth_string, cfg.mlflow_admin_password) == (host, None, None)
    assert (cfg.prefect_port, cfg.mlflow_port) == (4200, 5000)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        (
            "servers.prefect_database_url=postgresql://u:pw-secret@db/prefect",
            "prefect_database_url",
        ),
        ("servers.mlflow_backend_store_uri=mysql://u:pw-secret@db/m", "mlflow_backend_store_uri"),
        ("servers.prefect_auth_string=pw-secret", "prefect_auth_string"),
        ("servers.mlflow_admin_password=pw-secret", "mlflow_admin_password"),
        ("servers.mlflow_artifacts_destination=gs://bucket", "mlflow_artifacts_destination"),
        ("servers.mlflow_port=4200", "mlflow_port"),
        ("servers.prefect_prot=1", "prefect_prot"),
    ],
)
def test_invalid_settings_name_the_key_and_hide_secrets(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"servers\.{key}") as caught:
        servers_from_recipe(None, [override])
    assert "pw-secret" not in str(caught.value)


def test_recipe_without_servers_section_gives_defaults_and_only_servers_overrides(
    tmp_path: Path,
) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: demo\nworkspace: some/where\ntrain: {max_steps: 3}\n")
    cfg, workspace = servers_from_recipe(recipe, ["servers.prefect_port=4300"])
    assert (cfg.host, cfg.prefect_port, cfg.mlflow_port) == ("127.0.0.1", 4300, 5000)
    assert workspace == Path("some/where")
    assert resolve_state_dir(cfg, workspace) == (Path.cwd() / "some/where/.servers")
    with pytest.raises(ConfigError, match=r"servers\.\* and workspace only"):
        servers_from_recipe(recipe, ["train.max_steps=4"])


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = ServersConfig(prefect_port=_free_port(), mlflow_port=port)
        with pytest.raises(ServersError, match=f"servers.mlflow_port={port}"):
            start_servers(cfg, tmp_path)
    assert read_states(cfg, tmp_path) == {}


@pytest.mark.skipif(importlib.util.find_spec("psycopg2") is not None, reason="psycopg2 installed")
def test_up_names_a_missing_database_driver(tmp_path: Path) -> None:
    cfg = ServersConfig(
        prefect_port=_free_port(),
        mlflow_port=_free_port(),
        mlflow_backend_store_uri="postgresql://u:p@127.0.0.1:1/m",  # type: ignore[arg-type]
    )
    with pytest.raises(ServersError, match="psycopg2-binary"):
        start_servers(cfg, tmp_path)
    assert read_states(cfg, tmp_path) == {}


def test_down_removes_a_stale_state_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = ServersConfig()
    path = _write_state(
        resolve_state_dir(cfg, tmp_path), _state("mlflow", _dead_pid(), 1.0, tmp_path / "x")
    )
    assert _lmpipe("down", f"workspace={tmp_path}") == 0
    assert "mlflow was not running" in capsys.readouterr().out
    assert not path.exists()


_STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # inherited by the child below
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
time.sleep(120)
"""


@pytest.mark.slow
def test_down_sigkills_a_group_that_ignores_sigterm(tmp_path: Path) -> None:
    leader = subprocess.Popen([sys.executable, "-c", _STUBBORN], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        parent = psutil.Process(leader.pid)
        while not parent.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        procs = [parent, *parent.children()]
        assert len(procs) == 2
        cfg = ServersConfig(stop_timeout_s=0.5)
        state = _state("prefect", leader.pid, parent.create_time(), tmp_path / "x")
        path = _write_state(resolve_state_dir(cfg, tmp_path), state)
        [stopped] = stop_servers(cfg, tmp_path)
        assert (stopped.signal, stopped.processes) == ("SIGKILL", 2)
        assert not path.exists()
        assert not any(p.is_running() and p.status() != "zombie" for p in procs)
    finally:
        if leader.poll() is None:
            leader.kill()
        leader.wait()


def test_compose_stack_publishes_only_on_loopback_and_env_example_covers_it() -> None:
    infra = Path(__file__).resolve().parents[3] / "infra"
    text = (infra / "docker-compose.yml").read_text()
    compose = yaml.safe_load(text)
    assert set(compose["services"]) == {
        "postgres", "minio", "minio-init", "prefect-server", "mlflow-server"
    }  # fmt: skip
    published = [p for s in compose["services"].values() for p in s.get("ports", [])]
    assert published
    assert all(port.startswith("127.0.0.1:") for port in published), published
    assert "postgres" not in {n for n, s in compose["services"].items() if "ports" in s}
    required = set(re.findall(r"\$\{(\w+):\?", text))
    example = dict(
        line.split("=", 1)
        for line in (infra / ".env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert required <= set(example), required - set(example)
    secrets = {k for k in required if "PASSWORD" in k or "SECRET" in k or k.endswith("STRING")}
    assert secrets
    assert all("change-me" in example[k] for k in secrets)
