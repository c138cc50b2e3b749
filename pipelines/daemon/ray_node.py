"""The local Ray node the command daemon keeps for its commands.

A command that needs a local Ray (no `ray.address`) asks the daemon for one of its size (CPUs
and object store, `tasks.common.ray_runtime.local_ray_cpus`) and joins it as a driver: about a
second, against several seconds to start a node and one more to stop it at the command's end.
The node is `ray start --head --block` in a process of its own, bound to loopback like the node
a command starts itself (`ray_runtime.local_node_command`); SIGTERM to that process stops the
node's processes. The daemon answers with the node's address at once and the command waits for
its GCS to open (`ray_runtime.use_local_node`), so a node being started never blocks the
daemon's other answers. Nodes stop with the daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_STOP_WAIT_S = 30.0


@dataclass
class RayNode:
    """A `ray start --head --block` the daemon started: its pid and GCS address."""

    pid: int
    address: str
    num_cpus: int
    object_store_mb: int


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _stop_with_parent() -> None:
    """In the node's `ray start`, before exec: SIGTERM when the daemon dies, even killed."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def node_temp_dir(key: str) -> Path:
    """The temporary folder of the daemon `key`'s nodes (Ray's sessions, sockets and logs)."""
    return Path(tempfile.gettempdir()) / f"lmpipe-ray-{os.getuid()}-{key}"


def remove_node_temp_dir(key: str) -> None:
    """Delete the daemon `key`'s node folder once its nodes are stopped (`stop_node`).

    Each daemon key (each edit of lmpipe's code makes a new one) would otherwise leave its
    folder behind; a node's own output stays in `<cache>/daemon/ray-PORT.log`.
    """
    shutil.rmtree(node_temp_dir(key), ignore_errors=True)


def start_node(
    num_cpus: int, object_store_mb: int, env: dict[str, str], log_dir: Path, key: str
) -> RayNode:
    """Start a local node of this size in the background; its address answers once it is up.

    Its temporary folder is `<tmp>/lmpipe-ray-<uid>-KEY` (short: Ray's socket paths under it
    must fit in 107 bytes), not Ray's default `/tmp/ray`, which other Rays on this machine read.
    """
    from tasks.common.ray_runtime import local_node_command, local_node_env

    port = _free_port()
    args = local_node_command(num_cpus, object_store_mb, port, _free_port(), node_temp_dir(key))
    code = "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; main()"
    with open(log_dir / f"ray-{port}.log", "ab") as out:
        started = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            env=local_node_env(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: a terminal's Ctrl-C is the command's
            cwd=str(log_dir),
            preexec_fn=_stop_with_parent,
        )
    node = RayNode(started.pid, f"127.0.0.1:{port}", num_cpus, object_store_mb)
    log.info("Ray node %s: pid %d, %d CPUs", node.address, node.pid, num_cpus)
    return node


def stop_node(node: RayNode) -> None:
    """Stop `node` (SIGTERM to its `ray start`, which stops the node's processes), and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(node.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_WAIT_S
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(node.pid, os.WNOHANG)
        except ChildProcessError:
            break  # reaped already (the daemon's SIGCHLD handling)
        if pid == node.pid:
            break
        time.sleep(0.05)
    else:
        log.warning("Ray node %s (pid %d) did not stop; SIGKILL", node.address, node.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGKILL)
    log.info("Ray node %s stopped", node.address)
