"""Ingestion on a real local Ray (the session's): bad input, idempotence, incremental, dedup."""

import gzip
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

from tasks.common import schema
from tasks.common.io import read_ipc_stream, sha256_file
from tasks.common.ray_runtime import RayConfig
from tasks.ingest.ingest import IngestConfig, prepare_documents
from tasks.ingest.sources import SourceConfig
from tasks.ingest.stage import plan_ingest, run_ingest

pytestmark = [pytest.mark.slow, pytest.mark.integration]
RAY2 = RayConfig(num_workers=2)


def config(*sources: SourceConfig, **kwargs: object) -> IngestConfig:
    return IngestConfig(sources=list(sources), **kwargs)  # type: ignore[arg-type]


def reconcile(counts: dict) -> int:
    return (
        counts["kept"]
        + sum(counts["filtered"].values())
        + sum(counts["duplicates"].values())
        + sum(counts["quarantined"].values())
    )


def shard_rows(out: Path, manifest: dict) -> list[dict]:
    rows: list[dict] = []
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            rows += read_ipc_stream(out / shard["name"]).to_pylist()
    return rows


def test_prepare_documents_filters_cleans_and_hashes(tiny_text_table: pa.Table) -> None:
    docs, filtered = prepare_documents(tiny_text_table, config(SourceConfig(path="x"), min_chars=2))
    assert filtered == {"empty": 1, "too_short": 1}
    assert docs.num_rows == tiny_text_table.num_rows - 2
    texts = docs.column(schema.TEXT).to_pylist()
    assert "BOM and CRLF" in texts
    assert "Tabs andbells." in texts
    assert docs.column(schema.SENTENCES).to_pylist()[0] == [
        "Document number 0.",
        "It has two sentences.",
    ]


def write_hostile_corpus(root: Path) -> dict[str, int]:
    """Every bad case of the issue, plus good documents; return the expected count per reason."""
    root.mkdir()
    good = [json.dumps({"text": f"Good document {i}. It is fine."}) for i in range(20)]
    bad = [
        b'{"text": "bad utf8 \xc3\x28"}',
        b'{"text": "nul \x00 inside"}',
        b'{"text": "unclosed',
        b'{"title": "no text field"}',
        b'{"text": ["not", "a", "string"]}',
    ]
    (root / "mixed.jsonl").write_bytes(b"\n".join([g.encode() for g in good[:10]] + bad) + b"\n")
    (root / "binary.jsonl").write_bytes(os.urandom(1 << 16).replace(b"\n", b"\x00"))
    (root / "empty.jsonl").write_bytes(b"")
    payload = "\n".join(good[10:]).encode() + b"\n" + b'{"text": "' + b"y" * 200_000
    (root / "cut.jsonl.gz").write_bytes(gzip.compress(payload)[:-200])
    with open(root / "huge.jsonl", "wb") as handle:  # one line of 100 MB between good ones
        handle.write(b'{"text": "before the huge line"}\n{"text": "')
        for _ in range(100):
            handle.write(b"z" * (1 << 20))
        handle.write(b'"}\n{"text": "after the huge line"}\n')
    return {
        "invalid_utf8": 1,
        "nul_byte": 1,
        "malformed_json": 1,
        "missing_field": 1,
        "wrong_type": 1,
        "binary_file": 1,
        "empty_file": 1,
        "truncated_compressed": 1,
        "record_too_large": 1,
    }


