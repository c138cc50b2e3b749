"""Tokenizers of the three families: build, train, load your own, and wrap for transformers.

- WordPiece (BERT): `[PAD] [UNK] [CLS] [SEP] [MASK]`, BERT normalisation, `##` continuation,
  `[CLS] A [SEP] B [SEP]` with token type ids.
- Byte-level BPE: GPT-2 style (`<|endoftext|>`, never an unknown token) or RoBERTa style
  (`<s> <pad> </s> <unk> <mask>`, `<s> A </s></s> B </s>`).
- Unigram (T5, SentencePiece-style `▁`): `<pad>=0 </s>=1 <unk>=2`, and 100 sentinels at the top
  of the vocabulary, counted down: `<extra_id_0>` has the highest id.

Pure functions over texts and files: no Ray, Prefect or MLflow here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers as tk_trainers
from transformers import PreTrainedTokenizerFast

Family = Literal["wordpiece", "bpe", "unigram"]

WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT2_SPECIALS = ["<|endoftext|>"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]


class PretrainedFiles(BaseModel):
    """Bring your own tokenizer instead of training one (local files only)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tokenizer_json: str | None = Field(None, description="A `tokenizers` tokenizer.json.")
    vocab_txt: str | None = Field(None, description="A BERT WordPiece vocab.txt.")
    vocab_json: str | None = Field(None, description="GPT-2 vocab.json / encoder.json.")
    merges: str | None = Field(None, description="GPT-2 merges.txt / vocab.bpe.")

    @model_validator(mode="after")
    def _one_kind(self) -> PretrainedFiles:
        kinds = [
            self.tokenizer_json is not None,
            self.vocab_txt is not None,
            self.vocab_json is not None or self.merges is not None,
        ]
        if sum(kinds) != 1:
            raise ValueError("give exactly one of tokenizer_json, vocab_txt, or vocab_json+merges")
        if (self.vocab_json is None) != (self.merges is None):
            raise ValueError("vocab_json and merges go together")
        return self


class TokenizerConfig(BaseModel):
    """Which tokenizer to train (or load), and how it is exported."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    family: Family = Field(
        "wordpiece", description="wordpiece (BERT), bpe (GPT-2/RoBERTa), unigram (T5)."
    )
    bpe_style: Literal["gpt2", "roberta"] = Field("gpt2", description="Specials of a BPE vocab.")
    vocab_size: int = Field(
        30_000,
        ge=100,
        le=1_000_000,
        description="Tokens to train, specials and (unigram) sentinels included.",
    )
    pad_to_multiple_of: int = Field(
        64,
        ge=1,
        le=4096,
        description="Model embedding rows are "
        "padded up to a multiple of this (fast matrix shapes).",
    )
    min_frequency: int = Field(2, ge=1, description="Minimum count of a merge/piece.")
    lowercase: bool = Field(True, description="Lowercase before tokenizing (wordpiece default).")
    strip_accents: bool | None = Field(
        None, description="WordPiece: strip accents; None follows `lowercase`, as BERT does."
    )
    split_chinese_chars: bool = Field(
        True, description="WordPiece: put spaces around CJK characters, as BERT does."
    )
    extra_ids: int = Field(100, ge=0, le=1000, description="Unigram: number of sentinels.")
    sample_documents: int | None = Field(
        None,
        ge=1,
        description="Train on at most this many "
        "documents (evenly spaced over the corpus); None: all.",
    )
    model_max_length: int = Field(512, ge=8, description="Maximum sequence length recorded.")
    padding_side: Literal["right", "left"] = Field("right", description="Padding side.")
    pretrained: PretrainedFiles | None = Field(
        None, description="Load these files instead of training."
    )


def special_tokens(cfg: TokenizerConfig) -> list[str]:
    """Return the family's special tokens in id order (sentinels excluded)."""
    if cfg.family == "wordpiece":
        return WORDPIECE_SPECIALS
    if cfg.family == "bpe":
        return GPT2_SPECIALS if cfg.bpe_style == "gpt2" else ROBERTA_SPECIALS
    return T5_SPECIALS


def sentinels(cfg: TokenizerConfig) -> list[str]:
    """T5 sentinels in the order they are added: `<extra_id_{n-1}>` first, `<extra_id_0>` last."""
    return (
        [f"<extra_id_{i}>" for i in reversed(range(cfg.extra_ids))]
        if cfg.family == "unigram"
        else []
    )


