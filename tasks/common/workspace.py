"""A workspace's identity and the places it has lived: what lets a workspace be copied or moved.

`<workspace>/workspace.json` holds a random `id` and `roots`, every absolute directory the
workspace was opened at (`open_workspace`; the entry points and the stage steps open it). A
copy (`cp -a`) or a move carries the file: the copy keeps the id, so the Prefect cache key,
which names a workspace by its id and an output by its path inside it
(`tasks.common.caching.cache_key`), finds the records the copy carries; and it gains its new
root. Records written before a move name files by absolute paths under an old root:
`relocate` (one path) and `relocate_record` (a JSON value) map such paths into the place the
workspace is now, so a record read in a copy names the copy's files, never the tree it was
copied from. A path outside every root (a corpus elsewhere, a shared checkpoint store) is
left as it is. The few files another library reads a path from (`REWRITTEN_PATHS`: a peft
adapter export's base model) cannot be relocated on read: `open_workspace` rewrites them in
place, together with their entry in their output's manifest.

Not here: the fingerprints (`tasks/common/stage.py`), which never include a location.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.io import atomic_writer, write_json_atomic

#: The file that makes a directory a workspace: its id and every root it was opened at.
WORKSPACE_FILE = "workspace.json"
#: Paths that another library reads, so no lmpipe read can relocate them: (outputs, as a glob
#: under the root; the JSON file inside each; its key holding a path). peft's
#: `AutoPeftModelFor<Task>` loads a fine-tuned adapter export's base model from its absolute
#: `base_model_name_or_path` (`training.finetune.adapters.save_peft_export`).
REWRITTEN_PATHS: tuple[tuple[str, str, str], ...] = (
    ("finetune/*", "export/adapter_config.json", "base_model_name_or_path"),
)


@dataclass(frozen=True)
class WorkspaceInfo:
    """One workspace as `workspace.json` describes it, seen from where it is now.

    Attributes:
        root: Where it is now (absolute, symlinks kept as given).
        id: Random, made once; a copy keeps it, another workspace has its own.
        roots: Every absolute directory it was opened at, oldest first (`root` among them
            once opened there).
    """

    root: Path
    id: str
    roots: tuple[str, ...]


def _forms(root: Path) -> tuple[str, ...]:
    """`root` as given (absolute) and with its symlinks resolved, the first one first."""
    given = os.path.abspath(root)
    real = os.path.realpath(root)
    return (given,) if real == given else (given, real)


def read_workspace(workspace: Path | str) -> WorkspaceInfo | None:
    """The workspace at `workspace` as its `workspace.json` says, or None without one."""
    root = Path(os.path.abspath(workspace))
    try:
        data = json.loads((root / WORKSPACE_FILE).read_text(encoding="utf-8"))
        return WorkspaceInfo(root, str(data["id"]), tuple(str(r) for r in data["roots"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def open_workspace(workspace: Path | str) -> WorkspaceInfo:
    """Make `workspace` a workspace (an id, once) and record where it is now among its roots.

    The first open writes `workspace.json` without ever replacing one another process wrote
    meanwhile (a hard link, which fails on an existing name); opening a copy or a moved
    workspace adds its new root. A workspace that has lived elsewhere gets the files of
    `REWRITTEN_PATHS` that name a place under an old root rewritten (`rewrite_paths`).

    Raises:
        OSError: `workspace.json` exists but is not one (or the directory is not writable).
    """
    root = Path(os.path.abspath(workspace))
    info = read_workspace(root)
    if info is None:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{WORKSPACE_FILE}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        write_json_atomic(tmp, {"id": uuid.uuid4().hex, "roots": list(_forms(root))})
        with contextlib.suppress(FileExistsError):
            os.link(tmp, root / WORKSPACE_FILE)
        tmp.unlink()
        info = read_workspace(root)
        if info is None:
            raise OSError(
                f"{root / WORKSPACE_FILE}: not a workspace file (JSON with `id` and `roots`); "
                "move it aside to give the workspace a new id"
            )
    new = [form for form in _forms(root) if form not in info.roots]
    if new:
        info = WorkspaceInfo(root, info.id, (*info.roots, *new))
        write_json_atomic(root / WORKSPACE_FILE, {"id": info.id, "roots": list(info.roots)})
    # On every open, not only a new root's: a workspace moved back to an old root has files
    # written at the other place.
    if any(r not in _forms(root) for r in info.roots):
        rewrite_paths(info)
    return info


def rewrite_paths(info: WorkspaceInfo) -> list[Path]:
    """Rewrite each path of `REWRITTEN_PATHS` that lies under an old root into `info.root`.

    The output's `manifest.json` entry of the file (bytes, sha256) is updated first, so the
    output stays complete; a process killed in between leaves the old path in the file, which
    the next open rewrites. Outputs being built (hidden temp directories) are left alone.

    Returns:
        The files rewritten.
    """
    move, done = _mover(info), []
    for pattern, name, key in REWRITTEN_PATHS:
        for output in sorted(info.root.glob(pattern)):
            path = output / name
            if output.name.startswith(".") or not path.is_file():
                continue
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue  # unreadable to its library too: not this function's to repair
            value = record.get(key) if isinstance(record, dict) else None
            if not isinstance(value, str) or move(value) == value:
                continue
            text = json.dumps({**record, key: move(value)}, indent=2, sort_keys=True) + "\n"
            data = text.encode("utf-8")
            _update_manifest_entry(output, name, data)
            with atomic_writer(path) as handle:
                handle.write(data)
            done.append(path)
    return done


def _update_manifest_entry(output: Path, name: str, data: bytes) -> None:
    """Record `data` as the bytes of `output/name` in `output/manifest.json`, if it lists it."""
    manifest_file = output / "manifest.json"
    if not manifest_file.is_file():
        return
    manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
    entries = [e for e in manifest.get("files", []) if e.get("name") == name]
    for entry in entries:
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    if entries:
        write_json_atomic(manifest_file, manifest)


def workspace_of(path: Path | str) -> Path | None:
    """The workspace that holds `path` (its nearest directory with a `workspace.json`), or None."""
    here = Path(os.path.abspath(path))
    for candidate in (here, *here.parents):
        if (candidate / WORKSPACE_FILE).is_file():
            return candidate
    return None


def location_key(path: Path | str) -> str | None:
    """Where `path` is, independent of where its workspace lies: `<workspace id>:<relative>`.

    None when `path` is in no workspace. A copy of the workspace gives the same key; another
    workspace, even at the same place later, another.
    """
    root = workspace_of(path)
    info = read_workspace(root) if root is not None else None
    if root is None or info is None:
        return None
    rel = Path(os.path.abspath(path)).relative_to(root).as_posix()
    return f"{info.id}:{rel}"


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def relocator(workspace: Path | str | None) -> Callable[[str], str]:
    """A function that maps a recorded path under an old root of `workspace` into it.

    A path under the workspace's current root, or under none of its roots, is returned as
    given; so is every path when `workspace` is None or not a workspace.
    """
    info = read_workspace(workspace) if workspace is not None else None
    return (lambda path: path) if info is None else _mover(info)


def _mover(info: WorkspaceInfo) -> Callable[[str], str]:
    current = _forms(info.root)
    old = sorted((r for r in info.roots if r not in current), key=len, reverse=True)

    def move(path: str) -> str:
        if not old or not path.startswith("/") or any(_under(path, c) for c in current):
            return path
        for root in old:
            if _under(path, root):
                return current[0] + path[len(root.rstrip("/")) :]
        return path

    return move


def relocate(path: str, workspace: Path | str | None) -> str:
    """`path` as recorded, mapped into `workspace` when it names a file under an old root."""
    return relocator(workspace)(path)


def relocate_record(value: Any, workspace: Path | str | None) -> Any:
    """A JSON value (a summary, a run record) with every path under an old root relocated."""
    move = relocator(workspace)

    def walk(item: Any) -> Any:
        if isinstance(item, str):
            return move(item)
        if isinstance(item, dict):
            return {k: walk(v) for k, v in item.items()}
        if isinstance(item, list | tuple):
            return [walk(v) for v in item]
        return item

    return walk(value)
