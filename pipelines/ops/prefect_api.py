"""The Prefect API a command reports to, chosen before Prefect is imported, and its home.

Prefect reads its settings once, when it is imported, so a command settles them first
(`open_prefect_api`, from the CLI once the recipe is loaded):

- `PREFECT_HOME` defaults to `<workspace>/.prefect` (`prefect_home`): a command's flow runs,
  results and logs are kept with the workspace, where `lmpipe up` serves them from.
- The API, the first that applies: `PREFECT_API_URL` (set by the user, or by a profile in the
  Prefect home), the recipe's `prefect.api_url`, the Prefect server `lmpipe up` runs for this
  workspace (it serves the same home), else a temporary API for this command alone.
- The temporary API is Prefect's own (the same uvicorn command and settings as Prefect's
  `SubprocessASGIServer`, so it records the same flow and task runs), started at once in the
  background: it boots while the command imports Prefect and its flows on the other core, and
  the command no longer imports Prefect's server modules itself to start it (2 s). A flow waits
  for it on its first call (`await_prefect_api`); it stops when the process exits.
- A new Prefect home's database is a copy of a template migrated once per Prefect version
  (`seed_prefect_home`): Prefect's migrations took 6 s of a server's first start.
- In a fork of the command daemon (`pipelines.daemon`, `use_api_host`) Prefect is imported
  already: its settings and logging are reloaded once the home and API are settled, and the
  daemon serves the temporary API, which then outlives the command for the next one.

Not here: the servers of `lmpipe up` (`pipelines.ops.servers`), other environment variables
(`pipelines.ops.runtime`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from pipelines.config import RunConfig
from pipelines.ops.runtime import cache_dir
from pipelines.ops.server_processes import (
    ServersError,
    answers,
    live_leader,
    read_state,
    resolve_state_dir,
)

log = logging.getLogger(__name__)

#: The workspace's Prefect home, relative to the workspace.
PREFECT_DIR = ".prefect"
_DB_FILE = "prefect.db"
_MEMO_FILE = "memo_store.toml"  # Prefect's record that its block types are registered
_DB_URL_VARS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
# What Prefect's SubprocessASGIServer sets for its server: no UI, ephemeral, final settings.
_TEMPORARY_SERVER_ENV = {
    "PREFECT_UI_ENABLED": "0",
    "PREFECT__SERVER_EPHEMERAL": "1",
    "PREFECT__SERVER_FINAL": "1",
}
_PORT_IN_USE_EXIT = 3  # uvicorn's exit code when its port is taken: try another


def prefect_home(workspace: Path) -> Path:
    """The Prefect home of `workspace`'s runs: `PREFECT_HOME`, else `<workspace>/.prefect`."""
    home = os.environ.get("PREFECT_HOME")
    return Path(home) if home else Path(os.path.abspath(workspace)) / PREFECT_DIR


#: Serves a temporary Prefect API for a home (with an environment) in another process: its port.
ApiHost = Callable[[Path, dict[str, str]], int]


@dataclass
class TemporaryApi:
    """A temporary Prefect API server: this command's own, or one the daemon serves.

    `process` is None for the daemon's (`host`): it outlives the command, and the daemon
    starts it again if it ends.
    """

    home: Path
    port: int
    process: subprocess.Popen[bytes] | None
    started_s: float = field(default_factory=time.monotonic)
    #: Where to save the home's pristine database once healthy (a fresh home, no template).
    template: Path | None = None
    host: ApiHost | None = None

    @property
    def api_url(self) -> str:
        """What clients use: `PREFECT_API_URL`."""
        return f"http://127.0.0.1:{self.port}/api"

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait until the API answers its health check; save the template if it is to be made.

        Raises:
            ServersError: the server exited, or did not answer within `timeout_s`.
        """
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        asked_s = time.monotonic()
        while not answers(opener, f"{self.api_url}/health"):
            code = None if self.process is None else self.process.poll()
            if self.host is not None and time.monotonic() - asked_s > 1.0:
                # The daemon starts it again if it ended (its port was taken, say).
                self.port = self.host(self.home, server_env(self.home, self.template is None))
                asked_s = time.monotonic()
            elif self.process is not None and code == _PORT_IN_USE_EXIT:
                # Another process took the port meanwhile.
                self.port = _free_port()
                self.process = _launch(self.home, self.port, self.template is None)
            elif code is not None:
                raise ServersError(f"the temporary Prefect API exited with code {code}")
            elif time.monotonic() - self.started_s > timeout_s:
                raise ServersError(
                    f"the temporary Prefect API did not answer within {timeout_s:g} s "
                    "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
                )
            time.sleep(0.05)
        log.debug("temporary Prefect API healthy after %.2f s", time.monotonic() - self.started_s)
        if self.template is not None:
            save_template(self.home, self.template)
            self.template = None

    def stop(self) -> None:
        """Terminate this command's own server (SIGTERM, then SIGKILL after 5 s) and reap it."""
        if self.process is not None and self.process.poll() is None:
            log.info("Stopping temporary server on http://127.0.0.1:%d", self.port)
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


