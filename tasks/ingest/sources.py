"""Input discovery, work-unit planning and streaming record readers for ingestion.

A *source* is a configured path (file, directory, glob or fsspec URI). It expands to files, each
cut into *work units* (a byte range of an uncompressed text file, a whole compressed file, a
Parquet row group, an Arrow file of a saved dataset) that a Ray task reads independently. Readers
yield `RawRecord`s and never raise on bad data: a bad record comes back with a quarantine reason.
"""

from __future__ import annotations

import bz2
import json
import lzma
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import IO, Any, Literal

import fsspec
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import zstandard
from fsspec.core import url_to_fs
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

Format = Literal["auto", "txt", "jsonl", "json", "csv", "tsv", "parquet", "hf_disk"]
TxtMode = Literal["line", "block", "file"]

_COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
# Markdown/README files are not auto-detected: a data folder's README is not corpus text.
_SUFFIX_FORMATS = {
    ".txt": "txt",
    ".text": "txt",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "tsv",
    ".parquet": "parquet",
}
_BLOCK = 8 << 20  # bytes read per step of a streaming reader
_SNIFF = 8192


class SourceConfig(BaseModel):
    """One input of the corpus: where it is, how to read it, and its mixture weight."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str = Field(description="File, directory, glob or fsspec URI (s3://..., gs://...).")
    name: str | None = Field(
        None, description="Source name recorded per document; defaults to the path's stem."
    )
    format: Format = Field("auto", description="Input format; 'auto' infers it from the suffix.")
    txt_mode: TxtMode = Field(
        "block",
        description="For .txt: a document per 'line', per blank-line-separated 'block', or per "
        "'file'.",
    )
    text_field: str = Field("text", description="JSON key or CSV/Parquet/dataset column of text.")
    weight: float = Field(1.0, gt=0, description="Relative sampling weight of this source.")
    storage_options: dict[str, SecretStr] = Field(
        default_factory=dict, description="fsspec options (credentials) for remote paths."
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", value):
            raise ValueError(f"{value!r} must be 1-64 letters, digits, '_', '.' or '-'")
        return value

    def fs_options(self) -> dict[str, str]:
        """Return the storage options with their secret values revealed, for fsspec only."""
        return {key: value.get_secret_value() for key, value in self.storage_options.items()}

    def display_name(self) -> str:
        """Return `name`, or a sanitised stem of `path`."""
        if self.name:
            return self.name
        stem = PurePosixPath(self.path.rstrip("/*")).name or "source"
        return re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:64].lstrip("._-") or "source"


class InputError(ValueError):
    """An input path is missing, unreadable or does not match its configured format."""


@dataclass(frozen=True)
class InputFile:
    """A resolved input file: its URI, its name relative to the source, format and compression."""

    source: str
    uri: str
    rel: str
    format: str
    compression: str | None
    size: int


@dataclass(frozen=True)
class WorkUnit:
    """An independently readable slice of one input file. `index` orders units globally."""

    index: int
    file: InputFile
    start: int  # byte offset (splittable text) or first row group / arrow file index
    end: int  # exclusive; -1 means to the end of the file
    binary: bool = False


@dataclass
class RawRecord:
    """One record as read: its location, its text (or None) and a quarantine reason if bad."""

    offset: int
    line: int | None
    text: str | None
    reason: str | None = None
    detail: str = ""
    excerpt: bytes = b""


def _split_compression(name: str) -> tuple[str, str | None]:
    for suffix, compression in _COMPRESSIONS.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], compression
    return name, None


def _infer_format(source: SourceConfig, name: str) -> str | None:
    if source.format != "auto":
        return source.format
    bare, _ = _split_compression(name.lower())
    return _SUFFIX_FORMATS.get(PurePosixPath(bare).suffix)


def _is_hf_disk(fs: Any, path: str) -> bool:
    return bool(fs.isdir(path)) and (
        fs.exists(f"{path}/state.json") or fs.exists(f"{path}/dataset_dict.json")
    )


@dataclass(frozen=True)
class _Matched:
    """What a source's path matches: sorted paths under `base`, or one saved dataset folder."""

    fs: Any
    protocol: str
    paths: list[str]
    base: str
    saved_dataset: bool = False  # `base` is a dataset saved by `save_to_disk`


