"""Stages that read a tokenizer key on its bytes: another vocabulary under the same tokenizer
fingerprint (a retrain by a nondeterministic trainer, a file put in by hand) rebuilds encode and
everything after it; the same bytes keep every key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.common.io import sha256_file
from tasks.common.stage import content_hash
from tasks.encode.encode import EncodeConfig
from tasks.encode.stage import run_encode
from tasks.examples.config import ExamplesConfig
from tasks.examples.stage import run_examples
from tasks.tokenizer.stage import run_tokenizer
from tasks.tokenizer.tokenizer import TokenizerConfig
from training.pretrain.config import TrainConfig
from training.pretrain.driver import run_id_for

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOKENIZER = TokenizerConfig(vocab_size=1024, model_max_length=512)
EXAMPLES = ExamplesConfig.model_validate({"objective": "bert", "max_seq_length": 64})


def swap_two_pieces(tokenizer_dir: Path) -> None:
    """Give two ordinary pieces each other's ids, and record the file as a retrain would."""
    path = tokenizer_dir / "tokenizer.json"
    state = json.loads(path.read_text())
    vocab = state["model"]["vocab"]
    first, second = [t for t in vocab if t.isalpha() and len(t) > 3][:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    path.write_text(json.dumps(state, ensure_ascii=False))
    manifest_path = tokenizer_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for entry in manifest["files"]:
        if entry["name"] == "tokenizer.json":
            entry.update(bytes=path.stat().st_size, sha256=sha256_file(path))
    manifest_path.write_text(json.dumps(manifest))


def test_another_vocabulary_rebuilds_encode_examples_and_pretraining(
    demo_data: object, tmp_path: Path
) -> None:
    ingest = demo_data.ingest  # type: ignore[attr-defined]
    ray = demo_data.ray  # type: ignore[attr-defined]
    ws = tmp_path / "ws"
    tokenizer = run_tokenizer(TOKENIZER, ingest, ws).path
    encode = run_encode(EncodeConfig(), ray, ingest, tokenizer, ws)
    examples = run_examples(EXAMPLES, 0, ray, encode.path, tokenizer, ws)
    run_id = run_id_for(TrainConfig(), 0, examples.path, tokenizer)
    before = content_hash(tokenizer)

    # The same bytes: every key holds, every stage is reused.
    assert run_tokenizer(TOKENIZER, ingest, ws).reused
    assert run_encode(EncodeConfig(), ray, ingest, tokenizer, ws).reused
    assert run_examples(EXAMPLES, 0, ray, encode.path, tokenizer, ws).reused
    assert run_id_for(TrainConfig(), 0, examples.path, tokenizer) == run_id

    swap_two_pieces(tokenizer)
    assert content_hash(tokenizer) != before
    again = run_tokenizer(TOKENIZER, ingest, ws)
    assert again.reused
    assert again.path == tokenizer
    encode2 = run_encode(EncodeConfig(), ray, ingest, tokenizer, ws)
    assert not encode2.reused
    assert encode2.path != encode.path
    assert encode2.manifest["tokenizer"]["content"] == content_hash(tokenizer)
    examples2 = run_examples(EXAMPLES, 0, ray, encode2.path, tokenizer, ws)
    assert not examples2.reused
    assert examples2.path != examples.path
    assert run_id_for(TrainConfig(), 0, examples2.path, tokenizer) != run_id
    # Even over the old examples, another vocabulary is another pretraining run.
    assert run_id_for(TrainConfig(), 0, examples.path, tokenizer) != run_id
    shutil.rmtree(ws)
