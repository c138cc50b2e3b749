"""The stage scaffold every data stage follows, and what their outputs share.

A stage writes `<workspace>/<stage>/<fingerprint>/` with `manifest.json` last. An output is
complete when its manifest exists and every file it lists has the recorded size; anything else
is rebuilt (or resumed, where the stage stages its parts). `plan_output` and `StageOutput` are
the scaffold: fingerprint → reuse → staging → manifest → sweep of leftovers, in that order and
in one place; the functions below them are its parts (and the checks stages make of their
upstream outputs).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from tasks.common.io import (
    code_version,
    fingerprint,
    safe_join,
    sha256_file,
    write_json_atomic,
)
from tasks.common.progress import Reporter
from tasks.common.schema import SCHEMA_VERSION

#: What a stage's completeness check returns for a complete output: its manifest.
Manifest = TypeVar("Manifest")


@dataclass(frozen=True)
class StageResult:
    """Where a stage's output is, its manifest, and whether it was reused as it was."""

    path: Path
    manifest: dict[str, Any]
    reused: bool

    def summary(self) -> dict[str, Any]:
        """The small dict a Prefect task returns: stage, path, fingerprint, reused."""
        return {
            "stage": self.manifest["stage"],
            "path": str(self.path),
            "fingerprint": self.manifest["fingerprint"],
            "reused": self.reused,
        }


@dataclass(frozen=True)
class BuildOptions:
    """How one call of a stage driver builds; neither option changes the output's fingerprint.

    Attributes:
        progress: Where the driver reports `(phase, done, total)`; None: nowhere.
        rebuild: Build a complete output again, aside, and swap it in whole
            (`StageOutput.build_aside`; a refreshed Prefect cache, `tasks.common.caching`).
    """

    progress: Reporter | None = None
    rebuild: bool = False


@dataclass(frozen=True)
class StageOutput:
    """One stage output to reuse or make: its directory, fingerprint and manifest header.

    Every data stage runs the same steps, each a method here:

    ```python
    out = plan_output(STAGE, inputs, config, workspace=workspace)  # fingerprint and place
    done = out.reuse(complete_sharded, rebuild)  # complete with this fingerprint: reused
    if done is not None:
        return StageResult(out.path, done, reused=True)
    out = out.build_aside() if rebuild else out  # a forced rebuild never touches the old one
    staging = out.open_staging()  # or `tmp = out.open_temp_dir()` for an output built aside
    ...  # write the output's files
    return out.commit({**out.header(), ...})  # manifest.json last, then the sweep
    ```

    `rebuild` (a refreshed Prefect cache, `tasks.common.caching`) makes a complete output be
    built again; the new one replaces it whole at `commit`.
    """

    stage: str
    path: Path
    fingerprint: str
    config: dict[str, Any]
    code: dict[str, str | None]
    inputs: Any
    #: Where `commit` moves this output when it is built aside (`build_aside`); else None.
    target: Path | None = None

    def header(self) -> dict[str, Any]:
        """The keys this output's manifest starts with (`manifest_header`)."""
        return manifest_header(self.stage, self.fingerprint, self.config, self.code, self.inputs)

    def reuse(
        self, complete: Callable[[Path], Manifest | None], rebuild: bool = False
    ) -> Manifest | None:
        """Return the manifest of a complete output here, its leftovers swept; else None.

        Args:
            complete: The stage's completeness check: the manifest of a complete output at a
                path, else None (`complete_manifest`, `complete_sharded`, or the stage's own).
            rebuild: Build the output again even when it is complete (None, unchecked).
        """
        if rebuild:
            return None
        manifest = complete(self.path)
        if manifest is not None:
            sweep_leftovers(self.path)
        return manifest

    def build_aside(self) -> StageOutput:
        """This output, to be built in a fresh temp directory beside it, for `commit` to swap in.

        A stage that builds in place (`open_staging`) rebuilds a complete output this way, so
        that readers see the old output or the new one, never a mix.
        """
        remove_stale_temps(self.path)
        return replace(self, path=temp_dir_beside(self.path), target=self.path)

    def open_staging(self) -> Path:
        """Create the output directory's `_staging/` for a stage that builds in place."""
        return open_staging(self.path)

    def open_temp_dir(self) -> Path:
        """Delete killed runs' temp directories, then create one to build the output in."""
        remove_stale_temps(self.path)
        return temp_dir_beside(self.path)

    def commit(self, manifest: dict[str, Any], built_in: Path | None = None) -> StageResult:
        """Write `manifest.json` last, move a temp directory into place, sweep leftovers.

        Args:
            manifest: The finished output's manifest.
            built_in: The temp directory from `open_temp_dir`, when the output was built there;
                None when it was built in place (or aside, `build_aside`).
        """
        write_json_atomic((built_in or self.path) / "manifest.json", manifest)
        if built_in is not None:
            commit_dir(built_in, self.path)
        final = self.path
        if self.target is not None:
            commit_dir(self.path, self.target)
            final = self.target
        sweep_leftovers(final)
        return StageResult(final, manifest, reused=False)


