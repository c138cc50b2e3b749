"""The content hash of each ingest input, and a workspace's stat cache that skips re-hashing.

An input is identified by its bytes' xxh3-128 (`file_digest`), never by where it lies. Hashing
a large corpus on every plan would cost a full read, so `InputHashes` keeps
`<workspace>/.cache/input-hashes.json`: per local input path, the stat it had when hashed (size,
`mtime_ns`, inode, `ctime_ns`) and its digest. The digest is reused only when all of them still
match; a copy or a move of the file (a new inode and ctime) or any write (a new ctime) hashes it
again. A file changed in the same clock tick as it was hashed could keep its stat, so an entry is
recorded only for a file whose last change (`ctime_ns`) is `RACY_NS` older than the hash (git's
"racily clean" rule). Remote inputs (any fsspec protocol but the local one) are always hashed.

Not here: finding the inputs (`tasks/ingest/sources.py`) and the fingerprint (`stage.py`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import xxhash

from tasks.common.io import write_json_atomic
from tasks.ingest.sources import InputFile

log = logging.getLogger(__name__)

#: Where a workspace keeps the stat cache of its inputs' hashes.
CACHE_FILE = Path(".cache") / "input-hashes.json"
#: A file changed less than this before it was hashed is hashed again next time (1 s: coarser
#: than any local file system's timestamp tick).
RACY_NS = 1_000_000_000
_LOCAL = ("file", "local")
#: One file's stat as the cache compares it: path, size, mtime_ns, inode, ctime_ns.
Stat = list[Any]


def file_digest(file: InputFile, storage: dict[str, str]) -> str:
    """Hash an input's bytes (every file of a saved dataset, in name order) with xxh3-128."""
    digest = xxhash.xxh3_128()
    for path in _paths(file, storage):
        with fsspec.open(path, "rb", **storage) as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _paths(file: InputFile, storage: dict[str, str]) -> list[str]:
    if file.format != "hf_disk":
        return [file.uri]
    fs, root = fsspec.core.url_to_fs(file.uri, **storage)
    return sorted(fs.find(root))


def _is_local(uri: str) -> bool:
    protocol = fsspec.utils.get_protocol(uri)
    return protocol in _LOCAL


def _stats(file: InputFile, storage: dict[str, str]) -> list[Stat]:
    """The stat of every file an input's digest covers (`os.stat`: local inputs only)."""
    stats = []
    for path in _paths(file, storage):
        local = fsspec.utils.stringify_path(path).removeprefix("file://")
        st = os.stat(local)
        stats.append([local, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
    return stats


class InputHashes:
    """The stat cache of one workspace's input digests (`<workspace>/.cache/input-hashes.json`).

    `digest` answers from it or hashes; `save` writes it back (atomically) when it changed.
    """

    def __init__(self, path: Path | None, clock: Callable[[], int] = time.time_ns) -> None:
        """Load the cache at `path` (None: a cache that remembers nothing).

        Args:
            path: The cache file.
            clock: Now, in ns since the epoch (what a file's `ctime_ns` is compared with).
        """
        self.path = path
        self.clock = clock
        self.entries: dict[str, dict[str, Any]] = {}
        self.changed = False
        if path is not None and path.is_file():
            try:
                loaded = json.loads(path.read_text(encoding="utf-8"))
                self.entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                log.warning("%s: unreadable, every input is hashed again", path)

    @classmethod
    def of_workspace(
        cls, workspace: Path | str, clock: Callable[[], int] = time.time_ns
    ) -> InputHashes:
        """The stat cache kept in `workspace`."""
        return cls(Path(workspace) / CACHE_FILE, clock)

    def digest(
        self,
        file: InputFile,
        storage: dict[str, str],
        compute: Callable[[InputFile, dict[str, str]], str] = file_digest,
    ) -> str:
        """`file`'s digest: the recorded one when its stat matches in full, else `compute`d."""
        if not _is_local(file.uri):
            return compute(file, storage)
        before = _stats(file, storage)
        entry = self.entries.get(file.uri)
        if entry is not None and entry.get("stats") == before:
            return str(entry["xxh3_128"])
        started = self.clock()
        digest = compute(file, storage)
        settled = all(stat[4] < started - RACY_NS for stat in before)
        if settled and _stats(file, storage) == before:
            self.entries[file.uri] = {"stats": before, "xxh3_128": digest}
            self.changed = True
        elif file.uri in self.entries:
            del self.entries[file.uri]
            self.changed = True
        return digest

    def save(self) -> None:
        """Write the cache back when it changed, without the entries of inputs now gone."""
        if self.path is None or not self.changed:
            return
        kept = {
            uri: entry
            for uri, entry in self.entries.items()
            if all(os.path.exists(stat[0]) for stat in entry["stats"])
        }
        write_json_atomic(self.path, kept)
        self.changed = False
