"""The downstream stage: prepare a configured dataset once as Arrow files, and read it back.

Layout of one output, `<out_dir>/`: `<split>.arrow` (Arrow IPC stream, one table per split in
`schema.downstream_schema`) and `manifest.json` (stage `downstream`, task type, labels, pair
flag, rows and counts per split, and a fingerprint of the input files' sha256, the config and the
code). The directory is built under a temp name and renamed when complete; a complete output
with the same fingerprint is reused untouched. `read_downstream_dir` reads it back with json and
pyarrow only, so that `training/` can do the same through `tasks.common.io` (see
`docs/downstream.md`).
"""

from __future__ import annotations

import hashlib
from functools import partial
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger
from pydantic import BaseModel, ConfigDict, Field

from tasks.common.caching import refresh_requested, stage_task
from tasks.common.io import (
    DOWNSTREAM_STAGE,
    public_dump,
    read_downstream_dir,
    sha256_file,
    write_ipc_stream,
)
from tasks.common.schema import SCHEMA_VERSION
from tasks.common.stage import StageOutput, file_entry, files_complete, plan_output
from tasks.downstream.config import DatasetConfig
from tasks.downstream.downstream import DownstreamData, SplitCounts, load_downstream, source_paths

STAGE = DOWNSTREAM_STAGE


class SplitEntry(BaseModel):
    """One prepared split: its file and how many records were read, refused, dropped and kept."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(description="File name inside the output directory (`train.arrow`).")
    bytes: int = Field(description="File size in bytes.")
    sha256: str = Field(description="sha256 of the file.")
    rows: int = Field(description="Examples in the file (= kept).")
    read: int = Field(description="Records read from the source for this split.")
    refused: int = Field(description="Bad records dropped (on_bad_row: skip).")
    dropped: int = Field(description="Good records left out by max_examples.")


class DownstreamManifest(BaseModel):
    """What a prepared downstream directory holds; `manifest.json` is this, as JSON."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    stage: Literal["downstream"] = Field("downstream", description="Always `downstream`.")
    schema_version: int = Field(description="`tasks.common.schema.SCHEMA_VERSION` when written.")
    fingerprint: str = Field(description="Hash of input sha256s, config and code.")
    path: str = Field(
        description="The output directory, as given when it was written (`prepare` returns a "
        "reused output's manifest with the directory it is read from)."
    )
    name: str = Field(description="Task name (`DatasetConfig.name`).")
    task_type: str = Field(description="One of `tasks.common.schema.DOWNSTREAM_TASK_TYPES`.")
    pair: bool = Field(description="Examples have `text_pair` (sentence-pair tasks).")
    labels: list[str] = Field(description="Label list: label id = index (classification, tags).")
    splits: dict[str, SplitEntry] = Field(description="Split name -> its file and counts.")
    unassigned: int = Field(description="Records of a single file no split took (skipped).")
    inputs: dict[str, str] = Field(description="Source path (as configured) -> sha256.")
    config: dict[str, Any] = Field(description="The `DatasetConfig`, as JSON.")
    code: dict[str, str | None] = Field(description="git commit and source hash of `tasks`.")


def input_hashes(cfg: DatasetConfig, base_dir: Path) -> dict[str, str]:
    """sha256 of every source file; a saved-dataset directory hashes its files' names and hashes."""
    hashes: dict[str, str] = {}
    for _, path in source_paths(cfg, base_dir):
        key = path.relative_to(base_dir).as_posix() if path.is_relative_to(base_dir) else str(path)
        if path.is_dir():
            digest = hashlib.sha256()
            for file in sorted(p for p in path.rglob("*") if p.is_file()):
                digest.update(
                    f"{file.relative_to(path).as_posix()}\0{sha256_file(file)}\n".encode()
                )
            hashes[key] = digest.hexdigest()
        elif path.is_file():
            hashes[key] = sha256_file(path)
    return hashes  # a missing file is refused by the loader, naming it


def complete_output(out_dir: Path) -> DownstreamManifest | None:
    """The manifest of a complete prepared output at `out_dir` (of any fingerprint), else None."""
    path = out_dir / "manifest.json"
    if not path.is_file():
        return None
    manifest = DownstreamManifest.model_validate_json(path.read_text())
    entries = [entry.model_dump() for entry in manifest.splits.values()]
    return manifest if files_complete(out_dir, entries) else None


