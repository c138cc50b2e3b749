"""The `lmpipe` entry point: stage commands run in a fork of a warm daemon, the rest here.

A stage command spends seconds importing Prefect, MLflow and its flows, and starting a Prefect
API, before any stage runs (docs/cli.md, "The command daemon"). The daemon does that once and
then forks one child per command. The child takes this process's terminal, working directory,
environment and arguments, runs `pipelines.cli.main.main` as this process would, and its exit
code becomes this process's. Signals this process gets (Ctrl-C, SIGTERM, SIGHUP) are passed
on to the child, and a child whose client is killed gets SIGTERM.

A daemon serves one key (`daemon_key`): the interpreter, the installed packages, lmpipe's
source and the environment. A change to any of them starts a new daemon, and an idle daemon
exits (`LMPIPE_DAEMON_IDLE_S`, default 900 s). `LMPIPE_DAEMON=0` runs every command in its
own process, as before; `lmpipe daemon status` and `lmpipe daemon stop` inspect or stop the
daemon of the current key.

Standard library only, until the command is known to run here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipelines.daemon import protocol

if TYPE_CHECKING:
    import argparse

#: The commands a daemon runs: those that run stages (the others answer at once here).
DAEMON_COMMANDS = frozenset(
    {"ingest", "tokenizer", "encode", "examples", "pretrain", "finetune", "compare", "evaluate"}
    | {"run"}
)
#: Variables that change from shell to shell without changing what a command does; the
#: Prefect home and API, which a command settles and its fork then reads Prefect's settings
#: for again (`pipelines.ops.prefect_api.use_api_host`); and LMPIPE_DAEMON, which chooses
#: whether to use a daemon, not which.
VOLATILE_ENV = frozenset(
    {"PWD", "OLDPWD", "SHLVL", "_", "COLUMNS", "LINES", "TERM_SESSION_ID", "WINDOWID"}
    | {"SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "TMUX_PANE", "LS_COLORS", "LMPIPE_DAEMON"}
    | {"PREFECT_HOME", "PREFECT_API_URL"}
)
_SOURCES = ("pipelines", "tasks", "training")
_REPO = Path(__file__).resolve().parents[2]
_START_TIMEOUT_S = 120.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def main() -> int:
    """Run `lmpipe` with this process's arguments; return its exit code."""
    argv = sys.argv[1:]
    command = _command(argv)
    if command == "daemon" and "-h" not in argv and "--help" not in argv:
        return daemon_command(argv[argv.index("daemon") + 1 :])
    if command in DAEMON_COMMANDS and daemon_enabled():
        try:
            code = run_in_daemon(argv)
        except KeyboardInterrupt:  # before the command was handed over: nothing ran
            return 130
        if code is not None:
            return code
    from pipelines.cli.main import process_main

    return process_main(argv)


def daemon_enabled() -> bool:
    """Whether stage commands go through a daemon: `LMPIPE_DAEMON` (default on, Linux only)."""
    value = os.environ.get("LMPIPE_DAEMON", "1").strip().lower()
    if value in {"0", "off", "false", "no"}:
        return False
    return sys.platform == "linux" and hasattr(socket, "send_fds")


def daemon_key(env: dict[str, str] | None = None) -> str:
    """What a daemon must share with a command to run it: 16 hex digits.

    The code (`code_fingerprint`) and the environment but for `VOLATILE_ENV`.
    """
    env = dict(os.environ if env is None else env)
    digest = hashlib.sha256(code_fingerprint().encode() + b"\0")
    for name in sorted(set(env) - VOLATILE_ENV):
        digest.update(f"{name}={env[name]}\0".encode())
    return digest.hexdigest()[:16]


def code_fingerprint() -> str:
    """The code a daemon runs: 16 hex digits.

    The interpreter and its version, the user, the packages installed (their folder's
    modification time changes with every install) and lmpipe's source (each module's path,
    size and modification time). A daemon whose code is not the current one is stopped by the
    next daemon to start (`pipelines.daemon.server`).
    """
    digest = hashlib.sha256()
    for part in (sys.executable, sys.version, str(os.getuid())):
        digest.update(part.encode() + b"\0")
    for folder in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        digest.update(f"{folder}:{_mtime_ns(folder)}\0".encode())
    for root in _SOURCES:
        for path, stat in _python_files(_REPO / root):
            digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def run_in_daemon(argv: list[str]) -> int | None:
    """Run `lmpipe argv` in a fork of the daemon; its exit code, or None to run it here."""
    key = daemon_key()
    sock = _connect_or_start(key)
    if sock is None:
        return None
    forward = _Forwarder()  # before the request: a signal at any moment reaches the command
    with sock:
        protocol.send(sock, _request(argv), fds=[0, 1, 2])
        try:
            forward.to(int(protocol.receive(sock)[0]["pid"]))
        except protocol.DaemonGone:
            # It refused or ended before forking: nothing ran yet (here, unless interrupted).
            return 128 + forward.pending[0] if forward.pending else None
        try:
            answer = protocol.receive(sock)[0]
        except protocol.DaemonGone:
            print(
                f"lmpipe: the daemon running this command (pid {forward.child}) ended; see "
                "`lmpipe daemon status` for its log",
                file=sys.stderr,
            )
            return 1
    return int(answer["exit"])


