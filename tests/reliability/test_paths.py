"""Names that become paths never escape their root.

Every place a name from config, data or a registry becomes a path is fed traversal: `..`,
absolute paths, URL-encoded and double-encoded dots and slashes, backslashes, NUL, Unicode
look-alikes (fullwidth dots and solidus, dot leaders: NFKC-normalised before the check) and
symbolic links pointing outside. Each must be refused, naming what was refused.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

from pipelines.config import ConfigError, load_config
from tasks.common.io import UnsafePathError, read_downstream_dir, safe_join, safe_name

pytestmark = [pytest.mark.reliability]

TRAVERSALS = [
    "..",
    "../x",
    "a/../../x",
    "/etc/passwd",
    "//etc/passwd",
    "~/x",
    "%2e%2e",
    "%2e%2e%2fx",
    "..%2Fx",
    "a%2F..%2F..%2Fx",
    "%252e%252e%252fx",  # double-encoded
    "..\\x",
    "a\\..\\..\\x",
    "C:\\x",
    "C:x",
    "a\x00b",
    "",
    ".",
    "a//b",
    "\uff0e\uff0e",  # fullwidth full stops
    "\uff0e\uff0e\uff0fx",  # ... and fullwidth solidus
    "a\uff0f\uff0e\uff0e\uff0f\uff0e\uff0e\uff0fx",
    "\u2025",  # two dot leader: NFKC ".."
    "\u2024\u2024/x",  # one dot leaders
    "..\uff3cx",  # fullwidth reverse solidus
]
GOOD = ["train-00000.arrow", "splits/train.arrow", "a.b..c", "shard_1"]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_safe_name_refuses_traversal(name: str) -> None:
    with pytest.raises(UnsafePathError):
        safe_name(name, what="shard")


@pytest.mark.parametrize("name", GOOD)
def test_safe_name_accepts_plain_relative_names(name: str, tmp_path: Path) -> None:
    assert safe_name(name) == name
    assert safe_join(tmp_path, name).is_relative_to(tmp_path.resolve())


def test_safe_join_refuses_a_symlink_out_of_the_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.arrow").write_text("x")
    (root / "link").symlink_to(outside, target_is_directory=True)
    (root / "file.arrow").symlink_to(outside / "secret.arrow")
    for name in ("link/secret.arrow", "file.arrow"):
        with pytest.raises(UnsafePathError, match="resolves outside"):
            safe_join(root, name, what="shard")


@pytest.mark.parametrize("name", [*TRAVERSALS[:8], "a/b", "-x", ".hidden", "x" * 101])
def test_run_name_that_is_not_one_plain_segment_is_refused(tmp_path: Path, name: str) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"name": name}))
    with pytest.raises(ConfigError, match="name"):
        load_config(recipe)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "%2e%2e", "\uff0e\uff0e", "a\\b"])
def test_downstream_task_name_is_refused(name: str) -> None:
    from tasks.downstream.config import DatasetConfig

    with pytest.raises(ValueError, match="letters, digits"):
        DatasetConfig.model_validate(
            {
                "name": name,
                "task_type": "classification",
                "splits": {"train": "train.jsonl"},
                "labels": ["a", "b"],
            }
        )


@pytest.mark.parametrize("name", ["../../outside", "a/b", "..", "%2e%2e", "x\x00", "\u2025"])
def test_registered_model_name_is_refused_before_mlflow(tmp_path: Path, name: str) -> None:
    from training.finetune.config import BaseModelRef
    from training.finetune.stage import resolve_base_model
    from training.tracking.registry import ModelVersionRef, download_model, resolve_version

    missing = f"sqlite:///{tmp_path / 'no-such-dir' / 'mlflow.db'}"  # never opened
    with pytest.raises(UnsafePathError):
        resolve_version(missing, name, "1")
    with pytest.raises(UnsafePathError):
        resolve_base_model(BaseModelRef(registry_name=name), missing, tmp_path / "ws")
    ref = ModelVersionRef(name, "1", None, f"models:/{name}/1", "")
    with pytest.raises(UnsafePathError):
        download_model(missing, ref, tmp_path / "dl")
    assert not (tmp_path / "no-such-dir").exists()
    assert not (tmp_path / "ws").exists()


def _downstream(root: Path, name: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    manifest = {"stage": "downstream", "splits": {"train": {"name": name, "rows": 1}}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return root


@pytest.mark.parametrize("name", TRAVERSALS)
def test_downstream_manifest_file_names_cannot_escape(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafePathError):
        read_downstream_dir(_downstream(tmp_path / "task", name))


@pytest.mark.parametrize("name", ["../x.arrow", "/etc/passwd", "%2e%2e/x", "\uff0e\uff0e/x"])
def test_example_and_stage_manifest_names_cannot_escape(tmp_path: Path, name: str) -> None:
    from tasks.common.stage import files_complete
    from training.pretrain.data import ExampleShards

    examples = tmp_path / "examples"
    examples.mkdir()
    shard = {"name": name, "rows": 1, "bytes": 1, "sha256": "0"}
    manifest = {
        "stage": "examples",
        "objective": "causal",
        "splits": {"train": {"shards": [shard]}},
    }
    (examples / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafePathError):
        ExampleShards(examples, "train")
    with pytest.raises(UnsafePathError):
        files_complete(examples, [shard])


@pytest.mark.parametrize("binary", ["../../outside", "/etc", "%2e%2e/outside", "model/../.."])
def test_registry_mlmodel_cannot_name_directories_outside(tmp_path: Path, binary: str) -> None:
    from training.tracking.registry import _flatten_flavor

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("x")
    download = tmp_path / "dl" / "a" / "model"
    (download / "model").mkdir(parents=True)
    flavor = {"model_binary": binary, "components": []}
    (download / "MLmodel").write_text(yaml.safe_dump({"flavors": {"transformers": flavor}}))
    with pytest.raises(UnsafePathError):
        _flatten_flavor(download, tmp_path / "hf", read_from=tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_registry_download_with_a_symlink_is_refused(tmp_path: Path) -> None:
    from training.tracking.registry import _flatten_flavor

    download = tmp_path / "dl"
    (download / "model").mkdir(parents=True)
    (download / "model" / "config.json").symlink_to("/etc/hostname")
    flavor = {"model_binary": "model", "components": ["../../x"]}
    (download / "MLmodel").write_text(yaml.safe_dump({"flavors": {"transformers": flavor}}))
    with pytest.raises(UnsafePathError, match="symbolic links"):
        _flatten_flavor(download, tmp_path / "hf", read_from=tmp_path / "hf")


def test_gc_never_deletes_through_a_symlink(tmp_path: Path) -> None:
    from pipelines.ops.gc import apply_plan, plan_gc

    outside = tmp_path / "outside"
    (outside / "data").mkdir(parents=True)
    (outside / "data" / "keep.arrow").write_text("precious")
    ws = tmp_path / "ws"
    (ws / "ingest").mkdir(parents=True)
    (ws / "ingest" / "0123456789abcdef").symlink_to(outside / "data", target_is_directory=True)
    real = ws / "ingest" / "fedcba9876543210"
    real.mkdir()
    (real / "inner-link").symlink_to(outside / "data", target_is_directory=True)
    old = time.time() - 30 * 86400
    for path in (ws / "ingest" / "0123456789abcdef", real / "inner-link", real):
        os.utime(path, (old, old), follow_symlinks=False)
    plan = plan_gc(ws, [], now=time.time())
    assert plan.removals  # both outputs are unreferenced and old
    apply_plan(plan)
    assert (outside / "data" / "keep.arrow").read_text() == "precious"
    assert not real.exists()


def test_gc_refuses_a_stage_directory_that_links_outside(tmp_path: Path) -> None:
    from pipelines.ops.gc import apply_plan, plan_gc

    outside = tmp_path / "outside"
    (outside / "0123456789abcdef").mkdir(parents=True)
    (outside / "0123456789abcdef" / "keep.arrow").write_text("precious")
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "ingest").symlink_to(outside, target_is_directory=True)
    old = time.time() - 30 * 86400
    os.utime(outside / "0123456789abcdef", (old, old))
    plan = plan_gc(ws, [], now=time.time())
    if plan.removals:
        with pytest.raises(ValueError, match="outside the workspace"):
            apply_plan(plan)
    assert (outside / "0123456789abcdef" / "keep.arrow").read_text() == "precious"


def test_checkpoint_meta_file_names_cannot_escape(tmp_path: Path) -> None:
    from tasks.common.io import sha256_file
    from training.runtime import checkpoint as ckpt

    outside = tmp_path / "outside.txt"
    outside.write_text("x")
    path = tmp_path / "run" / ckpt.checkpoint_name(1)
    path.mkdir(parents=True)
    meta = {"format": 1, "files": {"../../outside.txt": sha256_file(outside)}}
    (path / ckpt.META).write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="outside"):
        ckpt.validate(path)