_PENDING: list[TemporaryApi] = []  # started, not yet waited for
_STARTED: list[TemporaryApi] = []
_HOST: list[ApiHost] = []  # set in a fork of the command daemon


def use_api_host(host: ApiHost) -> None:
    """Say that this process is a fork of the command daemon, which serves temporary APIs.

    Prefect is imported already (its settings were read in the daemon, with the daemon's
    environment): `open_prefect_api` settles the home and API as in a new process, then
    reloads Prefect's settings and logging from this process's environment.
    """
    _HOST[:] = [host]


def open_prefect_api(cfg: RunConfig) -> str | None:
    """Settle the Prefect home and API of this process before Prefect is imported.

    A no-op once Prefect is imported (its settings are read then: the process keeps them).
    Sets `PREFECT_HOME` to `prefect_home` unless set, exports the recipe's `prefect.api_url`,
    else uses the live Prefect server `lmpipe up` runs for this workspace, else starts a
    temporary API in the background when nothing else names one.

    Returns:
        The API URL this process's flows will report to; None when Prefect decides (it was
        imported already, or a profile or the environment names the API).
    """
    if "prefect" in sys.modules and not _HOST:
        return None
    url = _settle_api(cfg)
    if _HOST:
        _reload_prefect_settings()
    return url


def _settle_api(cfg: RunConfig) -> str | None:
    workspace = Path(os.path.abspath(cfg.workspace))
    home = prefect_home(workspace)
    home.mkdir(parents=True, exist_ok=True)  # Prefect makes only the last level
    os.environ["PREFECT_HOME"] = str(home)
    if cfg.prefect.api_url:
        os.environ["PREFECT_API_URL"] = cfg.prefect.api_url
    if os.environ.get("PREFECT_API_URL"):
        return os.environ["PREFECT_API_URL"]
    if _profile_names_api(home) or not _ephemeral_allowed():
        return None
    url = up_server_api(cfg, workspace)
    if url is None:
        url = start_temporary_api(home, cache_dir()).api_url
        # It serves no UI and is gone at exit: no "View at" link to it (none, as before).
        os.environ.setdefault("PREFECT_UI_URL", "")
    os.environ["PREFECT_API_URL"] = url
    return url


def up_server_api(cfg: RunConfig, workspace: Path) -> str | None:
    """The API URL of the Prefect server `lmpipe up` runs for `workspace`, if it answers.

    Its basic-auth string (`servers.prefect_auth_string`) is exported for the client too.
    """
    try:
        state = read_state(resolve_state_dir(cfg.servers.state_dir, workspace) / "prefect.json")
    except ServersError:
        return None
    if state is None or live_leader(state) is None:
        return None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    if not answers(opener, state.health_url):
        return None
    auth = cfg.servers.prefect_auth_string
    if auth is not None:
        os.environ.setdefault("PREFECT_API_AUTH_STRING", auth.get_secret_value())
    log.info("Prefect API: the server of `lmpipe up`, %s", state.api_url)
    return state.api_url


def start_temporary_api(home: Path, templates: Path) -> TemporaryApi:
    """Start Prefect's temporary API server on a free loopback port, without waiting for it.

    A new home's database is seeded from the template first; the first new home without one
    saves its database as the template once the server is healthy (migrated, nothing run yet).
    """
    home.mkdir(parents=True, exist_ok=True)
    template = None if seed_prefect_home(home, templates) else _template_path(templates)
    registered = template is None  # its database is a copy of one or was made before
    if _HOST:
        port = _HOST[0](home, server_env(home, registered))
        api = TemporaryApi(home, port, None, template=template, host=_HOST[0])
        log.info("Prefect API: the daemon's temporary server, http://127.0.0.1:%d", port)
    else:
        port = _free_port()
        log.info("Starting temporary server on http://127.0.0.1:%d", port)
        api = TemporaryApi(home, port, _launch(home, port, registered), template=template)
    _PENDING.append(api)
    _STARTED.append(api)
    if len(_STARTED) == 1:
        # Registered before Prefect is imported, so it runs after Prefect's exit handlers
        # (the last logs and events) have sent everything.
        atexit.register(_stop_all)
    return api


