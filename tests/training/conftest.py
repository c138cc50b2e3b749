"""Pretraining fixtures: the demo corpus cut into each objective's examples, once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.encode import EncodeConfig
from tasks.encode_run import run_encode
from tasks.examples import ExamplesConfig
from tasks.examples_run import run_examples
from tasks.ingest import IngestConfig
from tasks.ingest_run import run_ingest
from tasks.ray_runtime import RayConfig
from tasks.synthetic import SyntheticConfig, write_corpus
from tasks.tokenizer import TokenizerConfig
from tasks.tokenizer_run import run_tokenizer

_FAMILY = {"bert": "wordpiece", "causal": "bpe", "span_corruption": "unigram", "roberta": "bpe"}
_BUILT: dict[tuple[str, str], dict[str, Path]] = {}


class DemoData:
    """Builds (once per session) the demo corpus's examples for an objective."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ray = RayConfig(num_workers=2, num_cpus=4)
        corpus = root / "corpus"
        write_corpus(corpus, SyntheticConfig(seed=0, documents=1500))
        self.ingest = run_ingest(
            IngestConfig.model_validate(
                {
                    "sources": [{"path": str(corpus / "corpus"), "format": "jsonl"}],
                    "split": {"validation": 0.05, "test": 0.05},
                }
            ),
            self.ray,
            root / "ws",
        ).path

    def examples(self, objective: str, **overrides: Any) -> dict[str, Path]:
        key = (objective, repr(sorted(overrides.items())))
        if key not in _BUILT:
            family = _FAMILY[objective]
            tok_cfg = TokenizerConfig(family=family, vocab_size=1024, model_max_length=512)
            ws = self.root / "ws"
            tokenizer = run_tokenizer(tok_cfg, self.ingest, ws).path
            encode = run_encode(EncodeConfig(), self.ray, self.ingest, tokenizer, ws).path
            cfg = ExamplesConfig.model_validate(
                {"objective": objective, "max_seq_length": 64, "block_size": 64, **overrides}
            )
            out = run_examples(cfg, 0, self.ray, encode, tokenizer, ws).path
            _BUILT[key] = {"examples": out, "tokenizer": tokenizer}
        return _BUILT[key]


@pytest.fixture(scope="session")
def demo_data(ray_session: str, tmp_path_factory: pytest.TempPathFactory) -> DemoData:
    """The synthetic demo corpus, ingested; `.examples(objective)` cuts examples on demand."""
    return DemoData(tmp_path_factory.mktemp("pretrain-data"))
