"""Tokenizers of the four families: build, train, load your own, and wrap for transformers.

- WordPiece (BERT): `[PAD] [UNK] [CLS] [SEP] [MASK]`, BERT normalisation, `##` continuation,
  `[CLS] A [SEP] B [SEP]` with token type ids.
- Byte-level BPE: GPT-2 style (`<|endoftext|>`, never an unknown token) or RoBERTa style
  (`<s> <pad> </s> <unk> <mask>`, `<s> A </s></s> B </s>`).
- Unigram (T5, SentencePiece-style `▁`): `<pad>=0 </s>=1 <unk>=2`, and 100 sentinels at the top
  of the vocabulary, counted down: `<extra_id_0>` has the highest id.
- Character level (nanoGPT's shakespeare_char): one token per code point, `<|endoftext|>=0
  <unk>=1`, then the characters seen, most frequent first (`tasks/tokenizer/char.py`).

Pure functions over texts and files: no Ray, Prefect or MLflow here.
"""

from __future__ import annotations

import functools
import io
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import sentencepiece as spm
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import trainers as tk_trainers

from tasks.tokenizer.char import CHAR_SPECIALS, char_model, char_pipeline, char_trainer
from tasks.tokenizer.language_sampling import LanguageSamplingConfig
from tasks.tokenizer.pretrained import PretrainedFiles as PretrainedFiles
from tasks.tokenizer.wordpiece import train_wordpiece

if TYPE_CHECKING:  # imported where used: `TokenizerConfig` validates without transformers
    from transformers import PreTrainedTokenizerFast

Family = Literal["wordpiece", "bpe", "unigram", "char"]
#: Training texts: strings or batches of strings, or a function that returns them afresh (a
#: trainer that reads the corpus twice calls it twice; a one-shot iterator is kept in memory).
Texts = Iterable[str] | Iterable[list[str]]
TextSource = Texts | Callable[[], Texts]

#: The version of the training algorithms below; it enters the tokenizer stage's fingerprint,
#: so outputs trained by another algorithm are never reused. 2: deterministic training.
TRAINER_VERSION = 2
#: sentencepiece's EM sums its threads' partial counts in thread order, so the model depends on
#: the thread count: a fixed count keeps it the same on every machine (sentencepiece runs that
#: many threads whatever the cores; extra ones on a small machine only share its cores).
SENTENCEPIECE_THREADS = 16
SENTENCEPIECE_SEED = 0x5EED

WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
GPT2_SPECIALS = ["<|endoftext|>"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
T5_SPECIALS = ["<pad>", "</s>", "<unk>"]


class TokenizerConfig(BaseModel):
    """Which tokenizer to train (or load), and how it is exported."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    family: Family = Field(
        "wordpiece",
        description="wordpiece (BERT), bpe (GPT-2/RoBERTa), unigram (T5), char (a token per "
        "character, as nanoGPT's shakespeare_char).",
    )
    bpe_style: Literal["gpt2", "roberta"] = Field("gpt2", description="Specials of a BPE vocab.")
    vocab_size: int = Field(
        30_000,
        ge=100,
        le=1_000_000,
        description="Tokens to train (at most), specials and (unigram) sentinels included; "
        "char: the characters seen, up to this many.",
    )
    pad_to_multiple_of: int = Field(
        64,
        ge=1,
        le=4096,
        description="Model embedding rows are "
        "padded up to a multiple of this (fast matrix shapes).",
    )
    min_frequency: int = Field(
        2, ge=1, description="Minimum count of a merge/piece (char: of a character)."
    )
    lowercase: bool | None = Field(
        None,
        description="Lowercase before tokenizing. None: by family, true for wordpiece (as BERT "
        "uncased), false for bpe, unigram and char (GPT-2, RoBERTa and T5 are cased).",
    )
    strip_accents: bool | None = Field(
        None, description="WordPiece: strip accents; None follows `lowercase`, as BERT does."
    )
    split_chinese_chars: bool = Field(
        True, description="WordPiece: put spaces around CJK characters, as BERT does."
    )
    extra_ids: int = Field(100, ge=0, le=1000, description="Unigram: number of sentinels.")
    unigram_trainer: Literal["sentencepiece", "tokenizers"] = Field(
        "sentencepiece",
        description="Unigram: train with sentencepiece (several times faster, the same bytes in "
        "every process) and convert to tokenizer.json, or with the `tokenizers` Unigram trainer "
        "(not reproducible run to run: docs/tokenizers.md).",
    )
    character_coverage: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="Unigram (sentencepiece): share of characters the alphabet covers; the "
        "rarest rest become <unk>. 1.0 keeps every character seen; ~0.9995 suits CJK corpora.",
    )
    sample_documents: int | None = Field(
        None,
        ge=1,
        description="Train on at most this many "
        "documents (evenly spaced over the corpus); None: all. With language_sampling "
        "(unit documents): the documents of the sampled mix.",
    )
    model_max_length: int = Field(512, ge=8, description="Maximum sequence length recorded.")
    padding_side: Literal["right", "left"] = Field("right", description="Padding side.")
    pretrained: PretrainedFiles | None = Field(
        None, description="Load these files instead of training."
    )
    language_sampling: LanguageSamplingConfig | None = Field(
        None,
        description="Train on an XLM-R-style mix: language i drawn with share "
        "p_i^alpha / sum p_j^alpha (docs/tokenizers.md); None: the corpus as it is.",
    )

    @model_validator(mode="after")
    def _lowercase_by_family(self) -> TokenizerConfig:
        # Resolved here, so the dump (fingerprints, `lmpipe config`, MLflow params) says what
        # runs; not marked as set, so a deployment's form still offers the family's default.
        object.__setattr__(self, "lowercase", lowercases(self))
        return self

    @model_validator(mode="after")
    def _sampling_needs_training(self) -> TokenizerConfig:
        sampling = self.language_sampling
        if sampling is not None and self.pretrained is not None:
            raise ValueError("language_sampling applies to training; `pretrained` loads files")
        if (
            sampling is not None
            and sampling.unit == "characters"
            and self.sample_documents is not None
        ):
            raise ValueError(
                "with language_sampling.unit characters the budget is "
                "language_sampling.sample_characters, not sample_documents"
            )
        return self

    @model_validator(mode="after")
    def _char_loads_its_own_json(self) -> TokenizerConfig:
        files = self.pretrained
        if self.family == "char" and files is not None and files.tokenizer_json is None:
            raise ValueError(
                "tokenizer.family char loads only tokenizer.pretrained.tokenizer_json; vocab_txt, "
                "vocab_json+merges and spm_model are the vocabularies of other families"
            )
        return self


def lowercases(cfg: TokenizerConfig) -> bool:
    """Whether `cfg` lowercases: its `lowercase` when set, else its family's convention.

    WordPiece lowercases, as bert-base-uncased does; byte-level BPE (GPT-2, RoBERTa) and Unigram
    (T5) keep case, as those models' own tokenizers do, and so does char, as nanoGPT's.
    """
    return cfg.family == "wordpiece" if cfg.lowercase is None else cfg.lowercase


def special_tokens(cfg: TokenizerConfig) -> list[str]:
    """Return the family's special tokens in id order (sentinels excluded)."""
    if cfg.family == "wordpiece":
        return WORDPIECE_SPECIALS
    if cfg.family == "bpe":
        return GPT2_SPECIALS if cfg.bpe_style == "gpt2" else ROBERTA_SPECIALS
    if cfg.family == "char":
        return CHAR_SPECIALS
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
            lowercase=lowercases(cfg),
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # exact round trip
    elif cfg.family == "bpe":
        if lowercases(cfg):
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    elif cfg.family == "char":
        char_pipeline(tok, lowercases(cfg))
    else:
        steps = [normalizers.Nmt(), normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
        if lowercases(cfg):
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

    if cfg.family == "char":  # as GPT-2: `<|endoftext|>` only goes between documents
        tok.post_processor = None
    elif cfg.family == "wordpiece":
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


def train_tokenizer(texts: TextSource, cfg: TokenizerConfig) -> Tokenizer:
    """Train a tokenizer of `cfg.family` on `texts` (strings or batches of strings; every core).

    The result is the same bytes for the same texts and config in any process, whatever the
    thread count or hash seed (docs/tokenizers.md, "Deterministic training"). WordPiece reads
    the texts twice (`tasks/tokenizer/wordpiece.py`); pass a function returning them afresh to
    stream a large corpus twice rather than hold it. Unigram trains with sentencepiece by
    default and is converted (`from_sentencepiece`).
    """
    source = _replayable(texts)
    if cfg.family == "unigram" and cfg.unigram_trainer == "sentencepiece":
        return from_sentencepiece(train_sentencepiece(source(), cfg), cfg)
    specials = special_tokens(cfg)
    if cfg.family == "wordpiece":
        blank = functools.partial(untrained_tokenizer, cfg)
        tok = train_wordpiece(source, blank, specials, cfg.vocab_size, cfg.min_frequency)
    else:
        tok = untrained_tokenizer(cfg)
        tok.train_from_iterator(source(), trainer=_trainer(cfg, specials))
    tok.add_special_tokens(sentinels(cfg))
    _post_processor(tok, cfg)
    return tok


def untrained_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """An empty tokenizer of `cfg.family` with its normaliser, pre-tokeniser and decoder."""
    if cfg.family == "wordpiece":
        model: models.Model = models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=100)
    elif cfg.family == "bpe":
        model = models.BPE()
    elif cfg.family == "char":
        model = char_model()
    else:
        model = models.Unigram()
    return _pipeline(Tokenizer(model), cfg)


def _trainer(cfg: TokenizerConfig, specials: list[str]) -> tk_trainers.Trainer:
    """The `tokenizers` trainer of a BPE, char or (`unigram_trainer: tokenizers`) Unigram model."""
    if cfg.family == "char":
        return char_trainer(cfg.vocab_size, cfg.min_frequency)
    if cfg.family == "bpe":
        return tk_trainers.BpeTrainer(
            vocab_size=cfg.vocab_size,
            min_frequency=cfg.min_frequency,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    return tk_trainers.UnigramTrainer(
        vocab_size=cfg.vocab_size - cfg.extra_ids,
        special_tokens=specials,
        unk_token="<unk>",
        show_progress=False,
    )


def _replayable(texts: TextSource) -> Callable[[], Texts]:
    """`texts` as a function that gives them afresh on every call."""
    if callable(texts):
        return texts
    if iter(texts) is texts:  # a one-shot iterator: kept for a second pass
        kept = list(texts)
        return lambda: kept
    return lambda: texts


def _flat(texts: Texts) -> Iterable[str]:
    for item in texts:
        if isinstance(item, str):
            yield item
        else:
            yield from item


def train_sentencepiece(texts: Texts, cfg: TokenizerConfig) -> bytes:
    """Train a T5-style SentencePiece Unigram model on `texts`; return the serialised model.

    Ids 0-2 are `<pad> </s> <unk>` (no `<s>`), as in T5; the sentinels are not part of it
    (`from_sentencepiece` adds them on top). sentencepiece keeps the texts it is given in
    memory: bound them with `sample_documents` on a large corpus.
    """
    model = io.BytesIO()
    spm.set_random_generator_seed(SENTENCEPIECE_SEED)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_flat(texts)),
        model_writer=model,
        model_type="unigram",
        vocab_size=cfg.vocab_size - cfg.extra_ids,
        character_coverage=cfg.character_coverage,
        normalization_rule_name="nmt_nfkc_cf" if lowercases(cfg) else "nmt_nfkc",
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        pad_piece="<pad>",
        eos_piece="</s>",
        unk_piece="<unk>",
        # A document is one "sentence" here; sentencepiece would skip any over 4 kB.
        max_sentence_length=1 << 24,
        hard_vocab_limit=False,  # a small corpus yields fewer pieces instead of an error
        num_threads=SENTENCEPIECE_THREADS,  # not the cores: the model would depend on them
        minloglevel=2,
    )
    return model.getvalue()