def await_prefect_api() -> None:
    """Wait until the temporary API this process started answers (a no-op otherwise)."""
    timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "20"))
    while _PENDING:
        _PENDING[0].wait_healthy(timeout_s)
        _PENDING.pop(0)


def temporary_api_urls() -> list[str]:
    """The API URLs of the temporary servers this process started (gone when it exits)."""
    return [api.api_url for api in _STARTED]


def seed_prefect_home(home: Path, templates: Path) -> bool:
    """Give a home without a database a copy of the template database; say if one was copied.

    Only for Prefect's default SQLite database (no database URL in the environment), and only
    when a template of the installed Prefect version exists.
    """
    db, template = home / _DB_FILE, _template_path(templates)
    if db.exists() or any(os.environ.get(key) for key in _DB_URL_VARS):
        return db.exists()
    memo = template.with_suffix(".memo.toml")
    if not (template.is_file() and memo.is_file()):
        return False
    home.mkdir(parents=True, exist_ok=True)
    tmp = home / f".{_DB_FILE}.{os.getpid()}.tmp"
    shutil.copyfile(template, tmp)
    with contextlib.suppress(FileExistsError):  # another command seeded it meanwhile
        os.link(tmp, db)
        if not (home / _MEMO_FILE).exists():
            shutil.copyfile(memo, home / _MEMO_FILE)
    tmp.unlink()
    return True


def save_template(home: Path, template: Path) -> None:
    """Save `home`'s database (a consistent snapshot) and memo as the template, atomically."""
    db, memo = home / _DB_FILE, home / _MEMO_FILE
    if not (db.is_file() and memo.is_file()) or template.exists():
        return
    template.parent.mkdir(parents=True, exist_ok=True)
    tmp = template.with_name(f".{template.name}.{os.getpid()}.tmp")
    src, dst = sqlite3.connect(db, timeout=30), sqlite3.connect(tmp)
    try:
        src.backup(dst)  # the server runs in WAL mode: a plain copy could miss pages
        dst.execute("PRAGMA journal_mode=DELETE")  # one file
    finally:
        src.close()
        dst.close()
    shutil.copyfile(memo, template.with_suffix(".memo.toml"))
    os.replace(tmp, template)
    log.info("saved %s as the Prefect database template %s", db, template)


def _template_path(templates: Path) -> Path:
    # Migrations change with the version: one template per Prefect version.
    return templates / f"prefect-{version('prefect')}.db"


def _launch(home: Path, port: int, registered: bool) -> subprocess.Popen[bytes]:
    """Prefect's temporary server command (`SubprocessASGIServer._run_uvicorn_command`)."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")  # where it is installed, without importing it
    if spec is None or spec.origin is None:
        raise ServersError("prefect is not installed: pip install -e .")
    command = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(spec.origin).parents[1])]
    command += ["--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "error", "--lifespan", "on"]
    return subprocess.Popen(command, env=server_env(home, registered), stdin=subprocess.DEVNULL)


def server_env(home: Path, registered: bool) -> dict[str, str]:
    """The environment of a temporary API for `home`: this process's, as Prefect sets it.

    `registered`: the home's database holds Prefect's block types already (it was made by a
    server, or copied from the template one made), so the server skips registering them
    again (unless `PREFECT_API_BLOCKS_REGISTER_ON_START` is set): 0.4 s of its 0.9 s start,
    since Prefect's record of the registration is keyed on the database's path.
    """
    env = {**os.environ, **_TEMPORARY_SERVER_ENV, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    if registered:
        env.setdefault("PREFECT_API_BLOCKS_REGISTER_ON_START", "false")
    return env


def _reload_prefect_settings() -> None:
    """Read Prefect's settings and logging configuration again from this environment."""
    from prefect.context import refresh_global_settings_context
    from prefect.logging.configuration import setup_logging

    refresh_global_settings_context()
    setup_logging(incremental=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _profile_names_api(home: Path) -> bool:
    """Whether a Prefect profile in `home` (or `PREFECT_PROFILES_PATH`) names an API URL."""
    path = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml")
    try:
        profiles = tomllib.loads(path.read_text())
    except (OSError, ValueError):
        return False
    active = os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral")
    settings = profiles.get("profiles", {}).get(active, {})
    return bool(settings.get("PREFECT_API_URL"))


def _ephemeral_allowed() -> bool:
    value = os.environ.get("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "true")
    return value.strip().lower() not in {"0", "false", "no", "off"}


def _stop_all() -> None:
    for api in _STARTED:
        api.stop()
