"""A workspace's identity and roots: a copy keeps its id and reads its records where it is now."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tasks.common.workspace import (
    WORKSPACE_FILE,
    location_key,
    open_workspace,
    read_workspace,
    relocate,
    relocate_record,
    workspace_of,
)


def test_opening_makes_one_id_and_records_each_root_once(tmp_path: Path) -> None:
    first = open_workspace(tmp_path / "ws")
    again = open_workspace(tmp_path / "ws")
    assert again == first
    assert first.roots == (str(tmp_path / "ws"),)
    assert read_workspace(tmp_path / "ws") == first
    assert read_workspace(tmp_path / "nothing") is None
    assert open_workspace(tmp_path / "other").id != first.id


def test_a_copy_keeps_the_id_and_gains_its_root(tmp_path: Path) -> None:
    original = open_workspace(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    copy = open_workspace(tmp_path / "b")
    assert copy.id == original.id
    assert copy.roots == (str(tmp_path / "a"), str(tmp_path / "b"))
    assert read_workspace(tmp_path / "a") == original  # the original is not touched


def test_a_copy_relocates_what_its_records_name_under_an_old_root(tmp_path: Path) -> None:
    open_workspace(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    open_workspace(tmp_path / "b")
    shutil.copytree(tmp_path / "b", tmp_path / "c")  # a copy of a copy: both old roots map
    copy = tmp_path / "c"
    record = {
        "path": str(tmp_path / "a" / "ingest" / "f00d"),
        "runs": [str(tmp_path / "b" / "pretrain" / "r1.export"), 3],
        "here": str(copy / "tokenizer" / "beef"),
        "elsewhere": str(tmp_path / "corpus" / "part-0.jsonl"),
        "prefix_only": str(tmp_path / "ab" / "x"),
        "text": "not a path",
    }
    assert relocate_record(record, copy) == {
        "path": str(copy / "ingest" / "f00d"),
        "runs": [str(copy / "pretrain" / "r1.export"), 3],
        "here": record["here"],
        "elsewhere": record["elsewhere"],
        "prefix_only": record["prefix_only"],
        "text": "not a path",
    }
    assert relocate(str(tmp_path / "a"), copy) == str(copy)
    assert relocate(record["path"], None) == record["path"]
    assert relocate(record["path"], tmp_path / "not-a-workspace") == record["path"]


def test_the_location_key_names_the_workspace_by_id_and_is_the_same_in_a_copy(
    tmp_path: Path,
) -> None:
    open_workspace(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    key = location_key(tmp_path / "a" / "ingest" / "f00d")
    assert key is not None
    assert key.endswith(":ingest/f00d")
    assert location_key(tmp_path / "b" / "ingest" / "f00d") == key
    open_workspace(tmp_path / "other")
    assert location_key(tmp_path / "other" / "ingest" / "f00d") != key
    assert location_key(tmp_path / "loose" / "ingest" / "f00d") is None
    assert workspace_of(tmp_path / "b" / "ingest" / "f00d") == tmp_path / "b"


def test_the_workspace_file_holds_the_id_and_roots(tmp_path: Path) -> None:
    info = open_workspace(tmp_path / "ws")
    data = json.loads((tmp_path / "ws" / WORKSPACE_FILE).read_text())
    assert data == {"id": info.id, "roots": [str(tmp_path / "ws")]}
    assert not [p.name for p in (tmp_path / "ws").iterdir() if p.name != WORKSPACE_FILE]


def adapter_export(workspace: Path, base: str) -> Path:
    """A finished fine-tuning run whose export's adapter names `base`, listed in its manifest."""
    run = workspace / "finetune" / "k1"
    config = run / "export" / "adapter_config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"base_model_name_or_path": base, "r": 8}, indent=2))
    entry = {"name": "export/adapter_config.json", "bytes": config.stat().st_size, "sha256": "x"}
    (run / "manifest.json").write_text(json.dumps({"files": [entry], "fingerprint": "k1"}))
    return config


def test_opening_a_copy_rewrites_the_base_path_of_its_adapter_exports(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    open_workspace(a)
    adapter_export(a, str(a / "finetune" / "k1" / "export" / "base_model"))
    shutil.copytree(a, b)

    open_workspace(b)

    config = b / "finetune" / "k1" / "export" / "adapter_config.json"
    record = json.loads(config.read_text())
    assert record == {"base_model_name_or_path": str(config.parent / "base_model"), "r": 8}
    (entry,) = json.loads((b / "finetune" / "k1" / "manifest.json").read_text())["files"]
    assert entry["bytes"] == config.stat().st_size  # the run stays complete (`files_complete`)
    assert entry["sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()
    original = a / "finetune" / "k1" / "export" / "adapter_config.json"
    assert json.loads(original.read_text())["base_model_name_or_path"].startswith(str(a))
    before = config.stat().st_mtime_ns
    open_workspace(b)  # nothing under an old root any more: nothing rewritten
    assert config.stat().st_mtime_ns == before


def test_a_workspace_moved_back_rewrites_what_was_written_elsewhere(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    open_workspace(a)
    shutil.move(a, b)
    open_workspace(b)
    config = adapter_export(b, str(b / "finetune" / "k1" / "export" / "base_model"))
    shutil.move(b, a)  # `a` is among the roots already: no new root, still a move

    open_workspace(a)

    moved = a / "finetune" / "k1" / "export" / "adapter_config.json"
    assert json.loads(moved.read_text())["base_model_name_or_path"] == str(
        moved.parent / "base_model"
    )
    assert not config.exists()


def test_the_rewrite_leaves_relative_and_outside_paths_alone(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    open_workspace(a)
    for base in ("base_model", str(tmp_path / "models" / "bert")):
        shutil.rmtree(b, ignore_errors=True)
        config = adapter_export(a, base)
        shutil.copytree(a, b)
        open_workspace(b)
        copied = b / config.relative_to(a)
        assert copied.read_bytes() == config.read_bytes()
        shutil.rmtree(a / "finetune")
