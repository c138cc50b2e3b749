"""Example cores: sentence pairs on BERT's own sample text, full sentences, causal blocks."""

from pathlib import Path

import numpy as np
import pytest

from tasks.examples.config import ExamplesConfig
from tasks.examples.cutting import causal_blocks, full_sentences, raw_chunks
from tasks.examples.documents import EncodedDocs
from tasks.examples.examples import example_rng
from tasks.examples.pairs import document_pairs
from tasks.tokenizer.tokenizer import PretrainedFiles, TokenizerConfig, load_tokenizer_files


def docs_from(sentences_per_doc: list[list[list[int]]]) -> EncodedDocs:
    ids = [t for doc in sentences_per_doc for s in doc for t in s]
    sent_lengths = [len(s) for doc in sentences_per_doc for s in doc]
    doc_counts = [len(doc) for doc in sentences_per_doc]
    return EncodedDocs(
        ids=np.asarray(ids, dtype=np.uint16),
        sent_offsets=np.concatenate([[0], np.cumsum(sent_lengths)]).astype(np.int64),
        doc_offsets=np.concatenate([[0], np.cumsum(doc_counts)]).astype(np.int64),
    )


@pytest.fixture(scope="module")
def bert_sample(shared_data: Path) -> EncodedDocs:
    """BERT's sample input: one sentence per line, a blank line between documents."""
    tok = load_tokenizer_files(
        PretrainedFiles(
            vocab_txt=str(shared_data / "bert_wordpiece_reference" / "bert-base-uncased-vocab.txt")
        ),
        TokenizerConfig(family="wordpiece"),
    )
    text = (shared_data / "bert_sample_text" / "sample_text.txt").read_text(encoding="utf-8")
    docs = [[line for line in block.split("\n") if line.strip()] for block in text.split("\n\n")]
    docs = [d for d in docs if d]
    return docs_from([[tok.encode(s, add_special_tokens=False).ids for s in doc] for doc in docs])


def find(haystack: np.ndarray, needle: np.ndarray) -> int:
    """Start of `needle` inside `haystack`, or -1."""
    for at in range(len(haystack) - len(needle) + 1):
        if np.array_equal(haystack[at : at + len(needle)], needle):
            return at
    return -1


@pytest.mark.parametrize("objective", ["bert", "sop"])
def test_pairs_respect_sentence_and_document_boundaries(
    bert_sample: EncodedDocs, objective: str
) -> None:
    cfg = ExamplesConfig(objective=objective, max_seq_length=64)  # type: ignore[arg-type]
    docs = bert_sample

    def random_doc(rng: np.random.Generator, current: int) -> tuple[int, list[np.ndarray]]:
        other = current
        while other == current:
            other = int(rng.integers(0, docs.documents))
        return other, docs.sentences(other)

    seen = {"IsNext": 0, "NotNext": 0}
    for copy in range(20):
        for d in range(docs.documents):
            starts = set(np.cumsum([0, *[len(s) for s in docs.sentences(d)]]).tolist())
            doc_ids = docs.document(d)
            for pair in document_pairs(
                docs.sentences(d), d, cfg, example_rng(7, 0, copy, d), random_doc
            ):
                assert 2 <= len(pair.a) + len(pair.b) <= cfg.max_seq_length - 3
                first, second = (
                    (pair.b, pair.a)
                    if objective == "sop" and pair.label
                    else (
                        pair.a,
                        pair.b,
                    )
                )
                at = find(doc_ids, first)
                assert at >= 0, "segment A is a contiguous span of its own document"
                if objective == "bert" and pair.label:  # NotNext: B from another document
                    assert pair.b_doc != d
                    assert find(docs.document(pair.b_doc), pair.b) >= 0
                    seen["NotNext"] += 1
                    continue
                assert pair.b_doc == d
                b_at = find(doc_ids[at + len(first) :], second)
                assert b_at >= 0, "B follows A inside the same document"
                seen["IsNext"] += 1
                if not pair.single and len(pair.a) + len(pair.b) < cfg.max_seq_length - 3:
                    # Untruncated pairs of whole sentences start and end on sentence boundaries.
                    assert at in starts
                    assert at + len(first) + b_at in starts
                    assert at + len(first) + b_at + len(second) in starts
    assert seen["IsNext"] > 50
    if objective == "bert":
        assert seen["NotNext"] > 50


def test_full_sentences_pack_in_order_across_documents_with_a_separator() -> None:
    docs = docs_from([[[1, 2, 3], [4, 5]], [[6, 7, 8, 9]], [[10] * 12]])
    packed = full_sentences(docs, max_tokens=8, sep=99)
    assert all(len(p) <= 8 for p in packed)
    flat = np.concatenate(packed).tolist()
    assert flat == [1, 2, 3, 4, 5, 99, 6, 7, 8, 9, 99, *([10] * 12)]


def test_causal_blocks_record_boundaries_after_end_of_text() -> None:
    rng = np.random.default_rng(0)
    docs = docs_from([[rng.integers(1, 50, rng.integers(1, 30)).tolist()] for _ in range(40)])
    blocks, starts, dropped = causal_blocks(docs, block_size=16, eot=0)
    stream = np.concatenate([np.append(docs.document(d), 0) for d in range(docs.documents)])
    assert dropped == len(stream) % 16
    assert np.array_equal(blocks.reshape(-1), stream[: blocks.size])
    boundaries = 0
    for block, positions in zip(blocks, starts.to_pylist(), strict=True):
        assert all(block[p - 1] == 0 for p in positions)  # a document starts after eot
        boundaries += len(positions)
    expected = int(np.sum(np.flatnonzero(stream[: blocks.size] == 0) % 16 != 15))
    assert boundaries == expected


def test_raw_chunks_concatenate_documents_without_separators() -> None:
    docs = docs_from([[[1, 2, 3]], [[4, 5], [6]], [[7, 8, 9, 10]]])
    chunks, dropped = raw_chunks(docs, 4)
    assert chunks.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert dropped == 2
