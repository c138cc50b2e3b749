"""A workspace's identity and roots: a copy keeps its id and reads its records where it is now."""

from __future__ import annotations

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