def _source_paths(source: SourceConfig) -> _Matched | None:
    """The paths `source` matches on its filesystem; None if it matches nothing."""
    fs, root = url_to_fs(source.path, **source.fs_options())
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if source.format == "hf_disk" or (source.format == "auto" and _is_hf_disk(fs, root)):
        return _Matched(fs, protocol, [], root, saved_dataset=True)
    if any(ch in source.path for ch in "*?["):
        paths = sorted(p for p in fs.glob(root) if fs.isfile(p))
        return _Matched(fs, protocol, paths, root.split("*")[0].rsplit("/", 1)[0])
    if fs.isdir(root):
        return _Matched(fs, protocol, sorted(fs.find(root)), root)
    if fs.isfile(root):
        return _Matched(fs, protocol, [root], str(PurePosixPath(root).parent))
    return None


def _is_local(protocol: str) -> bool:
    return protocol in ("file", "local")


def expand_source(source: SourceConfig, index: int) -> list[InputFile]:
    """Resolve a source into its input files, sorted by path.

    Raises:
        InputError: the path matches nothing, a file is unreadable, or no file has a known format.
    """
    where = f"ingest.sources[{index}].path"
    matched = _source_paths(source)
    if matched is None:
        raise InputError(f"{where}: {source.path!r} does not exist")
    fs, protocol, base = matched.fs, matched.protocol, matched.base
    unstrip = (lambda p: p) if _is_local(protocol) else (lambda p: f"{protocol}://{p}")
    if matched.saved_dataset:
        return [_input(source, fs, unstrip(base), PurePosixPath(base).name, "hf_disk")]
    files = []
    for path in matched.paths:
        fmt = _infer_format(source, path)
        if fmt is None:
            continue  # a directory may hold READMEs, licenses and the like in unknown formats
        rel = (
            str(PurePosixPath(path).relative_to(base)) if path != base else PurePosixPath(path).name
        )
        files.append(_input(source, fs, unstrip(path), rel, fmt))
    if not files:
        raise InputError(f"{where}: {source.path!r} matches no file of a known format")
    for file in files:
        check_text_column(file, source)
    return files


#: How much larger than its stored bytes a compressed input counts where a stage weighs its
#: work (`work_bytes`): text compresses about 3-4x, and the work is on the decompressed text.
COMPRESSED_WEIGHT = 4


def work_bytes(size: int, name: str) -> int:
    """The bytes of text a stored input of `size` bytes named `name` holds, about."""
    compressed = _split_compression(name.lower())[1] is not None
    return size * (COMPRESSED_WEIGHT if compressed else 1)


def local_corpus_bytes(sources: list[SourceConfig], stop_above: int) -> int | None:
    """The bytes of text the sources hold, when every one is local; None otherwise.

    The files `expand_source` would read (the same matching and formats), sized without being
    opened: what a command weighs before its stages run (`RayConfig.runs_locally`). Sizing
    stops once the total passes `stop_above`. A remote source, or a path that matches nothing,
    gives None: the stage itself resolves it, with its own errors.
    """
    total = 0
    for source in sources:
        if "://" in source.path and not source.path.startswith("file://"):
            return None  # asked before its filesystem is even imported: no network here
        matched = _source_paths(source)
        if matched is None or not _is_local(matched.protocol):
            return None
        if matched.saved_dataset:
            total += int(matched.fs.du(matched.base))
        for path in matched.paths:
            if _infer_format(source, path) is not None:
                total += work_bytes(int(matched.fs.size(path)), path)
            if total > stop_above:
                return total
    return total


def check_text_column(file: InputFile, source: SourceConfig) -> None:
    """Refuse a tabular input whose schema lacks `text_field`, naming the columns it has."""
    if file.format not in ("csv", "tsv", "parquet", "hf_disk"):
        return
    try:
        columns = _columns(file, source.fs_options())
    # EOFError, zlib.error, ZstdError: a compressed file cut or corrupt before its header ends.
    except (
        OSError,
        pa.ArrowInvalid,
        ValueError,
        KeyError,
        EOFError,
        zlib.error,
        zstandard.ZstdError,
    ) as exc:
        raise InputError(f"input file {file.uri!r} cannot be read as {file.format}: {exc}") from exc
    if source.text_field not in columns:
        raise InputError(
            f"input file {file.uri!r} has no column {source.text_field!r} "
            f"(text_field); its columns are {columns}"
        )


