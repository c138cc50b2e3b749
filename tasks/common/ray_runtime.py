"""How stage work reaches Ray: plain Ray tasks over work units, a bounded number in flight.

One Prefect task per stage drives these Ray tasks from its process (the driver). A local Ray is
started on first use, bound to 127.0.0.1 and sized so its own tasks never starve (docs/stack.md, "A
local Ray with room for its own tasks"); with `ray.address` set, the same code runs on a cluster.
`check_storage` refuses a workspace that the cluster's other nodes cannot see (a local path on
several nodes), and `ensure_ray` refuses a non-loopback cluster without token authentication
(`RAY_AUTH_MODE=token`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)
T = TypeVar("T")


class RayConfig(BaseModel):
    """Where Ray runs and how much of it the data stages use."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    address: str | None = Field(
        None,
        description="Cluster address ('ray://host:10001' or 'host:6379'); None starts a local Ray.",
    )
    num_workers: int = Field(
        2, ge=1, le=4096, description="Ray tasks a data stage keeps in flight at once."
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="Logical CPUs of a local Ray; default the usable cores (at least "
        "num_workers) + 2.",
    )
    object_store_mb: int = Field(
        256, ge=80, description="Object store size of a local Ray, in MiB."
    )
    shared_storage: bool = Field(
        False,
        description="All nodes see the workspace path (e.g. NFS, or all nodes on one host); "
        "without it a local workspace path on a multi-node cluster is refused.",
    )
    local_max_mb: float = Field(
        8.0,
        ge=0,
        description="A data stage whose input is at most this many MiB runs its work units in "
        "the command's own process when no Ray is connected or configured (address, "
        "RAY_ADDRESS): starting or joining Ray and warming its workers costs seconds, more "
        "than such a stage's work. 0 sends every stage of more than one unit to Ray.",
    )

    def runs_locally(self, input_bytes: int | None) -> bool:
        """Whether a stage reading `input_bytes` (None: unknown) stays out of Ray's way."""
        limit = self.local_max_mb * (1 << 20)
        return input_bytes is not None and limit > 0 and input_bytes <= limit


class StorageError(RuntimeError):
    """The workspace is a local path that other nodes of the Ray cluster cannot see."""


class RayAuthError(RuntimeError):
    """`ray.address` names a cluster off this machine, but Ray token auth is not turned on."""


LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


def address_host(address: str) -> str:
    """The host part of a Ray address: 'ray://h:10001', 'h:6379', '[::1]:6379' or 'auto'."""
    return urlsplit(address if "://" in address else f"//{address}").hostname or address


def ray_auth_problem(address: str | None, auth_mode: str | None) -> str | None:
    """Say why connecting to `address` with `RAY_AUTH_MODE=auth_mode` is refused; None if not.

    A local Ray (no address) and a cluster on loopback are fine either way. Any other address,
    `auto` included (the cluster `ray start` left on this host, whose servers may listen on
    every interface), needs token auth: without it the driver talks to the cluster, and
    listens itself, unauthenticated.
    """
    if address is None or address_host(address) in LOOPBACK_HOSTS:
        return None
    if (auth_mode or "").lower() == "token":
        return None
    return (
        f"ray.address={address!r} is not a loopback address (127.0.0.1, ::1, localhost), so "
        "Ray token authentication must be on: export RAY_AUTH_MODE=token, with the cluster's "
        f"token in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH (RAY_AUTH_MODE is {auth_mode!r})"
    )


# A URI scheme of two or more letters: one letter is a Windows drive (C:/...), not a URI.
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")


def is_remote_uri(path: str | Path) -> bool:
    """Whether `path` names storage every node reaches (s3://, gs://, ...), not a local file."""
    match = _URI.match(str(path))
    return match is not None and match.group(1).lower() != "file"


