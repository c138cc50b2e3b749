import bz2
import gzip
import json
import lzma
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from tasks.ingest.readers import plan_units, read_unit
from tasks.ingest.sources import InputError, SourceConfig, expand_source

Record = tuple[int, str]


def read_all(source: SourceConfig, unit_bytes: int = 1 << 30, limit: int = 1 << 20):
    """Read every unit of a source; return good (offset, text) records and bad (offset, reason)."""
    files = expand_source(source, 0)
    units = plan_units(files, source.txt_mode, unit_bytes, {source.display_name(): {}})
    good: list[Record] = []
    bad: list[tuple[int, str]] = []
    for unit in units:
        for batch in read_unit(unit, source.txt_mode, source.text_field, limit, {}):
            good += list(zip(batch.offsets, batch.texts, strict=True))
            bad += [(r.offset, r.reason or "") for r in batch.bad]
    return good, bad, units


LINES = "first line\nsecond line\n\n  \nthird line\r\nfourth line"


def test_txt_line_mode_yields_each_nonblank_line_with_its_offset(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text(LINES)
    good, bad, _ = read_all(SourceConfig(path=str(tmp_path / "a.txt"), txt_mode="line"))
    assert [t.rstrip("\r") for _, t in good] == [
        "first line",
        "second line",
        "third line",
        "fourth line",
    ]
    assert [o for o, _ in good] == [0, 11, 27, 39]
    assert bad == []


def test_txt_block_mode_splits_on_blank_lines_including_crlf(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"p1 l1\r\np1 l2\r\n\r\np2 l1\r\n \r\n\r\np3\r\n")
    good, _, _ = read_all(SourceConfig(path=str(tmp_path / "a.txt"), txt_mode="block"))
    assert [t.strip() for _, t in good] == ["p1 l1\r\np1 l2", "p2 l1", "p3"]


def test_txt_file_mode_reads_one_document_per_file(tmp_path: Path) -> None:
    for name in ("b.txt", "a.txt"):
        (tmp_path / name).write_text(f"doc {name}\n\nsecond para")
    good, _, _ = read_all(SourceConfig(path=str(tmp_path), txt_mode="file"))
    assert [t for _, t in good] == ["doc a.txt\n\nsecond para", "doc b.txt\n\nsecond para"]


@pytest.mark.parametrize("mode", ["line", "block"])
def test_unit_splitting_reads_exactly_the_same_records(tmp_path: Path, mode: str) -> None:
    paragraphs = [f"paragraph {i} " + "word " * (i % 17) + "\nmore" for i in range(400)]
    (tmp_path / "big.txt").write_text("\n\n".join(paragraphs) + "\n")
    source = SourceConfig(path=str(tmp_path / "big.txt"), txt_mode=mode)  # type: ignore[arg-type]
    whole, _, units_one = read_all(source)
    split, _, units_many = read_all(source, unit_bytes=997)
    assert len(units_one) == 1
    assert len(units_many) > 10
    assert split == whole


def _write_compressed(path: Path, data: bytes) -> None:
    compressors = {
        ".gz": gzip.compress,
        ".bz2": bz2.compress,
        ".xz": lzma.compress,
        ".zst": zstandard.ZstdCompressor().compress,
    }
    path.write_bytes(compressors[path.suffix](data))


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_inputs_read_like_plain_ones(tmp_path: Path, suffix: str) -> None:
    data = "".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(500)).encode()
    (tmp_path / "plain.jsonl").write_bytes(data)
    _write_compressed(tmp_path / f"packed.jsonl{suffix}", data)
    plain, _, _ = read_all(SourceConfig(path=str(tmp_path / "plain.jsonl")))
    packed, bad, _ = read_all(SourceConfig(path=str(tmp_path / f"packed.jsonl{suffix}")))
    assert packed == plain
    assert bad == []


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_truncated_compressed_file_keeps_what_was_read_and_quarantines_the_rest(
    tmp_path: Path, suffix: str
) -> None:
    # 3 MB: several bz2 blocks (900 kB each), so some are whole before the cut.
    data = "".join(
        json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(12000)
    ).encode()
    _write_compressed(tmp_path / f"full.jsonl{suffix}", data)
    raw = (tmp_path / f"full.jsonl{suffix}").read_bytes()
    (tmp_path / f"cut.jsonl{suffix}").write_bytes(raw[: len(raw) // 2])
    good, bad, _ = read_all(SourceConfig(path=str(tmp_path / f"cut.jsonl{suffix}")))
    assert [reason for _, reason in bad] == ["truncated_compressed"]
    assert 0 < len(good) < 12000
    assert good[:3] == [(0, "document 0 " * 20), *good[1:3]]


def test_jsonl_bad_records_are_quarantined_with_their_reason(tmp_path: Path) -> None:
    lines = [
        b'{"text": "good one"}',
        b'{"text": "broken',
        b'{"body": "no text"}',
        b'{"text": 42}',
        b'["not", "an object"]',
        b'{"text": "bad \xff utf8"}',
        b'{"text": "nul \x00 byte"}',
        b'{"text": "good two"}',
    ]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    good, bad, _ = read_all(SourceConfig(path=str(tmp_path / "a.jsonl")))
    assert [t for _, t in good] == ["good one", "good two"]
    assert [r for _, r in bad] == [
        "malformed_json",
        "missing_field",
        "wrong_type",
        "missing_field",
        "invalid_utf8",
        "nul_byte",
    ]


def test_json_array_is_streamed_element_by_element(tmp_path: Path) -> None:
    records = [{"text": f"doc {i}", "meta": {"n": [i, {"deep": True}]}} for i in range(50)]
    records.insert(10, {"other": 1})
    (tmp_path / "a.json").write_text(json.dumps(records, indent=2))
    good, bad, _ = read_all(SourceConfig(path=str(tmp_path / "a.json")))
    assert [t for _, t in good] == [f"doc {i}" for i in range(50)]
    assert bad == [(10, "missing_field")]


def test_json_top_level_object_is_quarantined(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"data": []}')
    _, bad, _ = read_all(SourceConfig(path=str(tmp_path / "a.json"), format="json"))
    assert bad == [(0, "malformed_json")]


def test_csv_and_tsv_read_the_configured_column(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text('id,body\n1,"hello, ""world"""\n2,"two\nlines"\n3,\n')
    (tmp_path / "a.tsv").write_text("id\tbody\n1\tfirst\n2\tsecond\n")
    good, bad, _ = read_all(SourceConfig(path=str(tmp_path / "a.csv"), text_field="body"))
    # An empty cell is a record (filtered later as empty), not a separator.
    assert [t for _, t in good] == ['hello, "world"', "two\nlines", ""]
    assert bad == []
    good, _, _ = read_all(SourceConfig(path=str(tmp_path / "a.tsv"), text_field="body"))
    assert [t for _, t in good] == ["first", "second"]


def test_tabular_input_without_the_text_column_is_refused_before_work(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id,body\n1,x\n")
    with pytest.raises(InputError, match=r"no column 'text'.*\['id', 'body'\]"):
        expand_source(SourceConfig(path=str(tmp_path / "a.csv")), 0)


def test_parquet_row_groups_become_units_with_row_offsets(tmp_path: Path) -> None:
    table = pa.table({"text": [f"row {i}" for i in range(1000)]})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=100)
    good, _, units = read_all(SourceConfig(path=str(tmp_path / "a.parquet")), unit_bytes=1)
    assert len(units) == 10
    assert good == [(i, f"row {i}") for i in range(1000)]


def test_saved_dataset_directory_is_read(tmp_path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": ["alpha", "beta"], "label": [0, 1]}).save_to_disk(
        str(tmp_path / "ds")
    )
    good, _, _ = read_all(SourceConfig(path=str(tmp_path / "ds")))
    assert [t for _, t in good] == ["alpha", "beta"]


def test_missing_path_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"sources\[0\]\.path.*nope\.txt.*does not exist"):
        expand_source(SourceConfig(path=str(tmp_path / "nope.txt")), 0)


def test_unreadable_file_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")  # listed, but cannot be opened
    with pytest.raises(InputError, match=r"dangling\.txt.*cannot be read"):
        expand_source(SourceConfig(path=str(tmp_path)), 0)


def test_oversize_line_is_quarantined_with_bounded_memory(tmp_path: Path) -> None:
    with open(tmp_path / "a.txt", "wb") as handle:
        handle.write(b"before\n" + b"x" * (3 << 20) + b"\nafter\n")
    good, bad, _ = read_all(
        SourceConfig(path=str(tmp_path / "a.txt"), txt_mode="line"), limit=64 << 10
    )
    assert [t for _, t in good] == ["before", "after"]
    assert bad == [(7, "record_too_large")]


def test_binary_and_empty_files_are_quarantined(tmp_path: Path) -> None:
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "empty.txt").write_bytes(b"")
    good, bad, _ = read_all(SourceConfig(path=str(tmp_path), txt_mode="line"))
    assert good == []
    assert sorted(r for _, r in bad) == ["binary_file", "empty_file"]


# Lines of every kind a JSON Lines file may hold, good and bad (hostile cases).
_JSONL_LINES = [
    b'{"text": "plain"}',
    b'{"text": "unicode \xc3\xa9\xe2\x80\xa8 \\u2028 \\n escaped"}',
    b'{"text": "crlf"}\r',
    b'  {"text": "padded"}  ',
    b'{"id": 3, "text": "with other fields", "meta": {"a": [1, 2]}}',
    b'{"text": "first", "text": "duplicate key"}',
    b"",
    b"   \t ",
    b"\r",
    b"\xef\xbb\xbf" + b'{"text": "byte-order mark"}',
    b'{"text": "broken',
    b'{"body": "no text"}',
    b'{"text": null}',
    b'{"text": 42}',
    b'{"text": ["a"]}',
    b'["not", "an object"]',
    b'"a bare string"',
    b"17",
    b'{"text": "bad \xff utf8"}',
    b'{"text": "nul \x00 byte"}',
    b'{"text": "lone \\ud800 surrogate"}',
    b'{"text": "' + b"long " * 40 + b'"}',
]


@pytest.mark.parametrize("seed", range(40))
def test_jsonl_line_splitter_reads_exactly_as_the_general_separator_path(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_emit_lines` (one split, orjson first) against the regex path with its per-record checks.

    Small read blocks put block ends inside records, at newlines and inside CRLF pairs.
    """
    import io
    import random
    import re

    from tasks.ingest import readers
    from tasks.ingest.sources import InputFile, WorkUnit

    rng = random.Random(seed)
    lines = [rng.choice(_JSONL_LINES) for _ in range(rng.randint(1, 120))]
    data = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
    monkeypatch.setattr(readers, "_BLOCK", rng.choice([16, 37, 64, 256, 4096]))
    file = InputFile("s", "a.jsonl", "a.jsonl", "jsonl", None, len(data))
    unit = WorkUnit(0, file, 0, len(data), False)
    limit = rng.choice([150, 1 << 20])

    def read(sep: re.Pattern[bytes]) -> list[tuple[object, ...]]:
        out: list[tuple[object, ...]] = []
        for batch in readers._read_delimited(io.BytesIO(data), unit, sep, limit, "text"):
            out += [("ok", *r) for r in zip(batch.offsets, batch.lines, batch.texts, strict=True)]
            out += [("bad", r.offset, r.line, r.reason, r.detail, r.excerpt) for r in batch.bad]
        return sorted(out, key=lambda r: (r[1], r[0]))

    general = re.compile(rb"(?:\n)")  # the same matches, but not the line fast path
    assert read(readers._SEPARATORS["line"]) == read(general)
