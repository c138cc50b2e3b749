"""Server security: what each server lmpipe starts listens on, and who it answers.

Started here, once per module and side by side (each in its own process group, ports free, state
under a temp dir, traffic to 127.0.0.1 only, stopped by pid and group):

- Prefect and MLflow through `start_servers` (`lmpipe up`) on 127.0.0.1 with both auths on. The
  same start without auth is `tests/pipelines/ops/test_servers.py::test_up_binds_loopback_only_...`,
  which checks its sockets too; refusals of a non-loopback host without auth are there as well.
- lmpipe's local Ray: a driver process that calls `ensure_ray` exactly as the stages do.
- A Ray head as docs/cluster.md starts one (`ray start --head`, token auth, dashboard on
  127.0.0.1). Ray 2.60 has no bind-address option: a node whose IP is not exactly 127.0.0.1 (any
  node of a multi-node cluster) listens on every interface, so this head is the documented
  exception, and the tests name its wildcard sockets and show that the token guards them.

A gRPC call without the token is sent with grpcio and Ray's own message classes from a child
process (`_PROBE`), so this process holds no channel and no Ray token.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from figures import record

from pipelines.cli.servers import servers_from_recipe
from pipelines.config import ConfigError
from pipelines.config.servers import MLFLOW_LEGACY_DEFAULT_PASSWORD, ServersConfig
from pipelines.ops.server_processes import ServersError, ServerState, group_processes
from pipelines.ops.servers import start_servers, stop_servers
from tasks.common.ray_runtime import RayAuthError, RayConfig, ensure_ray, ray_auth_problem

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.reliability]

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
_FIGURES: dict[str, Any] = {}


# --- processes and sockets --------------------------------------------------------------------


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("", 0))  # free on every interface: a Ray head binds the wildcard
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _label(proc: psutil.Process) -> str:
    """A stable name for a Ray or server process (Python ones by what they run)."""
    cmdline = " ".join(proc.cmdline())
    for marker, label in (
        ("ray.util.client.server", "ray client server"),
        ("dashboard/dashboard.py", "ray dashboard"),
        ("autoscaler/_private/monitor.py", "ray autoscaler monitor"),
    ):
        if marker in cmdline:
            return label
    return proc.name()


def _tree(root_pid: int, marker: str | None = None) -> list[psutil.Process]:
    """`root_pid`, its descendants, and any process whose command line holds `marker`."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(root_pid)
        found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    if marker is not None:
        for proc in psutil.process_iter(["cmdline"]):
            if any(marker in arg for arg in proc.info["cmdline"] or ()):
                found.setdefault(proc.pid, proc)
    return list(found.values())


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _listening(procs: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process label, IP, port) of every listening TCP socket of `procs`."""
    found = set()
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    found.add((_label(proc), conn.laddr.ip, conn.laddr.port))
    return sorted(found)


def _wait_listening(
    procs_of: Any, labels: set[str], timeout_s: float = 60
) -> list[tuple[str, str, int]]:
    """Poll until every label in `labels` has a listening socket (Ray's agents start late)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sockets = _listening(procs_of())
        if labels <= {label for label, _, _ in sockets} or time.monotonic() > deadline:
            return sockets
        time.sleep(0.5)


def _kill_all(node: RayNode, seen: list[psutil.Process], grace_s: float) -> None:
    """Wait `grace_s` for the node's processes to end, then SIGKILL each one left; reap ours."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        node.popen.wait(timeout=grace_s)
    others = [p for p in seen if p.pid != node.popen.pid]
    psutil.wait_procs(others, timeout=1 if node.popen.returncode is None else grace_s / 2)
    left = {p.pid: p for p in [*others, *node.procs()] if p.pid != node.popen.pid}
    for proc in left.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    psutil.wait_procs(list(left.values()), timeout=10)
    if node.popen.poll() is None:
        node.popen.kill()
    node.popen.wait(timeout=10)


# --- what the module starts -------------------------------------------------------------------


@dataclass
class RayNode:
    """A Ray started by this module: its launcher process, temp root and token."""

    popen: subprocess.Popen[bytes]
    root: Path
    token: str
    ports: dict[str, int] = field(default_factory=dict)

    def procs(self) -> list[psutil.Process]:
        """Every live process of this Ray (by parentage, and by its temp root in argv)."""
        return _tree(self.popen.pid, str(self.root))


@dataclass
class Stack:
    """Everything the module started."""

    servers_cfg: ServersConfig
    workspace: Path
    states: dict[str, ServerState]
    prefect_auth: str
    mlflow_password: str
    lmpipe_ray: RayNode
    head: RayNode


def _ray_env(root: Path) -> tuple[dict[str, str], str]:
    token = secrets.token_hex(32)
    (root / "token").write_text(token)
    (root / "token").chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PREFECT_API"))}
    env |= {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(root / "token"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TMPDIR": str(root),  # not /tmp/ray, which the session's Ray uses
        "PYTHONPATH": str(REPO),
    }
    return env, token


# lmpipe's own local Ray: the driver calls `ensure_ray` as every stage does, reports where the
# node listens, and shuts Ray down when the test closes its stdin.
_LMPIPE_DRIVER = """
import json, sys
import ray
from tasks.common.ray_runtime import RayConfig, ensure_ray
ensure_ray(RayConfig(num_workers=1, num_cpus=1, object_store_mb=80))
node = ray.nodes()[0]
ip = ray.get(ray.remote(lambda: ray.util.get_node_ip_address()).remote())
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "task_node_ip": ip,
                  "node_manager": node["NodeManagerPort"],
                  "object_manager": node["ObjectManagerPort"]}), flush=True)