def storage_problem(workspace: str | Path, nodes: int, shared_storage: bool) -> str | None:
    """Say why `workspace` cannot serve a cluster of `nodes` alive nodes; None when it can.

    A local path is fine on one node, or when the config says every node sees it
    (`ray.shared_storage`); a remote URI is always fine.
    """
    if nodes <= 1 or shared_storage or is_remote_uri(workspace):
        return None
    return (
        f"workspace {workspace} is a local path, but the Ray cluster has {nodes} nodes: "
        "workers on the other nodes would not see its files. Put the workspace on storage "
        "every node mounts at the same path (NFS, a shared disk) and set "
        "ray.shared_storage=true (also right when every node runs on this host), or use a "
        "cloud URI (s3://, gs://, ...)"
    )


def alive_nodes() -> int:
    """Count the alive nodes (distinct node ids) of the connected Ray cluster."""
    import ray

    return len({node["NodeID"] for node in ray.nodes() if node.get("Alive")})


def check_storage(cfg: RayConfig, workspace: str | Path) -> None:
    """Refuse a local workspace path on a multi-node Ray cluster unless storage is shared.

    Cheap: nothing is contacted when the answer does not depend on the cluster (no address,
    a remote URI, or `shared_storage`); otherwise one `ray.nodes()` call after `ensure_ray`.

    Raises:
        StorageError: the workspace is local and the cluster has more than one alive node.
    """
    if cfg.address is None or cfg.shared_storage or is_remote_uri(workspace):
        return
    ensure_ray(cfg)
    problem = storage_problem(workspace, alive_nodes(), cfg.shared_storage)
    if problem is not None:
        raise StorageError(problem)


