"""`lmpipe submit` against a real two-node Ray cluster on this machine, plus its pure helpers.

The cluster is this module's own: `ray start --head` and `ray start --address` as subprocesses,
each node with its own temp dir (so the nodes never share `runtime_resources`: docs/stack.md, "Ray
nodes on one host, and checkpoint registration"), its own ports and resources, token auth with a
token file under the cluster's folder, and the dashboard on 127.0.0.1. It is stopped by killing
exactly the processes it started.

Ray 2.60's multi-node GCS and raylet listen on every interface whatever `--node-ip-address`
says (docs/cluster.md), so the whole cluster, and every client the tests run against it, lives
in a private network namespace whose only interface is `lo`: nothing the cluster opens is
reachable from outside this machine's loopback, which
`test_cluster_listens_only_on_its_private_loopback` checks socket by socket.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from pipelines.ops.submit import (
    WORKING_DIR_EXCLUDES,
    SubmitError,
    build_entrypoint,
    build_runtime_env,
    recipe_in_project,
    refused_overrides,
    resolve_address,
    validate_recipe,
)

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent
RECIPE = "configs/demo.yaml"


# --- the local two-node cluster ---------------------------------------------------------------


@dataclass
class Loopback:
    """A private network namespace with only `lo` (up), held open by one `sleep` process.

    Unprivileged, it needs a user namespace too (`unshare -rn`); as root a network namespace
    alone does. `command` wraps an argv so that it runs inside.
    """

    holder: subprocess.Popen[bytes]
    nsenter: list[str]

    @classmethod
    def open(cls) -> Loopback:
        user = os.geteuid() != 0
        unshare = ["unshare", "--net", *(["--map-root-user"] if user else [])]
        holder = subprocess.Popen(
            [*unshare, "sh", "-c", "ip link set lo up && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        assert holder.stdout is not None
        assert holder.stderr is not None
        if holder.stdout.readline() != b"up\n" or _net_devices(holder.pid) != ["lo"]:
            holder.kill()
            why = holder.stderr.read().decode(errors="replace").strip()
            raise OSError(f"cannot open a private network namespace: {why}")
        flags = ["--net", *(["--user", "--preserve-credentials"] if user else [])]
        return cls(holder, ["nsenter", f"--target={holder.pid}", *flags, "--"])

    def command(self, argv: list[str]) -> list[str]:
        return [*self.nsenter, *argv]

    @property
    def inode(self) -> str:
        return os.readlink(f"/proc/{self.holder.pid}/ns/net")

    def close(self) -> None:
        self.holder.kill()  # the one process this class started, by its handle
        self.holder.wait(timeout=10)


def _net_devices(pid: int) -> list[str]:
    """The interfaces of `pid`'s network namespace, from /proc/PID/net/dev."""
    lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return sorted(line.split(":", 1)[0].strip() for line in lines)


