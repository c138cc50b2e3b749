"""Fixtures shared by the tokenizer and encoding tests."""

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from tasks.tokenizer.tokenizer import PretrainedFiles, TokenizerConfig, load_tokenizer_files


@pytest.fixture(scope="session")
def gpt2(shared_data: Path) -> Tokenizer:
    """GPT-2's published `encoder.json` and `vocab.bpe`, loaded as lmpipe loads your own files."""
    folder = shared_data / "gpt2_bpe_reference"
    files = PretrainedFiles(
        vocab_json=str(folder / "encoder.json"), merges=str(folder / "vocab.bpe")
    )
    return load_tokenizer_files(files, TokenizerConfig(family="bpe", lowercase=False))