#: Logical CPUs a local Ray keeps beyond what its workers take, for the tasks that feed them.
RESERVED_CPUS = 2


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs this process's cgroup may use (v2 `cpu.max`, or v1's CFS quota); None: no limit."""
    v2 = root / "cpu.max"
    try:
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by the cgroup's CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity outside Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, int(quota))  # a fraction of a core more is throttled, not used
    return max(1, cores)


def local_ray_cpus(cfg: RayConfig) -> int:
    """The logical CPUs a local Ray starts with.

    `ray.num_cpus` when set, else the usable cores (at least `ray.num_workers`) plus
    `RESERVED_CPUS`, so that training workers that take the cores leave room for the tasks
    that feed them (docs/stack.md).
    """
    return cfg.num_cpus or max(cfg.num_workers, usable_cores()) + RESERVED_CPUS


def ensure_ray(cfg: RayConfig) -> None:
    """Connect to the configured Ray cluster, or start a local one, unless already connected.

    A local Ray listens on 127.0.0.1 only (see `_loopback_node_ip`), and so does this driver when
    it joins a cluster on loopback.

    Raises:
        RayAuthError: `cfg.address` is not on loopback and `RAY_AUTH_MODE` is not `token`.
    """
    problem = ray_auth_problem(cfg.address, os.environ.get("RAY_AUTH_MODE"))
    if problem is not None:
        raise RayAuthError(problem)
    import ray  # here, not at the top: `RayConfig` validates without importing Ray

    if ray.is_initialized():
        return
    runtime_env = {"env_vars": dict(WORKER_ENV)}
    if cfg.address and address_host(cfg.address) not in LOOPBACK_HOSTS:
        ray.init(address=cfg.address, runtime_env=runtime_env, log_to_driver=False)
        return
    with _loopback_node_ip():
        if cfg.address:
            ray.init(address=cfg.address, runtime_env=runtime_env, log_to_driver=False)
            return
        if _join_provided_node(cfg):
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        # A local Ray's workers inherit the raylet's environment, so the variables are set
        # while `ray.init` starts it, not as a job runtime_env: Ray prestarts its workers
        # without the job's runtime_env, could not use them for its tasks, and would start
        # a second set (measured: 2 idle workers of 80 MiB each, and a slower first task).
        with scoped_environ(WORKER_ENV), keep_sigterm_handler():
            ray.init(
                num_cpus=local_ray_cpus(cfg),
                object_store_memory=cfg.object_store_mb << 20,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
            )


#: What a local Ray's workers inherit: one thread each keeps 2-core machines from
#: oversubscribing.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
#: Who provides a running local Ray node (the command daemon's, `use_local_node`), if anyone.
_NODE_PROVIDER: list[Callable[[int, int], str | None]] = []
_NODE_WAIT_S = 120.0


def use_local_node(provider: Callable[[int, int], str | None]) -> None:
    """Join the local Ray node `provider(num_cpus, object_store_mb)` names instead of starting one.

    The command daemon keeps one (pipelines/daemon/ray_node.py), so that a command pays a
    driver's connection, not a node's start and stop. The provider answers the node's GCS
    address, or None when it has none to give.
    """
    _NODE_PROVIDER[:] = [provider]


def prepare_local_node(cfg: RayConfig, input_bytes: int | None = None) -> None:
    """Have the provided local node start now, if this command would join one (a no-op else).

    A command calls this once its recipe is loaded, with the size of its corpus (None when
    unknown, e.g. remote): the node then starts while the command sets up its Prefect API and
    flow, rather than when its first stage needs Ray. A corpus small enough that its stages
    run in the command's process (`RayConfig.runs_locally`) starts none: on a small machine a
    booting node takes the cores the command's own work needs, and whatever needs Ray later
    (a multi-worker training) asks for the node then.
    """
    if cfg.runs_locally(input_bytes):
        return
    if _NODE_PROVIDER and not cfg.address and not os.environ.get("RAY_ADDRESS"):
        _NODE_PROVIDER[0](local_ray_cpus(cfg), cfg.object_store_mb)


def local_node_command(
    num_cpus: int, object_store_mb: int, port: int, client_port: int, temp_dir: Path
) -> list[str]:
    """`ray start` arguments of a local node as `ensure_ray` would start it: loopback only.

    Run with `local_node_env`; `--block` keeps the command in the foreground, and SIGTERM to it
    stops the node's processes. Its own `temp_dir`: `ray start` writes the address of the
    cluster it starts into `<temp dir>/ray_current_cluster`, which a plain `ray.init()` on this
    machine would then join instead of starting its own Ray (and fail on its `num_cpus`).
    """
    return [
        *("start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--port={port}"),
        f"--temp-dir={temp_dir}",
        f"--ray-client-server-port={client_port}",
        f"--num-cpus={num_cpus}",
        f"--object-store-memory={object_store_mb << 20}",
        *("--include-dashboard=false", "--disable-usage-stats"),
    ]


def local_node_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of `local_node_command`: `base`, the workers' variables, loopback only.

    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 is what `_loopback_node_ip` sets in this process: the
    node keeps 127.0.0.1 as its address, so its servers listen on loopback only.
    """
    return (
        base
        | WORKER_ENV
        | {
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
        }
    )


def _join_provided_node(cfg: RayConfig) -> bool:
    """Connect to the provided local node, once its GCS answers; False if there is none."""
    if not _NODE_PROVIDER:
        return False
    address = _NODE_PROVIDER[0](local_ray_cpus(cfg), cfg.object_store_mb)
    if address is None:
        return False
    import socket
    import time

    import ray

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + _NODE_WAIT_S
    while True:  # a node just asked for is still starting: its GCS port opens first
        try:
            socket.create_connection((host, int(port)), timeout=1.0).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                log.warning("the local Ray node at %s never answered; starting one", address)
                return False
            time.sleep(0.05)
    ray.init(address=address, log_to_driver=False)
    return True


