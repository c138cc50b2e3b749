"""Readers of downstream source files: one file in, the requested fields of every record out.

Each reader returns a `SourceRows`: for every record, the values of the requested fields (a field
is a header name, a 0-based position, or a dotted path into nested records such as
`translation.en`), the record's location (line, row or record number) and, for a record that could
not be read (a malformed line), the reason. Readers raise `DownstreamDataError` only for a file
that cannot be read at all: missing, not UTF-8, not a JSON document, or without a requested column
in its header or schema. A bad record is reported, not raised, so that the loader decides whether
to refuse the file or skip the record. Turning values into typed columns lives in
`tasks/downstream/checks.py`; which files to read lives in `tasks/downstream/downstream.py`.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

if TYPE_CHECKING:
    from _csv import Reader as CsvReader

#: A source field: a header name or dotted path (str), or a 0-based column position (int).
Spec = str | int


class DownstreamDataError(ValueError):
    """A downstream source is unreadable or holds a bad record; the message says where."""


class _Missing:
    """The value of a field that a record does not have."""

    def __repr__(self) -> str:
        return "<missing>"


#: The value of a requested field that a record lacks (a JSON key that is absent).
MISSING: Any = _Missing()


@dataclass(frozen=True)
class ReadOptions:
    """How to parse one source file (the reader-facing part of a `DatasetConfig`)."""

    header: bool = True
    delimiter: str | None = None  # None: "," for csv, "\t" for tsv, whitespace for conll
    quoting: bool | None = None  # None: on for csv, off for tsv (GLUE TSVs hold stray quotes)
    records_path: str | None = None  # dotted key path to the records of a JSON document


@dataclass
class SourceRows:
    """The requested fields of every record of one file, with locations and unreadable records.

    `fields[key][i]` is record `i`'s value of the field requested under `key` (MISSING when a
    JSON record lacks it); `problems[i]` says why record `i` could not be read.
    """

    file: str
    unit: str  # "line", "row" or "record": what `locations` count (1-based)
    locations: list[int] = field(default_factory=list)
    fields: dict[str, list[Any]] = field(default_factory=dict)
    problems: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.locations)

    def where(self, index: int) -> str:
        """Name the file and the location of record `index` (`texts.csv: line 12`)."""
        return f"{self.file}: {self.unit} {self.locations[index]}"

    def take(self, indexes: list[int]) -> SourceRows:
        """Return the records at `indexes`, in that order, with their problems renumbered."""
        renumber = {old: new for new, old in enumerate(indexes)}
        return SourceRows(
            self.file,
            self.unit,
            [self.locations[i] for i in indexes],
            {key: [values[i] for i in indexes] for key, values in self.fields.items()},
            {renumber[i]: msg for i, msg in self.problems.items() if i in renumber},
        )


def _append(rows: SourceRows, location: int, values: dict[str, Any], problem: str | None) -> None:
    if problem is not None:
        rows.problems[len(rows.locations)] = problem
    rows.locations.append(location)
    for key, value in values.items():
        rows.fields[key].append(value)


def _open_text(path: Path) -> IO[str]:
    """Open a UTF-8 text file (a leading BOM is dropped), or raise naming the file."""
    if not path.is_file():
        raise DownstreamDataError(f"{path}: no such file")
    return open(path, encoding="utf-8-sig", newline="")


def _decode_guard(path: Path, read: Callable[[], SourceRows]) -> SourceRows:
    try:
        return read()
    except UnicodeDecodeError:
        raise DownstreamDataError(f"{path}: {_first_bad_byte(path)}: not UTF-8 text") from None


def _first_bad_byte(path: Path) -> str:
    """Name the line and column of the first byte of `path` that is not UTF-8."""
    # The decoder's own position counts from the start of a read buffer, not of the file.
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, line_start = raw.count(b"\n", 0, exc.start) + 1, raw.rfind(b"\n", 0, exc.start) + 1
        return f"line {line} column {exc.start - line_start + 1}"
    return "somewhere"  # unreachable for a file whose text failed to decode


def _columns_of(path: Path, header: list[str] | None, wanted: dict[str, Spec]) -> dict[str, int]:
    """Map each wanted key to its column position, by header name or position."""
    positions: dict[str, int] = {}
    for key, spec in wanted.items():
        if isinstance(spec, int):
            positions[key] = spec
        elif header is None:
            raise DownstreamDataError(
                f"{path}: column {key!r} is given by name ({spec!r}) but the file is read "
                "without a header; give its 0-based position instead"
            )
        elif spec not in header:
            raise DownstreamDataError(
                f"{path}: no column {spec!r} (wanted as {key!r}); the header has {header}"
            )
        else:
            positions[key] = header.index(spec)
    return positions


def read_delimited(path: Path, fmt: str, wanted: dict[str, Spec], opts: ReadOptions) -> SourceRows:
    """Read a CSV or TSV file; a record with the wrong number of fields is a bad record."""
    tsv = fmt == "tsv"
    delimiter = opts.delimiter or ("\t" if tsv else ",")
    quoting = (not tsv) if opts.quoting is None else opts.quoting
    rows = SourceRows(str(path), "line", fields={key: [] for key in wanted})

    def read() -> SourceRows:
        with _open_text(path) as handle:
            reader = csv.reader(
                handle,
                delimiter=delimiter,
                quoting=csv.QUOTE_MINIMAL if quoting else csv.QUOTE_NONE,
                strict=True,
            )
            records = _csv_records(path, reader)
            header = None
            if opts.header:
                first = next(records, None)
                if first is None:
                    return rows  # no header, no records: the loader refuses the empty split
                header = first[1]
            positions = _columns_of(path, header, wanted)
            width = len(header) if header is not None else None
            for line, record in records:
                width = len(record) if width is None else width
                problem = None
                if len(record) != width:
                    problem = f"expected {width} fields, found {len(record)}"
                values = {
                    key: record[pos] if -len(record) <= pos < len(record) else MISSING
                    for key, pos in positions.items()
                }
                _append(rows, line, values, problem)
        return rows

    return _decode_guard(path, read)


def _csv_records(path: Path, reader: CsvReader) -> Iterator[tuple[int, list[str]]]:
    """Yield (first line, fields) of each non-blank record; malformed quoting is fatal."""
    while True:
        line = reader.line_num + 1
        try:
            record = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise DownstreamDataError(f"{path}: line {line}: malformed CSV ({exc})") from None
        if record:
            yield line, record


def resolve_path(record: dict[str, Any], spec: str) -> Any:
    """Return the value at dotted path `spec` in a nested record, or MISSING.

    A key that itself contains dots (`"a.b"` at top level) wins over the nested path.
    """
    if spec in record:
        return record[spec]
    node: Any = record
    for part in spec.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _record_values(record: Any, wanted: dict[str, Spec]) -> tuple[dict[str, Any], str | None]:
    if not isinstance(record, dict):
        found = type(record).__name__
        return {key: MISSING for key in wanted}, f"expected a JSON object, found {found}"
    return {key: resolve_path(record, str(spec)) for key, spec in wanted.items()}, None


def read_jsonl(path: Path, wanted: dict[str, Spec]) -> SourceRows:
    """Read JSON Lines: one object per line; blank lines are skipped, bad lines reported."""
    rows = SourceRows(str(path), "line", fields={key: [] for key in wanted})

    def read() -> SourceRows:
        with _open_text(path) as handle:
            for line, text in enumerate(handle, 1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as exc:
                    values = {key: MISSING for key in wanted}
                    _append(rows, line, values, f"invalid JSON ({exc.msg}, column {exc.colno})")
                    continue
                except (ValueError, RecursionError) as exc:  # a 4300+ digit int, deep nesting
                    values = {key: MISSING for key in wanted}
                    _append(rows, line, values, f"unreadable JSON ({str(exc)[:80]})")
                    continue
                values, problem = _record_values(record, wanted)
                _append(rows, line, values, problem)
        return rows

    return _decode_guard(path, read)


def walk_records(node: Any, keys: list[str], inherited: dict[str, Any]) -> Iterator[Any]:
    """Yield the records at key path `keys` under `node`, descending through every list.

    Each record inherits the other fields of the objects it sits in (its own fields win): with
    `data.paragraphs.qas`, a SQuAD question gets its paragraph's `context` and article's `title`.
    """
    if isinstance(node, list):
        for item in node:
            yield from walk_records(item, keys, inherited)
    elif not keys:
        yield {**inherited, **node} if isinstance(node, dict) else node
    elif isinstance(node, dict) and keys[0] in node:
        outer = {**inherited, **{k: v for k, v in node.items() if k != keys[0]}}
        yield from walk_records(node[keys[0]], keys[1:], outer)
    else:
        shape = sorted(node) if isinstance(node, dict) else type(node).__name__
        raise KeyError(f"no key {keys[0]!r} here (found {shape})")


def read_json(path: Path, wanted: dict[str, Spec], opts: ReadOptions) -> SourceRows:
    """Read one JSON document: an array of records, or records under `opts.records_path`."""
    rows = SourceRows(str(path), "record", fields={key: [] for key in wanted})

    def read() -> SourceRows:
        with _open_text(path) as handle:
            text = handle.read()
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            where = f"line {exc.lineno} column {exc.colno}"
            raise DownstreamDataError(f"{path}: {where}: invalid JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # a 4300+ digit int, deep nesting
            raise DownstreamDataError(f"{path}: unreadable JSON ({str(exc)[:80]})") from None
        if opts.records_path is None and not isinstance(document, list):
            keys = sorted(document) if isinstance(document, dict) else type(document).__name__
            raise DownstreamDataError(
                f"{path}: the top level is not an array of records; set records_path to the "
                f"key that holds them (top-level keys: {keys})"
            )
        keys = opts.records_path.split(".") if opts.records_path else []
        try:
            for number, record in enumerate(walk_records(document, keys, {}), 1):
                values, problem = _record_values(record, wanted)
                _append(rows, number, values, problem)
        except KeyError as exc:
            where = f"records_path {opts.records_path!r}"
            raise DownstreamDataError(f"{path}: {where}: {exc.args[0]}") from None
        return rows

    return _decode_guard(path, read)


def read_conll(path: Path, wanted: dict[str, Spec], opts: ReadOptions) -> SourceRows:
    """Read token-per-line text (CoNLL, GermEval): blank lines end sentences.

    `wanted` maps `tokens` and `tags` to field positions on each line; `-DOCSTART-` lines end a
    sentence and are not tokens. A sentence's location is the line of its first token.
    """
    rows = SourceRows(str(path), "line", fields={key: [] for key in wanted})
    named = {key: spec for key, spec in wanted.items() if not isinstance(spec, int)}
    if named:
        raise DownstreamDataError(f"{path}: conll fields are 0-based positions, not names {named}")
    positions = {key: int(spec) for key, spec in wanted.items()}

    def read() -> SourceRows:
        sentence: dict[str, list[str]] = {key: [] for key in wanted}
        start, problem = 0, None
        with _open_text(path) as handle:
            for line, text in enumerate([*handle, ""], 1):
                parts = text.split(opts.delimiter) if opts.delimiter else text.split()
                if not text.strip() or parts[0] == "-DOCSTART-":
                    if start:
                        _append(rows, start, dict(sentence), problem)
                    sentence, start, problem = {key: [] for key in wanted}, 0, None
                    continue
                start = start or line
                for key, pos in positions.items():
                    if -len(parts) <= pos < len(parts):
                        sentence[key].append(parts[pos].strip())
                    elif problem is None:
                        problem = f"line {line} has {len(parts)} field(s), {key} is field {pos}"
        return rows

    return _decode_guard(path, read)


def _arrow_field(path: Path, table: pa.Table, key: str, spec: Spec) -> pa.ChunkedArray:
    """Return column `spec` of `table`: a name, a position, or a dotted path into structs."""
    if isinstance(spec, int):
        if not -table.num_columns <= spec < table.num_columns:
            raise DownstreamDataError(f"{path}: no column at position {spec} (wanted as {key!r})")
        return table.column(spec)
    if spec in table.column_names:
        return table.column(spec)
    head, *rest = spec.split(".")
    missing = DownstreamDataError(
        f"{path}: no column {spec!r} (wanted as {key!r}); columns are {table.column_names}"
    )
    if head not in table.column_names:
        raise missing
    column = table.column(head)
    for part in rest:
        if not pa.types.is_struct(column.type) or column.type.get_field_index(part) < 0:
            raise missing
        column = pc.struct_field(column, part)
    return column


def rows_from_table(path: Path, table: pa.Table, wanted: dict[str, Spec]) -> SourceRows:
    """Take the wanted columns of an Arrow table (Parquet, saved dataset) as records."""
    values = {key: _arrow_field(path, table, key, spec).to_pylist() for key, spec in wanted.items()}
    return SourceRows(str(path), "row", list(range(1, table.num_rows + 1)), values)


def read_parquet(path: Path, wanted: dict[str, Spec]) -> SourceRows:
    """Read a Parquet file's wanted columns."""
    if not path.is_file():
        raise DownstreamDataError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise DownstreamDataError(f"{path}: not a readable Parquet file ({exc})") from None
    return rows_from_table(path, table, wanted)


