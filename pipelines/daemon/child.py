"""What a fork of the daemon does first: become the client's command, or a Prefect API.

A command child takes on everything a new `lmpipe` process would have from its client: the
terminal (descriptors 0-2, so rich and Prefect see the same terminal), the working directory,
umask, environment, `sys.argv` and `sys.path[0]`; the daemon's signal handlers and sockets are
dropped. The modules the daemon imported were imported under the daemon's environment, so
what they read then is read again: Prefect's settings and logging once the command has settled
its Prefect home and API (`pipelines.ops.prefect_api.use_api_host`), and rich's global console.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

#: What the daemon imports before it answers its first command: what a stage command imports
#: before its first stage. Not the modules that build a rich console when imported (the
#: CLI's): a child builds those for its own terminal. Not torch, Ray or DeepSpeed: they may
#: probe a GPU, which a fork must not inherit, and only the stages that train need them.
FIRST_MODULES = (
    "pipelines.config",
    "pipelines.ops.prefect_api",
    "pipelines.ops.runtime",
    "pipelines.flows.pipeline_flow",
    "pipelines.flows.summary",
    "prefect",
    "prefect.flow_engine",
    "prefect.task_engine",
    "pyarrow",
    "numpy",
)
#: Prefect's server, which each new workspace's temporary API runs: imported when the first
#: one is asked for (the first command imports its flows meanwhile, on the other core).
SERVER_MODULES = ("prefect.server.api.server", "uvicorn")
#: What the data stages import around their work (MLflow's SQL store, 0.7 s, with its
#: migration tool; matplotlib for the encode stage's histogram, 1.2 s): imported once the
#: daemon has nothing else to do, so that the first command does not wait for them.
LATER_MODULES = (
    "mlflow",
    "mlflow.store.tracking.sqlalchemy_store",
    "alembic",
    "training.tracking.runs",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
)
#: The daemon's own handlers; a child starts with Python's defaults.
DAEMON_SIGNALS = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def detach(sockets: Iterable[socket.socket]) -> None:
    """In a new child: drop the daemon's signal handlers and close its `sockets`."""
    signal.set_wakeup_fd(-1)
    for signum in DAEMON_SIGNALS:
        handler = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
        signal.signal(signum, handler)
    for sock in sockets:
        sock.close()  # through the object: a stray finaliser would close a reused descriptor


def become_command(
    request: dict[str, Any],
    fds: list[int],
    ask_api: Callable[..., int],
    ask_ray: Callable[[int, int], str | None],
) -> None:
    """Take on the client's terminal, directory, environment and arguments (`request`).

    The command then asks the daemon for its temporary Prefect API (`ask_api`) and for a local
    Ray node (`ask_ray`) instead of starting its own.
    """
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
    # Python chose the daemon's buffering for its log file: a terminal gets line buffering.
    for stream, lines in ((sys.stdout, sys.stdout.isatty()), (sys.stderr, True)):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=lines, write_through=unbuffered)
    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["argv0"], *request["argv"]]
    sys.path[0] = request["path0"]
    root = logging.getLogger()
    for handler in list(root.handlers):  # Prefect's, from its import: main configures its own
        root.removeHandler(handler)
    import rich

    rich._console = None  # built again for this terminal on first use
    from pipelines.ops.prefect_api import use_api_host

    use_api_host(ask_api)
    from tasks.common.ray_runtime import use_local_node

    use_local_node(ask_ray)


def serve_prefect_api(home: str, port: int, env: dict[str, str]) -> int:
    """Run Prefect's temporary API for `home` on `port` in this child, until SIGTERM."""
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    root = logging.getLogger()
    for handler in list(root.handlers):  # the daemon's log lines; Prefect configures its own
        root.removeHandler(handler)
    from prefect.context import refresh_global_settings_context
    from prefect.logging.configuration import setup_logging

    refresh_global_settings_context()  # the home's database, not the daemon's scratch home
    setup_logging(incremental=False)
    import uvicorn

    Path(home).mkdir(parents=True, exist_ok=True)
    uvicorn.run(
        "prefect.server.api.server:create_app",
        factory=True,
        host="127.0.0.1",
        port=port,
        log_level="error",
        lifespan="on",
    )
    return 0