def daemon_command(args: list[str]) -> int:
    """`lmpipe daemon status|stop`: show or stop the daemon of this environment's key."""
    action = args[0] if args else "status"
    if action not in {"status", "stop"}:
        print(f"error: lmpipe daemon {action}: expected status or stop", file=sys.stderr)
        return 2
    key = daemon_key()
    try:
        answer = protocol.ask(key, {"op": action})
    except OSError:
        print(f"no lmpipe daemon runs for this environment (key {key})")
        return 0
    if action == "stop":
        print(f"stopping the lmpipe daemon {answer['pid']} (key {key})")
        return 0
    for name, value in answer.items():
        print(f"{name}: {value}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `daemon` subcommand (its help; the client answers it before parsing)."""
    daemon = sub.add_parser(
        "daemon",
        help="show (status) or stop the command daemon of this environment",
        description="Stage commands run in forks of a daemon that imported Prefect, MLflow "
        "and the flows once and keeps a temporary Prefect API per workspace (docs/cli.md, "
        "'The command daemon'). status: its pid, log, commands and APIs; stop: it exits once "
        "its running commands end. LMPIPE_DAEMON=0 runs commands without it.",
    )
    daemon.add_argument("action", choices=["status", "stop"], nargs="?", default="status")
    daemon.set_defaults(func=lambda args: daemon_command([args.action]))


def _command(argv: list[str]) -> str | None:
    for word in argv:
        if not word.startswith("-"):
            return word
    return None


def _request(argv: list[str]) -> dict[str, Any]:
    umask = os.umask(0)
    os.umask(umask)
    return {
        "op": "run",
        "argv": argv,
        "argv0": sys.argv[0],
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "umask": umask,
    }


def _connect_or_start(key: str) -> socket.socket | None:
    """A connection to the daemon for `key`, starting one first if none listens."""
    try:
        return protocol.connect(key)
    except OSError:
        pass
    import subprocess  # only when a daemon is to start

    started = subprocess.Popen(
        [sys.executable, "-m", "pipelines.daemon", key, code_fingerprint()],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in this terminal's process group: Ctrl-C is forwarded
        # From this checkout's root, so that `-m` imports the code `code_fingerprint` hashed
        # (another checkout's installed copy would otherwise be found first).
        cwd=str(_REPO),
    )
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return protocol.connect(key)  # it listens before it warms up: one wait, in accept
        except OSError:
            if started.poll() not in (None, 0):  # 0: another command's daemon took the name
                break
            time.sleep(0.02)
    print(
        f"lmpipe: the command daemon did not start (exit {started.poll()}); running the "
        "command in this process",
        file=sys.stderr,
    )
    return None


class _Forwarder:
    """Passes Ctrl-C, SIGTERM and SIGHUP (as SIGTERM) on to the command's child.

    Installed before the request is sent; a signal that arrives before the child's pid is
    known waits for it.
    """

    def __init__(self) -> None:
        self.child: int | None = None
        self.pending: list[int] = []
        for signum in _FORWARDED:
            signal.signal(signum, self._on_signal)

    def to(self, child: int) -> None:
        """Forward to `child` from now on, and the signals that came before."""
        self.child = child
        for signum in self.pending:
            self._send(signum)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.child is None:
            self.pending.append(signum)
        else:
            self._send(signum)

    def _send(self, signum: int) -> None:
        assert self.child is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.child, signal.SIGTERM if signum == signal.SIGHUP else signum)


def _python_files(root: Path) -> list[tuple[str, os.stat_result]]:
    found = []
    stack = [str(root)]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False) and entry.name != "__pycache__":
                    stack.append(entry.path)
                elif entry.name.endswith((".py", ".so")):
                    found.append((entry.path, entry.stat()))
    return sorted(found, key=lambda item: item[0])


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
