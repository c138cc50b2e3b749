"""The command daemon: imports once, then forks a child per command and per Prefect home.

`python -m pipelines.daemon KEY CODE` (started by the `lmpipe` client,
`pipelines.daemon.client`) takes the abstract socket of KEY first, so that of two commands
starting a daemon at once only one warms up. It registers itself in `<cache>/daemon/KEY.json`
and stops the daemons registered there whose CODE (`client.code_fingerprint`) is not its own:
lmpipe or its packages changed, so no command will reach them again. Then it imports
`child.FIRST_MODULES` (`SERVER_MODULES` with the first Prefect API, `LATER_MODULES` once idle:
the first command does not wait for what it would not have imported yet) and answers, one at
a time:

- `run`: fork; the child becomes the client's command (`child.become_command`) and returns
  from `Daemon.serve` to run it; the daemon sends the client the child's pid, then its exit
  code once reaped. A client that disconnects first has its child sent SIGTERM.
- `prefect`: the port of the temporary Prefect API serving a home, forked on the first ask
  (Prefect's server is imported already: it answers in under a second) and kept for the next
  commands; a home whose database was replaced gets a new one.
- `ray`: the address of the local Ray node of a size (CPUs, object store), started on the
  first ask and kept for the next commands (`pipelines.daemon.ray_node`).
- `status`, `stop`: what it runs; exit once the running commands end.

No thread of its own (a fork copies only the forking thread): child exits arrive as SIGCHLD on a
wake-up socket. It exits when idle for `LMPIPE_DAEMON_IDLE_S` seconds (default 900),
stopping the Prefect APIs and Ray nodes it started. Its log: `<cache>/daemon/KEY.log`.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import importlib
import json
import logging
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.daemon import protocol
from pipelines.daemon.child import (
    DAEMON_SIGNALS,
    FIRST_MODULES,
    LATER_MODULES,
    SERVER_MODULES,
    become_command,
    detach,
    serve_prefect_api,
)
from pipelines.daemon.ray_node import RayNode, remove_node_temp_dir, start_node, stop_node

log = logging.getLogger(__name__)

IDLE_S = 900.0
#: What a client passes on to its command (`client._Forwarder`).
FORWARDED_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
MAX_APIS = 8  # Prefect homes served at once; the least recently used stops first
MAX_NODES = 2  # local Ray nodes of different sizes; a command asking for a third starts its own
_ACCEPT_TIMEOUT_S = 10.0  # for a client's request once connected


@dataclass
class PrefectApi:
    """A temporary Prefect API the daemon forked for a home."""

    pid: int
    port: int
    db_inode: int | None
    used_s: float = field(default_factory=time.monotonic)


@dataclass
class Request:
    """A command to run, in the child that runs it."""

    message: dict[str, Any]
    fds: list[int]


def run(key: str, code: str = "") -> int:
    """The daemon process for `key`; in a forked child, the command's exit code."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(protocol.socket_name(key))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return 0  # another daemon for this key took it first; the client connects to it
        raise
    listener.listen(64)
    _log_to(key)
    registry = _register(key, code)
    started = time.monotonic()
    _warm_up()
    log.info("daemon %s ready after %.2f s (pid %d)", key, time.monotonic() - started, os.getpid())
    daemon = Daemon(key, listener)
    request = daemon.serve()
    if request is None:
        registry.unlink(missing_ok=True)
        return 0
    become_command(request.message, request.fds, daemon.api_host, daemon.ray_address)
    from pipelines.cli.main import process_main

    return process_main(request.message["argv"])


def _log_to(key: str) -> None:
    from pipelines.ops.runtime import cache_dir

    folder = cache_dir() / "daemon"
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"{key}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")


def _register(key: str, code: str) -> Path:
    """Write this daemon's registration; stop the registered daemons of other code."""
    from pipelines.ops.runtime import cache_dir

    folder = cache_dir() / "daemon"
    for path in folder.glob("*.json"):
        try:
            other = json.loads(path.read_text())
            if path.stem != key and other.get("code") != code:
                protocol.ask(path.stem, {"op": "stop"})
                log.info(
                    "stopped daemon %s (pid %s): its code is not current", path.stem, other["pid"]
                )
        except (OSError, ValueError, KeyError):
            path.unlink(missing_ok=True)  # gone without removing it (killed)
    registry = folder / f"{key}.json"
    registry.write_text(json.dumps({"pid": os.getpid(), "code": code}))
    return registry


def _warm_up() -> None:
    """Import `FIRST_MODULES` as a command would: Prefect's settings fixed first."""
    from pipelines.ops.runtime import cache_dir, no_prefect_telemetry, patient_temporary_api

    # A scratch home for the daemon's own import of Prefect, which makes it if missing; each
    # child reads its own settings again.
    os.environ["PREFECT_HOME"] = str(cache_dir() / "daemon" / "prefect-home")
    os.environ.pop("PREFECT_API_URL", None)
    patient_temporary_api()
    no_prefect_telemetry()
    _import(FIRST_MODULES)


