"""The workspace's own MLflow store, `<workspace>/mlflow.db`, and keeping it usable after a move.

MLflow stores every artifact location as an absolute URI: it resolves a relative one against
the working directory when it creates an experiment, so a location relative to the store is not
an option. The workspace's experiments put their artifacts in `<workspace>/mlartifacts`
(`training.tracking.runs.experiment_id`); a copy of the workspace would carry a store whose
experiments, runs and model versions still name the original tree, so the copy's new runs would
write there and its registered models would load from there. `open_local_store` re-roots the
store instead: in one transaction it rewrites every artifact location under the root the store
was last opened at (`LOCATION_COLUMNS`, MLflow 3.17's schema) to the same place under the root
it is opened at now, and records that root in a table of its own (`ROOT_TABLE`; MLflow ignores
tables it does not define). A store from before this table is re-rooted from the root its
experiments' `mlartifacts` locations name. A remote tracking server is never touched here.

Only `sqlite3` is used: re-rooting costs a query, never an MLflow import. A new store is a copy
of a template MLflow created once per MLflow version (`seed_local_store`): MLflow's migrations
took 1.7-1.9 s of a command in a fresh workspace, a copy 0.04 s. MLflow imports itself only to
make the template.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import time
from importlib.metadata import version
from pathlib import Path
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

#: The workspace-local store's file, and the directory its experiments keep artifacts in.
STORE_FILE = "mlflow.db"
ARTIFACTS_DIR = "mlartifacts"
#: lmpipe's table in the store: the one root it was last opened at.
ROOT_TABLE = "lmpipe_store_root"
#: Every column of MLflow 3.17's schema that holds an artifact location (a path or a URI), with
#: the rows it holds one in.
LOCATION_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("experiments", "artifact_location", "1"),
    ("runs", "artifact_uri", "1"),
    ("logged_models", "artifact_location", "1"),
    ("model_versions", "source", "1"),
    ("model_versions", "storage_location", "1"),
    ("workspaces", "default_artifact_root", "1"),
    ("workspaces", "trace_archival_location", "1"),
    ("trace_tags", "value", "key = 'mlflow.artifactLocation'"),
)


def local_store_uri(workspace: Path) -> str:
    """The workspace's own tracking URI: `sqlite:///<workspace, resolved>/mlflow.db`."""
    return f"sqlite:///{(workspace / STORE_FILE).resolve()}"


def open_local_store(workspace: Path) -> str:
    """The workspace's own tracking URI, its store re-rooted first when the workspace moved."""
    db = (workspace / STORE_FILE).resolve()
    if db.is_file():
        moved = reroot_store(db, db.parent)
        if moved is not None:
            log.info("%s: artifact locations moved from %s to %s", db, moved, db.parent)
    return f"sqlite:///{db}"


def seed_local_store(workspace: Path, templates: Path) -> bool:
    """Give a workspace without a store a copy of MLflow's own new store; say if one was copied.

    The copy is what MLflow would have made there: its schema at the installed version, the
    `Default` experiment (id 0) created now, its artifacts under `./mlruns/0` of the working
    directory (MLflow's default for a SQLite store). An existing store is left alone.
    """
    db = (workspace / STORE_FILE).resolve()
    if db.exists():
        return False
    template = store_template(templates)
    db.parent.mkdir(parents=True, exist_ok=True)
    tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
    shutil.copyfile(template, tmp)
    try:
        con = sqlite3.connect(tmp, isolation_level=None)
        try:
            now_ms = int(time.time() * 1000)
            con.execute(
                "UPDATE experiments SET artifact_location = ?, creation_time = ?, "
                "last_update_time = ? WHERE experiment_id = 0",
                (os.path.join(os.getcwd(), "mlruns", "0"), now_ms, now_ms),
            )
        finally:
            con.close()
        os.link(tmp, db)  # never over a store another command made meanwhile
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def store_template(templates: Path) -> Path:
    """The pristine store of the installed MLflow version under `templates`; made once by MLflow.

    MLflow creates it as it creates any new SQLite store (every migration), in a temporary
    file renamed into place, so concurrent commands each see a whole template.
    """
    path = templates / f"mlflow-{version('mlflow')}.db"
    if path.is_file():
        return path
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    scratch = templates / f".mlflow-template.{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        store = SqlAlchemyStore(f"sqlite:///{scratch / STORE_FILE}", str(scratch / "mlruns"))
        store.engine.dispose()
        os.replace(scratch / STORE_FILE, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    log.info("made the MLflow store template %s", path)
    return path


def reroot_store(db: Path, root: Path) -> str | None:
    """Move `db`'s artifact locations from the root it was last opened at to `root`.

    One transaction: the locations and the recorded root change together or not at all. A
    database MLflow has not set up yet is left alone.

    Returns:
        The root the locations were moved from; None when nothing moved.
    """
    con = sqlite3.connect(db, timeout=60, isolation_level=None)
    try:
        tables = _tables(con)
        if "alembic_version" not in tables or "experiments" not in tables:
            return None
        old = _recorded_root(con, tables)
        if old == str(root):
            return None
        con.execute("BEGIN IMMEDIATE")  # another opener may have re-rooted meanwhile
        try:
            old = _recorded_root(con, _tables(con)) or _inferred_root(con)
            moved = _move(con, tables, old, root) if old not in (None, str(root)) else None
            con.execute(
                f"CREATE TABLE IF NOT EXISTS {ROOT_TABLE} "
                "(id INTEGER PRIMARY KEY CHECK (id = 0), root TEXT NOT NULL)"
            )
            con.execute(f"INSERT OR REPLACE INTO {ROOT_TABLE} VALUES (0, ?)", (str(root),))
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        return moved
    finally:
        con.close()


def _tables(con: sqlite3.Connection) -> set[str]:
    return {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _recorded_root(con: sqlite3.Connection, tables: set[str]) -> str | None:
    if ROOT_TABLE not in tables:
        return None
    row = con.execute(f"SELECT root FROM {ROOT_TABLE} WHERE id = 0").fetchone()
    return str(row[0]) if row else None


def _inferred_root(con: sqlite3.Connection) -> str | None:
    """The root a store without `ROOT_TABLE` lived at: where its experiments' `mlartifacts` is.

    None unless exactly one such directory is named.
    """
    roots = set()
    for (location,) in con.execute("SELECT artifact_location FROM experiments"):
        path = _local_path(str(location or ""))
        if path is not None and path.name == ARTIFACTS_DIR:
            roots.add(str(path.parent))
    return roots.pop() if len(roots) == 1 else None


def _local_path(location: str) -> Path | None:
    parts = urlsplit(location)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    return Path(location) if location.startswith("/") else None


def _move(con: sqlite3.Connection, tables: set[str], old: str, root: Path) -> str:
    """Rewrite every location under `old` (as a path or a `file://` URI) to lie under `root`."""
    prefixes = [(old, str(root)), (Path(old).as_uri(), root.as_uri())]
    for table, column, rows in LOCATION_COLUMNS:
        if table not in tables or column not in _columns(con, table):
            continue
        for before, after in prefixes:
            # substr, not LIKE: a path may hold `%` or `_`.
            con.execute(
                f'UPDATE "{table}" SET "{column}" = ? || substr("{column}", ?) '
                f'WHERE ({rows}) AND ("{column}" = ? OR substr("{column}", 1, ?) = ?)',
                (after, len(before) + 1, before, len(before) + 1, before + "/"),
            )
    return old


def _columns(con: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in con.execute(f'PRAGMA table_info("{table}")')}
