"""The byte-level BPE fast path gives exactly the ids of `Tokenizer.encode_batch_fast`."""

import csv
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers

from tasks.tokenizer.bytelevel import SegmentEncoder, fast_path_reason
from tasks.tokenizer.tokenizer import (
    TokenizerConfig,
    train_tokenizer,
)


def reference(tok: Tokenizer, segments: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encodings = tok.encode_batch_fast(segments, add_special_tokens=False)
    lengths = np.array([len(e) for e in encodings], dtype=np.int64)
    flat = np.array([i for e in encodings for i in e.ids], dtype=np.uint32)
    return flat, lengths


def assert_same_ids(encoder: SegmentEncoder, segments: list[str], batch: int = 997) -> None:
    """Encode in batches (so the word cache carries over) and compare with `tokenizers`."""
    ids, lengths = [], []
    for at in range(0, len(segments), batch):
        got_ids, got_lengths = encoder.encode(segments[at : at + batch])
        assert got_ids.dtype == np.uint32
        assert got_lengths.dtype == np.int64
        ids.append(got_ids)
        lengths.append(got_lengths)
    want_ids, want_lengths = reference(encoder.tok, segments)
    np.testing.assert_array_equal(np.concatenate(lengths), want_lengths)
    np.testing.assert_array_equal(np.concatenate(ids), want_ids)


def real_segments(shared_data: Path) -> list[str]:
    """Paragraphs and lines of every real English text in ../shared/data, whitespace kept."""
    texts = [
        (shared_data / "tiny_shakespeare" / "input.txt").read_text(encoding="utf-8"),
        (shared_data / "gpt2_bpe_reference" / "the-verdict.txt").read_text(encoding="utf-8"),
        (shared_data / "gpt2_bpe_reference" / "llama_cpp_vocab_test.inp").read_text("utf-8"),
    ]
    texts += [
        p.read_text(encoding="utf-8") for p in (shared_data / "gutenberg_books").glob("*.txt")
    ]
    with (shared_data / "imdb_sample" / "texts.csv").open(newline="", encoding="utf-8") as handle:
        texts += [" ".join(row) for row in csv.reader(handle)]
    segments: list[str] = []
    for text in texts:
        # paragraphs with their trailing blank lines, so whitespace runs end segments too
        parts = text.split("\n\n")
        segments += [p + "\n\n" for p in parts[:-1]] + parts[-1:]
    return segments


#: Every ASCII character, weighted towards the ones the split pattern treats specially.
ALPHABET = [chr(c) for c in range(128)]
SPECIAL = [*"  \t\n\r\v\f'sStTdDmMlLrReEvV09.,!?-\x1c\x1f\x7f\x00", "'s", "'ll", "'RE"]
NON_ASCII = ["é", "\u2019", "\u00a0", "\u3000", "\u2028", "😀", "\x85", "ß", "Ⅻ", "٣"]


def random_segments(seed: int, count: int, added: list[str]) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.randint(0, 40)):
            roll = rng.random()
            if roll < 0.45:
                pieces.append(rng.choice(ALPHABET))
            elif roll < 0.9:
                pieces.append(rng.choice(SPECIAL))
            elif roll < 0.97:
                pieces.append(rng.choice(["word", " word", "  ", " 12", "Hello", "\n\n"]))
            elif roll < 0.99:
                pieces.append(rng.choice(NON_ASCII))
            else:
                pieces.append(rng.choice(added))
        out.append("".join(pieces))
    return out


@pytest.fixture(scope="module")
def trained(shared_data: Path) -> dict[str, Tokenizer]:
    text = (shared_data / "tiny_shakespeare" / "input.txt").read_text(encoding="utf-8")
    docs = text.split("\n\n")[:3000]
    out = {}
    for name, cfg in {
        "gpt": TokenizerConfig(family="bpe", vocab_size=1000, lowercase=False),
        "roberta-lower": TokenizerConfig(
            family="bpe", vocab_size=1000, lowercase=True, bpe_style="roberta"
        ),
    }.items():
        out[name] = train_tokenizer(iter(docs), cfg)
    return out


def test_lmpipe_byte_level_tokenizers_take_the_fast_path(
    gpt2: Tokenizer, trained: dict[str, Tokenizer]
) -> None:
    for tok in (gpt2, *trained.values()):
        assert fast_path_reason(tok) is None


def test_real_corpora_encode_identically(
    shared_data: Path, gpt2: Tokenizer, trained: dict[str, Tokenizer]
) -> None:
    segments = real_segments(shared_data)
    for tok in (gpt2, *trained.values()):
        encoder = SegmentEncoder(tok)
        assert_same_ids(encoder, segments)
        # both paths ran: the corpora hold ASCII paragraphs and paragraphs with curly quotes
        assert encoder.fast_segments > 0.5 * len(segments)
        assert encoder.slow_segments > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_ascii_strings_encode_identically(
    seed: int, gpt2: Tokenizer, trained: dict[str, Tokenizer]
) -> None:
    for tok in (gpt2, *trained.values()):
        added = [t.content for t in tok.get_added_tokens_decoder().values()]
        segments = random_segments(seed, 3000, added)
        encoder = SegmentEncoder(tok, cache_words=2000)  # small: the cache empties on the way
        assert_same_ids(encoder, segments, batch=251)
        assert encoder.fast_segments > 0
        assert encoder.slow_segments > 0


def test_added_tokens_nul_and_empty_segments_keep_their_ids(gpt2: Tokenizer) -> None:
    segments = [
        "",
        "Hello<|endoftext|>world",
        "hello <|ENDOFTEXT|> world",
        "a\x00b",
        "   ",
        "end with spaces   ",
        "\n\n",
        "it's 12 o'clock",
        "",
    ]
    encoder = SegmentEncoder(gpt2)
    assert_same_ids(encoder, segments)
    assert encoder.slow_segments == 3  # the special token (either case) and the NUL
    flat, lengths = encoder.encode(["x", "<|endoftext|>"])
    assert lengths.tolist() == [1, 1]
    assert flat[1] == gpt2.token_to_id("<|endoftext|>")


def test_other_tokenizers_fall_back_to_tokenizers_with_a_reason(gpt2: Tokenizer) -> None:
    docs = ["The cat sat on the mat.", "Dogs bark, cats purr!"] * 20
    wordpiece = train_tokenizer(iter(docs), TokenizerConfig(family="wordpiece", vocab_size=200))
    unigram = train_tokenizer(iter(docs), TokenizerConfig(family="unigram", vocab_size=200))
    prefixed = Tokenizer.from_str(gpt2.to_str())
    prefixed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    reasons = {
        "wordpiece": fast_path_reason(wordpiece),
        "unigram": fast_path_reason(unigram),
        "prefixed": fast_path_reason(prefixed),
    }
    assert "not a BPE" in (reasons["wordpiece"] or "")
    assert "not a BPE" in (reasons["unigram"] or "")
    assert "add_prefix_space=False" in (reasons["prefixed"] or "")
    for tok in (wordpiece, unigram, prefixed):
        encoder = SegmentEncoder(tok)
        assert not encoder.fast
        assert_same_ids(encoder, docs)
        assert encoder.fast_segments == 0
    off = SegmentEncoder(gpt2, fast=False)
    assert off.reason == "the fast path is switched off"
    assert_same_ids(off, docs)
    assert off.fast_segments == 0
