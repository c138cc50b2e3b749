"""Tokenizer and encode stages end to end: real corpora, Prefect, Ray, MLflow, cache and rebuild."""

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml
from mlflow.tracking import MlflowClient
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pipelines.cli.main import main
from pipelines.config import RunConfig, load_config
from tasks.common import schema
from tasks.common.io import read_ipc_stream, sha256_file

pytestmark = [pytest.mark.slow, pytest.mark.integration]


@pytest.fixture(scope="module")
def recipe(shared_data: Path, tmp_path_factory: pytest.TempPathFactory, mlflow_uri: str) -> Path:
    """One workspace for the module, so that later tests reuse its ingest output."""
    root = tmp_path_factory.mktemp("encode")
    path = root / "recipe.yaml"
    config = {
        "name": "encode-acceptance",
        "workspace": str(root / "ws"),
        "tracking": {"tracking_uri": mlflow_uri, "experiment": "encode-acceptance"},
        "ingest": {
            "sources": [
                {
                    "path": str(shared_data / "gutenberg_books"),
                    "name": "books",
                    "txt_mode": "block",
                },
                {
                    "path": str(shared_data / "tiny_shakespeare" / "input.txt"),
                    "name": "shakespeare",
                    "txt_mode": "line",
                },
            ],
            "shard_size_mb": 0.5,
        },
        "tokenizer": {"vocab_size": 4000, "model_max_length": 256},
        "encode": {"batch_documents": 300, "shard_documents": 700},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def config(recipe: Path, *overrides: str) -> RunConfig:
    return load_config(recipe, list(overrides))


def shard_pairs(stages: dict[str, Any]) -> list[tuple[pa.Table, pa.Table]]:
    """(ingested documents, encoded documents) per shard, read back from disk."""
    ingest, encode = Path(stages["ingest"]["path"]), Path(stages["encode"]["path"])
    manifest = json.loads((encode / "manifest.json").read_text())
    pairs = []
    for entry in manifest["splits"].values():
        for shard in entry["shards"]:
            source = shard["source"]
            docs = read_ipc_stream(ingest / source["shard"])
            part = docs.slice(source["start"], source["stop"] - source["start"])
            pairs.append((part, read_ipc_stream(encode / shard["name"])))
    return pairs


def each_document(stages: dict[str, Any]) -> Any:
    """Yield (text, sentences, ids per sentence) for every document of every shard."""
    for docs, encoded in shard_pairs(stages):
        assert docs.column(schema.DOC_ID).to_pylist() == encoded.column(schema.DOC_ID).to_pylist()
        yield from zip(
            docs.column(schema.TEXT).to_pylist(),
            docs.column(schema.SENTENCES).to_pylist(),
            encoded.column(schema.TOKEN_IDS).to_pylist(),
            strict=True,
        )


def test_lmpipe_encode_bpe_end_to_end_reuse_and_rebuild(recipe: Path, mlflow_uri: str) -> None:
    from pipelines.flows.encode_flow import encode_flow

    assert main(["encode", str(recipe), "tokenizer.family=bpe", "tokenizer.lowercase=false"]) == 0
    cfg = config(recipe, "tokenizer.family=bpe", "tokenizer.lowercase=false")
    stages = encode_flow(cfg)  # the same config again: every stage reused
    assert all(result["reused"] for result in stages.values())

    # The tokenizer directory loads offline with the family's settings.
    directory = Path(stages["tokenizer"]["path"])
    loaded = AutoTokenizer.from_pretrained(directory)
    assert loaded.model_max_length == 256
    assert loaded.padding_side == "right"
    assert loaded.eos_token == "<|endoftext|>"
    assert PreTrainedTokenizerFast.from_pretrained(directory).vocab_size == loaded.vocab_size
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))

    # Every document decodes back to its text; every sentence to itself.
    documents = 0
    for text, sentences, per_sentence in each_document(stages):
        assert tok.decode([i for s in per_sentence for i in s]) == text
        assert [tok.decode(s).strip() for s in per_sentence] == sentences
        documents += 1

    ingest = json.loads((Path(stages["ingest"]["path"]) / "manifest.json").read_text())
    manifest = json.loads((Path(stages["encode"]["path"]) / "manifest.json").read_text())
    assert documents == ingest["counts"]["kept"] == manifest["metrics"]["documents"]
    assert manifest["dtype"] == "uint16"
    assert manifest["metrics"]["unknown_tokens"] == 0
    assert 2.5 < manifest["metrics"]["characters_per_token"] < 6
    assert sum(manifest["histogram"]["documents"]) == documents
    for split, entry in manifest["splits"].items():
        assert entry["rows"] == ingest["splits"][split]["rows"]
        # The parts of each ingest shard cover its rows in order, without gaps.
        covered: dict[str, int] = {}
        for shard in entry["shards"]:
            source = shard["source"]
            assert source["start"] == covered.get(source["shard"], 0)
            covered[source["shard"]] = source["stop"]
        assert covered == {s["name"]: s["rows"] for s in ingest["splits"][split]["shards"]}
    assert len(manifest["splits"]["train"]["shards"]) > len(ingest["splits"]["train"]["shards"])

    # MLflow: the tokenizer as an artifact with its hash, vocab size and training time.
    client = MlflowClient(mlflow_uri)
    run = client.get_run(stages["tokenizer"]["mlflow_run_id"])
    assert run.data.tags["lmpipe.tokenizer_sha256"] == sha256_file(directory / "tokenizer.json")
    assert run.data.metrics["vocab_size"] == tok.get_vocab_size()
    assert run.data.metrics["padded_vocab_size"] % 64 == 0
    assert "training_s" in run.data.metrics
    names = {a.path for a in client.list_artifacts(run.info.run_id, "tokenizer")}
    assert "tokenizer/tokenizer.json" in names
    encode_run = client.get_run(stages["encode"]["mlflow_run_id"])
    assert encode_run.data.metrics["tokens"] == manifest["metrics"]["tokens"]
    png = [a.path for a in client.list_artifacts(encode_run.info.run_id, "encode")]
    assert png == ["encode/tokens_per_document.png"]

    # A changed vocabulary size rebuilds the tokenizer and the encoding, never the ingest.
    changed = encode_flow(
        config(
            recipe, "tokenizer.family=bpe", "tokenizer.lowercase=false", "tokenizer.vocab_size=3000"
        )
    )
    assert changed["ingest"]["reused"]
    assert changed["ingest"]["path"] == stages["ingest"]["path"]
    for stage in ("tokenizer", "encode"):
        assert not changed[stage]["reused"]
        assert changed[stage]["path"] != stages[stage]["path"]
    assert Path(stages["encode"]["path"], "manifest.json").exists()  # the old output stays


