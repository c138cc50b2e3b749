"""The character-level family: a token per code point, `<|endoftext|>=0 <unk>=1` first.

Real tokenizers throughout: the vocabulary and its limits, exact round trips, the unknown
token, the transformers wrapper, Tiny Shakespeare's 65 characters, and the tokenizer → encode →
causal examples cores end to end.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tasks.common import schema
from tasks.common.schema import ObjectiveMismatchError
from tasks.encode.encode import encode_documents
from tasks.examples.cutting import causal_blocks
from tasks.examples.documents import encoded_docs
from tasks.examples.objectives.masking import word_start_table
from tasks.examples.specials import objective_specials
from tasks.tokenizer.bytelevel import SegmentEncoder
from tasks.tokenizer.stage import vocabulary_shortfall
from tasks.tokenizer.tokenizer import (
    PretrainedFiles,
    TokenizerConfig,
    load_tokenizer_files,
    padded_vocab_size,
    roles,
    special_tokens,
    to_transformers,
    train_tokenizer,
    unknown_id,
)
from tests.tasks.encode.encode_inputs import documents

SPECIALS = ["<|endoftext|>", "<unk>"]
TEXTS = [
    "First Citizen:\nBefore we proceed any further, hear me speak.\n",
    "All:\nSpeak, speak.\r\n\n\tIndented—with a dash, café, naïve, Ωmega 🙂 and  two spaces. ",
    "  Leading and trailing whitespace\t\n",
]
CHAR = TokenizerConfig(family="char", vocab_size=256, min_frequency=1)


def by_frequency(texts: list[str]) -> list[str]:
    """The characters of `texts`, most frequent first, ties in code-point order."""
    counts = Counter("".join(texts))
    return sorted(counts, key=lambda c: (-counts[c], c))


def vocabulary(tok: Tokenizer) -> list[str]:
    """The tokens of `tok` in id order."""
    return [tok.id_to_token(i) or "" for i in range(tok.get_vocab_size(with_added_tokens=True))]


@pytest.fixture(scope="module")
def char_tok() -> Tokenizer:
    return train_tokenizer(TEXTS, CHAR)


def test_the_vocabulary_is_the_specials_then_the_characters_by_frequency(
    char_tok: Tokenizer,
) -> None:
    assert vocabulary(char_tok) == SPECIALS + by_frequency(TEXTS)
    assert special_tokens(CHAR) == SPECIALS
    assert [t.content for t in char_tok.get_added_tokens_decoder().values()] == SPECIALS


def test_every_character_is_one_token_whitespace_and_non_ascii_included(
    char_tok: Tokenizer,
) -> None:
    for text in TEXTS:
        encoding = char_tok.encode(text)
        assert encoding.tokens == list(text)  # "\n", "\r", "\t", "é", "—", "🙂": one each
        assert unknown_id(char_tok) not in encoding.ids


def test_decode_of_encode_is_the_text_exactly(char_tok: Tokenizer) -> None:
    for text in [*TEXTS, "".join(TEXTS), " ", "\n\n\n", "a  e\t\tc"]:
        assert char_tok.decode(char_tok.encode(text).ids) == text


def test_nothing_is_added_around_a_sequence(char_tok: Tokenizer) -> None:
    assert char_tok.post_processor is None
    assert char_tok.encode("ab").ids == char_tok.encode("ab", add_special_tokens=False).ids
    assert len(char_tok.encode("ab", "cd").ids) == 4


def test_an_unseen_character_encodes_to_unk(char_tok: Tokenizer) -> None:
    assert unknown_id(char_tok) == char_tok.token_to_id("<unk>") == 1
    ids = char_tok.encode("aZ€e").ids
    assert ids == [char_tok.token_to_id("a"), 1, 1, char_tok.token_to_id("e")]


def test_min_frequency_drops_characters_seen_fewer_times() -> None:
    texts = ["aaaaabbbbcccdde"]  # a:5 b:4 c:3 d:2 e:1
    for min_frequency, kept in [(1, "abcde"), (2, "abcd"), (4, "ab"), (6, "")]:
        cfg = TokenizerConfig(family="char", vocab_size=256, min_frequency=min_frequency)
        assert vocabulary(train_tokenizer(texts, cfg)) == SPECIALS + list(kept)


def test_vocab_size_keeps_the_most_frequent_characters_ties_in_code_point_order() -> None:
    # 150 characters: the first 60 seen 3 times, the rest once, listed in reverse order.
    alphabet = [chr(c) for c in range(0x100, 0x100 + 150)]
    texts = ["".join(alphabet[:60]) * 3, "".join(reversed(alphabet[60:]))]
    cfg = TokenizerConfig(family="char", vocab_size=100, min_frequency=1)
    tok = train_tokenizer(texts, cfg)
    assert tok.get_vocab_size(with_added_tokens=True) == 100
    assert vocabulary(tok) == SPECIALS + alphabet[:98]  # the tie of the rare ones cut in order
    assert tok.encode(alphabet[-1]).ids == [1]


def test_lowercase_folds_case_only_when_asked() -> None:
    assert TokenizerConfig(family="char").lowercase is False
    cased = train_tokenizer(["Aa"], CHAR)
    assert vocabulary(cased)[2:] == ["A", "a"]
    lowered_cfg = TokenizerConfig(family="char", vocab_size=256, min_frequency=1, lowercase=True)
    lowered = train_tokenizer(["Aa"], lowered_cfg)
    assert vocabulary(lowered)[2:] == ["a"]
    assert lowered.encode("A").ids == lowered.encode("a").ids


def test_to_transformers_reloads_and_encodes_and_decodes_the_same(
    char_tok: Tokenizer, tmp_path: Path
) -> None:
    assert roles(CHAR) == {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<unk>"}
    to_transformers(char_tok, CHAR).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 0, 1)
    assert loaded.pad_token is None  # as GPT-2: causal blocks are full
    assert loaded.model_input_names == ["input_ids", "attention_mask"]
    assert len(loaded) == char_tok.get_vocab_size(with_added_tokens=True)
    for text in TEXTS:
        ids = loaded(text)["input_ids"]
        assert ids == char_tok.encode(text).ids
        assert loaded.decode(ids) == text
    assert loaded("a€")["input_ids"] == [char_tok.token_to_id("a"), 1]
    size = char_tok.get_vocab_size(with_added_tokens=True)
    assert padded_vocab_size(char_tok, CHAR) == -(-size // 64) * 64


def test_a_char_tokenizer_json_loads_as_your_own_and_other_files_are_refused(
    char_tok: Tokenizer, tmp_path: Path
) -> None:
    path = tmp_path / "tokenizer.json"
    char_tok.save(str(path))
    cfg = TokenizerConfig(family="char", pretrained=PretrainedFiles(tokenizer_json=str(path)))
    assert cfg.pretrained is not None
    assert load_tokenizer_files(cfg.pretrained, cfg).encode(TEXTS[0]).ids == (
        char_tok.encode(TEXTS[0]).ids
    )
    with pytest.raises(ValueError, match=r"tokenizer\.pretrained\.tokenizer_json"):
        TokenizerConfig(family="char", pretrained=PretrainedFiles(vocab_txt=str(path)))


def test_vocab_size_is_a_cap_so_a_short_char_vocabulary_is_no_shortfall() -> None:
    assert vocabulary_shortfall(CHAR, 67) is None


@pytest.mark.slow
def test_tiny_shakespeare_gives_its_65_characters_and_the_2_specials(shared_data: Path) -> None:
    path = shared_data / "tiny_shakespeare" / "input.txt"
    if not path.is_file():
        pytest.skip(f"Tiny Shakespeare not found at {path}")
    text = path.read_text(encoding="utf-8")
    speeches = text.split("\n\n")  # the documents of configs/shakespeare_char.yaml
    tok = train_tokenizer(speeches, CHAR)
    assert len(set(text)) == 65
    assert set(vocabulary(tok)[2:]) == set(text)
    assert vocabulary(tok) == SPECIALS + by_frequency(speeches)
    assert tok.get_vocab_size(with_added_tokens=True) == 67
    assert tok.decode(tok.encode(text).ids) == text
    # min_frequency 2 (the default) drops "$", which the play uses once.
    default = train_tokenizer(speeches, TokenizerConfig(family="char", vocab_size=256))
    assert set(vocabulary(default)[2:]) == set(text) - {"$"}


def test_tokenizer_encode_and_causal_cores_round_trip_every_document(tmp_path: Path) -> None:
    # The tokenizer stage's save, reloaded as the encode stage's workers load it.
    to_transformers(train_tokenizer(TEXTS, CHAR), CHAR).save_pretrained(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    encoder = SegmentEncoder(tok)
    assert not encoder.fast  # the byte-level BPE fast path is not for a WordLevel model
    encoded = encode_documents(documents(TEXTS), encoder, pa.uint16())
    for row, text in enumerate(TEXTS):
        flat = [i for sentence in encoded.column(schema.TOKEN_IDS)[row].as_py() for i in sentence]
        assert flat == tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(flat) == text
    # examples.objective causal: <|endoftext|> (the manifest's id 0) separates the documents.
    manifest_ids = {t: i for i, t in enumerate(SPECIALS)}
    assert manifest_ids == {t: tok.token_to_id(t) for t in SPECIALS}
    specials = objective_specials("causal", CHAR, manifest_ids, tok.get_vocab_size())
    assert specials.eos == specials.pad == 0
    assert specials.eos is not None
    blocks, _, dropped = causal_blocks(encoded_docs(encoded), 8, specials.eos)
    stream = [i for text in TEXTS for i in [*tok.encode(text).ids, 0]]
    assert blocks.reshape(-1).tolist() == stream[: blocks.size]
    assert dropped == len(stream) - blocks.size < 8
    decoded = tok.decode(stream, skip_special_tokens=False)
    assert decoded.split("<|endoftext|>") == [*TEXTS, ""]


def test_objectives_without_a_char_token_and_whole_word_masking_are_refused() -> None:
    ids = {"<|endoftext|>": 0, "<unk>": 1}
    with pytest.raises(ObjectiveMismatchError, match=r"tokenizer\.family=char tokenizer does"):
        objective_specials("bert", CHAR, ids, 67)
    with pytest.raises(ValueError, match=r"examples\.mask\.whole_word=false"):
        word_start_table(["<|endoftext|>", "<unk>", "a"], "char", {0, 1})
