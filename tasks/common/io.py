"""Side-effecting helpers shared by the stages: safe paths, atomic writes, shards, fingerprints.

Everything that touches the file system for a stage goes through here, so that the rules hold in
one place: a file appears under its final name only complete (temp name, fsync, rename), a name
taken from config or data never escapes its root, and a stage output is addressed by a fingerprint.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import unicodedata
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from functools import cache, lru_cache
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import xxhash
from pydantic import BaseModel, SecretBytes, SecretStr

_READ_CHUNK = 1 << 20


class UnsafePathError(ValueError):
    """A name would resolve outside the directory it must stay in."""


def safe_name(name: str, *, what: str = "name") -> str:
    """Return `name` if it is a safe relative path inside a root, else raise `UnsafePathError`.

    Refuses empty names, absolute paths, drive letters, backslashes, NUL bytes, `..` segments and
    their URL-encoded or Unicode-compatibility variants (`%2e%2e`, fullwidth dots).
    """
    if not name or "\x00" in name:
        raise UnsafePathError(f"{what} {name!r} is empty or contains a NUL byte")
    # Decode repeatedly so that double-encoded traversal (%252e%252e) is caught too.
    decoded = name
    for _ in range(4):
        nxt = urllib.parse.unquote(decoded)
        if nxt == decoded:
            break
        decoded = nxt
    for candidate in (name, decoded, unicodedata.normalize("NFKC", decoded)):
        if (
            "\\" in candidate
            or candidate.startswith(("/", "~"))
            or re.match(r"^[A-Za-z]:", candidate)
        ):
            raise UnsafePathError(f"{what} {name!r} must be a relative path inside the workspace")
        if any(part in ("..", ".") or part == "" for part in candidate.split("/")):
            raise UnsafePathError(f"{what} {name!r} contains '..', '.' or an empty path segment")
    return name


def safe_join(root: Path, name: str, *, what: str = "name") -> Path:
    """Join a checked relative `name` to `root` and verify the result stays under `root`."""
    path = (root / safe_name(name, what=what)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise UnsafePathError(f"{what} {name!r} resolves outside {root}")
    return path


@contextlib.contextmanager
def atomic_writer(path: Path, mode: str = "wb", *, durable: bool = True) -> Iterator[IO[Any]]:
    """Open a temp file beside `path`; on success fsync it (if `durable`) and rename it to `path`.

    A crash of the process at any moment leaves either no file or the complete file under `path`;
    leftover temp files carry a `.tmp-` infix and are never read as outputs. With
    `durable=False` the fsync is skipped: the rename still makes the file appear whole, but a
    crash of the machine may lose or truncate it, so such a file must be verified before it is
    reused (staged units record a digest of each file, see `DigestSink`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, mode) as handle:
            yield handle
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _sync_file_range() -> Callable[[int], None] | None:
    """Linux's sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    write = 2  # SYNC_FILE_RANGE_WRITE: start writeback of the dirty pages, do not wait

    def start(fd: int) -> None:
        call(fd, 0, 0, write)  # advisory: a failure only means the fsync waits longer

    return start


_START_WRITEBACK = _sync_file_range()


def _hasher(algorithm: str) -> Any:
    """A fresh hash object: "xxh3_128" (xxhash) or any `hashlib` algorithm name."""
    return xxhash.xxh3_128() if algorithm == "xxh3_128" else hashlib.new(algorithm)


class DigestSink:
    """A binary sink around an open file: hashes every byte written and counts them.

    With `writeback_bytes`, it also asks the kernel to start writing the file back every that
    many bytes (Linux), so the fsync that closes a durable file waits for the tail only, instead
    of for the whole file while its core idles (measured on the ingest shards).
    `algorithm` is a `hashlib` name or "xxh3_128" (fast, for files that only lmpipe verifies).
    """

    def __init__(self, handle: IO[bytes], algorithm: str, writeback_bytes: int = 0) -> None:
        self._handle = handle
        self.algorithm = algorithm
        self._hash = _hasher(algorithm)
        self._start = _START_WRITEBACK if writeback_bytes > 0 else None
        self._writeback = writeback_bytes
        self._since_writeback = 0
        self.bytes_written = 0

    def write(self, data: Any) -> int:
        """Write `data` (any buffer) to the file, hashing it on the way."""
        view = memoryview(data)
        self._hash.update(view)
        self._handle.write(view)  # a buffered file in blocking mode writes it all
        self.bytes_written += view.nbytes
        self._since_writeback += view.nbytes
        if self._start is not None and self._since_writeback >= self._writeback:
            self._handle.flush()
            self._start(self._handle.fileno())
            self._since_writeback = 0
        return view.nbytes

    def flush(self) -> None:
        """Flush the wrapped file's buffer."""
        self._handle.flush()

    @property
    def closed(self) -> bool:
        """Whether the wrapped file is closed."""
        return self._handle.closed

    def hexdigest(self) -> str:
        """The hex digest of everything written so far."""
        return str(self._hash.hexdigest())

    def entry(self) -> dict[str, Any]:
        """What verifies the file later: its size and digest, keyed by the algorithm."""
        return {"bytes": self.bytes_written, self.algorithm: self.hexdigest()}