@dataclass
class LocalCluster:
    """A head and a worker node started by this module, and how to reach them."""

    root: Path
    gcs_port: int
    dashboard_url: str
    client_env: dict[str, str]
    loopback: Loopback
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def run(
        self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run a client command inside the cluster's namespace, from the project directory."""
        return subprocess.run(
            self.loopback.command(argv),
            env=self.client_env if env is None else env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )


def _free_ports(count: int) -> list[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("", 0))  # free here too; the cluster's namespace starts empty
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _free_range(size: int) -> int:
    # Below the kernel's ephemeral range (32768+) and above the session Ray's default worker
    # ports (10002-19999), so neither picks a port of ours.
    for _ in range(50):
        base = random.randrange(20000, 32000 - size)
        try:
            for port in range(base, base + size):
                with socket.socket() as sock:
                    sock.bind(("", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free range of worker ports")


def _start_node(cluster: LocalCluster, name: str, args: list[str]) -> None:
    log = cluster.root / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            # --block keeps `ray start` as the parent of every process of the node; nsenter
            # execs it (no fork without a PID namespace), so `proc` is `ray start` itself.
            cluster.loopback.command(
                [str(VENV_BIN / "ray"), "start", "--block", "--disable-usage-stats", *args]
            ),
            env=cluster.client_env | {"PREFECT_HOME": str(cluster.root / "prefect")},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    cluster.procs.append(proc)
    deadline = time.monotonic() + 120
    while b"block forever" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"ray node {name} did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def _node_args(cluster: LocalCluster, name: str, workers: int) -> list[str]:
    ports = _free_ports(6)
    base = _free_range(workers)
    return [
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={cluster.root / name}",  # per node: no shared runtime_resources
        f"--node-manager-port={ports[0]}",
        f"--object-manager-port={ports[1]}",
        f"--dashboard-agent-listen-port={ports[2]}",
        f"--dashboard-agent-grpc-port={ports[3]}",
        f"--runtime-env-agent-port={ports[4]}",
        f"--metrics-export-port={ports[5]}",
        f"--min-worker-port={base}",
        f"--max-worker-port={base + workers - 1}",
        "--object-store-memory=100000000",
    ]


def _tree(cluster: LocalCluster) -> list[psutil.Process]:
    """Every live process of the cluster: each `ray start` and its descendants."""
    tree = []
    for proc in cluster.procs:
        try:
            root = psutil.Process(proc.pid)
            tree += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return tree


def _stop(cluster: LocalCluster, grace_s: float = 5.0) -> None:
    """Stop exactly the processes this module started: SIGTERM, then SIGKILL what is left."""
    seen = _tree(cluster)
    for proc in cluster.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node on SIGTERM
    _, alive = psutil.wait_procs(seen, timeout=grace_s)
    # Whatever did not exit in time, and anything started since the first look; plus any
    # process with this cluster's unique temp dir in its command line (reparented strays).
    leftovers = {p.pid: p for p in [*alive, *_tree(cluster)] if p.is_running()}
    for p in psutil.process_iter(["cmdline"]):
        if any(str(cluster.root) in arg for arg in p.info["cmdline"] or ()):
            leftovers[p.pid] = p
    for p in leftovers.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(list(leftovers.values()), timeout=10)
    for proc in cluster.procs:
        proc.wait(timeout=10)  # reap our direct children


def _wait_for_nodes(cluster: LocalCluster, count: int) -> None:
    # Through the dashboard's state API, in a process that holds the cluster's token.
    script = f"""
import time
from ray.util.state import list_nodes
deadline = time.monotonic() + 60
alive = [("state", "=", "ALIVE")]
while len(list_nodes(address="{cluster.dashboard_url}", filters=alive)) < {count}:
    if time.monotonic() > deadline:
        raise SystemExit("the cluster never had {count} alive nodes")
    time.sleep(0.5)
"""
    result = cluster.run([sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    """A head (2 CPUs) and a worker node (2 CPUs + `worker_node`) on this machine."""
    # Short: Ray's unix socket paths live under it, and those are limited to ~107 characters.
    root = Path(tempfile.mkdtemp(prefix="lmp-", dir="/tmp"))
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PREFECT_API"))}
    env |= {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_USAGE_STATS_ENABLED": "0",
        # The job's entrypoint runs `python`: the venv's, as on a cluster built from one image.
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    gcs_port, dashboard_port, client_port = _free_ports(3)
    try:
        loopback = Loopback.open()
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"no private network namespace for the test cluster here: {exc}")
    cluster = LocalCluster(root, gcs_port, f"http://127.0.0.1:{dashboard_port}", env, loopback)
    try:
        head = [
            "--head",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--ray-client-server-port={client_port}",
            "--num-cpus=2",
        ]
        _start_node(cluster, "head", head + _node_args(cluster, "h", 60))
        worker = [f"--address=127.0.0.1:{gcs_port}", "--num-cpus=2"]
        worker.append('--resources={"worker_node": 1}')
        _start_node(cluster, "worker", worker + _node_args(cluster, "w", 60))
        _wait_for_nodes(cluster, 2)
        yield cluster
    finally:
        _stop(cluster)
        loopback.close()
        shutil.rmtree(root, ignore_errors=True)


def _lmpipe(
    cluster: LocalCluster, args: list[str], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    return cluster.run([str(VENV_BIN / "lmpipe"), *args], env, timeout_s)


@pytest.mark.slow
@pytest.mark.integration
def test_two_node_cluster_refuses_local_workspace_unless_shared(ray_cluster: LocalCluster) -> None:
    script = f"""
from tasks.common.ray_runtime import RayConfig, StorageError, check_storage
cfg = RayConfig(address="127.0.0.1:{ray_cluster.gcs_port}")
check_storage(cfg.model_copy(update={{"shared_storage": True}}), "/tmp/lmpipe-ws")
check_storage(cfg, "s3://bucket/lmpipe-ws")
try:
    check_storage(cfg, "/tmp/lmpipe-ws")
except StorageError as exc:
    print("REFUSED:", exc)
"""
    result = ray_cluster.run([sys.executable, "-c", script])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED: workspace /tmp/lmpipe-ws is a local path" in result.stdout
    assert "the Ray cluster has 2 nodes" in result.stdout
    assert "ray.shared_storage=true" in result.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_submit_refuses_local_workspace_on_two_nodes_before_submitting(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    args = [
        "submit",
        RECIPE,
        f"workspace={tmp_path / 'ws'}",
        "--address",
        ray_cluster.dashboard_url,
    ]
    result = _lmpipe(ray_cluster, args, ray_cluster.client_env, timeout_s=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"workspace {tmp_path / 'ws'} is a local path" in result.stderr
    assert "the Ray cluster has 2 nodes" in result.stderr
    assert "submitted Ray job" not in result.stdout


@pytest.mark.slow
@pytest.mark.integration
def test_job_server_refuses_a_client_without_the_clusters_token(ray_cluster: LocalCluster) -> None:
    # This client holds another token: the cluster's own is only in its token file.
    script = f"""
from pipelines.ops.submit import SubmitError, connect
try:
    connect("{ray_cluster.dashboard_url}")
except SubmitError as exc:
    print("REFUSED:", exc)
"""
    env = ray_cluster.client_env | {"RAY_AUTH_TOKEN_PATH": str(ray_cluster.root / "other")}
    (ray_cluster.root / "other").write_text(secrets.token_hex(32))
    result = ray_cluster.run([sys.executable, "-c", script], env)
    assert result.returncode == 0, result.stderr[-3000:]
    refused = r"(?is)REFUSED: cannot reach the Ray job server.*authentication"
    assert re.search(refused, result.stdout)


@pytest.mark.slow
@pytest.mark.integration
def test_cluster_listens_only_on_its_private_loopback(ray_cluster: LocalCluster) -> None:
    # On the host's network, Ray rewrites the node IP 127.0.0.1 to the host's address and its
    # GCS and raylet bind every interface. In a namespace with `lo` alone there is no such
    # address: the node IP stays 127.0.0.1 and every server binds loopback, which is checked
    # here address by address, with the namespace as a second wall.
    assert _net_devices(ray_cluster.loopback.holder.pid) == ["lo"]
    assert ray_cluster.loopback.inode != os.readlink("/proc/self/ns/net")
    listening: dict[str, list[str]] = {}
    for proc in _tree(ray_cluster):
        with contextlib.suppress(psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            if sockets := _listening(proc.pid):
                assert os.readlink(f"/proc/{proc.pid}/ns/net") == ray_cluster.loopback.inode
                listening.setdefault(proc.name(), []).extend(sockets)
    assert {"gcs_server", "raylet"} <= set(listening), listening
    assert f"127.0.0.1:{ray_cluster.gcs_port}" in listening["gcs_server"], listening
    wide = {name: [a for a in found if not _loopback(a)] for name, found in listening.items()}
    assert not any(wide.values()), f"listening beyond loopback: {wide}"


def _listening(pid: int) -> list[str]:
    """`ADDRESS:PORT` of every TCP socket `pid` listens on, read in its own namespace.

    psutil matches a process's socket inodes against the caller's /proc/net/tcp, so it sees
    nothing in another network namespace; /proc/PID/net/tcp{,6} is the process's own table.
    """
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(fd)
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                address, port = fields[1].split(":")
                found.append(f"{_address(address)}:{int(port, 16)}")
    return found


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address of /proc/net/tcp (little-endian 32-bit words); IPv4-mapped IPv6 as IPv4."""
    words = [bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8)]
    address = ipaddress.ip_address(b"".join(words))
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped or address


def _loopback(listen: str) -> bool:
    return ipaddress.ip_address(listen.rsplit(":", 1)[0]).is_loopback


@pytest.mark.slow
@pytest.mark.integration
def test_submit_tiny_pipeline_to_two_node_cluster_registers_model(
    ray_cluster: LocalCluster, tmp_path: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from tasks.demo.synthetic import SyntheticConfig, write_corpus

    write_corpus(tmp_path / "demo", SyntheticConfig(documents=200, task_examples=10))
    tracking_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        "name=cluster-demo",
        f"workspace={tmp_path / 'ws'}",
        f"ingest.sources.0.path={tmp_path / 'demo' / 'corpus'}",
        "task=null",  # pretraining and its evaluation only: fine-tuning is tested elsewhere
        f"tracking.tracking_uri={tracking_uri}",
        "ray.address=auto",  # the job's RAY_ADDRESS: the cluster it runs on
        "ray.shared_storage=true",  # both nodes are on this host
        "tokenizer.vocab_size=256",
        "train.model.size=tiny",
        "train.max_steps=4",
        "train.checkpoint.every_steps=4",
        "train.eval.every_steps=4",
        "train.eval.max_samples=16",
        "evaluate.intrinsic.heldout_max_samples=16",
    ]
    # The session's Prefect API is on the host's loopback, out of the cluster's namespace: the
    # job's flow runs on Prefect's ephemeral API (under the nodes' PREFECT_HOME) instead.
    args = ["submit", RECIPE, *overrides, "--address", ray_cluster.dashboard_url]
    result = _lmpipe(ray_cluster, args, ray_cluster.client_env, timeout_s=400)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert "submitted Ray job raysubmit_" in result.stdout
    assert f"ray job stop --address {ray_cluster.dashboard_url} raysubmit_" in result.stdout
    assert "SUCCEEDED" in result.stdout
    versions = MlflowClient(tracking_uri).search_model_versions("name='cluster-demo-bert'")
    assert [int(v.version) for v in versions] == [1]
    # The printed job id is a real Ray job: Ray's own CLI finds it, its status and its logs.
    found = re.search(r"submitted Ray job (raysubmit_\w+)", result.stdout)
    assert found, result.stdout[-3000:]
    job_id = found.group(1)
    ray_cli = [str(VENV_BIN / "ray"), "job"]
    where = ["--address", ray_cluster.dashboard_url, job_id]
    status = ray_cluster.run([*ray_cli, "status", *where])
    assert status.returncode == 0, status.stderr[-3000:]
    assert f"Job '{job_id}' succeeded" in status.stdout, status.stdout  # Ray's CLI wording
    logs = ray_cluster.run([*ray_cli, "logs", *where])
    assert logs.returncode == 0, logs.stderr[-3000:]
    assert "registered model (pretrain): cluster-demo-bert version 1" in logs.stdout
    # No terminal on a cluster: the pretraining's progress is in the job's log, line by line.
    assert "pretrain bert-tiny: done at step 4/4" in logs.stdout


# --- pure helpers (no cluster) ----------------------------------------------------------------


def test_resolve_address_prefers_flag_then_api_server_then_http_ray_address() -> None:
    env = {"RAY_API_SERVER_ADDRESS": "http://a:8265", "RAY_ADDRESS": "http://b:8265"}
    assert resolve_address("http://c:8265/", env) == "http://c:8265"
    assert resolve_address(None, env) == "http://a:8265"
    assert resolve_address(None, {"RAY_ADDRESS": "https://b:443"}) == "https://b:443"
    with pytest.raises(SubmitError, match="no Ray cluster to submit to"):
        resolve_address(None, {"RAY_ADDRESS": "10.0.0.1:6379"})  # a GCS address: not a job server


def test_resolve_address_refuses_a_gcs_address_as_flag() -> None:
    with pytest.raises(SubmitError, match="--address='head:6379' is not the dashboard URL"):
        resolve_address("head:6379", {})


def test_recipe_outside_project_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "r.yaml"
    outside.write_text("name: x\n")
    with pytest.raises(SubmitError, match="outside the project directory"):
        recipe_in_project(outside, REPO)
    assert recipe_in_project(REPO / RECIPE, REPO) == RECIPE


def test_validate_recipe_refuses_relative_workspace_and_secrets() -> None:
    with pytest.raises(SubmitError, match="workspace='workspace' is relative"):
        validate_recipe(REPO, RECIPE, [])
    with pytest.raises(SubmitError, match="relative SQLite path"):
        validate_recipe(REPO, RECIPE, ["workspace=/mnt/ws", "tracking.tracking_uri=sqlite:///m.db"])
    with pytest.raises(SubmitError, match=r"tracking\.password sets a secret"):
        validate_recipe(REPO, RECIPE, ["workspace=/mnt/ws", "tracking.password=hunter2"])
    with pytest.raises(SubmitError, match=r"train\.max_steps"):
        validate_recipe(REPO, RECIPE, ["workspace=/mnt/ws", "train.max_steps=-1"])
    assert validate_recipe(REPO, RECIPE, ["workspace=/mnt/ws"]).workspace == Path("/mnt/ws")


def test_refused_overrides_names_only_secret_keys() -> None:
    overrides = [
        "prefect.api_key=k",
        "tokenizer.vocab_size=256",
        "name=token-run",
        "examples.mask.mask_token_prob=0.8",
        "x.auth_token=t",
        "ingest.sources.0.storage_options.key=k",
    ]
    assert refused_overrides(overrides) == [
        "prefect.api_key=k",
        "x.auth_token=t",
        "ingest.sources.0.storage_options.key=k",
    ]


def test_entrypoint_quotes_overrides_and_runs_the_stage() -> None:
    entry = build_entrypoint("pretrain", RECIPE, ["name=a b", "train.max_steps=4"])
    assert (
        entry == "python -m pipelines.cli.main pretrain configs/demo.yaml 'name=a b' "
        "train.max_steps=4"
    )
    with pytest.raises(SubmitError, match="stage 'deploy'"):
        build_entrypoint("deploy", RECIPE, [])


def test_runtime_env_ships_project_without_outputs_or_secrets() -> None:
    env = {
        "PREFECT_API_URL": "http://p:4200/api",
        "PREFECT_API_KEY": "secret",
        "MLFLOW_TRACKING_PASSWORD": "secret",
        "RAY_AUTH_MODE": "token",
    }
    runtime_env: dict[str, Any] = build_runtime_env(REPO, env, {"X": "1"}, ["data/"])
    assert runtime_env["working_dir"] == str(REPO)
    assert {".venv/", ".git/", "workspace/", "bench/results/", "data/"} <= set(
        runtime_env["excludes"]
    )
    assert runtime_env["env_vars"] == {
        "RAY_AUTH_MODE": "token",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "RAY_OVERRIDE_JOB_RUNTIME_ENV": "1",
        "PREFECT_API_URL": "http://p:4200/api",
        "X": "1",
    }


def test_excludes_repeat_gitignore_except_the_compiled_extension() -> None:
    lines = (REPO / ".gitignore").read_text().splitlines()
    ignored = {line.strip().lstrip("/") for line in lines if line.strip() and line[0] != "#"}
    assert ignored - {"*.so"} <= set(WORKING_DIR_EXCLUDES), ignored - set(WORKING_DIR_EXCLUDES)
    assert "*.so" not in WORKING_DIR_EXCLUDES  # the job imports the C extension


# --- infra manifests --------------------------------------------------------------------------


def _yaml(path: str) -> Any:
    return yaml.safe_load((REPO / path).read_text())


def test_ray_cluster_launcher_yaml_has_head_and_worker_types() -> None:
    cfg = _yaml("infra/ray/cluster.yaml")
    assert {"cluster_name", "provider", "available_node_types", "head_node_type"} <= set(cfg)
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    assert any(t["max_workers"] > 0 for name, t in types.items() if name != cfg["head_node_type"])
    assert "RAY_AUTH_MODE=token" in " ".join(cfg["head_start_ray_commands"])
    assert any("pip install" in c for c in cfg["setup_commands"])


def test_kuberay_raycluster_manifest_has_head_and_workers() -> None:
    cfg = _yaml("infra/kuberay/raycluster.yaml")
    assert (cfg["apiVersion"], cfg["kind"]) == ("ray.io/v1", "RayCluster")
    _check_cluster_spec(cfg["spec"])


def test_kuberay_rayjob_manifest_runs_lmpipe_on_a_cluster_spec() -> None:
    cfg = _yaml("infra/kuberay/rayjob.yaml")
    assert (cfg["apiVersion"], cfg["kind"]) == ("ray.io/v1", "RayJob")
    assert cfg["spec"]["entrypoint"].startswith("lmpipe run configs/")
    runtime_env = yaml.safe_load(cfg["spec"]["runtimeEnvYAML"])
    assert runtime_env["env_vars"]["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "1"
    _check_cluster_spec(cfg["spec"]["rayClusterSpec"])


def _check_cluster_spec(spec: dict[str, Any]) -> None:
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["limits"]["cpu"]
    token_env = [e for e in head["env"] if e["name"] == "RAY_AUTH_TOKEN"]
    assert token_env[0]["valueFrom"]["secretKeyRef"]["name"]
    assert {"name": "RAY_AUTH_MODE", "value": "token"} in head["env"]
    group = spec["workerGroupSpecs"][0]
    assert group["groupName"]
    assert group["maxReplicas"] >= group["minReplicas"] >= 0
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
