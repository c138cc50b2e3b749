"""Prefect's cache of the data stages, against the session's real Prefect server.

Ingest and tokenizer on a tiny synthetic corpus, in a flow that calls them as the steps do
(`in_workspace`, `stage_summary`): a rerun is `Cached`, a deleted output is rebuilt while the
stage after it stays cached, `refresh_cache` rebuilds an intact output, results are JSON.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]


def task_states(flow_run_id: Any) -> dict[str, str]:
    """The state name of each task run of a flow run, by task name, read from the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs if run.state}


def digests(out: Path) -> dict[str, str]:
    """sha256 of every file of an output but its manifest (which records the time taken)."""
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.is_file() and p.name != "manifest.json"
    }


def test_stage_tasks_are_cached_on_their_fingerprint_guarded_by_the_workspace(
    tmp_path: Path, ray_session: str, prefect_api: str
) -> None:
    from prefect import flow

    from tasks.common.caching import in_workspace, results_dir, stage_summary
    from tasks.common.ray_runtime import RayConfig
    from tasks.demo.synthetic import SyntheticConfig, write_corpus
    from tasks.ingest.ingest import IngestConfig
    from tasks.ingest.stage import ingest_task
    from tasks.tokenizer.stage import tokenizer_task
    from tasks.tokenizer.tokenizer import TokenizerConfig

    write_corpus(tmp_path / "demo", SyntheticConfig(documents=60, parts=1, task_examples=10))
    ingest_cfg = IngestConfig.model_validate(
        {"sources": [{"path": str(tmp_path / "demo" / "corpus"), "format": "jsonl"}]}
    )
    tok_cfg = TokenizerConfig(vocab_size=300, min_frequency=1)
    ray_cfg = RayConfig(num_workers=2, num_cpus=4)
    ws = str(tmp_path / "ws")

    @flow
    def data(refresh_ingest: bool = False) -> dict[str, dict[str, Any]]:
        ingest = in_workspace(ingest_task.with_options(refresh_cache=refresh_ingest), ws)
        first = stage_summary(ingest(ingest_cfg, ray_cfg, ws, return_state=True))
        tok = in_workspace(tokenizer_task, ws)(tok_cfg, first["path"], ws, return_state=True)
        return {"ingest": first, "tokenizer": stage_summary(tok)}

    def run(refresh_ingest: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
        state = data(refresh_ingest, return_state=True)
        return state.result(), task_states(state.state_details.flow_run_id)

    built, states = run()
    assert states == {"ingest": "Completed", "tokenizer": "Completed"}
    assert not any(s["reused"] for s in built.values())
    ingest_dir = Path(built["ingest"]["path"])
    files = digests(ingest_dir)

    # Nothing changed: both task runs are Prefect cache hits, and say they were reused.
    again, states = run()
    assert states == {"ingest": "Cached", "tokenizer": "Cached"}
    assert again == {name: s | {"reused": True} for name, s in built.items()}

    # The result is a JSON record holding the summary the task returned, never a pickle.
    [record] = results_dir(ws).glob(f"tokenizer-{built['tokenizer']['fingerprint']}-*")
    stored = json.loads(record.read_bytes())
    assert stored["metadata"]["serializer"]["type"] == "json"
    assert json.loads(stored["result"]) == built["tokenizer"]

    # A deleted output is rebuilt (same bytes, same fingerprint); the tokenizer stays cached.
    shutil.rmtree(ingest_dir)
    rebuilt, states = run()
    assert states == {"ingest": "Completed", "tokenizer": "Cached"}
    assert rebuilt["ingest"] == built["ingest"]
    assert digests(ingest_dir) == files

    # A refreshed cache rebuilds an intact output, swapped in whole; then it is cached again.
    manifest = (ingest_dir / "manifest.json").stat().st_ino
    refreshed, states = run(refresh_ingest=True)
    assert states == {"ingest": "Completed", "tokenizer": "Cached"}
    assert refreshed["ingest"] == built["ingest"]
    assert (ingest_dir / "manifest.json").stat().st_ino != manifest
    assert digests(ingest_dir) == files
    assert not list(ingest_dir.parent.glob(".*"))  # no temp directory left beside it
    assert run()[1] == {"ingest": "Cached", "tokenizer": "Cached"}
