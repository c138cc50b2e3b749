"""The character-level family (nanoGPT's shakespeare_char): one token per Unicode code point.

The vocabulary is `<|endoftext|>=0 <unk>=1`, then the characters of the training text seen
`min_frequency` times or more, most frequent first, ties in code-point order, `vocab_size`
tokens at most in all. `<|endoftext|>` separates documents (bos and eos, as GPT-2's); a
character outside the vocabulary encodes to `<unk>`. Nothing is added around a sequence, and
the decoder joins the characters back without spaces, so text of known characters decodes to
itself exactly.

Deterministic as it is: `tokenizers`' WordLevel trainer sums exact counts and sorts them by
count, then by the word's UTF-8 bytes (code-point order), so no hash order or thread count
reaches the vocabulary (tests/tasks/tokenizer/test_determinism.py).

Not here: the config, the dispatch on the family, the transformers wrapper
(`tasks/tokenizer/tokenizer.py`).
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import trainers as tk_trainers

END_OF_TEXT = "<|endoftext|>"
UNKNOWN = "<unk>"
CHAR_SPECIALS = [END_OF_TEXT, UNKNOWN]
#: One code point, whatever it is. `.` does not match `\n` (Oniguruma's default syntax), so a
#: run of newlines would stay one piece between its matches.
ONE_CHARACTER = r"[\s\S]"


def char_model() -> models.Model:
    """An empty WordLevel model whose unknown token is `<unk>`."""
    return models.WordLevel(unk_token=UNKNOWN)


def char_pipeline(tok: Tokenizer, lowercase: bool) -> Tokenizer:
    """Attach the character pipeline to `tok`: optional lowercasing, a split per character."""
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    # Every code point its own piece, newlines, tabs and spaces included (none is dropped).
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(ONE_CHARACTER), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters joined as they are: no spaces in between
    return tok


def char_trainer(vocab_size: int, min_frequency: int) -> tk_trainers.Trainer:
    """The trainer of a character vocabulary: specials first, then characters by frequency."""
    return tk_trainers.WordLevelTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=CHAR_SPECIALS,
        show_progress=False,
    )