def from_sentencepiece(model: bytes, cfg: TokenizerConfig) -> Tokenizer:
    """Convert a serialised SentencePiece Unigram model into an equivalent `tokenizers` one.

    The pieces keep their ids and scores; its own normalisation (the precompiled character
    map, whitespace stripping and collapsing) and `▁` handling are carried over, then the T5
    sentinels and template are added. Encodings equal sentencepiece's except where two
    segmentations score the same to float precision (see docs/tokenizers.md).

    Raises:
        ValueError: the model is not a Unigram model, or uses byte fallback.
    """
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if trainer.model_type != trainer.UNIGRAM:
        raise ValueError("the SentencePiece model is not a Unigram model (T5 uses Unigram)")
    if trainer.byte_fallback:
        raise ValueError("SentencePiece models with byte_fallback are not supported")
    vocab = [(piece.piece, piece.score) for piece in proto.pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=trainer.unk_id, byte_fallback=False))
    steps: list[normalizers.Normalizer] = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(steps)
    prepend = "always" if norm.add_dummy_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=prepend)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme=prepend)
    # Control pieces and the unknown piece are specials: never split, never normalised.
    controls = [p.piece for p in proto.pieces if p.type in (p.CONTROL, p.UNKNOWN)]
    tok.add_special_tokens(controls)
    tok.add_special_tokens(sentinels(cfg))
    _post_processor(tok, cfg)
    return tok


