"""A new workspace store is a copy of MLflow's own new store: its schema and Default experiment."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from training.tracking.local_store import STORE_FILE, local_store_uri, seed_local_store

pytestmark = pytest.mark.slow  # MLflow makes the template and its own store


def _definition(sql: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A table's or index's SQL as (its other lines in order, its constraints as a set).

    MLflow's migrations recreate tables in batches that list the same CHECK constraints in a
    different order from one process to the next: the order of constraints means nothing.
    """
    lines = [line.strip().rstrip(",") for line in sql.splitlines()]
    constraints = sorted(line for line in lines if line.startswith("CONSTRAINT"))
    return tuple(line for line in lines if not line.startswith("CONSTRAINT")), tuple(constraints)


def _schema(db: Path) -> tuple[list[str], list[tuple[str, Any]]]:
    con = sqlite3.connect(db)
    try:
        versions = [v for (v,) in con.execute("SELECT version_num FROM alembic_version")]
        objects = con.execute(
            "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%' ORDER BY 2"
        ).fetchall()
    finally:
        con.close()
    return versions, [(kind, _definition(str(sql))) for kind, _, sql in objects]


def _default_experiment(db: Path) -> tuple[str, str, int]:
    con = sqlite3.connect(db)
    try:
        row = con.execute(
            "SELECT name, artifact_location, creation_time FROM experiments WHERE experiment_id = 0"
        ).fetchone()
    finally:
        con.close()
    return str(row[0]), str(row[1]), int(row[2])


def test_a_seeded_store_has_the_schema_and_default_experiment_mlflow_creates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    own, seeded = tmp_path / "own", tmp_path / "seeded"
    own.mkdir()
    MlflowClient(local_store_uri(own)).search_experiments()  # MLflow creates its own store
    assert seed_local_store(seeded, tmp_path / "cache")
    assert not seed_local_store(seeded, tmp_path / "cache")  # an existing store is kept

    assert _schema(seeded / STORE_FILE) == _schema(own / STORE_FILE)
    name, location, created = _default_experiment(seeded / STORE_FILE)
    assert (name, location) == _default_experiment(own / STORE_FILE)[:2]
    assert location == os.path.join(str(tmp_path), "mlruns", "0")
    assert abs(created - _default_experiment(own / STORE_FILE)[2]) < 600_000  # made now
    assert list((tmp_path / "cache").iterdir()) == [
        next((tmp_path / "cache").glob("mlflow-*.db"))
    ]  # the template alone: no scratch left

    client = MlflowClient(local_store_uri(seeded))  # MLflow opens and writes the copy
    exp = client.create_experiment("x", artifact_location=(seeded / "a").as_uri())
    client.create_run(exp)
    assert len(client.search_runs([exp])) == 1
