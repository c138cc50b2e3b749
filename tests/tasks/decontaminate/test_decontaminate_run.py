"""The decontamination stage on real ingest outputs (session Ray): removal, counts, reuse."""

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from tasks.common import schema
from tasks.common.io import read_ipc_stream, sha256_file
from tasks.common.ray_runtime import RayConfig
from tasks.common.stage import StageInputError, StageResult
from tasks.decontaminate.decontaminate import CONTAMINATED_BY, DecontaminateConfig, EvalTask
from tasks.decontaminate.stage import (
    REMOVED_FILE,
    SPLIT,
    decontaminated_counts,
    plan_decontaminate,
    run_decontaminate,
)
from tasks.ingest.ingest import IngestConfig, SplitConfig
from tasks.ingest.sources import SourceConfig
from tasks.ingest.stage import run_ingest
from tasks.tokenizer.stage import run_tokenizer
from tasks.tokenizer.tokenizer import TokenizerConfig

VALIDATION_SENTENCE = (
    "The old lighthouse keeper counted forty seven ships passing the harbour wall "
    "before the storm arrived that night"
)  # 18 words
TRAIN_SENTENCE = (
    "A quiet librarian in the mountain village catalogued every letter the postman "
    "had ever lost along the winding road"
)  # 19 words
TEST_SENTENCE = (
    "Seven children built a raft from broken crates and sailed it across the pond "
    "while their parents slept"
)  # 18 words
PLANTED = (
    "Someone wrote that "
    + " ".join(VALIDATION_SENTENCE.split()[3:16])  # 13 words, in order
    + ", and then left the town."
)
NEAR_MISS = "It is said that " + " ".join(TEST_SENTENCE.split()[:12]) + " once."  # 12 words
TRAIN_QUOTE = f"From the training data: {TRAIN_SENTENCE}."
FILLER = [
    f"Filler document {i} describes the weather in town {i} and the price of bread there."
    for i in range(40)
]


def write_eval_task(root: Path) -> Path:
    """A classification task, one CSV with a split column, and its YAML; return the YAML."""
    root.mkdir(parents=True, exist_ok=True)
    rows = [
        ("train", TRAIN_SENTENCE, "pos"),
        ("train", "A short train sentence.", "neg"),
        ("validation", VALIDATION_SENTENCE, "pos"),
        ("test", TEST_SENTENCE, "neg"),
    ]
    lines = ["text,label,split"] + [f'"{text}",{label},{split}' for split, text, label in rows]
    (root / "eval.csv").write_text("\n".join(lines) + "\n")
    task = {
        "name": "evalset",
        "task_type": "classification",
        "path": "eval.csv",
        "split_column": "split",
        "split_values": {"train": "train", "validation": "validation", "test": "test"},
        "columns": {"text": "text", "label": "label"},
        "labels": ["neg", "pos"],
    }
    (root / "evalset.yaml").write_text(yaml.safe_dump(task))
    return root / "evalset.yaml"


def ingest_corpus(root: Path, texts: list[str]) -> StageResult:
    root.mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = IngestConfig(
        sources=[SourceConfig(path=str(root / "corpus.jsonl"))],
        split=SplitConfig(validation=0.3, test=0.3),
    )
    return run_ingest(cfg, RayConfig(num_workers=2), root / "ws")


@pytest.fixture(scope="module")
def task_yaml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_eval_task(tmp_path_factory.mktemp("eval"))


@pytest.fixture(scope="module")
def ingested(tmp_path_factory: pytest.TempPathFactory, ray_session: str) -> StageResult:
    """An ingest of 40 filler documents, the planted one, a near miss and a train quote."""
    return ingest_corpus(
        tmp_path_factory.mktemp("corpus") / "c", [*FILLER, PLANTED, NEAR_MISS, TRAIN_QUOTE]
    )


def enabled(task_yaml: Path, **kwargs: Any) -> DecontaminateConfig:
    task = EvalTask(config=task_yaml, base_dir=task_yaml.parent)
    return DecontaminateConfig(enabled=True, tasks=[task], **kwargs)


