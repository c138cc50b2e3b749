"""Deterministic WordPiece training over `tokenizers`' trainer.

`tokenizers`' WordPiece trainer (a BPE trainer with the `##` continuation prefix) numbers the
`##c` continuation pieces in the order it meets them in its word-count hash map, which differs
from process to process; merges of equal count are then ordered by those ids, so ties pick
other merges and two trainings of one corpus give different vocabularies
(huggingface/tokenizers#1794). Listed as special tokens after the family's specials, in
code-point order, the continuation pieces get the same ids in every process and the ties break
the same way; once trained they become plain vocabulary entries again (`as_vocabulary`).

Which pieces: one vectorised scan of the texts (`continuation_pieces`: every character that
follows another word character once normalised, words split as BERT's pre-tokeniser splits
them), then a check against what the trainer made: a piece the scan missed (a character the two
Unicode tables class differently) is added and the training repeated once, so the list is
always exactly the trainer's own.

Not here: the family's pipeline and specials (`tasks/tokenizer/tokenizer.py`).
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable, Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer, normalizers
from tokenizers import trainers as tk_trainers

PREFIX = "##"
_UNICODE = 0x110000
# Unicode's White_Space property (Rust's `char::is_whitespace`, which the pre-tokeniser uses).
_WHITESPACE = frozenset(
    (*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B))
).union((0x2028, 0x2029, 0x202F, 0x205F, 0x3000))


def _in_words(code: int) -> bool:
    """Whether BERT's pre-tokeniser keeps this character inside words (not a separator)."""
    char = chr(code)
    if code in _WHITESPACE:
        return False
    return not (
        (char.isascii() and not char.isalnum() and char.isprintable() and char != " ")
        or unicodedata.category(char).startswith("P")
    )


class _CharTable:
    """What the normaliser makes of each character seen so far, as arrays over code points.

    BERT's normaliser works character by character (control characters removed, CJK padded
    with spaces, accents stripped, lowercased), so a text's normalised words follow from its
    characters' expansions; the rare context it ignores (canonical reordering of combining
    marks) is what `train_wordpiece`'s check catches.
    """

    def __init__(self, normalizer: normalizers.Normalizer | None) -> None:
        self.normalizer = normalizer
        self.known = np.zeros(_UNICODE, dtype=bool)
        self.empty = np.zeros(_UNICODE, dtype=bool)  # normalised away entirely
        self.ends_in_word = np.zeros(_UNICODE, dtype=bool)
        self.starts_in_word = np.zeros(_UNICODE, dtype=bool)
        self.head = np.zeros(_UNICODE, dtype=np.uint32)  # first normalised character
        self.continues = np.zeros(_UNICODE, dtype=bool)  # the answer, filled as texts pass

    def learn(self, codes: np.ndarray) -> None:
        """Normalise the characters of `codes` not seen before (a handful per batch)."""
        for code in np.unique(codes[~self.known[codes]]).tolist():
            char = chr(code)
            text = self.normalizer.normalize_str(char) if self.normalizer else char
            self.known[code] = True
            self.empty[code] = not text
            if not text:
                continue
            inside = [_in_words(ord(c)) for c in text]
            self.head[code] = ord(text[0])
            self.starts_in_word[code], self.ends_in_word[code] = inside[0], inside[-1]
            for k in range(1, len(text)):  # a character continuing a word inside its expansion
                if inside[k] and inside[k - 1]:
                    self.continues[ord(text[k])] = True


def continuation_pieces(
    texts: Iterable[str] | Iterable[list[str]], normalizer: normalizers.Normalizer | None
) -> list[str]:
    """The `##c` piece of every character that continues a word in `texts`, sorted.

    Words as the trainer sees them: normalised, split at whitespace and punctuation. One NumPy
    pass over each batch's code points (the normaliser runs once per distinct character).
    """
    table = _CharTable(normalizer)
    for text in _joined(texts):
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # (N,) code points
        table.learn(codes)
        codes = codes[~table.empty[codes]]
        follows = table.ends_in_word[codes[:-1]] & table.starts_in_word[codes[1:]]
        table.continues[table.head[codes[1:][follows]]] = True
    return [PREFIX + chr(int(c)) for c in np.flatnonzero(table.continues)]


def _joined(texts: Iterable[str] | Iterable[list[str]], size: int = 1000) -> Iterator[str]:
    """The texts joined by spaces (separators: no word spans two texts), `size` at a time."""
    pending: list[str] = []
    for item in texts:
        pending += [item] if isinstance(item, str) else item
        if len(pending) >= size:
            yield " ".join(pending)
            pending = []
    yield " ".join(pending)


def train_wordpiece(
    texts: Callable[[], Iterable[str] | Iterable[list[str]]],
    blank: Callable[[], Tokenizer],
    specials: list[str],
    vocab_size: int,
    min_frequency: int,
) -> Tokenizer:
    """Train a WordPiece model on `texts` that is the same bytes in every process.

    Args:
        texts: Gives the training texts afresh on each call (read two or three times).
        blank: A new untrained tokenizer with the family's normaliser and pre-tokeniser.
        specials: The family's special tokens, in id order.
        vocab_size: Tokens to train, specials included.
        min_frequency: Minimum count of a merge.
    """
    pieces = continuation_pieces(texts(), blank().normalizer)
    while True:
        tok = blank()
        trainer = tk_trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[*specials, *pieces],
            continuing_subword_prefix=PREFIX,
            show_progress=False,
        )
        tok.train_from_iterator(texts(), trainer=trainer)
        made = {t for t in tok.get_vocab() if len(t) == len(PREFIX) + 1 and t.startswith(PREFIX)}
        if made <= set(pieces):
            return as_vocabulary(tok, pieces)
        pieces = sorted(made | set(pieces))  # the trainer's exact set: the next pass is final


def as_vocabulary(tok: Tokenizer, pieces: list[str]) -> Tokenizer:
    """`tok` with `pieces` (trained as special tokens) as plain vocabulary entries again.

    An added token is matched in raw text before pre-tokenisation; the continuation pieces
    must only ever come out of the WordPiece model, with the ids they were trained at.
    """
    state = json.loads(tok.to_str())
    drop = set(pieces)
    state["added_tokens"] = [t for t in state["added_tokens"] if t["content"] not in drop]
    return Tokenizer.from_str(json.dumps(state))
