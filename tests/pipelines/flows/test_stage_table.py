"""The CLI's stage table says what this run did: a build's own time, or 'reused' without one."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.flows.summary import stage_rows


def _ingest_output(tmp_path: Path) -> Path:
    out = tmp_path / "ingest"
    out.mkdir()
    split = {"rows": 3, "shards": [{"bytes": 2**20}]}
    manifest = {
        "elapsed_s": 7.441,
        "counts": {
            "read": 4,
            "kept": 3,
            "filtered": {},
            "duplicates": {"exact": 1},
            "quarantined": {},
        },
        "splits": {"train": split, "validation": split, "test": split},
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def _tokenizer_output(tmp_path: Path) -> Path:
    out = tmp_path / "tokenizer"
    out.mkdir()
    manifest = {"metrics": {"elapsed_s": 0.185, "vocab_size": 257}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_a_built_stage_shows_its_own_time_ingest_included(tmp_path: Path) -> None:
    for name, path in (
        ("ingest", _ingest_output(tmp_path)),
        ("tokenizer", _tokenizer_output(tmp_path)),
    ):
        rows = dict(stage_rows(name, {"path": str(path), "reused": False}))
        assert rows["status"] == "built"
        assert rows["elapsed s"] in ("7.441", "0.185"), rows


def test_a_reused_stage_shows_no_time_of_the_original_build(tmp_path: Path) -> None:
    for name, path in (
        ("ingest", _ingest_output(tmp_path)),
        ("tokenizer", _tokenizer_output(tmp_path)),
    ):
        rows = dict(stage_rows(name, {"path": str(path), "reused": True}))
        assert rows["status"] == "reused (cache hit)"
        assert "elapsed s" not in rows, rows
        assert "output" in rows  # the rest of the summary stays
