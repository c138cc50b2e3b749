"""What each data stage's MLflow run lists as its inputs, read from the stage's manifest."""

from __future__ import annotations

from pathlib import Path

from pipelines.flows.stage_tracking import corpus_inputs, stage_inputs
from training.registry.tracking import DatasetRef


def test_a_stage_lists_each_upstream_output_its_manifest_names(tmp_path: Path) -> None:
    manifest = {
        "stage": "examples",
        "inputs": {"encode": "e1", "tokenizer": "t1"},
        "encode": {"fingerprint": "e1", "path": "/ws/encode/e1"},
        "tokenizer": {"fingerprint": "t1", "path": "/ws/tokenizer/t1"},
        "specials": {"vocab_size": 300},
    }
    assert stage_inputs("examples", manifest, tmp_path) == [
        DatasetRef("encode", "e1", "/ws/encode/e1"),
        DatasetRef("tokenizer", "t1", "/ws/tokenizer/t1"),
    ]


def test_ingest_lists_its_corpus_files_and_decontaminate_the_ingest_it_filtered(
    tmp_path: Path,
) -> None:
    files = [{"source": "s", "uri": f"/corpus/{i}.txt", "xxh3_128": f"{i:032x}"} for i in range(2)]
    assert stage_inputs("ingest", {"inputs": files}, tmp_path) == [
        DatasetRef("corpus", f"{i:032x}", f"/corpus/{i}.txt") for i in range(2)
    ]
    decontaminated = {"inputs": files, "decontaminated_from": "i9"}
    assert stage_inputs("decontaminate", decontaminated, tmp_path) == [
        DatasetRef("ingest", "i9", str(tmp_path / "ingest" / "i9"))
    ]


def test_a_downstream_task_lists_its_source_files_under_its_base_dir() -> None:
    manifest = {"inputs": {"cola/train.tsv": "a" * 64, "/abs/dev.tsv": "b" * 64}}
    assert stage_inputs("downstream", manifest, Path("/ws"), Path("/data")) == [
        DatasetRef("source", "a" * 64, "/data/cola/train.tsv"),
        DatasetRef("source", "b" * 64, "/abs/dev.tsv"),
    ]


def test_a_corpus_of_many_files_is_listed_per_source_with_a_stable_digest() -> None:
    files = [{"source": f"s{i % 2}", "uri": f"/c/{i}", "xxh3_128": f"{i:032x}"} for i in range(100)]
    refs = corpus_inputs(files)
    assert [r.source for r in refs] == ["s0", "s1"]
    assert refs == corpus_inputs(list(reversed(files)))
    assert all(len(r.digest) == 32 for r in refs)