def _pipeline(tok: Tokenizer, cfg: TokenizerConfig) -> Tokenizer:
    """Attach the family's normaliser, pre-tokeniser and decoder to `tok`."""
    if cfg.family == "wordpiece":
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True,
            handle_chinese_chars=cfg.split_chinese_chars,
            strip_accents=cfg.strip_accents,
            lowercase=cfg.lowercase,
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # exact round trip
    elif cfg.family == "bpe":
        if cfg.lowercase:
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        steps = [normalizers.Nmt(), normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
        if cfg.lowercase:
            steps.append(normalizers.Lowercase())
        tok.normalizer = normalizers.Sequence(steps)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return tok


def _token_id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the vocabulary has no special token {token!r}")
    return token_id


def _post_processor(tok: Tokenizer, cfg: TokenizerConfig) -> None:
    """Attach the family's single/pair template (needs the special tokens' ids)."""

    def ids(token: str) -> int:  # only the tokens a template uses must exist
        return _token_id(tok, token)

    if cfg.family == "wordpiece":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", ids("[CLS]")), ("[SEP]", ids("[SEP]"))],
        )
    elif cfg.family == "bpe" and cfg.bpe_style == "roberta":
        tok.post_processor = processors.RobertaProcessing(
            ("</s>", ids("</s>")), ("<s>", ids("<s>")), trim_offsets=True, add_prefix_space=False
        )
    elif cfg.family == "bpe":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>",
            pair="$A </s> $B </s>",
            special_tokens=[("</s>", ids("</s>"))],
        )


def train_tokenizer(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Train a tokenizer of `cfg.family` on `texts` (streamed; uses every core)."""
    specials = special_tokens(cfg)
    if cfg.family == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100))
        trainer: tk_trainers.Trainer = tk_trainers.WordPieceTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=specials,
            continuing_subword_prefix="##",
            show_progress=False,
        )
    elif cfg.family == "bpe":
        tok = Tokenizer(models.BPE())
        trainer = tk_trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        tok = Tokenizer(models.Unigram())
        trainer = tk_trainers.UnigramTrainer(
            vocab_size=cfg.vocab_size - cfg.extra_ids,
            special_tokens=specials,
            unk_token="<unk>",
            show_progress=False,
        )
    _pipeline(tok, cfg)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(sentinels(cfg))
    _post_processor(tok, cfg)
    return tok


def load_tokenizer_files(files: PretrainedFiles, cfg: TokenizerConfig) -> Tokenizer:
    """Build a tokenizer from your own files with this family's conventions.

    A `tokenizer.json` is taken as it is; a BERT `vocab.txt` gets the WordPiece pipeline; GPT-2
    `vocab.json`/`encoder.json` plus `merges.txt`/`vocab.bpe` get the byte-level BPE pipeline.
    """
    if files.tokenizer_json is not None:
        return Tokenizer.from_file(files.tokenizer_json)
    if files.vocab_txt is not None:
        lines = Path(files.vocab_txt).read_text(encoding="utf-8").split("\n")
        vocab = {token: i for i, token in enumerate(lines[:-1] if lines[-1] == "" else lines)}
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    else:
        assert files.vocab_json is not None
        assert files.merges is not None
        vocab = json.loads(Path(files.vocab_json).read_text(encoding="utf-8"))
        merge_lines = Path(files.merges).read_text(encoding="utf-8").split("\n")
        merges = [
            tuple(line.split(" "))
            for line in merge_lines
            if line and not line.startswith("#version")
        ]
        tok = Tokenizer(models.BPE(vocab, merges))  # type: ignore[arg-type]
    _pipeline(tok, cfg)
    # The family's specials that the vocabulary holds are never split and keep their ids.
    tok.add_special_tokens([t for t in special_tokens(cfg) if tok.token_to_id(t) is not None])
    _post_processor(tok, cfg)
    return tok


def padded_vocab_size(tok: Tokenizer, cfg: TokenizerConfig) -> int:
    """Embedding rows a model should allocate: the vocabulary padded to `pad_to_multiple_of`."""
    return math.ceil(tok.get_vocab_size(with_added_tokens=True) / cfg.pad_to_multiple_of) * (
        cfg.pad_to_multiple_of
    )


# The token that plays each `transformers` role, per family (BPE: per style).
_ROLES: dict[str, dict[str, str]] = {
    "wordpiece": {"unk": "[UNK]", "pad": "[PAD]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"},
    "roberta": {
        "bos": "<s>",
        "eos": "</s>",
        "unk": "<unk>",
        "pad": "<pad>",
        "cls": "<s>",
        "sep": "</s>",
        "mask": "<mask>",
    },
    "gpt2": {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<|endoftext|>"},
    "unigram": {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"},
}


def to_transformers(tok: Tokenizer, cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """Wrap `tok` so that `AutoTokenizer.from_pretrained` reloads it with the right specials."""
    key = cfg.family if cfg.family != "bpe" else cfg.bpe_style
    inputs = (
        ["input_ids", "token_type_ids", "attention_mask"]
        if cfg.family == "wordpiece"
        else ["input_ids", "attention_mask"]
    )
    extra = {"additional_special_tokens": sentinels(cfg)} if cfg.family == "unigram" else {}
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        model_max_length=cfg.model_max_length,
        padding_side=cfg.padding_side,
        model_input_names=inputs,
        **{f"{role}_token": token for role, token in _ROLES[key].items()},
        **extra,
    )
