"""The token conventions every model input follows: which id pads, which ids start a causal text.

Shared by fine-tuning's featurizers and collators and by generation and prompting. Nothing here
imports transformers at import time, so the sections that use it validate at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class VocabularyError(ValueError):
    """A tokenizer lacks a token a model input needs (neither pad nor eos, for example)."""


def pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id that pads inputs: the pad token, else eos (GPT-2 style vocabularies have no pad).

    Raises:
        VocabularyError: the tokenizer has neither.
    """
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    raise VocabularyError(f"{type(tokenizer).__name__} has neither a pad nor an eos token")


def causal_bos(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that start a causal-LM input: bos where it differs from eos, else nothing.

    Llama-style vocabularies start every text with `<s>`; GPT-2 style ones (bos = eos =
    `<|endoftext|>`) only separate documents with it, so a prompt starts bare.
    """
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return [int(bos)] if bos is not None and bos != eos else []