def documents(out: Path, manifest: dict[str, Any], split: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for shard in manifest["splits"][split]["shards"]:
        rows += read_ipc_stream(out / shard["name"]).to_pylist()
    return rows


def reconciled(counts: dict[str, Any]) -> int:
    groups = ("filtered", "duplicates", "quarantined")
    total: int = counts["kept"] + sum(sum(counts[g].values()) for g in groups)
    return total


def test_moving_removed_documents_to_filtered_keeps_counts_reconciled() -> None:
    counts = {"read": 10, "kept": 8, "filtered": {"empty": 1}, "duplicates": {"exact": 1}}
    new = decontaminated_counts(counts | {"quarantined": {}}, 3)
    assert new["kept"] == 5
    assert new["filtered"] == {"contaminated": 3, "empty": 1}
    assert reconciled(new) == new["read"] == 10


def test_counts_that_do_not_reconcile_are_a_loud_error() -> None:
    counts = {"read": 10, "kept": 7, "filtered": {}, "duplicates": {}, "quarantined": {}}
    with pytest.raises(AssertionError, match="read=10, accounted=7"):
        decontaminated_counts(counts, 0)


@pytest.mark.slow
@pytest.mark.integration
def test_stage_removes_exactly_the_document_that_quotes_an_eval_sentence(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    result = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path)
    assert not result.reused
    assert result.path.parent == tmp_path / "decontaminate"
    removed = read_ipc_stream(result.path / REMOVED_FILE)
    assert removed.column(schema.TEXT).to_pylist() == [PLANTED]
    assert removed.column(CONTAMINATED_BY).to_pylist() == [["evalset/validation"]]
    # Every other document is still there, in the split ingestion gave it, and nothing else.
    for split in ("train", "validation", "test"):
        before = documents(ingested.path, ingested.manifest, split)
        after = documents(result.path, result.manifest, split)
        assert [d for d in before if d[schema.TEXT] != PLANTED] == after
        if len(after) < len(before):
            assert removed.column(SPLIT).to_pylist() == [split]
    report = result.manifest["decontamination"]
    assert (report["documents_read"], report["documents_kept"]) == (43, 42)
    assert report["documents_removed"] == 1
    assert report["removed_by"] == {"evalset/validation": 1, "evalset/test": 0}
    assert report["eval_ngrams"] == {"evalset/validation": 18 - 12, "evalset/test": 18 - 12}
    assert result.manifest["decontaminated_from"] == ingested.manifest["fingerprint"]
    assert result.manifest["stage"] == "ingest"  # read by the next stages as a corpus


@pytest.mark.slow
@pytest.mark.integration
def test_new_manifest_reconciles_and_lists_files_with_their_true_hashes(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    manifest = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path).manifest
    out = tmp_path / "decontaminate" / manifest["fingerprint"]
    counts, old = manifest["counts"], ingested.manifest["counts"]
    assert counts["read"] == old["read"] == reconciled(counts)
    assert counts["kept"] == old["kept"] - 1
    assert counts["filtered"]["contaminated"] == 1
    assert manifest["metrics"]["kept"] == counts["kept"]
    assert manifest["metrics"]["filtered.contaminated"] == 1
    assert manifest["metrics"]["removed_by.evalset/validation"] == 1
    [source] = manifest["sources"].values()
    assert source["documents"] == counts["kept"]
    kept_rows = 0
    for split, entry in manifest["splits"].items():
        assert [s["name"] for s in entry["shards"]] == [
            s["name"] for s in ingested.manifest["splits"][split]["shards"]
        ]
        for shard in entry["shards"]:
            path = out / shard["name"]
            assert sha256_file(path) == shard["sha256"]
            assert path.stat().st_size == shard["bytes"]
            assert read_ipc_stream(path).num_rows == shard["rows"]
            kept_rows += shard["rows"]
        assert entry["rows"] == sum(s["rows"] for s in entry["shards"])
    assert kept_rows == counts["kept"]
    for entry in (manifest["removed"], manifest["quarantine"]):
        assert sha256_file(out / entry["name"]) == entry["sha256"]
    assert "dedup_index" not in manifest
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [s["name"] for e in manifest["splits"].values() for s in e["shards"]]
        + [REMOVED_FILE, "quarantine.jsonl", "manifest.json"]
    )


@pytest.mark.slow
@pytest.mark.integration
def test_rerun_reuses_the_output_without_touching_a_file(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    first = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path)
    files = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.path.iterdir()}
    second = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path)
    assert second.reused
    assert second.path == first.path
    assert second.manifest == json.loads((first.path / "manifest.json").read_text())
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in first.path.iterdir()} == files
    assert list((tmp_path / "decontaminate").iterdir()) == [first.path]  # no temp left behind


@pytest.mark.slow
@pytest.mark.integration
def test_reuse_sweeps_what_interrupted_work_left_inside_the_output(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    first = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path)
    listed = {p.name: p.read_bytes() for p in first.path.iterdir()}
    (first.path / "_staging").mkdir()
    (first.path / "_staging" / "part.json").write_text("{}")
    (first.path / f".{REMOVED_FILE}.tmp-999999-0123abcd").write_bytes(b"half a file")
    second = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path)
    assert second.reused
    assert {p.name: p.read_bytes() for p in second.path.iterdir()} == listed


@pytest.mark.slow
@pytest.mark.integration
def test_another_n_builds_another_output(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    thirteen = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path)
    twelve = run_decontaminate(enabled(task_yaml, n=12), ingested.path, tmp_path)
    assert not twelve.reused
    assert twelve.path != thirteen.path
    removed = read_ipc_stream(twelve.path / REMOVED_FILE).column(schema.TEXT).to_pylist()
    assert sorted(removed) == sorted([PLANTED, NEAR_MISS])  # 12 shared words now count