sys.stdin.read()
ray.shutdown()
"""


def _launch_lmpipe_ray(root: Path) -> RayNode:
    env, token = _ray_env(root)
    popen = subprocess.Popen(
        [sys.executable, "-c", _LMPIPE_DRIVER],
        env=env,
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=(root / "driver.log").open("wb"),
        start_new_session=True,
    )
    return RayNode(popen, root, token)


def _wait_lmpipe_ray(node: RayNode) -> None:
    assert node.popen.stdout is not None
    line = node.popen.stdout.readline()  # bounded: the driver exits if ray.init fails
    if not line:
        log = (node.root / "driver.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"lmpipe's local Ray did not start:\n{log}")
    info = json.loads(line)
    node.ports = {k: int(info[k]) for k in ("node_manager", "object_manager")}
    node.ports["gcs"] = int(info["gcs"].rsplit(":", 1)[1])
    _FIGURES["lmpipe_ray_gcs_address"] = info["gcs"]
    _FIGURES["lmpipe_ray_task_node_ip"] = info["task_node_ip"]


def _launch_head(root: Path) -> RayNode:
    """`ray start --head` as docs/cluster.md documents it, with its own ports and temp dir."""
    env, token = _ray_env(root)
    names = ["gcs", "dashboard", "client", "node_manager", "object_manager", "agent_grpc"]
    names += ["agent_http", "metrics", "runtime_env_agent"]
    ports = dict(zip(names, _free_ports(len(names)), strict=True))
    args = [
        f"--port={ports['gcs']}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={ports['dashboard']}",
        f"--ray-client-server-port={ports['client']}",
        f"--node-manager-port={ports['node_manager']}",
        f"--object-manager-port={ports['object_manager']}",
        f"--dashboard-agent-grpc-port={ports['agent_grpc']}",
        f"--dashboard-agent-listen-port={ports['agent_http']}",
        f"--metrics-export-port={ports['metrics']}",
        f"--runtime-env-agent-port={ports['runtime_env_agent']}",
        f"--temp-dir={root / 't'}",
        "--num-cpus=1",
        "--object-store-memory=100000000",
    ]
    with (root / "head.log").open("wb") as out:
        popen = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats", *args],
            env=env,
            cwd=root,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return RayNode(popen, root, token, ports)


def _wait_head(node: RayNode) -> None:
    log = node.root / "head.log"
    deadline = time.monotonic() + 120
    while b"block forever" not in log.read_bytes():
        if node.popen.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the Ray head did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def _stop_ray(node: RayNode, graceful: bool) -> None:
    procs = node.procs()
    if graceful and node.popen.stdin is not None and node.popen.poll() is None:
        node.popen.stdin.close()  # the driver calls ray.shutdown(), which stops its node
    elif node.popen.poll() is None:
        node.popen.send_signal(signal.SIGTERM)  # `ray start --block` stops its node
    _kill_all(node, procs, grace_s=15 if graceful else 3)
    left = [p.pid for p in node.procs() if _running(p)]
    assert left == [], f"processes of {node.root} outlived the test: {left}"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """Prefect + MLflow with auth (`start_servers`), lmpipe's local Ray and a Ray head."""
    # Short: Ray's unix socket paths live under it and are limited to about 107 characters.
    root = Path(tempfile.mkdtemp(prefix="lmp-sec-", dir="/tmp"))
    (root / "lmpipe").mkdir()
    (root / "head").mkdir()
    prefect_auth = f"ops:{secrets.token_urlsafe(18)}"
    mlflow_password = secrets.token_urlsafe(18)
    prefect_port, mlflow_port = _free_ports(2)
    cfg = ServersConfig.model_validate(
        {
            "prefect_port": prefect_port,
            "mlflow_port": mlflow_port,
            "prefect_auth_string": prefect_auth,
            "mlflow_admin_password": mlflow_password,
            "state_dir": str(root / "servers"),
        }
    )
    workspace = root / "ws"
    # All three start side by side: their start-ups overlap instead of adding up.
    lmpipe_ray = _launch_lmpipe_ray(root / "lmpipe")
    head = _launch_head(root / "head")
    try:
        states = {name: s.state for name, s in start_servers(cfg, workspace).items()}
        _wait_head(head)
        _wait_lmpipe_ray(lmpipe_ray)
        yield Stack(cfg, workspace, states, prefect_auth, mlflow_password, lmpipe_ray, head)
    finally:
        errors = []
        for stop in (
            lambda: stop_servers(cfg, workspace),
            lambda: _stop_ray(lmpipe_ray, graceful=True),
            lambda: _stop_ray(head, graceful=False),
        ):
            try:
                stop()
            except Exception as exc:  # stop the others all the same, then report it
                errors.append(exc)
        shutil.rmtree(root, ignore_errors=True)
        record("security_servers", _FIGURES)
        if errors:
            raise errors[0]


