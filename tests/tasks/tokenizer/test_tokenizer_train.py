"""Trained tokenizers of each family: round trips on a real corpus, specials, templates."""

import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    padded_vocab_size,
    to_transformers,
    train_tokenizer,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def documents(shared_data: Path) -> list[str]:
    """Blank-line-separated blocks of the Gutenberg books, wrapped lines joined."""
    docs = []
    for book in sorted((shared_data / "gutenberg_books").glob("*.txt")):
        text = book.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
        docs += [" ".join(b.split()) for b in re.split(r"\n\s*\n", text) if b.strip()]
    return docs


def train(documents: list[str], **cfg: object) -> tuple[Tokenizer, TokenizerConfig]:
    config = TokenizerConfig(vocab_size=4000, **cfg)  # type: ignore[arg-type]
    return train_tokenizer(iter(documents), config), config


def unknown_free_share(tok: Tokenizer, docs: list[str], unk: str) -> float:
    unk_id = tok.token_to_id(unk)
    encodings = tok.encode_batch(docs, add_special_tokens=False)
    return sum(unk_id not in e.ids for e in encodings) / len(docs)


def test_byte_level_bpe_round_trips_every_document(documents: list[str]) -> None:
    tok, _ = train(documents, family="bpe", lowercase=False)
    encodings = tok.encode_batch(documents, add_special_tokens=False)
    decoded = tok.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
    assert decoded == documents
    assert tok.token_to_id("<|endoftext|>") == 0
    assert tok.get_vocab_size() <= 4000


def test_wordpiece_decodes_to_its_own_pretokenization(documents: list[str]) -> None:
    tok, cfg = train(documents, family="wordpiece")
    assert [tok.token_to_id(t) for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]] == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert unknown_free_share(tok, documents, "[UNK]") >= 0.99
    unk = tok.token_to_id("[UNK]")
    for doc, encoding in zip(
        documents, tok.encode_batch(documents, add_special_tokens=False), strict=True
    ):
        if unk in encoding.ids:
            continue
        words = tok.pre_tokenizer.pre_tokenize_str(tok.normalizer.normalize_str(doc))
        assert tok.decode(encoding.ids) == " ".join(w for w, _ in words)
    pair = tok.encode("first part", "second part")
    assert pair.tokens[0] == "[CLS]" and pair.tokens.count("[SEP]") == 2  # noqa: PT018
    assert pair.type_ids == [0] * (pair.tokens.index("[SEP]") + 1) + [1] * (
        len(pair.tokens) - pair.tokens.index("[SEP]") - 1
    )
    assert padded_vocab_size(tok, cfg) % 64 == 0


@pytest.mark.parametrize("trainer", ["sentencepiece", "tokenizers"])
def test_unigram_round_trips_after_normalisation_with_t5_sentinels(
    documents: list[str], trainer: str
) -> None:
    tok, _ = train(documents, family="unigram", lowercase=False, unigram_trainer=trainer)
    size = tok.get_vocab_size()
    assert [tok.token_to_id(t) for t in ["<pad>", "</s>", "<unk>"]] == [0, 1, 2]
    assert tok.token_to_id("<extra_id_0>") == size - 1
    assert tok.token_to_id("<extra_id_99>") == size - 100
    assert unknown_free_share(tok, documents, "<unk>") >= 0.99
    unk = tok.token_to_id("<unk>")
    for doc, encoding in zip(
        documents, tok.encode_batch(documents, add_special_tokens=False), strict=True
    ):
        if unk not in encoding.ids:
            assert tok.decode(encoding.ids) == tok.normalizer.normalize_str(doc)
    assert tok.encode("hello").tokens[-1] == "</s>"


@pytest.mark.parametrize(
    ("family", "style", "pair_types"),
    [("wordpiece", "gpt2", True), ("bpe", "roberta", False), ("unigram", "gpt2", False)],
)
def test_auto_tokenizer_loads_each_family_offline(
    documents: list[str], tmp_path: Path, family: str, style: str, pair_types: bool
) -> None:
    tok, cfg = train(documents[:3000], family=family, bpe_style=style, model_max_length=128)
    to_transformers(tok, cfg).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.model_max_length == 128
    encoded = loaded("The first sentence.", "And the second.")
    assert ("token_type_ids" in encoded) == pair_types
    if pair_types:
        assert set(encoded["token_type_ids"]) == {0, 1}
    if style == "roberta" and family == "bpe":
        ids = encoded["input_ids"]
        assert ids[0] == loaded.bos_token_id == 0
        assert ids.count(loaded.eos_token_id) == 3  # <s> A </s></s> B </s>
        assert loaded.mask_token_id == 4
    if family == "unigram":
        assert loaded.convert_tokens_to_ids("<extra_id_0>") == len(loaded) - 1
        assert encoded["input_ids"][-1] == loaded.eos_token_id == 1


def test_a_vocabulary_short_of_its_size_is_named_with_the_size_reached() -> None:
    from tasks.tokenizer.stage import vocabulary_shortfall

    text = ["the cat sat on the mat", "a dog ran to the cat"] * 50
    cfg = TokenizerConfig(family="wordpiece", vocab_size=8000)
    reached = train_tokenizer(iter(text), cfg).get_vocab_size(with_added_tokens=True)
    assert reached < 8000
    assert vocabulary_shortfall(cfg, reached) == (
        f"tokenizer.vocab_size 8,000 asked, {reached:,} reached: the training text has no more "
        "pieces seen 2 times or more (more text, or a lower tokenizer.min_frequency, gives more)"
    )
    assert vocabulary_shortfall(cfg.model_copy(update={"vocab_size": reached}), reached) is None
