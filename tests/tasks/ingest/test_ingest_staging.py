"""Staged units: the digests that replace an fsync, and the redo of a unit that fails them."""

import json
import logging
from pathlib import Path

import pytest

from tasks.ingest.ingest import IngestConfig, UnitJob, process_unit, staged_summary
from tasks.ingest.readers import plan_units
from tasks.ingest.sources import SourceConfig, expand_source


def one_unit_job(tmp_path: Path) -> UnitJob:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": f"Doc {i}. It has two sentences."}) + "\n" for i in range(40))
        + "{not json\n"
    )
    source = SourceConfig(path=str(corpus), format="jsonl")
    cfg = IngestConfig(sources=[source])
    files = expand_source(source, 0)
    units = plan_units(files, source.txt_mode, 1 << 20, {source.display_name(): {}})
    assert len(units) == 1
    return UnitJob(units[0], cfg, str(tmp_path / "staging"), {})


def test_summary_records_size_and_digest_of_each_staged_file(tmp_path: Path) -> None:
    job = one_unit_job(tmp_path)
    summary = process_unit(job)
    stem = Path(job.staging) / "unit-000000"
    assert summary["read"] == 41
    assert summary["kept"] == 40
    assert summary["quarantined"] == {"malformed_json": 1}
    for kind in ("docs", "bad"):
        entry = summary["staged"][kind]
        path = stem.with_suffix(f".{kind}.arrow")
        assert entry["bytes"] == path.stat().st_size > 0
        assert len(entry["xxh3_128"]) == 32
    assert json.loads(stem.with_suffix(".json").read_text()) == summary
    assert staged_summary(stem) == summary


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "drop_file", "old_summary", "torn"])
def test_a_staged_unit_that_fails_its_digests_is_done_again(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """What a crash of the machine can leave behind (unsynced data lost) is never reused."""
    job = one_unit_job(tmp_path)
    first = process_unit(job)
    stem = Path(job.staging) / "unit-000000"
    docs, summary_path = stem.with_suffix(".docs.arrow"), stem.with_suffix(".json")
    original = docs.read_bytes()
    if damage == "flip_byte":
        data = bytearray(original)
        data[len(data) // 2] ^= 0xFF
        docs.write_bytes(bytes(data))
    elif damage == "truncate":
        docs.write_bytes(original[: len(original) // 2])
    elif damage == "drop_file":
        stem.with_suffix(".bad.arrow").unlink()
    elif damage == "old_summary":
        summary_path.write_text(json.dumps({k: v for k, v in first.items() if k != "staged"}))
    else:
        summary_path.write_text(summary_path.read_text()[:20])
    assert staged_summary(stem) is None
    with caplog.at_level(logging.WARNING, logger="tasks.ingest.ingest"):
        again = process_unit(job)
    assert again == first
    assert docs.read_bytes() == original
    assert staged_summary(stem) == first
    assert any("processing it again" in r.getMessage() for r in caplog.records)


def test_an_intact_staged_unit_is_reused_without_reading_the_input(tmp_path: Path) -> None:
    job = one_unit_job(tmp_path)
    first = process_unit(job)
    stem = Path(job.staging) / "unit-000000"
    stamp = stem.with_suffix(".docs.arrow").stat().st_mtime_ns
    Path(job.unit.file.uri).unlink()  # reading the input again would fail
    assert process_unit(job) == first
    assert stem.with_suffix(".docs.arrow").stat().st_mtime_ns == stamp