# --- requests ---------------------------------------------------------------------------------


def _http(url: str, headers: dict[str, str] | None = None, body: bytes | None = None) -> int:
    """The HTTP status of one request to a loopback URL (never through a proxy)."""
    assert url.startswith("http://127.0.0.1:"), url
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=body, headers=headers or {})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with opener.open(request, timeout=15) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


# One process sends every gRPC call: argv[1] is a JSON list of [port, full method name, request
# message class or null for an empty message, authorization header or null]; it prints one
# status code name per call, in order.
_PROBE = """
import importlib, json, sys
import grpc
calls = json.loads(sys.argv[1])
codes = []
for port, method, message, authorization in calls:
    payload = b""
    if message:
        module, name, kwargs = message
        payload = getattr(importlib.import_module(module), name)(**kwargs).SerializeToString()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.enable_http_proxy", 0)])
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    metadata = (("authorization", authorization),) if authorization else ()
    try:
        call(payload, metadata=metadata, timeout=10)
        codes.append("OK")
    except grpc.RpcError as exc:
        codes.append(exc.code().name)
    channel.close()
print(json.dumps(codes))
"""

_GCS_NODES = ("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo", None)
_RAYLET_STATS = ("/ray.rpc.NodeManagerService/GetNodeStats", None)
_OBJECT_PULL = ("/ray.rpc.ObjectManagerService/Pull", None)  # never sent with the token
_AGENT_TRACEBACK = (
    "/ray.rpc.ReporterService/GetTraceback",
    ["ray.core.generated.reporter_pb2", "GetTracebackRequest", {"pid": 1}],
)
_CLIENT_PING = (
    "/ray.rpc.RayletDriver/ClusterInfo",
    [
        "ray.core.generated.ray_client_pb2",
        "ClusterInfoRequest",
        {"type": 6},
    ],  # ClusterInfoType.PING
)


def _grpc_codes(node: RayNode, targets: dict[str, tuple[int, tuple[str, Any]]]) -> dict[str, Any]:
    """For each target: the status without a token, with a wrong one and with the right one."""
    tokens = {"no token": None, "wrong token": "Bearer " + "0" * 64}
    tokens["the token"] = f"Bearer {node.token}"
    calls, keys = [], []
    for name, (port, (method, message)) in targets.items():
        for which, header in tokens.items():
            if method == _OBJECT_PULL[0] and which == "the token":
                continue  # a real Pull of an empty object id: not worth sending
            calls.append([port, method, message, header])
            keys.append((name, which))
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(calls)],
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},  # and no token anywhere: raw calls
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    codes: dict[str, Any] = {}
    for (name, which), code in zip(keys, json.loads(result.stdout), strict=True):
        codes.setdefault(name, {})[which] = code
    return codes


# --- 1. binding ------------------------------------------------------------------------------