@pytest.mark.parametrize("family", ["wordpiece", "unigram"])
def test_encodings_decode_per_the_family_rule(recipe: Path, family: str) -> None:
    from pipelines.flows.encode_flow import encode_flow

    stages = encode_flow(config(recipe, f"tokenizer.family={family}", "tokenizer.lowercase=false"))
    tok = Tokenizer.from_file(str(Path(stages["tokenizer"]["path"]) / "tokenizer.json"))
    unk = tok.token_to_id("[UNK]" if family == "wordpiece" else "<unk>")
    assert tok.normalizer is not None
    assert tok.pre_tokenizer is not None
    documents = with_unknown = 0
    for text, _sentences, per_sentence in each_document(stages):
        documents += 1
        flat = [i for s in per_sentence for i in s]
        if unk in flat:
            with_unknown += 1
            continue
        normalized = tok.normalizer.normalize_str(text)
        if family == "wordpiece":
            words = tok.pre_tokenizer.pre_tokenize_str(normalized)
            assert tok.decode(flat) == " ".join(w for w, _ in words)
        else:
            assert tok.decode(flat) == normalized
    assert with_unknown <= documents // 100
    manifest = json.loads((Path(stages["encode"]["path"]) / "manifest.json").read_text())
    assert manifest["metrics"]["documents_with_unknown"] == with_unknown


def test_failed_encode_resumes_from_its_finished_shards_to_clean_bytes(
    recipe: Path, ray_session: str, tmp_path: Path
) -> None:
    from pipelines.flows.tokenizer_flow import tokenizer_flow
    from tasks.encode.stage import run_encode

    cfg = config(recipe, "tokenizer.family=wordpiece", "ray.num_workers=1")
    stages = tokenizer_flow(cfg)
    ingest, tok = Path(stages["ingest"]["path"]), Path(stages["tokenizer"]["path"])
    clean = run_encode(cfg.encode, cfg.ray, ingest, tok, tmp_path / "clean")
    shards = [s for entry in clean.manifest["splits"].values() for s in entry["shards"]]
    assert len(shards) > 3
    # Parts start largest first (stable among equals): block the one that starts last.
    last = sorted(shards, key=lambda s: -(s["source"]["stop"] - s["source"]["start"]))[-1]
    others = [s["name"] for s in shards if s is not last]
    out = tmp_path / "ws" / "encode" / clean.path.name
    (out / last["name"]).mkdir(parents=True)  # this shard cannot be committed: the run fails
    with pytest.raises(Exception, match="Is a directory"):
        run_encode(cfg.encode, cfg.ray, ingest, tok, tmp_path / "ws")
    assert not (out / "manifest.json").exists()
    finished = {n: (out / n).stat().st_ino for n in others}
    assert len(list((out / "_staging").glob("*.json"))) == len(finished)
    (out / last["name"]).rmdir()

    resumed = run_encode(cfg.encode, cfg.ray, ingest, tok, tmp_path / "ws")
    assert not resumed.reused
    assert resumed.manifest["splits"] == clean.manifest["splits"]  # names, sizes, sha256
    assert {n: (out / n).stat().st_ino for n in others} == finished  # not encoded again
    assert not list(out.glob(".*"))
    assert not (out / "_staging").exists()
    assert run_encode(cfg.encode, cfg.ray, ingest, tok, tmp_path / "ws").reused
