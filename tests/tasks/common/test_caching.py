"""The data stages' Prefect cache policy and the scaffold's forced rebuild, without a server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore
from prefect.serializers import JSONSerializer

from tasks.common.caching import StageCache, cache_key, refresh_requested, stage_summary
from tasks.common.stage import StageOutput, complete_manifest, file_entry, plan_output
from tasks.common.workspace import open_workspace

CONFIG = {"size": 3}
INPUTS = {"upstream": "0123456789abcdef"}


def plan(workspace: str) -> StageOutput:
    return plan_output("demo", INPUTS, CONFIG, workspace=Path(workspace))


def build(out: StageOutput, rows: bytes = b"rows") -> dict[str, Any]:
    (out.path / "part.arrow").write_bytes(rows)
    manifest = {**out.header(), "files": [file_entry(out.path, out.path / "part.arrow")]}
    return out.commit(manifest).manifest


def task_context(results: Path) -> Any:
    """What `compute_key` reads of a task run's context: the task and its result store."""
    store = ResultStore(
        result_storage=LocalFileSystem(basepath=str(results)), serializer=JSONSerializer()
    )
    return SimpleNamespace(task=SimpleNamespace(name="demo"), result_store=store)


def test_a_forced_rebuild_is_built_aside_and_swapped_in_whole(tmp_path: Path) -> None:
    out = plan(str(tmp_path))
    out.path.mkdir(parents=True)
    build(out)
    assert out.reuse(complete_manifest, rebuild=True) is None
    aside = out.build_aside()
    assert aside.path.parent == out.path.parent
    assert aside.path != out.path
    assert (out.path / "part.arrow").read_bytes() == b"rows"  # untouched while it builds
    built = build(aside, b"new rows")
    assert not aside.path.exists()
    assert (out.path / "part.arrow").read_bytes() == b"new rows"
    assert complete_manifest(out.path) == built
    assert [p.name for p in tmp_path.joinpath("demo").iterdir()] == [out.path.name]


def test_the_cache_key_is_the_fingerprint_of_a_complete_output_only(tmp_path: Path) -> None:
    policy = StageCache(plan=plan, complete=complete_manifest)
    ctx = task_context(tmp_path / "results")
    inputs = {"workspace": str(tmp_path / "ws"), "ray_cfg": None}  # unnamed arguments: ignored
    out = plan(inputs["workspace"])
    key = cache_key(out)
    assert key.startswith(f"demo-{out.fingerprint}-")
    ctx.result_store.write({"path": str(out.path)}, key=key)
    assert ctx.result_store.exists(key)

    # Missing output: the key stays, and its record is expired, so the task runs and rewrites it.
    assert policy.compute_key(ctx, inputs, {}) == key
    assert not ctx.result_store.exists(key)
    record = json.loads((tmp_path / "results" / key).read_bytes())
    assert record["metadata"]["serializer"]["type"] == "json"

    out.path.mkdir(parents=True)
    build(out)
    ctx.result_store.write({"path": str(out.path)}, key=key)
    assert policy.compute_key(ctx, inputs, {}) == key
    assert ctx.result_store.exists(key)


def test_a_call_that_cannot_be_planned_has_no_cache_key(tmp_path: Path) -> None:
    def broken(workspace: str) -> StageOutput:
        raise ValueError("no upstream output")

    policy = StageCache(plan=broken, complete=complete_manifest)
    assert policy.compute_key(task_context(tmp_path), {"workspace": str(tmp_path)}, {}) is None
    off = StageCache(plan=lambda workspace: None, complete=complete_manifest)
    assert off.compute_key(task_context(tmp_path), {"workspace": str(tmp_path)}, {}) is None


def test_no_refresh_is_requested_outside_a_task_run() -> None:
    assert refresh_requested() is False


def test_a_copied_workspace_keeps_its_cache_keys_and_another_workspace_has_its_own(
    tmp_path: Path,
) -> None:
    open_workspace(tmp_path / "a")
    open_workspace(tmp_path / "other")
    key = cache_key(plan(str(tmp_path / "a")))
    shutil.copytree(tmp_path / "a", tmp_path / "b", symlinks=True)
    assert cache_key(plan(str(tmp_path / "b"))) == key
    assert cache_key(plan(str(tmp_path / "other"))) != key
    assert cache_key(plan(str(tmp_path / "loose"))) != key  # no workspace: its absolute path


def test_a_cache_hit_in_a_copy_names_the_copy_s_output(tmp_path: Path) -> None:
    from prefect.states import Completed

    open_workspace(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    open_workspace(tmp_path / "b")
    written = {"stage": "demo", "path": str(tmp_path / "a" / "demo" / "f00d"), "reused": False}
    hit = stage_summary(Completed(data=written, name="Cached"), tmp_path / "b")
    assert hit == written | {"path": str(tmp_path / "b" / "demo" / "f00d"), "reused": True}