def test_prefect_and_mlflow_with_auth_listen_on_loopback_only(stack: Stack) -> None:
    procs = [p for state in stack.states.values() for p in group_processes(state)]
    sockets = _listening(procs)
    _FIGURES["prefect_mlflow_sockets"] = sockets
    assert {port for _, _, port in sockets} >= {stack.servers_cfg.prefect_port}
    assert {port for _, _, port in sockets} >= {stack.servers_cfg.mlflow_port}
    assert [s for s in sockets if not _is_loopback(s[1])] == []


def test_lmpipe_local_ray_listens_on_loopback_only(stack: Stack) -> None:
    node = stack.lmpipe_ray
    needed = {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"}
    sockets = _wait_listening(node.procs, needed)
    _FIGURES["lmpipe_ray_sockets"] = sockets
    assert needed <= {label for label, _, _ in sockets}, sockets
    assert {port for _, _, port in sockets} >= set(node.ports.values())
    assert [s for s in sockets if not _is_loopback(s[1])] == []
    assert _FIGURES["lmpipe_ray_gcs_address"].startswith("127.0.0.1:")
    assert _FIGURES["lmpipe_ray_task_node_ip"] == "127.0.0.1"


# What a `ray start --head` node (any node whose IP is not exactly 127.0.0.1) opens beyond
# loopback: Ray 2.60 has no setting to keep these on loopback (docs/cluster.md, section 3).
HEAD_WILDCARD = {
    "gcs_server",  # GCS: gRPC, token checked
    "raylet",  # node manager and object manager: gRPC, token checked
    "ray client server",  # ray:// clients: gRPC, token checked
    "ray::DashboardAgent",  # agent gRPC (token checked), agent HTTP, Prometheus metrics
    "ray::RuntimeEnvAgent",  # HTTP on the node IP
}


def test_ray_head_opens_only_the_known_non_loopback_sockets(stack: Stack) -> None:
    head = stack.head
    needed = HEAD_WILDCARD | {"ray dashboard"}
    sockets = _wait_listening(head.procs, needed)
    _FIGURES["ray_head_sockets"] = sockets
    exposed = {label for label, ip, _ in sockets if not _is_loopback(ip)}
    _FIGURES["ray_head_non_loopback"] = sorted(exposed)
    # Worker processes (ray::IDLE) listen the same way once they exist; none may be up yet.
    assert exposed - {"ray::IDLE"} == HEAD_WILDCARD, sockets
    dashboard = [ip for label, ip, _ in sockets if label == "ray dashboard"]
    assert dashboard
    assert all(_is_loopback(ip) for ip in dashboard)  # --dashboard-host=127.0.0.1


# --- 2. refusals at start ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "address", ["10.0.0.5:6379", "ray://head.example.org:10001", "auto", "[2001:db8::1]:6379"]
)
@pytest.mark.parametrize("auth_mode", [None, "disabled"])
def test_ray_off_loopback_without_token_auth_is_refused_before_connecting(
    address: str, auth_mode: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if auth_mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", auth_mode)
    with pytest.raises(RayAuthError, match=r"ray\.address=.*export RAY_AUTH_MODE=token"):
        ensure_ray(RayConfig(address=address))  # raises before it looks for a Ray
    assert ray_auth_problem(address, "token") is None


@pytest.mark.parametrize("address", [None, "127.0.0.1:6379", "localhost:6379", "[::1]:6379"])
def test_ray_on_loopback_needs_no_token_auth(address: str | None) -> None:
    assert ray_auth_problem(address, "disabled") is None
    assert ray_auth_problem(address, None) is None


def test_start_servers_refuses_an_unvalidated_non_loopback_config(tmp_path: Path) -> None:
    # `model_construct` skips validation; `start_servers` checks again before anything starts.
    cfg = ServersConfig.model_construct(host="0.0.0.0", state_dir=tmp_path / "servers")
    with pytest.raises(ServersError, match=r"servers\.prefect_auth_string and servers\.mlflow"):
        start_servers(cfg, tmp_path)
    assert not (tmp_path / "servers").exists()


def test_mlflow_legacy_default_admin_password_is_refused_and_not_shown() -> None:
    overrides = ["servers.host=0.0.0.0", "servers.prefect_auth_string=ops:a-long-password"]
    overrides.append(f"servers.mlflow_admin_password={MLFLOW_LEGACY_DEFAULT_PASSWORD}")
    with pytest.raises(ConfigError, match=r"servers\.mlflow_admin_password = <hidden>: must not"):
        servers_from_recipe(None, overrides)


# --- 3. unauthenticated requests --------------------------------------------------------------


def test_prefect_api_rejects_requests_without_the_auth_string(stack: Stack) -> None:
    api = stack.states["prefect"].api_url
    user, password = stack.prefect_auth.split(":", 1)
    filter_flows = f"{api}/flows/filter"
    codes = {
        "no auth": _http(filter_flows, body=b"{}"),
        "wrong password": _http(filter_flows, _basic(user, "wrong-password"), b"{}"),
        "auth string": _http(filter_flows, _basic(user, password), b"{}"),
        "health, no auth": _http(f"{api}/health"),  # probes stay open, by design
    }
    _FIGURES["prefect_http"] = codes
    assert codes == {
        "no auth": 401,
        "wrong password": 401,
        "auth string": 200,
        "health, no auth": 200,
    }


def test_mlflow_rejects_requests_without_credentials(stack: Stack) -> None:
    search = f"{stack.states['mlflow'].api_url}/api/2.0/mlflow/experiments/search?max_results=1"
    user = stack.servers_cfg.mlflow_admin_username
    codes = {
        "no auth": _http(search),
        "wrong password": _http(search, _basic(user, "wrong-password-123")),
        "legacy default password": _http(search, _basic(user, MLFLOW_LEGACY_DEFAULT_PASSWORD)),
        "admin password": _http(search, _basic(user, stack.mlflow_password)),
    }
    _FIGURES["mlflow_http"] = codes
    assert codes == {
        "no auth": 401,
        "wrong password": 401,
        "legacy default password": 401,
        "admin password": 200,
    }


def assert_token_required(codes: dict[str, dict[str, str]]) -> None:
    """Every server refused the calls without or with a wrong token, and took the right one."""
    for name, by_token in codes.items():
        assert by_token["no token"] == "UNAUTHENTICATED", (name, by_token)
        assert by_token["wrong token"] == "UNAUTHENTICATED", (name, by_token)
        assert by_token.get("the token", "OK") == "OK", (name, by_token)


def test_lmpipe_local_ray_rejects_grpc_calls_without_the_token(stack: Stack) -> None:
    node = stack.lmpipe_ray
    codes = _grpc_codes(
        node,
        {
            "gcs": (node.ports["gcs"], _GCS_NODES),
            "raylet": (node.ports["node_manager"], _RAYLET_STATS),
            "object manager": (node.ports["object_manager"], _OBJECT_PULL),
        },
    )
    _FIGURES["lmpipe_ray_grpc"] = codes
    assert_token_required(codes)


def test_ray_head_rejects_grpc_calls_without_the_token(stack: Stack) -> None:
    head = stack.head
    codes = _grpc_codes(
        head,
        {
            "gcs": (head.ports["gcs"], _GCS_NODES),
            "raylet": (head.ports["node_manager"], _RAYLET_STATS),
            "object manager": (head.ports["object_manager"], _OBJECT_PULL),
            "dashboard agent": (head.ports["agent_grpc"], _AGENT_TRACEBACK),
            "ray client server": (head.ports["client"], _CLIENT_PING),
        },
    )
    _FIGURES["ray_head_grpc"] = codes
    assert_token_required(codes)


def test_ray_dashboard_and_job_api_reject_requests_without_the_token(stack: Stack) -> None:
    base = f"http://127.0.0.1:{stack.head.ports['dashboard']}"
    bearer = {"Authorization": f"Bearer {stack.head.token}"}
    job = json.dumps({"entrypoint": "echo should-never-run"}).encode()
    codes = {
        "list jobs, no token": _http(f"{base}/api/jobs/"),
        "list jobs, wrong token": _http(f"{base}/api/jobs/", {"Authorization": "Bearer 00"}),
        "submit job, no token": _http(f"{base}/api/jobs/", body=job),
        "cluster status, no token": _http(f"{base}/api/cluster_status"),
        "list jobs, the token": _http(f"{base}/api/jobs/", bearer),
        # Read-only Prometheus metrics on every interface: Ray does not authenticate them.
        "metrics, no token": _http(f"http://127.0.0.1:{stack.head.ports['metrics']}/metrics"),
    }
    _FIGURES["ray_head_http"] = codes
    assert codes == {
        "list jobs, no token": 401,
        "list jobs, wrong token": 403,
        "submit job, no token": 401,
        "cluster status, no token": 401,
        "list jobs, the token": 200,
        "metrics, no token": 200,
    }