def _columns(file: InputFile, storage: dict[str, str]) -> list[str]:
    if file.format == "parquet":
        with fsspec.open(file.uri, "rb", **storage) as handle:
            return list(pq.ParquetFile(handle).schema_arrow.names)
    if file.format == "hf_disk":
        with pa.memory_map(arrow_files(file.uri)[0]) as handle:
            return list(pa.ipc.open_stream(handle).schema.names)
    with open_stream(file, storage) as stream:
        head = stream.read(1 << 16).split(b"\n", 1)[0].decode("utf-8-sig", "replace").strip("\r")
    delimiter = "\t" if file.format == "tsv" else ","
    opts = pacsv.ParseOptions(delimiter=delimiter)
    return list(
        pacsv.read_csv(pa.py_buffer(head.encode() + b"\n"), parse_options=opts).column_names
    )


def _input(source: SourceConfig, fs: Any, uri: str, rel: str, fmt: str) -> InputFile:
    try:
        if fmt != "hf_disk":
            with fsspec.open(uri, "rb", **source.fs_options()) as handle:
                handle.read(1)
        size = int(fs.du(uri) if fmt == "hf_disk" else fs.size(uri))
    except OSError as exc:
        raise InputError(f"input file {uri!r} cannot be read: {exc}") from exc
    _, compression = _split_compression(uri.lower())
    return InputFile(source.display_name(), uri, rel, fmt, compression, size)


def open_stream(file: InputFile, storage: dict[str, str]) -> IO[bytes]:
    """Open `file` for reading decompressed bytes (gzip, bz2, xz or zstd inferred by suffix).

    Compressed input goes through decompressor objects: on a truncated or corrupt file every byte
    decoded before the break is returned first, and the next read raises (EOFError when cut).
    """
    raw = fsspec.open(file.uri, "rb", **storage).open()
    factories = {
        "gzip": lambda: zlib.decompressobj(wbits=47),  # 32 + 15: gzip or zlib header
        "bz2": bz2.BZ2Decompressor,
        "xz": lzma.LZMADecompressor,
        "zstd": lambda: zstandard.ZstdDecompressor().decompressobj(),
    }
    if file.compression in factories:
        return _DecompressedStream(raw, factories[file.compression])  # type: ignore[return-value]
    return raw  # type: ignore[no-any-return]


class _DecompressedStream:
    """Stream bytes through a decompressor object; multi-member/multi-frame files included."""

    def __init__(self, raw: IO[bytes], factory: Callable[[], Any]) -> None:
        self._raw, self._factory = raw, factory
        self._obj = factory()
        self._in_member = False  # has the current decompressor been fed part of a member?
        self._error: BaseException | None = None
        self._done = False

    def read(self, size: int = -1) -> bytes:
        if self._error is not None:
            raise self._error
        out = bytearray()
        while not self._done and (size < 0 or len(out) < size):
            chunk = self._raw.read(1 << 16)
            if not chunk:
                self._done = True
                if self._in_member:
                    self._error = EOFError("compressed stream ended before its end marker")
                break
            try:
                out += self._feed(chunk)
            except Exception as exc:  # corrupt data: return what was decoded, raise next time
                self._done, self._error = True, exc
        if self._error is not None and not out:
            raise self._error
        return bytes(out)

    def _feed(self, chunk: bytes) -> bytes:
        out = self._obj.decompress(chunk)
        self._in_member = True
        while self._obj.eof:
            rest = self._obj.unused_data
            self._obj = self._factory()
            self._in_member = bool(rest)
            if not rest:
                break
            out += self._obj.decompress(rest)
        return bytes(out)

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        """Whether the underlying file is closed (pyarrow's file wrapper asks)."""
        return bool(getattr(self._raw, "closed", False))

    def readable(self) -> bool:
        """Return True: the stream is read-only."""
        return True

    def __enter__(self) -> _DecompressedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def looks_binary(head: bytes) -> bool:
    """Return True if a file head is binary: NUL-heavy or mostly non-text control bytes."""
    if not head:
        return False
    nul = head.count(0)
    controls = sum(1 for b in head if b < 9 or 13 < b < 32)
    return nul > len(head) // 100 or controls > len(head) // 10


def arrow_files(dataset_dir: str) -> list[str]:
    """List the Arrow files of a dataset saved with `datasets.save_to_disk`, in order.

    A `DatasetDict` directory yields the files of every split, split by split in the order of
    its `dataset_dict.json`.
    """
    root = PurePosixPath(dataset_dir)
    dict_file = root / "dataset_dict.json"
    try:
        with open(dict_file) as handle:
            splits = json.load(handle)["splits"]
        return [f for split in splits for f in arrow_files(str(root / split))]
    except FileNotFoundError:
        pass
    with open(root / "state.json") as handle:
        state = json.load(handle)
    return [str(root / entry["filename"]) for entry in state["_data_files"]]
