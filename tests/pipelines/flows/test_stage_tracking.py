"""A data stage's MLflow run: the inputs it lists, from its manifest; the run a cache hit names."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pipelines.config import RunConfig, load_config
from pipelines.flows.stage_tracking import (
    corpus_inputs,
    recorded_run,
    run_record,
    stage_inputs,
    track_stage_task,
)
from training.tracking.runs import DatasetRef


def test_a_stage_lists_each_upstream_output_its_manifest_names(tmp_path: Path) -> None:
    manifest = {
        "stage": "examples",
        "inputs": {"encode": "e1", "tokenizer": "t1"},
        "encode": {"fingerprint": "e1", "path": "/ws/encode/e1"},
        "tokenizer": {"fingerprint": "t1", "path": "/ws/tokenizer/t1"},
        "specials": {"vocab_size": 300},
    }
    assert stage_inputs("examples", manifest, tmp_path) == [
        DatasetRef("encode", "e1", "/ws/encode/e1"),
        DatasetRef("tokenizer", "t1", "/ws/tokenizer/t1"),
    ]


def test_ingest_lists_its_corpus_files_and_decontaminate_the_ingest_it_filtered(
    tmp_path: Path,
) -> None:
    files = [{"source": "s", "uri": f"/corpus/{i}.txt", "xxh3_128": f"{i:032x}"} for i in range(2)]
    assert stage_inputs("ingest", {"inputs": files}, tmp_path) == [
        DatasetRef("corpus", f"{i:032x}", f"/corpus/{i}.txt") for i in range(2)
    ]
    decontaminated = {"inputs": files, "decontaminated_from": "i9"}
    assert stage_inputs("decontaminate", decontaminated, tmp_path) == [
        DatasetRef("ingest", "i9", str(tmp_path / "ingest" / "i9"))
    ]


def test_a_downstream_task_lists_its_source_files_under_its_base_dir() -> None:
    manifest = {"inputs": {"cola/train.tsv": "a" * 64, "/abs/dev.tsv": "b" * 64}}
    assert stage_inputs("downstream", manifest, Path("/ws"), Path("/data")) == [
        DatasetRef("source", "a" * 64, "/data/cola/train.tsv"),
        DatasetRef("source", "b" * 64, "/abs/dev.tsv"),
    ]


def test_a_corpus_of_many_files_is_listed_per_source_with_a_stable_digest() -> None:
    files = [{"source": f"s{i % 2}", "uri": f"/c/{i}", "xxh3_128": f"{i:032x}"} for i in range(100)]
    refs = corpus_inputs(files)
    assert [r.source for r in refs] == ["s0", "s1"]
    assert refs == corpus_inputs(list(reversed(files)))
    assert all(len(r.digest) == 32 for r in refs)


def reused_result(tmp_path: Path, stage: str = "tokenizer") -> dict[str, Any]:
    """A data stage's summary as a cache hit returns it, its output under `tmp_path`."""
    out = tmp_path / "ws" / stage / "f00d"
    return {"stage": stage, "path": str(out), "fingerprint": "f00d", "reused": True}


def stage_config(tmp_path: Path, *overrides: str) -> RunConfig:
    """A recipe that tracks into a SQLite store in the workspace, plus `overrides`."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: rec\nworkspace: {tmp_path / 'ws'}\n")
    uri = f"sqlite:///{tmp_path / 'ws' / 'mlflow.db'}"
    return load_config(recipe, [f"tracking.tracking_uri={uri}", *overrides])


def record(cfg: RunConfig, result: dict[str, Any], run_id: str) -> None:
    """Write the record `track_stage_task` writes once it logged `run_id` for the output."""
    path = run_record(cfg, result)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result | {"run_id": run_id}))


def test_a_cache_hit_names_the_run_recorded_for_its_output_in_this_store(tmp_path: Path) -> None:
    cfg, result = stage_config(tmp_path), reused_result(tmp_path)
    assert recorded_run(cfg, result) is None  # nothing recorded: the stage logs a run
    record(cfg, result, "r1")
    assert recorded_run(cfg, result) == "r1"
    # A built output, another store or experiment, or a parent run: a run is logged.
    assert recorded_run(cfg, result | {"reused": False}) is None
    for other in ("tracking.tracking_uri=http://127.0.0.1:5999", "tracking.experiment=other"):
        assert recorded_run(stage_config(tmp_path, other), result) is None
    assert recorded_run(stage_config(tmp_path, "tracking.parent_run_id=p1"), result) is None
    assert recorded_run(stage_config(tmp_path, "tracking.enabled=false"), result) is None


def test_a_copied_workspace_finds_the_runs_recorded_in_its_own_store(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg, result = stage_config(tmp_path / "a"), reused_result(tmp_path / "a")
    record(cfg, result, "r1")
    shutil.copytree(tmp_path / "a" / "ws", tmp_path / "b" / "ws")  # its mlflow.db goes with it
    assert recorded_run(stage_config(tmp_path / "b"), reused_result(tmp_path / "b")) == "r1"


def test_a_record_of_another_fingerprint_or_a_torn_one_names_no_run(tmp_path: Path) -> None:
    cfg, result = stage_config(tmp_path), reused_result(tmp_path)
    record(cfg, result | {"fingerprint": "beef"}, "r1")
    assert recorded_run(cfg, result) is None
    run_record(cfg, result).write_text('{"run_id": ')
    assert recorded_run(cfg, result) is None
    assert "sqlite" not in run_record(cfg, result).name  # the URI may hold a password


@pytest.mark.slow
def test_a_built_stage_records_its_run_and_its_cache_hit_then_names_it(
    tmp_path: Path, mlflow_uri: str
) -> None:
    from prefect.logging import disable_run_logger

    cfg = stage_config(tmp_path, f"tracking.tracking_uri={mlflow_uri}")
    out = tmp_path / "ws" / "tokenizer" / "f00d"
    out.mkdir(parents=True)
    manifest = {"code": {"git_commit": "abc"}, "metrics": {"vocab_size": 300.0}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    built = reused_result(tmp_path) | {"reused": False}
    with disable_run_logger():
        run_id = track_stage_task.fn(built, cfg)
        assert run_id is not None
        assert recorded_run(cfg, built | {"reused": True}) == run_id
        # A cache hit that logs a run (under a parent) keeps the record of the build's run.
        nested = stage_config(
            tmp_path, f"tracking.tracking_uri={mlflow_uri}", "tracking.parent_run_id=p1"
        )
        assert track_stage_task.fn(built | {"reused": True}, nested) != run_id
    assert recorded_run(cfg, built | {"reused": True}) == run_id