@contextlib.contextmanager
def keep_sigterm_handler() -> Iterator[None]:
    """Put back, after the block, a Python SIGTERM handler that the block replaced.

    `ray.init` starting a local Ray installs its own handler (stop the node's processes, then
    `sys.exit`), which ended the CLI with a crash instead of its exit 143. The CLI's handler
    raises instead, and Ray's processes still stop: `ray.shutdown` runs at exit. Without a
    Python handler (the default action) Ray's stays, so a plain process still cleans up.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread sets handlers; Ray leaves them alone there too
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def scoped_environ(env: dict[str, str]) -> Iterator[None]:
    """Set `env` in this process for the duration of the block, then restore what was there."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _loopback_node_ip() -> Iterator[None]:
    """Keep 127.0.0.1 as the node IP while `ray.init` runs, so that Ray binds loopback only.

    Ray 2.60 has no bind-address setting. Its gRPC servers (GCS, raylet, object manager, core
    workers, agents) listen on 127.0.0.1 when the node IP is exactly "127.0.0.1" and on every
    interface otherwise (GcsServer, NodeManager and GrpcServer::Run in Ray's C++ source). But
    `ray.init` rewrites a loopback node IP or GCS address to the host's address unless
    `ray_constants.ENABLE_RAY_CLUSTER` is false: the constant behind the documented
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read once when Ray is imported, hence set here.
    The processes that `ray.init` starts are given the IP explicitly and need nothing.
    tests/reliability/test_security_servers.py lists the sockets, so a Ray upgrade that
    breaks this fails there.
    """
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def run_units(
    fn: Callable[..., T],
    items: Sequence[Any],
    ray_cfg: RayConfig,
    on_done: Callable[[int, T], None] | None = None,
    sizes: Sequence[int] | None = None,
    input_bytes: int | None = None,
) -> list[T]:
    """Run a stage's `fn(item)` for every work unit; results in input order.

    On Ray (`ensure_ray`, then `map_bounded` with `ray_cfg.num_workers` in flight), except,
    with no Ray connected or configured (`ray.address`, `RAY_ADDRESS`), a job of one unit or
    one whose input is small (`input_bytes` within `ray.local_max_mb`): that runs here, since
    starting or joining Ray and warming its workers (seconds) would cost more than the work.
    """
    connected = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    cluster = ray_cfg.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    small = len(items) <= 1 or ray_cfg.runs_locally(input_bytes)
    if small and not connected and not cluster:
        results = []
        for index, item in enumerate(items):
            results.append(fn(item))
            if on_done is not None:
                on_done(index, results[index])
        return results
    ensure_ray(ray_cfg)
    return map_bounded(fn, items, ray_cfg.num_workers, on_done, sizes)


def map_bounded(
    fn: Callable[..., T],
    items: Sequence[Any],
    max_in_flight: int,
    on_done: Callable[[int, T], None] | None = None,
    sizes: Sequence[int] | None = None,
) -> list[T]:
    """Run `fn(item)` as Ray tasks, at most `max_in_flight` at once; results in input order.

    With `sizes`, the largest items are started first, so that no big item is left running
    alone at the end (longest-processing-time-first scheduling). The first task error is
    re-raised after the others in flight are cancelled.
    """
    import ray

    remote = ray.remote(num_cpus=1, max_retries=2)(fn)
    results: dict[int, T] = {}
    pending: dict[Any, int] = {}
    order = list(range(len(items)))
    if sizes is not None:
        order.sort(key=lambda i: -sizes[i])  # stable: equal sizes keep their order
    queue: Iterator[tuple[int, Any]] = ((i, items[i]) for i in order)
    try:
        for index, item in queue:
            pending[remote.remote(item)] = index
            if len(pending) >= max_in_flight:
                _collect_one(pending, results, on_done)
        while pending:
            _collect_one(pending, results, on_done)
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return [results[i] for i in range(len(items))]


def _collect_one(
    pending: dict[Any, int], results: dict[int, T], on_done: Callable[[int, T], None] | None
) -> None:
    import ray

    done, _ = ray.wait(list(pending), num_returns=1)
    index = pending.pop(done[0])
    results[index] = ray.get(done[0])
    if on_done is not None:
        on_done(index, results[index])