def _complete(out_dir: Path, fp: str) -> DownstreamManifest | None:
    manifest = complete_output(out_dir)
    return manifest if manifest is not None and manifest.fingerprint == fp else None


def _write(data: DownstreamData, tmp: Path) -> dict[str, SplitEntry]:
    entries = {}
    for split, table in data.splits.items():
        file = tmp / f"{split}.arrow"
        write_ipc_stream(table, file)
        counts = data.counts[split]
        entries[split] = SplitEntry(
            **file_entry(tmp, file),
            rows=table.num_rows,
            read=counts.read,
            refused=counts.refused,
            dropped=counts.dropped,
        )
    return entries


def plan_downstream(cfg: DatasetConfig, base_dir: Path | str, out_dir: Path | str) -> StageOutput:
    """Plan the prepared output at `out_dir`: its fingerprint (inputs' sha256, config, code)."""
    hashes = input_hashes(cfg, Path(base_dir))
    return plan_output(STAGE, hashes, public_dump(cfg), path=Path(out_dir))


def prepare(
    cfg: DatasetConfig, base_dir: Path, out_dir: Path, rebuild: bool = False
) -> tuple[DownstreamManifest, bool]:
    """Prepare `cfg` into `out_dir`, or reuse a complete output; return (manifest, reused).

    With `rebuild` a complete output is prepared again and replaced whole.
    """
    out = plan_downstream(cfg, base_dir, out_dir)
    done = out.reuse(partial(_complete, fp=out.fingerprint), rebuild)
    if done is not None:  # `path` as written; the output may have moved since (a copied workspace)
        return done.model_copy(update={"path": str(out_dir)}), True
    data = load_downstream(cfg, base_dir)
    tmp = out.open_temp_dir()
    manifest = DownstreamManifest(
        schema_version=SCHEMA_VERSION,
        fingerprint=out.fingerprint,
        path=str(out_dir),
        name=data.name,
        task_type=data.task_type,
        pair=data.pair,
        labels=list(data.labels),
        splits=_write(data, tmp),
        unassigned=data.unassigned,
        inputs=out.inputs,
        config=out.config,
        code=out.code,
    )
    out.commit(manifest.model_dump(mode="json"), built_in=tmp)
    return manifest, False


def prepare_downstream(cfg: DatasetConfig, base_dir: Path, out_dir: Path) -> DownstreamManifest:
    """Load, check and write a downstream dataset as `<out_dir>/<split>.arrow` + manifest.

    Relative source paths resolve against `base_dir`. A complete output with the same
    fingerprint (inputs' sha256, config, code) is returned as it is, its files untouched.
    """
    return prepare(cfg, base_dir, out_dir)[0]


@stage_task("prepare-downstream", plan_downstream, complete_output)
def prepare_downstream_task(cfg: DatasetConfig, base_dir: str, out_dir: str) -> dict[str, Any]:
    """Prepare one downstream dataset (or reuse it); return its manifest as a summary.

    Prefect's cache key is the output's fingerprint (`tasks.common.caching`), as for every
    stage; the summary adds `reused`.
    """
    rebuild = refresh_requested()
    manifest, reused = prepare(cfg, Path(base_dir), Path(out_dir), rebuild)
    get_run_logger().info(
        "downstream %s %s: %s, %s",
        manifest.name,
        manifest.fingerprint,
        "reused" if reused else "built",
        ", ".join(f"{split} {entry.rows}" for split, entry in manifest.splits.items()),
    )
    return manifest.model_dump(mode="json") | {"reused": reused}


def read_downstream(manifest_or_dir: DownstreamManifest | Path | str) -> DownstreamData:
    """Read a prepared downstream output back into a `DownstreamData`."""
    if isinstance(manifest_or_dir, DownstreamManifest):
        manifest_or_dir = manifest_or_dir.path
    manifest, tables = read_downstream_dir(manifest_or_dir)
    counts = {
        split: SplitCounts(e["read"], e["refused"], e["dropped"], e["rows"])
        for split, e in manifest["splits"].items()
    }
    return DownstreamData(
        name=manifest["name"],
        task_type=manifest["task_type"],
        pair=manifest["pair"],
        labels=tuple(manifest["labels"]),
        splits=tables,
        counts=counts,
        unassigned=manifest["unassigned"],
    )
