"""Checkpoint commit protocol: DeepSpeed shards, then `meta.json` last; validation and retention.

A checkpoint is a directory `checkpoint_step-NNNNNNNNN` in the run directory. Every rank writes
its DeepSpeed files and its RNG state; after a barrier rank 0 hashes every file and writes
`meta.json` (step, data cursor, config hash, sha256 of every file) atomically. A directory without
a valid `meta.json` is incomplete and is never loaded: DeepSpeed's files are pickles, so they are
opened only after every hash matched.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tasks.common.io import UnsafePathError, safe_join, sha256_file, write_json_atomic

log = logging.getLogger(__name__)
META = "meta.json"
LATEST = "latest"  # in the run directory: the name of the newest committed checkpoint
TAG = "ds"  # DeepSpeed's tag: the sub-directory holding its shards
_NAME = re.compile(r"checkpoint_step-(\d{9})")
FORMAT_VERSION = 2  # 2: meta.json carries its own sha256 (`meta_sha256`)
SELF_HASH = "meta_sha256"


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
    full[SELF_HASH] = _self_hash(full)
    write_json_atomic(ckpt / META, full)
    _fsync_dir(ckpt)
    return full


def _self_hash(meta: dict[str, Any]) -> str:
    # Over the canonical JSON of everything but the hash itself: a changed byte anywhere in
    # meta.json (a step, the cursor, a file's hash) no longer matches.
    body = {k: v for k, v in meta.items() if k != SELF_HASH}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _fsync_dir(path: Path) -> None:
    # The rename of meta.json must reach the disk before the checkpoint is reported.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(run_dir: Path, ckpt: Path) -> None:
    """Point `<run_dir>/latest` at `ckpt` (atomically), after its `meta.json` is written.

    The pointer is for people and tools (`lmpipe export <run dir>`); resume never trusts it
    alone: a kill between the commit and the pointer's move leaves a newer complete checkpoint
    than the pointer names, and `find_resumable` picks that one.
    """
    tmp = run_dir / f".{LATEST}.tmp"
    tmp.write_text(ckpt.name + "\n")
    os.replace(tmp, run_dir / LATEST)
    _fsync_dir(run_dir)


def read_latest(run_dir: Path) -> Path | None:
    """The checkpoint `<run_dir>/latest` names, if the pointer exists."""
    path = run_dir / LATEST
    if not path.is_file():
        return None
    name = path.read_text().strip()
    return run_dir / name if _NAME.fullmatch(name) else None


def validate(ckpt: Path, config_hash: str | None = None) -> dict[str, Any]:
    """The checkpoint's meta after checking it lists, and matches, every file it needs.

    Raises:
        CheckpointError: no such directory (the message names the checkpoints beside it), no,
            unreadable or changed `meta.json` (it holds its own sha256), a missing, changed or
            extra file, or a different config hash (when `config_hash` is given).
    """
    if not ckpt.is_dir():
        there = [p.name for _, p in checkpoint_dirs(ckpt.parent)]
        hint = f"; the checkpoints in {ckpt.parent}: {', '.join(there)}" if there else ""
        raise CheckpointError(f"{ckpt}: no such checkpoint{hint}")
    path = ckpt / META
    try:
        meta: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt}: no {META} (the save did not finish)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    legacy = meta.get("format") == 1 and SELF_HASH not in meta  # written before the self-hash
    if not legacy and meta.get(SELF_HASH) != _self_hash(meta):
        raise CheckpointError(f"{path}: its content does not match its own sha256 (changed)")
    listed: dict[str, str] = meta.get("files", {})
    if not listed:
        raise CheckpointError(f"{path}: lists no files")
    for name, digest in listed.items():
        try:  # a name in meta.json must not lead out of the checkpoint, not even to be hashed
            file = safe_join(ckpt, name, what="checkpoint file")
        except UnsafePathError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
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
        pointer = read_latest(run_dir)
        if pointer is not None and pointer.name != path.name:
            # A kill between the commit (meta.json) and the pointer's move, or a corrupt newer one.
            log.info("resuming from %s; the latest pointer names %s", path.name, pointer.name)
        return Resumable(path, meta)
    return None


def _step_of(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    return int(match.group(1)) if match else -1


def remove_incomplete(run_dir: Path, keep: Path | None) -> list[Path]:
    """Clear away checkpoint directories that fail validation; return the ones cleared.

    A directory without `meta.json` is a dead attempt's partial save (or a half-done purge) and
    is deleted. One whose `meta.json` no longer matches its files was complete once and has been
    damaged since (a flipped byte, a truncated or deleted file): it is never loaded, but kept for
    inspection under `<run_dir>/corrupt/`, with a warning. Call it only when no rank is saving:
    at the start of an attempt, before training resumes.
    """
    removed = []
    for _, path in checkpoint_dirs(run_dir):
        if keep is not None and path.resolve() == keep.resolve():
            continue
        try:
            validate(path)
        except CheckpointError as exc:
            if (path / META).is_file():
                moved = _quarantine(run_dir, path)
                log.warning("corrupt checkpoint %s moved to %s: %s", path.name, moved, exc)
            else:
                log.warning("removing incomplete checkpoint %s: %s", path.name, exc)
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _quarantine(run_dir: Path, path: Path) -> Path:
    # Out of the checkpoint_step-* namespace, so nothing lists, resumes from or prunes it.
    target = run_dir / "corrupt" / path.name
    n = 1
    while target.exists():
        target = run_dir / "corrupt" / f"{path.name}.{n}"
        n += 1
    target.parent.mkdir(exist_ok=True)
    os.replace(path, target)
    return target


def prune(
    run_dir: Path, keep_last: int, on_uncommitted: Callable[[Path], None] | None = None
) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; return what was deleted.

    Each one is un-committed first (its `meta.json` removed, and the removal made durable), so
    a purge killed half-way leaves an incomplete directory that resume deletes, never a
    `meta.json` over missing files. `on_uncommitted` runs at that moment (fault injection).
    """
    complete = [p for _, p in checkpoint_dirs(run_dir) if (p / META).is_file()]
    for path in complete[keep_last:]:
        (path / META).unlink(missing_ok=True)
        _fsync_dir(path)
        if on_uncommitted is not None:
            on_uncommitted(path)
        shutil.rmtree(path, ignore_errors=True)
    return complete[keep_last:]