def load_tokenizer_files(files: PretrainedFiles, cfg: TokenizerConfig) -> Tokenizer:
    """Build a tokenizer from your own files with this family's conventions.

    A `tokenizer.json` is taken as it is; a SentencePiece Unigram model is converted (with the
    T5 sentinels on top); a BERT `vocab.txt` gets the WordPiece pipeline; GPT-2
    `vocab.json`/`encoder.json` plus `merges.txt`/`vocab.bpe` get the byte-level BPE pipeline.
    """
    if files.tokenizer_json is not None:
        return Tokenizer.from_file(files.tokenizer_json)
    if files.spm_model is not None:
        return from_sentencepiece(Path(files.spm_model).read_bytes(), cfg)
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
    "char": {"bos": "<|endoftext|>", "eos": "<|endoftext|>", "unk": "<unk>"},
}


def roles(cfg: TokenizerConfig) -> dict[str, str]:
    """The token that plays each role (`bos`, `eos`, `unk`, `pad`, `cls`, `sep`, `mask`)."""
    return dict(_ROLES[cfg.family if cfg.family != "bpe" else cfg.bpe_style])


def to_transformers(tok: Tokenizer, cfg: TokenizerConfig) -> PreTrainedTokenizerFast:
    """Wrap `tok` so that `AutoTokenizer.from_pretrained` reloads it with the right specials."""
    from transformers import PreTrainedTokenizerFast

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
        **{f"{role}_token": token for role, token in roles(cfg).items()},
        **extra,
    )


def unknown_id(tok: Tokenizer) -> int | None:
    """The id the model emits for text it cannot represent; None if it has none (byte level)."""
    state = json.loads(tok.model.__getstate__())
    if "unk_id" in state:
        return state["unk_id"]  # type: ignore[no-any-return]
    token = state.get("unk_token")
    return None if token is None else tok.token_to_id(token)