def digest_file(path: Path, algorithm: str) -> str:
    """The hex digest of the file at `path` (as `DigestSink` computes it), read in 1 MiB chunks."""
    digest = _hasher(algorithm)
    with open(path, "rb") as handle:
        while chunk := handle.read(_READ_CHUNK):
            digest.update(chunk)
    return str(digest.hexdigest())


def file_matches(path: Path, entry: dict[str, Any]) -> bool:
    """Whether the file at `path` has the size and digest that `DigestSink.entry` recorded."""
    algorithms = [key for key in entry if key != "bytes"]
    if len(algorithms) != 1 or not path.is_file() or path.stat().st_size != entry.get("bytes"):
        return False
    return digest_file(path, algorithms[0]) == str(entry[algorithms[0]])


def write_json_atomic(path: Path, obj: Any, *, durable: bool = True) -> None:
    """Write `obj` as pretty, key-sorted JSON to `path` atomically (see `atomic_writer`)."""
    with atomic_writer(path, "w", durable=durable) as handle:
        json.dump(obj, handle, indent=2, sort_keys=True, ensure_ascii=False)
        handle.write("\n")


def write_ipc_stream(table: pa.Table, path: Path) -> None:
    """Write `table` to `path` in the Arrow IPC stream format, atomically.

    The stream format is what `datasets.Dataset.from_file` reads; pyarrow memory-maps it.
    """
    with atomic_writer(path) as handle, pa.ipc.new_stream(handle, table.schema) as writer:
        writer.write_table(table)


def read_ipc_stream(path: Path, columns: list[str] | None = None) -> pa.Table:
    """Read an Arrow IPC stream file by memory map (zero-copy), optionally a subset of columns."""
    with pa.memory_map(str(path)) as source:
        table = pa.ipc.open_stream(source).read_all()
    return table.select(columns) if columns is not None else table


# pyarrow imports pandas the first time `to_numpy` or `pa.array` meets a NumPy array (0.2-0.3 s
# in every fresh process). The ingest driver does that between its read and write phases, while
# a core idles, so its fixed-width columns go through these two instead.
_NUMPY_OF_ARROW = {"halffloat": "float16", "float": "float32", "double": "float64"}