def _import(modules: tuple[str, ...]) -> None:
    if all(name in sys.modules for name in modules):
        return
    for name in modules:
        importlib.import_module(name)
    gc.collect()
    gc.freeze()  # children share these pages; a collection in one would copy them


class Daemon:
    """The accept loop: commands and Prefect APIs forked, exits reaped, idleness timed."""

    def __init__(self, key: str, listener: socket.socket) -> None:
        self.key = key
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.commands: dict[int, socket.socket | None] = {}  # pid -> its client, until gone
        self.apis: dict[str, PrefectApi] = {}
        self.nodes: dict[tuple[int, int], RayNode] = {}  # (CPUs, object store MiB) -> node
        self.stopping = False
        self.active_s = time.monotonic()
        self.started_s = time.monotonic()
        self.idle_s = float(os.environ.get("LMPIPE_DAEMON_IDLE_S", IDLE_S))
        self.later: tuple[str, ...] = LATER_MODULES  # imported at the first quiet moment
        self.wake_r, self.wake_w = socket.socketpair()
        self.wake_r.setblocking(False)
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        for signum in DAEMON_SIGNALS:
            signal.signal(signum, self._on_signal)
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")

    def serve(self) -> Request | None:
        """Answer until stopped or idle (None); in a forked command child, its request."""
        while not self._done():
            events = self.selector.select(timeout=0.2 if self.later else self._timeout())
            if not events and self.later:
                _import(self.later)
                self.later = ()
            for event, _ in events:
                if event.data == "accept":
                    request = self._accept()
                    if request is not None:
                        return request
                elif event.data == "wake":
                    self._drain_wake()
                else:
                    self._client_readable(event.fileobj)  # type: ignore[arg-type]
        self._stop_apis()
        for node in self.nodes.values():
            stop_node(node)
        remove_node_temp_dir(self.key)
        log.info("daemon %s exits", self.key)
        return None

    def api_host(self, home: Path, env: dict[str, str]) -> int:
        """In a command child: the port of the daemon's temporary API for `home`."""
        answer = protocol.ask(self.key, {"op": "prefect", "home": str(home), "env": env})
        return int(answer["port"])

    def ray_address(self, num_cpus: int, object_store_mb: int) -> str | None:
        """In a command child: the address of the daemon's local Ray node of this size."""
        message = {"op": "ray", "num_cpus": num_cpus, "object_store_mb": object_store_mb}
        return protocol.ask(self.key, message)["address"]  # type: ignore[no-any-return]

    def _done(self) -> bool:
        if self.commands:
            return False
        return self.stopping or time.monotonic() - self.active_s > self.idle_s

    def _timeout(self) -> float:
        return max(0.1, min(30.0, self.idle_s - (time.monotonic() - self.active_s)))

    def _accept(self) -> Request | None:
        conn, _ = self.listener.accept()
        self.active_s = time.monotonic()
        try:
            if protocol.peer_uid(conn) != os.getuid():
                conn.close()
                return None
            conn.settimeout(_ACCEPT_TIMEOUT_S)
            message, fds = protocol.receive(conn, max_fds=3)
            return self._answer(conn, message, fds)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("a request failed: %s", exc)
            conn.close()
            return None

    def _answer(
        self, conn: socket.socket, message: dict[str, Any], fds: list[int]
    ) -> Request | None:
        op = message.get("op")
        if op == "run" and not self.stopping:
            return self._fork_command(conn, message, fds)
        for fd in fds:
            os.close(fd)
        with conn:
            if op == "prefect":
                protocol.send(conn, {"port": self._api_port(message["home"], message["env"])})
            elif op == "ray":
                address = self._ray_address(
                    int(message["num_cpus"]), int(message["object_store_mb"])
                )
                protocol.send(conn, {"address": address})
            elif op == "status":
                protocol.send(conn, self._status())
            elif op == "stop":
                self.stopping = True
                protocol.send(conn, {"pid": os.getpid()})
        return None

    def _fork_command(
        self, conn: socket.socket, message: dict[str, Any], fds: list[int]
    ) -> Request | None:
        _flush()  # or the child writes the daemon's buffered log lines to its terminal
        # A signal forwarded right after the fork must reach the command's handlers, not the
        # daemon's copied ones: held back until the child has installed its own.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
        pid = os.fork()
        if pid == 0:
            detach([self.listener, self.wake_r, self.wake_w, conn, *self._clients()])
            self.selector.close()
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            return Request(message, fds)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        protocol.send(conn, {"pid": pid})
        self.commands[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        log.info("command %d: lmpipe %s", pid, " ".join(message["argv"]))
        return None

    def _clients(self) -> list[socket.socket]:
        return [conn for conn in self.commands.values() if conn is not None]

    def _client_readable(self, conn: socket.socket) -> None:
        """A command's client sent nothing but may have gone: then its child gets SIGTERM."""
        with contextlib.suppress(OSError):
            if conn.recv(64):
                return
        pid = next(p for p, c in self.commands.items() if c is conn)
        log.info("command %d: its client went away; SIGTERM", pid)
        self.selector.unregister(conn)
        conn.close()
        self.commands[pid] = None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum != signal.SIGCHLD:
            self.stopping = True  # the wake-up byte ends the select; running commands finish

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self.wake_r.recv(512):
                pass
        self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by a signal: the shell's number
            self.active_s = time.monotonic()
            if pid in self.commands:
                self._finish(pid, code)
            for home, api in list(self.apis.items()):
                if api.pid == pid:
                    log.info("Prefect API for %s (pid %d) exited with %d", home, pid, code)
                    del self.apis[home]
            for size, node in list(self.nodes.items()):
                if node.pid == pid:
                    log.info("Ray node %s (pid %d) exited with %d", node.address, pid, code)
                    del self.nodes[size]

    def _finish(self, pid: int, code: int) -> None:
        conn = self.commands.pop(pid)
        log.info("command %d exited with %d", pid, code)
        if conn is None:
            return
        self.selector.unregister(conn)
        with contextlib.suppress(OSError), conn:
            protocol.send(conn, {"exit": code})

    def _ray_address(self, num_cpus: int, object_store_mb: int) -> str | None:
        """The address of the node of this size, started first if none; None past `MAX_NODES`."""
        size = (num_cpus, object_store_mb)
        node = self.nodes.get(size)
        if node is None:
            if len(self.nodes) >= MAX_NODES:
                return None  # the command starts its own, as without a daemon
            from pipelines.ops.runtime import cache_dir

            logs = cache_dir() / "daemon"
            node = start_node(num_cpus, object_store_mb, dict(os.environ), logs, self.key)
            self.nodes[size] = node
        return node.address

    def _api_port(self, home: str, env: dict[str, str]) -> int:
        """The port of the live API for `home`, forked first if none or its database changed."""
        inode = _inode(Path(home) / "prefect.db")
        api = self.apis.get(home)
        if api is not None and api.db_inode not in (None, inode):
            self._stop_api(home)  # the home was deleted and made again: a new database
            api = None
        if api is None:
            _import(SERVER_MODULES)  # once: the first API
            while len(self.apis) >= MAX_APIS:
                self._stop_api(min(self.apis, key=lambda h: self.apis[h].used_s))
            api = self._fork_api(home, env)
            self.apis[home] = api
        api.db_inode = api.db_inode or inode
        api.used_s = time.monotonic()
        return api.port

    def _fork_api(self, home: str, env: dict[str, str]) -> PrefectApi:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        _flush()
        pid = os.fork()
        if pid == 0:
            try:
                detach([self.listener, self.wake_r, self.wake_w, *self._clients()])
                self.selector.close()
                code = serve_prefect_api(home, port, env)
            except BaseException:  # a child never returns into the loop
                logging.getLogger(__name__).exception("Prefect API for %s failed", home)
                code = 1
            os._exit(code)
        log.info("Prefect API for %s: pid %d, port %d", home, pid, port)
        return PrefectApi(pid, port, _inode(Path(home) / "prefect.db"))

    def _stop_api(self, home: str) -> None:
        api = self.apis.pop(home)
        with contextlib.suppress(ProcessLookupError):
            os.kill(api.pid, signal.SIGTERM)

    def _stop_apis(self) -> None:
        pids = [api.pid for api in self.apis.values()]
        for home in list(self.apis):
            self._stop_api(home)
        deadline = time.monotonic() + 5.0
        for pid in pids:
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(pid, os.WNOHANG)[0] == 0:
                        time.sleep(0.05)
                        continue
                break
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _status(self) -> dict[str, Any]:
        from pipelines.ops.runtime import cache_dir

        return {
            "pid": os.getpid(),
            "key": self.key,
            "up_s": round(time.monotonic() - self.started_s, 1),
            "idle_s": round(time.monotonic() - self.active_s, 1),
            "exits_when_idle_for_s": self.idle_s,
            "commands": sorted(self.commands),
            "prefect_apis": {home: api.port for home, api in self.apis.items()},
            "ray_nodes": {node.address: node.pid for node in self.nodes.values()},
            "log": str(cache_dir() / "daemon" / f"{self.key}.log"),
        }


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(run(sys.argv[1]))
