"""Checkpoint commit protocol: DeepSpeed shards, then `meta.json` last; validation and retention.

A checkpoint is a directory `checkpoint_step-NNNNNNNNN` in the run directory. Every rank writes
its DeepSpeed files and its RNG state; after a barrier rank 0 hashes every file and writes
`meta.json` (step, data cursor, config hash, sha256 of every file) atomically. A directory without
a valid `meta.json` is incomplete and is never loaded: DeepSpeed's files are pickles, so they are
opened only after every hash matched.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.io import sha256_file, write_json_atomic

log = logging.getLogger(__name__)
META = "meta.json"
TAG = "ds"  # DeepSpeed's tag: the sub-directory holding its shards
_NAME = re.compile(r"checkpoint_step-(\d{9})")
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint is incomplete, corrupt or from another configuration."""


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint after `step` optimizer steps."""
    return f"checkpoint_step-{step:09d}"


def rng_file(rank: int) -> str:
    """The file that holds one rank's RNG states."""
    return f"rng-rank{rank:05d}.pt"


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != META)


def write_meta(ckpt: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """Hash every file of `ckpt` and write `meta.json` atomically; return what was written."""
    files = {str(p.relative_to(ckpt)): sha256_file(p) for p in _files(ckpt)}
    full = {"format": FORMAT_VERSION, **meta, "files": files}
    write_json_atomic(ckpt / META, full)
    _fsync_dir(ckpt)
    return full


def _fsync_dir(path: Path) -> None:
    # The rename of meta.json must reach the disk before the checkpoint is reported.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def validate(ckpt: Path, config_hash: str | None = None) -> dict[str, Any]:
    """The checkpoint's meta after checking it lists, and matches, every file it needs.

    Raises:
        CheckpointError: no or unreadable `meta.json`, a missing, changed or extra file, or a
            different config hash (when `config_hash` is given).
    """
    path = ckpt / META
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: no {META} (the save did not finish)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    listed: dict[str, str] = meta.get("files", {})
    if not listed:
        raise CheckpointError(f"{path}: lists no files")
    for name, digest in listed.items():
        file = ckpt / name
        if not file.is_file():
            raise CheckpointError(f"{ckpt}: {name} is listed in {META} but missing")
        if sha256_file(file) != digest:
            raise CheckpointError(f"{ckpt}: {name} does not match its sha256 in {META}")
    extra = {str(p.relative_to(ckpt)) for p in _files(ckpt)} - set(listed)
    if extra:
        raise CheckpointError(f"{ckpt}: files not in {META}: {sorted(extra)[:5]}")
    if config_hash is not None and meta.get("config_hash") != config_hash:
        raise CheckpointError(
            f"{ckpt}: written by another configuration (config hash {meta.get('config_hash')}, "
            f"this run {config_hash}); use a new run name or the same train config"
        )
    return meta


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint directory in `run_dir`, newest first."""
    found = []
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            match = _NAME.fullmatch(child.name)
            if match and child.is_dir():
                found.append((int(match.group(1)), child))
    return sorted(found, reverse=True)


@dataclass(frozen=True)
class Resumable:
    """The checkpoint a run resumes from."""

    path: Path
    meta: dict[str, Any]


def find_resumable(
    run_dir: Path, reported: Path | None, config_hash: str | None = None
) -> Resumable | None:
    """The newest valid checkpoint: Ray's `reported` one, or a newer valid one in `run_dir`.

    Ray registers a checkpoint only when its controller polls the workers, so a checkpoint that
    was complete but not yet registered when a worker died is newer than Ray's: it is used.
    An invalid `reported` checkpoint falls back to the newest valid one, with a warning.
    """
    candidates = checkpoint_dirs(run_dir)
    if reported is not None and all(p.resolve() != reported.resolve() for _, p in candidates):
        candidates.insert(0, (_step_of(reported), reported))
        candidates.sort(key=lambda c: c[0], reverse=True)
    for step, path in candidates:
        try:
            meta = validate(path, config_hash)
        except CheckpointError as exc:
            if reported is not None and path.resolve() == reported.resolve():
                log.warning("checkpoint reported by Ray is unusable (%s); falling back", exc)
            else:
                log.warning("skipping checkpoint at step %d: %s", step, exc)
            continue
        return Resumable(path, meta)
    return None


def _step_of(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else -1


def remove_incomplete(run_dir: Path, keep: Path | None) -> list[Path]:
    """Delete checkpoint directories without a valid `meta.json` (a dead attempt's partial saves).

    Call it only when no rank is saving: at the start of an attempt, before training resumes.
    """
    removed = []
    for _, path in checkpoint_dirs(run_dir):
        if keep is not None and path.resolve() == keep.resolve():
            continue
        try:
            validate(path)
        except CheckpointError as exc:
            log.warning("removing incomplete checkpoint %s: %s", path.name, exc)
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def prune(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; return what was deleted."""
    complete = [p for _, p in checkpoint_dirs(run_dir) if (p / META).is_file()]
    for path in complete[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
    return complete[keep_last:]


def rng_state() -> dict[str, Any]:
    """The RNG states that dropout and any host-side draw depend on, for this process."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