def plan_output(
    stage: str,
    inputs: Any,
    config: dict[str, Any],
    *,
    workspace: Path | None = None,
    path: Path | None = None,
    seed: int | None = None,
    code: tuple[str, ...] = ("tasks",),
) -> StageOutput:
    """Fingerprint a stage's inputs, config (and seed) with the code, and place its output.

    The fingerprint is `sha256(inputs, config, seed, source hash of the packages in code)[:16]`
    (a data stage runs `tasks/` only; a training run `tasks/` and `training/`). The output
    goes to `<workspace>/<stage>/<fingerprint>/`, or to `path` when the caller chose the
    directory (a downstream dataset), which its completeness check then keys on the
    fingerprint.

    Raises:
        ValueError: neither or both of `workspace` and `path` given.
    """
    code_ref = code_version(*code)
    key = {"inputs": inputs, "config": config, "code": code_ref["source_hash"]}
    if seed is not None:
        key["seed"] = seed
    fp = fingerprint(key)
    if workspace is not None and path is None:
        path = workspace / stage / fp
    elif workspace is not None or path is None:
        raise ValueError("plan_output needs exactly one of workspace and path")
    return StageOutput(stage, path, fp, config, code_ref, inputs)


class StageInputError(ValueError):
    """An upstream output is missing, incomplete or of the wrong stage."""


def file_entry(root: Path, path: Path) -> dict[str, Any]:
    """Describe one output file for a manifest: name relative to `root`, bytes, sha256."""
    return {
        "name": path.relative_to(root).as_posix(),
        "bytes": path.stat().st_size,
        "sha256": sha256_file(path),
    }


def files_complete(out: Path, entries: list[dict[str, Any]]) -> bool:
    """True when every listed file exists under `out` with its recorded size."""
    for entry in entries:
        path = safe_join(out, entry["name"], what="manifest file")
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            return False
    return True


def complete_manifest(out: Path, files_key: str = "files") -> dict[str, Any] | None:
    """Return the manifest of `out` if the output is complete, else None."""
    path = out / "manifest.json"
    if not path.is_file():
        return None
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest if files_complete(out, manifest[files_key]) else None


def read_upstream(path: Path | str, stage: str) -> dict[str, Any]:
    """Load the manifest of a finished upstream output, checking its stage.

    Raises:
        StageInputError: no manifest there (not run, or interrupted), or another stage's.
    """
    manifest_path = Path(path) / "manifest.json"
    if not manifest_path.is_file():
        raise StageInputError(f"{manifest_path}: no {stage} output here (not run or unfinished)")
    manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    if manifest.get("stage") != stage:
        raise StageInputError(f"{manifest_path}: a {manifest.get('stage')!r} output, not {stage}")
    return manifest


def content_hash(out: Path | str, files_key: str = "files") -> str:
    """A hash of the bytes of the files a finished output's manifest lists, read now.

    What a consumer keys on instead of the output's fingerprint when the same fingerprint can
    hold different bytes (a tokenizer retrained by a nondeterministic trainer, or a file put in
    by hand): different contents never share a key. Meant for small outputs (a tokenizer's
    ~1 MB is hashed in milliseconds).

    Raises:
        StageInputError: no manifest at `out`.
    """
    root = Path(out)
    path = root / "manifest.json"
    if not path.is_file():
        raise StageInputError(f"{path}: no output here (not run or unfinished)")
    names = sorted(entry["name"] for entry in json.loads(path.read_text())[files_key])
    return fingerprint({name: sha256_file(safe_join(root, name, what="file")) for name in names})