def read_hf_split(path: Path, wanted: dict[str, Spec]) -> SourceRows:
    """Read one split saved by `datasets.Dataset.save_to_disk` (a directory)."""
    import datasets  # deferred: a 2 s import only this format needs

    if not (path / "state.json").is_file():
        raise DownstreamDataError(f"{path}: not a dataset saved with save_to_disk (no state.json)")
    try:
        dataset = datasets.load_from_disk(str(path))
        table = dataset.with_format("arrow")[:]  # applies an indices mapping, if any
    # A saved dataset whose state.json or Arrow files are damaged or missing.
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError) as exc:
        raise DownstreamDataError(f"{path}: not a readable saved dataset ({exc})") from None
    return rows_from_table(path, table, wanted)


def hf_splits(path: Path) -> list[str]:
    """List the splits of a `DatasetDict.save_to_disk` directory (its `dataset_dict.json`)."""
    index = path / "dataset_dict.json"
    if not index.is_file():
        raise DownstreamDataError(
            f"{path}: not a DatasetDict saved with save_to_disk (no dataset_dict.json)"
        )
    try:
        splits = json.loads(index.read_text(encoding="utf-8"))["splits"]
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise DownstreamDataError(f"{index}: no list of splits ({exc!r})") from None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise DownstreamDataError(f"{index}: 'splits' must be a list of names, not {splits!r}")
    return splits


def read_source(path: Path, fmt: str, wanted: dict[str, Spec], opts: ReadOptions) -> SourceRows:
    """Read one source file (or saved split directory) in format `fmt`."""
    if fmt in ("csv", "tsv"):
        return read_delimited(path, fmt, wanted, opts)
    if fmt == "jsonl":
        return read_jsonl(path, wanted)
    if fmt == "json":
        return read_json(path, wanted, opts)
    if fmt == "conll":
        return read_conll(path, wanted, opts)
    if fmt == "parquet":
        return read_parquet(path, wanted)
    if fmt == "hf_disk":
        return read_hf_split(path, wanted)
    raise DownstreamDataError(f"{path}: unknown format {fmt!r}")