def numpy_of(values: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A null-free integer or float column as NumPy: a view of one chunk, else one copy.

    Raises:
        TypeError: the column is not of an integer or floating-point type.
        ValueError: the column holds nulls.
    """
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise TypeError(f"numpy_of takes integer or float columns, not {values.type}")
    if values.null_count:
        raise ValueError(f"numpy_of: the column holds {values.null_count} nulls")
    name = str(values.type)
    dtype = np.dtype(_NUMPY_OF_ARROW.get(name, name))
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    views = [
        np.frombuffer(c.buffers()[1], dtype, len(c), c.offset * dtype.itemsize)
        for c in chunks
        if len(c)
    ]
    if len(views) == 1:
        return views[0]
    return np.concatenate(views) if views else np.empty(0, dtype)


def arrow_of(values: np.ndarray) -> pa.Array:
    """A 1-D integer or float NumPy array as an Arrow array without nulls (one copy at most)."""
    if values.ndim != 1 or values.dtype.kind not in "iuf":
        raise TypeError(f"arrow_of takes 1-D integer or float arrays, not {values.dtype}")
    values = np.ascontiguousarray(values)
    arrow_type = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(arrow_type, len(values), [None, pa.py_buffer(values)])


def repeat_string(value: str, n: int) -> pa.Array:
    """`value` repeated `n` times as an Arrow string array, built from one buffer of repeats."""
    data = value.encode()
    if len(data) * n > np.iinfo(np.int32).max:
        raise ValueError(f"repeat_string: {n} copies of {len(data)} bytes exceed a string array")
    offsets = np.arange(n + 1, dtype=np.int32) * np.int32(len(data))
    return pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data * n)]
    )


def sha256_file(path: Path) -> str:
    """Return the hex sha256 of the file at `path`, read in 1 MiB chunks."""
    return digest_file(path, "sha256")


def fingerprint(obj: Any, length: int = 16) -> str:
    """Return a stable hex digest of a JSON-serialisable object (keys sorted)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent


@cache
def source_hash(*packages: str) -> str:
    """Hash the `.py` and `.c` sources of the named top-level packages (path and bytes, sorted).

    This is the part of the code version that output fingerprints use: it is the same in a git
    checkout and in an installed package, and it changes exactly when the code that runs changes
    (the C source of a compiled extension, such as tasks/ingest/_textscan.c, included).
    """
    digest = hashlib.sha256()
    for package in sorted(packages):
        root = _PACKAGE_ROOT / package
        for file in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
            digest.update(file.relative_to(_PACKAGE_ROOT).as_posix().encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=1)
def git_commit() -> str | None:
    """Return the git commit of the checkout lmpipe runs from, `+dirty` if modified, or None."""
    try:
        head = subprocess.run(
            ["git", "-C", str(_PACKAGE_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(_PACKAGE_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}+dirty" if dirty else head


def code_version(*packages: str) -> dict[str, str | None]:
    """Return the code version: the git commit when there is one, and the sources' hash."""
    return {"git_commit": git_commit(), "source_hash": source_hash(*packages)}


# `scheme://user:password@host`: the password part of a URL's user info.
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s/:@'\"]*):[^\s/@'\"]*@")


def redact_url(text: str) -> str:
    """Replace the password of every `scheme://user:password@host` in `text` with `***`."""
    return _URL_PASSWORD.sub(r"\1:***@", text)


def public_dump(value: Any) -> Any:
    """Dump a pydantic model (or nested data) to JSON-able data with every secret left out.

    `SecretStr`/`SecretBytes` fields are dropped; a dict of secrets keeps only its key names, so
    a reader can see *which* credentials were set but never their values. A password inside a
    URL (`https://user:password@host`, e.g. a tracking URI from the environment) is redacted.
    """
    secret = (SecretStr, SecretBytes)
    if isinstance(value, BaseModel):
        value = {name: getattr(value, name) for name in type(value).model_fields}
    if isinstance(value, dict):
        if value and all(isinstance(v, secret) for v in value.values()):
            return sorted(value)
        return {k: public_dump(v) for k, v in value.items() if not isinstance(v, secret)}
    if isinstance(value, list | tuple):
        return [public_dump(v) for v in value if not isinstance(v, secret)]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str):
        return redact_url(value)
    return value


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings into dotted keys (`ingest.split.validation`)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


DOWNSTREAM_STAGE = "downstream"  # the stage name in a prepared downstream manifest


def read_downstream_dir(path: Path | str) -> tuple[dict[str, Any], dict[str, pa.Table]]:
    """Read a prepared downstream directory: its manifest (a dict) and one table per split.

    Uses only json, pyarrow and `tasks.common.io`, so `training/` may use the same code.

    Raises:
        FileNotFoundError: no `manifest.json` (not prepared, or unfinished).
        ValueError: another stage's output, or a split file whose row count differs.
    """
    root = Path(path)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path}: no prepared downstream data here")
    manifest: dict[str, Any] = json.loads(manifest_path.read_text())
    if manifest.get("stage") != DOWNSTREAM_STAGE:
        raise ValueError(
            f"{manifest_path}: a {manifest.get('stage')!r} output, not {DOWNSTREAM_STAGE}"
        )
    tables = {}
    for split, entry in manifest["splits"].items():
        file = safe_join(root, entry["name"], what="split file")
        table = read_ipc_stream(file)
        if table.num_rows != entry["rows"]:
            raise ValueError(f"{file}: {table.num_rows} rows, the manifest says {entry['rows']}")
        tables[split] = table
    return manifest, tables