def test_hostile_corpus_ingests_without_crash_and_accounts_for_everything(
    tmp_path: Path, ray_session: str
) -> None:
    expected = write_hostile_corpus(tmp_path / "hostile")
    result = run_ingest(
        config(SourceConfig(path=str(tmp_path / "hostile"), format="jsonl")), RAY2, tmp_path / "ws"
    )
    counts = result.manifest["counts"]
    assert counts["quarantined"] == expected
    assert counts["read"] == reconcile(counts)
    assert counts["kept"] == 22  # 20 good + before/after the huge line
    quarantine = [json.loads(line) for line in (result.path / "quarantine.jsonl").open()]
    assert sorted(q["reason"] for q in quarantine) == sorted(expected)
    for record in quarantine:
        assert record["source_file"] in {
            "mixed.jsonl",
            "binary.jsonl",
            "empty.jsonl",
            "cut.jsonl.gz",
            "huge.jsonl",
        }
        assert isinstance(record["offset"], int)
    huge = next(q for q in quarantine if q["reason"] == "record_too_large")
    assert huge["source_file"] == "huge.jsonl"
    assert huge["line"] == 2
    assert len(huge["excerpt"]) <= 256
    bad_utf8 = next(q for q in quarantine if q["reason"] == "invalid_utf8")
    assert bad_utf8["line"] == 11
    assert bad_utf8["offset"] > 0


def write_docs(path: Path, docs: list[str]) -> None:
    path.write_text("\n\n".join(docs) + "\n")


def test_rerun_rewrites_nothing_and_changes_rebuild(tmp_path: Path, ray_session: str) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a", "b"):
        write_docs(corpus / f"{name}.txt", [f"Doc {name}{i}. Second sentence." for i in range(50)])
    cfg = config(SourceConfig(path=str(corpus)), shard_size_mb=0.001)
    first = run_ingest(cfg, RAY2, tmp_path / "ws")
    stamp = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.path.rglob("*")}
    again = run_ingest(cfg, RAY2, tmp_path / "ws")
    assert again.reused
    assert again.path == first.path
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in again.path.rglob("*")} == stamp
    changed_cfg = run_ingest(cfg.model_copy(update={"min_chars": 5}), RAY2, tmp_path / "ws")
    assert not changed_cfg.reused
    assert changed_cfg.path != first.path
    write_docs(corpus / "b.txt", [f"Doc b{i}. Changed sentence." for i in range(50)])
    changed_input = run_ingest(cfg.model_copy(update={"incremental": False}), RAY2, tmp_path / "ws")
    assert not changed_input.reused
    assert changed_input.path not in (first.path, changed_cfg.path)