def shards_of(
    manifest: dict[str, Any], split: str | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """List `(split, shard entry)` of a sharded output, in split then shard order."""
    return [
        (name, shard)
        for name, entry in manifest["splits"].items()
        if split is None or name == split
        for shard in entry["shards"]
    ]


def temp_dir_beside(out: Path) -> Path:
    """Create an empty temp directory next to `out`, to be committed with `commit_dir`."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, out: Path) -> None:
    """Move a fully written temp directory to `out`, replacing what is there.

    What is there is first renamed to a temp name beside it and deleted after the move, so
    `out` is only ever absent between two renames, never half deleted; a run killed between
    them leaves no output (rebuilt next time) and a temp that `remove_stale_temps` deletes.
    """
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}-old")
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        _remove(old)


def remove_stale_temps(out: Path) -> None:
    """Delete the temp directories and files that killed runs of `out` left beside it."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def sweep_leftovers(out: Path) -> None:
    """Delete what interrupted work left inside a finished output: `_staging/` and temp files.

    A finished output (its manifest written) can still hold them: its run was killed after the
    manifest but before this sweep, or a Ray worker was killed mid-write and its task retried
    on another worker, which leaves the dead worker's temp file beside the shard the retry
    wrote (tests/reliability/test_data_chaos.py). So a stage sweeps once its manifest
    is written, and again whenever it reuses the output.
    """
    shutil.rmtree(out / "_staging", ignore_errors=True)
    for stale in out.glob(".*.tmp-*"):
        _remove(stale)


def manifest_header(
    stage: str, fp: str, config: dict[str, Any], code: dict[str, Any], inputs: dict[str, Any]
) -> dict[str, Any]:
    """The keys every stage manifest starts with: what, which version, from what, by what code."""
    return {
        "stage": stage,
        "schema_version": SCHEMA_VERSION,
        "fingerprint": fp,
        "config": config,
        "code": code,
        "inputs": inputs,
    }


def complete_sharded(out: Path) -> dict[str, Any] | None:
    """The manifest of a complete sharded output (every split's shards present), else None."""
    path = out / "manifest.json"
    if not path.is_file():
        return None
    manifest: dict[str, Any] = json.loads(path.read_text())
    return manifest if files_complete(out, [s for _, s in shards_of(manifest)]) else None


def open_staging(out: Path) -> Path:
    """Create `out/_staging/` and delete the temp files a killed run left in either."""
    staging = out / "_staging"
    staging.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob(".*.tmp-*"), *staging.glob(".*.tmp-*")]:
        stale.unlink(missing_ok=True)  # never read as outputs
    return staging


def verify_shards(root: Path, entries: list[dict[str, Any]], stage: str) -> None:
    """Check every listed shard of an upstream `stage` output against its manifest entry.

    A stage reads its input shards only after this: a flipped byte would otherwise flow into
    tokens or examples without a trace. The hashes run on a thread per core (hashlib releases
    the GIL), one read of the input, small next to the work the stage then does with it.

    Raises:
        StageInputError: a shard is missing, has another size, or another sha256 than
            `<root>/manifest.json` records; the message names the file and how to rebuild it.
    """

    def problem(entry: dict[str, Any]) -> str | None:
        path = safe_join(root, entry["name"], what=f"{stage} shard")
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{path}: {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if sha256_file(path) != entry["sha256"]:
            return (
                f"{path}: sha256 differs from the manifest (the file changed after it was written)"
            )
        return None

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        found = [p for p in pool.map(problem, entries) if p is not None]
    if found:
        raise StageInputError(
            f"corrupt {stage} output {root}: {'; '.join(found[:3])}"
            + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
            + f". Delete {root} and rerun the {stage} stage to rebuild it."
        )