@pytest.mark.slow
@pytest.mark.integration
def test_the_fingerprint_names_the_eval_tasks_by_content_not_by_place(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(task_yaml.parent, moved)
    here = plan_decontaminate(enabled(task_yaml), ingested.path, tmp_path / "ws")
    there = plan_decontaminate(enabled(moved / task_yaml.name), ingested.path, tmp_path / "ws")
    assert here is not None
    assert there is not None
    assert there.fingerprint == here.fingerprint
    assert there.config["tasks"][0]["base_dir"] == str(moved)  # the manifest shows it as given
    (moved / "eval.csv").write_text((moved / "eval.csv").read_text().replace("pos", "neg"))
    changed = plan_decontaminate(enabled(moved / task_yaml.name), ingested.path, tmp_path / "ws")
    assert changed is not None
    assert changed.fingerprint != here.fingerprint


@pytest.mark.slow
@pytest.mark.integration
def test_disabled_stage_returns_the_ingest_output_untouched(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    cfg = enabled(task_yaml).model_copy(update={"enabled": False})
    result = run_decontaminate(cfg, ingested.path, tmp_path)
    assert result.path == ingested.path
    assert result.reused
    assert result.manifest == ingested.manifest
    assert not (tmp_path / "decontaminate").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_tokenizer_stage_trains_on_the_decontaminated_corpus(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    clean = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path)
    tok_cfg = TokenizerConfig(vocab_size=200, min_frequency=1)
    tokenizer = run_tokenizer(tok_cfg, clean.path, tmp_path)
    assert tokenizer.manifest["ingest"] == {
        "fingerprint": clean.manifest["fingerprint"],
        "path": str(clean.path),
    }
    assert tokenizer.manifest["metrics"]["documents"] == clean.manifest["splits"]["train"]["rows"]
    assert (tmp_path / "tokenizer" / tokenizer.manifest["fingerprint"] / "tokenizer.json").exists()


@pytest.mark.slow
@pytest.mark.integration
def test_contamination_is_removed_from_every_split(
    task_yaml: Path, tmp_path: Path, ray_session: str
) -> None:
    planted = [f"Note {k}: {VALIDATION_SENTENCE}, copied again ({k})." for k in range(8)]
    ingested = ingest_corpus(tmp_path / "c", [*FILLER[:10], *planted])
    result = run_decontaminate(enabled(task_yaml), ingested.path, tmp_path / "ws")
    removed = read_ipc_stream(result.path / REMOVED_FILE)
    assert sorted(removed.column(schema.TEXT).to_pylist()) == sorted(planted)
    # The planted documents' content hashes put them in all three splits (deterministic).
    per_split = result.manifest["removed"]["splits"]
    assert set(removed.column(SPLIT).to_pylist()) == {"train", "validation", "test"}
    assert per_split == {s: removed.column(SPLIT).to_pylist().count(s) for s in per_split}
    for split, entry in result.manifest["splits"].items():
        texts = [d[schema.TEXT] for d in documents(result.path, result.manifest, split)]
        assert not set(texts) & set(planted)
        assert entry["rows"] == ingested.manifest["splits"][split]["rows"] - per_split[split]


@pytest.mark.slow
@pytest.mark.integration
def test_enabled_stage_without_tasks_is_refused(ingested: StageResult, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"decontaminate\.tasks lists no task"):
        run_decontaminate(DecontaminateConfig(enabled=True), ingested.path, tmp_path)


@pytest.mark.slow
@pytest.mark.integration
def test_eval_splits_that_no_task_has_are_refused_by_name(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    cfg = enabled(task_yaml, eval_splits=["heldout"])
    with pytest.raises(ValueError, match=r"evalset.yaml.*\['heldout'\]"):
        run_decontaminate(cfg, ingested.path, tmp_path)


@pytest.mark.slow
@pytest.mark.integration
def test_ingest_output_missing_a_shard_is_refused_naming_it(
    ingested: StageResult, task_yaml: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "ingest-copy"
    shutil.copytree(ingested.path, broken)
    name = ingested.manifest["splits"]["train"]["shards"][0]["name"]
    (broken / name).unlink()
    with pytest.raises(StageInputError, match=re.escape(name)):
        run_decontaminate(enabled(task_yaml), broken, tmp_path)


def test_removed_file_schema_is_documents_plus_provenance() -> None:
    from tasks.decontaminate.stage import REMOVED

    assert REMOVED.names == [*schema.DOCUMENTS.names, CONTAMINATED_BY, SPLIT]
    assert REMOVED.field(SPLIT).type == pa.string()