def test_incremental_ingest_reads_only_new_files_and_dedups_against_old(
    tmp_path: Path, ray_session: str
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_docs(corpus / "a.txt", [f"Old document {i}. Kept as is." for i in range(40)])
    cfg = config(SourceConfig(path=str(corpus)), shard_size_mb=0.002)
    old = run_ingest(cfg, RAY2, tmp_path / "ws")
    write_docs(
        corpus / "b.txt",
        [f"New document {i}. Added later." for i in range(30)] + ["Old document 3. Kept as is."],
    )
    new = run_ingest(cfg, RAY2, tmp_path / "ws")
    assert new.manifest["extends"] == old.manifest["fingerprint"]
    assert new.manifest["units"] == 1  # only b.txt was read
    assert new.manifest["counts"]["read"] == 71
    assert new.manifest["counts"]["duplicates"]["exact"] == 1
    assert new.manifest["counts"]["kept"] == 70
    old_shards = {
        s["name"]: s["sha256"] for sp in old.manifest["splits"].values() for s in sp["shards"]
    }
    for name, digest in old_shards.items():
        assert sha256_file(new.path / name) == digest  # kept, byte for byte
    docs = shard_rows(new.path, new.manifest)
    assert len(docs) == 70
    assert len({d["doc_id"] for d in docs}) == 70


def test_the_fingerprint_names_the_inputs_by_content_not_by_place(tmp_path: Path) -> None:
    corpus = tmp_path / "here" / "corpus"
    corpus.mkdir(parents=True)
    write_docs(corpus / "a.txt", [f"Doc {i}. Second sentence." for i in range(20)])
    first = plan_ingest(config(SourceConfig(path=str(corpus))), tmp_path / "ws")
    moved = tmp_path / "there" / "corpus"
    shutil.copytree(corpus, moved)
    again = plan_ingest(config(SourceConfig(path=str(moved))), tmp_path / "ws2")
    assert again.fingerprint == first.fingerprint
    assert [i["uri"] for i in again.inputs] == [str(moved / "a.txt")]  # shown as it is now
    assert again.config["sources"][0]["path"] == str(moved)
    write_docs(moved / "a.txt", [f"Doc {i}. Other sentence." for i in range(20)])
    changed = plan_ingest(config(SourceConfig(path=str(moved))), tmp_path / "ws2")
    assert changed.fingerprint != again.fingerprint


def test_an_incremental_ingest_of_a_moved_corpus_reads_only_its_new_files(
    tmp_path: Path, ray_session: str
) -> None:
    corpus = tmp_path / "here" / "corpus"
    corpus.mkdir(parents=True)
    write_docs(corpus / "a.txt", [f"Old document {i}. Kept as is." for i in range(40)])
    old = run_ingest(config(SourceConfig(path=str(corpus))), RAY2, tmp_path / "ws")
    moved = tmp_path / "there" / "corpus"
    shutil.move(corpus, moved)
    write_docs(moved / "b.txt", [f"New document {i}. Added later." for i in range(30)])
    new = run_ingest(config(SourceConfig(path=str(moved))), RAY2, tmp_path / "ws")
    assert new.manifest["extends"] == old.manifest["fingerprint"]
    assert new.manifest["units"] == 1  # only b.txt was read
    assert new.manifest["counts"]["kept"] == 70


def test_output_is_independent_of_worker_count_and_keeps_smallest_file_offset(
    tmp_path: Path, ray_session: str
) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shared = "This paragraph appears in both files. It must be kept once."
    write_docs(corpus / "b.txt", [f"B unique {i}. Text here." for i in range(300)] + [shared])
    write_docs(corpus / "a.txt", [f"A unique {i}. Text here." for i in range(300)] + [shared])
    cfg = config(SourceConfig(path=str(corpus)), shard_size_mb=0.004, unit_size_mb=0.002)
    one = run_ingest(cfg, RayConfig(num_workers=1), tmp_path / "ws1")
    two = run_ingest(cfg, RayConfig(num_workers=2), tmp_path / "ws2")
    assert one.manifest["units"] > 4
    digests = [
        {s["name"]: s["sha256"] for sp in m.manifest["splits"].values() for s in sp["shards"]}
        for m in (one, two)
    ]
    assert digests[0] == digests[1]
    kept = [d for d in shard_rows(one.path, one.manifest) if d["text"] == shared]
    assert len(kept) == 1
    assert kept[0]["source_file"] == "a.txt"


def test_near_duplicates_are_removed_when_enabled(tmp_path: Path, ray_session: str) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    base = " ".join(f"word{i}" for i in range(120))
    docs = [base, base.replace("word7 ", "wordX "), "something else entirely " * 10]
    write_docs(corpus / "a.txt", docs)
    near = {"enabled": True, "threshold": 0.7}
    result = run_ingest(
        config(SourceConfig(path=str(corpus)), dedup={"near": near}), RAY2, tmp_path / "ws"
    )
    assert result.manifest["counts"]["duplicates"] == {"exact": 0, "near": 1}
    texts = [d["text"] for d in shard_rows(result.path, result.manifest)]
    assert base in texts
    assert len(texts) == 2


def test_tampered_manifest_cannot_point_outside_the_output(
    tmp_path: Path, ray_session: str
) -> None:
    from tasks.common.io import UnsafePathError

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_docs(corpus / "a.txt", ["One doc. Fine."])
    cfg = config(SourceConfig(path=str(corpus)))
    first = run_ingest(cfg, RAY2, tmp_path / "ws")
    manifest = json.loads((first.path / "manifest.json").read_text())
    manifest["quarantine"]["name"] = "../../../../etc/passwd"
    (first.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UnsafePathError, match="manifest file"):
        run_ingest(cfg, RAY2, tmp_path / "ws")
