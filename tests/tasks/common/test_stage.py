"""The stage scaffold: fingerprint and place, reuse (with the sweep), staging, commit."""

import json
from pathlib import Path
from typing import Any

import pytest

from tasks.common.stage import (
    StageResult,
    complete_manifest,
    file_entry,
    plan_output,
)

CONFIG = {"size": 3}
INPUTS = {"upstream": "0123456789abcdef"}


def leave_leftovers(out: Path) -> None:
    (out / "_staging").mkdir(exist_ok=True)
    (out / "_staging" / "part.json").write_text("{}")
    (out / ".part.arrow.tmp-999999-0123abcd").write_bytes(b"half a shard")


def build_in_place(workspace: Path) -> StageResult:
    out = plan_output("demo", INPUTS, CONFIG, workspace=workspace)
    staging = out.open_staging()
    (staging / "part.json").write_text("{}")
    (out.path / "part.arrow").write_bytes(b"rows")
    return out.commit({**out.header(), "files": [file_entry(out.path, out.path / "part.arrow")]})


def test_plan_output_places_the_output_under_its_fingerprint(tmp_path: Path) -> None:
    out = plan_output("demo", INPUTS, CONFIG, workspace=tmp_path)
    assert out.path == tmp_path / "demo" / out.fingerprint
    assert len(out.fingerprint) == 16
    assert out.header()["fingerprint"] == out.fingerprint
    assert out.header()["inputs"] == INPUTS


def test_plan_output_keys_the_fingerprint_on_inputs_config_and_seed(tmp_path: Path) -> None:
    base = plan_output("demo", INPUTS, CONFIG, workspace=tmp_path).fingerprint
    assert plan_output("demo", INPUTS, {"size": 4}, workspace=tmp_path).fingerprint != base
    assert plan_output("demo", {"upstream": "x"}, CONFIG, workspace=tmp_path).fingerprint != base
    assert plan_output("demo", INPUTS, CONFIG, workspace=tmp_path, seed=1).fingerprint != base
    assert plan_output("demo", INPUTS, CONFIG, path=tmp_path / "mine").fingerprint == base


def test_plan_output_needs_exactly_one_place(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        plan_output("demo", INPUTS, CONFIG)
    with pytest.raises(ValueError, match="exactly one"):
        plan_output("demo", INPUTS, CONFIG, workspace=tmp_path, path=tmp_path / "mine")


def test_commit_writes_the_manifest_and_sweeps_the_staging(tmp_path: Path) -> None:
    built = build_in_place(tmp_path)
    assert not built.reused
    assert json.loads((built.path / "manifest.json").read_text()) == built.manifest
    assert sorted(p.name for p in built.path.iterdir()) == ["manifest.json", "part.arrow"]


def test_commit_of_a_temp_directory_moves_it_into_place(tmp_path: Path) -> None:
    out = plan_output("demo", INPUTS, CONFIG, workspace=tmp_path)
    stale = out.path.with_name(f".{out.path.name}.tmp-999999-0123abcd")
    stale.mkdir(parents=True)
    tmp = out.open_temp_dir()
    assert not stale.exists()
    (tmp / "vocab.txt").write_text("a\n")
    manifest: dict[str, Any] = {**out.header(), "files": [file_entry(tmp, tmp / "vocab.txt")]}
    built = out.commit(manifest, built_in=tmp)
    assert not tmp.exists()
    assert sorted(p.name for p in built.path.iterdir()) == ["manifest.json", "vocab.txt"]
    assert complete_manifest(built.path) == manifest


def test_reuse_of_a_complete_output_sweeps_its_leftovers(tmp_path: Path) -> None:
    built = build_in_place(tmp_path)
    leave_leftovers(built.path)
    out = plan_output("demo", INPUTS, CONFIG, workspace=tmp_path)
    assert out.reuse(complete_manifest) == built.manifest
    assert sorted(p.name for p in built.path.iterdir()) == ["manifest.json", "part.arrow"]


def test_reuse_of_an_incomplete_output_returns_none_and_touches_nothing(tmp_path: Path) -> None:
    built = build_in_place(tmp_path)
    (built.path / "part.arrow").write_bytes(b"cut")
    leave_leftovers(built.path)
    out = plan_output("demo", INPUTS, CONFIG, workspace=tmp_path)
    assert out.reuse(complete_manifest) is None
    assert (built.path / "_staging" / "part.json").exists()