def to_universal(ckpt: Path, out: Path) -> Path:
    """Convert `ckpt`'s ZeRO shards into DeepSpeed's universal format; return the load dir.

    A ZeRO-partitioned optimizer state (at ZeRO-3 the weights too) is cut by the data-parallel
    world size it was saved at; the universal format holds every parameter's fp32 weights and
    Adam moments whole, so that a run can resume at another worker count (ZeRO-1, 2 and 3).
    `out/<TAG>` is rewritten; `out` is returned, to pass to `engine.load_checkpoint(out,
    tag=TAG)` with `load_universal` on. Call it only on a validated checkpoint: DeepSpeed
    unpickles the shards.
    """
    import argparse

    from deepspeed.checkpoint.ds_to_universal import main as convert

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    convert(
        argparse.Namespace(
            input_folder=str(ckpt / TAG),
            output_folder=str(out / TAG),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
    )
    return out


def reference_rtol(precision: str) -> float:
    """How far a reloaded model's reference-batch loss may be from the saved one, relatively."""
    return 1e-4 if precision == "fp32" else 5e-2


def check_resharded(ckpt: Path, meta: dict[str, Any], loss: float, world_size: int) -> None:
    """Check the weights loaded at another worker count give the reference loss saved with them.

    `loss` is the fixed reference batch's eval-mode loss right after the load; `meta` is the
    checkpoint's. A checkpoint without a reference (written before it was recorded) passes.

    Raises:
        CheckpointError: the loss differs beyond `reference_rtol`: the resharding lost or
            mixed up weights.
    """
    saved = meta.get("reference", {}).get("loss")
    if saved is None:
        return
    rtol = reference_rtol(meta["train"]["precision"])
    if not math.isclose(loss, saved, rel_tol=rtol, abs_tol=1e-12):
        raise CheckpointError(
            f"{ckpt}: resharded from {meta['world_size']} to {world_size} workers (ZeRO stage "
            f"{meta['train']['zero_stage']}), the weights give reference loss {loss!r}, not the "
            f"saved {saved!r} (rtol {rtol}); resume with train.scale.num_workers="
            f"{meta['world_size']}"
        )


def seed_rngs(seed: int) -> None:
    """Seed this process's torch, NumPy and Python RNGs (`rng_state` saves the first two).

    The loops draw from torch alone (and from counter-based seeds), but seeding all three makes
    any library's draw from the global RNGs repeat run to run, and the checkpoints' RNG files the
    same bits for the same recipe.
    """
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def rng_state() -> dict[str, Any]:
    """The RNG states that dropout and any host-side draw depend on, for this process.

    torch's (and CUDA's) and NumPy's; not Python's `random`: the loops draw nothing from it, and
    a worker in the driver's process shares it with Prefect's and MLflow's clients, whose rare
    draws (a retry's jitter) made two runs of one recipe write different RNG files.

    Only tensors and plain Python values, so that `load_rng_state` can read it back with
    `torch.load(weights_only=True)`: nothing in a checkpoint is unpickled as code.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(path: Path) -> dict[str, Any]:
    """Read a file `rng_state` wrote, with `weights_only=True` (tensors and plain values only)."""
    state: dict[str, Any] = torch.load(path, weights_only=True)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    if "python" in state:  # written before the Python state was left out (see rng_state)
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
