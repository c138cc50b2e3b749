"""The encode core: sentence segments, ids per sentence and document, id types, statistics."""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.encode.encode import (
    HISTOGRAM_EDGES,
    EncodeConfig,
    SentenceMismatchError,
    encode_documents,
    encode_stats,
    id_type,
    merge_stats,
    sentence_segments,
)
from tasks.tokenizer.tokenizer import TokenizerConfig, train_tokenizer, unknown_id
from tests.tasks.encode.encode_inputs import documents

TEXTS = [
    "The cat sat. Then it left!\nA new paragraph starts here.",
    "One sentence only",
    'Dr. Smith arrived.  "Hello," she said. It was 3 p.m. in the U.S. today.',
    "Ünïcödé wörds — and “quotes”. Ça va? Oui.",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_tokenizer(
        iter(TEXTS * 20), TokenizerConfig(family="bpe", vocab_size=400, lowercase=False)
    )


def test_segments_concatenate_to_the_text_and_keep_each_sentence() -> None:
    table = documents(TEXTS)
    sentences = table.column(schema.SENTENCES).to_pylist()
    segments, counts = sentence_segments(table.column(schema.DOC_ID).to_pylist(), TEXTS, sentences)
    assert counts.tolist() == [len(s) for s in sentences]
    start = 0
    for text, sents, n in zip(TEXTS, sentences, counts, strict=True):
        mine = segments[start : start + n]
        assert "".join(mine) == text
        assert [m.strip() for m in mine] == sents
        start += n


def test_trailing_text_and_sentence_less_documents_stay_whole() -> None:
    segments, counts = sentence_segments(
        ["a", "b"], ["Hi there. tail", "no split"], [["Hi there."], []]
    )
    assert segments == ["Hi there. tail", "no split"]
    assert counts.tolist() == [1, 1]


def test_rewritten_sentences_are_refused_with_the_document_named() -> None:
    with pytest.raises(SentenceMismatchError, match="document doc-7: sentence 1"):
        sentence_segments(["doc-7"], ["First. Second."], [["First.", "SECOND."]])


def test_ids_decode_to_each_document_and_each_sentence(bpe: Tokenizer) -> None:
    table = documents(TEXTS)
    encoded = encode_documents(table, bpe, pa.uint16())
    assert encoded.schema == schema.tokens_schema(pa.uint16())
    for row, text in enumerate(TEXTS):
        per_sentence = encoded.column(schema.TOKEN_IDS)[row].as_py()
        flat = [i for s in per_sentence for i in s]
        assert bpe.decode(flat) == text  # byte-level BPE: exact
        assert encoded.column(schema.NUM_TOKENS)[row].as_py() == len(flat)
        decoded = [bpe.decode(s).strip() for s in per_sentence]
        assert decoded == table.column(schema.SENTENCES)[row].as_py()
        # Sentence by sentence is how the whole text encodes, boundaries aside.
        assert len(flat) == pytest.approx(len(bpe.encode(text).ids), abs=len(per_sentence))


def test_empty_batch_encodes_to_an_empty_table(bpe: Tokenizer) -> None:
    encoded = encode_documents(documents([]), bpe, pa.uint32())
    assert encoded.num_rows == 0
    assert encoded.schema == schema.tokens_schema(pa.uint32())


def test_id_type_follows_the_vocabulary() -> None:
    auto = EncodeConfig()
    assert id_type(65_536, auto) == pa.uint16()
    assert id_type(65_537, auto) == pa.uint32()
    assert id_type(1000, EncodeConfig(dtype="uint32")) == pa.uint32()
    with pytest.raises(ValueError, match="uint16 cannot hold a vocabulary of 70,000"):
        id_type(70_000, EncodeConfig(dtype="uint16"))


def test_stats_count_unknowns_per_document_and_merge() -> None:
    wordpiece = train_tokenizer(
        iter(["plain ascii words only here"] * 50),
        TokenizerConfig(family="wordpiece", vocab_size=100, min_frequency=1),
    )
    unk = unknown_id(wordpiece)
    assert unk == 1
    table = documents(["plain words. The 漢字 here.", "only ascii", "ascii ΩΩ. And 漢"])
    encoded = encode_documents(table, wordpiece, pa.uint16())
    stats = encode_stats(table, encoded, unk)
    flat = pc.list_flatten(pc.list_flatten(encoded.column(schema.TOKEN_IDS))).to_numpy()
    assert stats["unknown_tokens"] == int(np.count_nonzero(flat == unk)) > 0
    assert stats["documents_with_unknown"] == 2
    assert stats["documents"] == 3
    assert stats["tokens"] == len(flat)
    assert stats["sentences"] == 5 == len(pc.list_flatten(table.column(schema.SENTENCES)))
    assert stats["characters"] == sum(len(t) for t in table.column(schema.TEXT).to_pylist())
    assert sum(stats["histogram"]) == 3
    assert len(stats["histogram"]) == len(HISTOGRAM_EDGES)
    twice = merge_stats(stats, stats)
    assert twice["tokens"] == 2 * stats["tokens"]
    assert twice["max_tokens_per_document"] == stats["max_tokens_per_document"]
    assert sum(twice["histogram"]) == 6


def test_byte_level_bpe_has_no_unknown_id(bpe: Tokenizer) -> None:
    assert unknown_id(bpe) is None
