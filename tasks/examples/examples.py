"""Pretraining examples from encoded documents: pairs, sentences, causal blocks, spans, noise.

Pure cores over `EncodedDocs` (flat NumPy views of an encode shard) plus explicit seeds; the
masking, span-corruption and denoising arithmetic is `tasks.examples.objectives`, shared with the
training loop.

Every random choice of an example comes from a generator seeded by (run seed, source shard,
copy, document or example index), never from a process-wide state, so a shard's examples are
the same whatever worker makes them and however many there are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tasks.common import schema
from tasks.examples.objectives import (
    DenoisingConfig,
    InfillResult,
    MaskConfig,
    SpanConfig,
    mask_tokens,
    permute_sentences,
    random_spans_helper,
    sample_keys,
    span_corrupt,
    text_infill,
)

Objective = Literal["bert", "sop", "roberta", "causal", "span_corruption", "denoising"]
_SPAN_HISTOGRAM = 16  # denoising counts spans of length 0..15 one by one, longer ones together


class ExamplesConfig(BaseModel):
    """Which pretraining examples to cut from the encoded corpus, and how."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    objective: Objective = Field(
        "bert",
        description="bert (MLM + next sentence), sop (MLM + sentence order), roberta (MLM on "
        "full sentences), causal (GPT blocks), span_corruption (T5), denoising (BART).",
    )
    max_seq_length: int = Field(
        128,
        ge=8,
        le=65_536,
        description="Tokens per example, specials included (bert, sop, roberta); the encoder "
        "input length (span_corruption); encoder and decoder length (denoising).",
    )
    block_size: int = Field(512, ge=2, le=1 << 20, description="Tokens per causal block.")
    short_seq_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="bert/sop: chance of a shorter random target length."
    )
    next_sentence: Literal["recipe", "balanced"] = Field(
        "recipe",
        description="bert: 'recipe' forces NotNext when a chunk holds one segment, as the "
        "original does; 'balanced' splits such a segment instead, for 50% NotNext.",
    )
    masking: Literal["static", "dynamic"] = Field(
        "static",
        description="static: masks written into the shards (dupe_factor copies); dynamic: "
        "masks drawn at batch time from (seed, epoch, sample index).",
    )
    dupe_factor: int = Field(
        1, ge=1, le=100, description="Static masking: copies of the corpus, each masked anew."
    )
    mask: MaskConfig = Field(default_factory=MaskConfig)
    span: SpanConfig = Field(default_factory=SpanConfig)
    denoising: DenoisingConfig = Field(default_factory=DenoisingConfig)

    @property
    def sequence_length(self) -> int:
        """Tokens per example: `block_size` for causal blocks, else `max_seq_length`."""
        return self.block_size if self.objective == "causal" else self.max_seq_length

    @model_validator(mode="after")
    def _dynamic_has_one_copy(self) -> ExamplesConfig:
        if self.masking == "dynamic" and self.dupe_factor != 1:
            raise ValueError("dupe_factor applies to static masking; dynamic masking needs 1")
        if self.masking == "dynamic" and self.objective == "denoising":
            raise ValueError(
                "examples.masking=dynamic: denoising writes its noise into the shards; use static"
            )
        return self


@dataclass(frozen=True)
class Specials:
    """The token ids an objective needs, taken from the tokenizer's manifest."""

    cls: int | None
    sep: int | None
    pad: int
    mask: int | None
    eos: int | None
    sentinel_top: int | None  # id of <extra_id_0>: T5 sentinels count down from it
    vocab_size: int
    special_ids: frozenset[int]


@dataclass(frozen=True)
class EncodedDocs:
    """An encode shard as flat arrays: token ids, sentence offsets, document offsets.

    Document d holds sentences `doc_offsets[d]:doc_offsets[d+1]`; sentence s holds tokens
    `ids[sent_offsets[s]:sent_offsets[s+1]]`.
    """

    ids: np.ndarray  # (T,)
    sent_offsets: np.ndarray  # (S + 1,)
    doc_offsets: np.ndarray  # (D + 1,)

    @property
    def documents(self) -> int:
        """Number of documents."""
        return len(self.doc_offsets) - 1

    def sentences(self, doc: int) -> list[np.ndarray]:
        """The sentences of document `doc`, as id arrays (views, no copy)."""
        start, stop = self.doc_offsets[doc], self.doc_offsets[doc + 1]
        bounds = self.sent_offsets[start : stop + 1]
        return [self.ids[a:b] for a, b in pairwise(bounds)]

    def document(self, doc: int) -> np.ndarray:
        """All ids of document `doc`, flat (a view)."""
        lo = self.sent_offsets[self.doc_offsets[doc]]
        hi = self.sent_offsets[self.doc_offsets[doc + 1]]
        return self.ids[lo:hi]


def encoded_docs(table: pa.Table) -> EncodedDocs:
    """View an encode shard's `token_ids` column as flat arrays (no Python object per token)."""
    schema.require_columns(table, schema.TOKEN_IDS)
    column = table.column(schema.TOKEN_IDS).combine_chunks()
    per_doc = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    sentences = pc.list_flatten(column)
    per_sentence = pc.list_value_length(sentences).to_numpy(zero_copy_only=False)
    ids = pc.list_flatten(sentences).to_numpy(zero_copy_only=False)
    return EncodedDocs(
        ids=ids,
        sent_offsets=np.concatenate([[0], np.cumsum(per_sentence, dtype=np.int64)]),
        doc_offsets=np.concatenate([[0], np.cumsum(per_doc, dtype=np.int64)]),
    )


def example_rng(seed: int, *counters: int) -> np.random.Generator:
    """A generator seeded by (run seed, counters...): the same tuple gives the same draws."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, *counters])))


# ---- bert / sop: sentence pairs (the original create_pretraining_data recipe) ----------------


@dataclass
class Pair:
    """One sentence pair before specials and masking."""

    a: np.ndarray
    b: np.ndarray
    label: int  # bert: 1 = NotNext (B is random); sop: 1 = swapped
    doc: int
    b_doc: int
    single: bool  # cut from a chunk of one segment (the recipe forces NotNext there)


RandomDoc = Callable[[np.random.Generator, int], tuple[int, list[np.ndarray]]]


def truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: np.random.Generator) -> None:
    """Cut the longer segment by one token at a time, from the front or the back at random."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def document_pairs(
    sentences: list[np.ndarray],
    doc: int,
    cfg: ExamplesConfig,
    rng: np.random.Generator,
    random_doc: RandomDoc,
) -> list[Pair]:
    """Cut one document into sentence pairs, following the original BERT recipe.

    Consecutive sentences are accumulated up to a target length (`max_seq_length - 3`, or a
    random shorter one with `short_seq_prob`); A is a random prefix of the chunk; B is the rest
    (IsNext) or, half the time and always when the chunk holds one segment, a span of another
    document (NotNext), whose unused sentences go back to be used next. For `sop`, B always
    follows A in the same document and the pair is swapped half the time.
    """
    max_tokens = cfg.max_seq_length - 3
    target = max_tokens
    if rng.random() < cfg.short_seq_prob:
        target = int(rng.integers(2, max_tokens + 1))
    pairs: list[Pair] = []
    chunk: list[np.ndarray] = []
    length = 0
    i = 0
    while i < len(sentences):
        chunk.append(sentences[i])
        length += len(sentences[i])
        if i == len(sentences) - 1 or length >= target:
            pair = _pair_from_chunk(chunk, doc, target, max_tokens, cfg, rng, random_doc)
            if pair is not None:
                pairs.append(pair[0])
                i -= pair[1]  # unused sentences are put back
            chunk, length = [], 0
        i += 1
    return pairs


def _pair_from_chunk(
    chunk: list[np.ndarray],
    doc: int,
    target: int,
    max_tokens: int,
    cfg: ExamplesConfig,
    rng: np.random.Generator,
    random_doc: RandomDoc,
) -> tuple[Pair, int] | None:
    a_end = int(rng.integers(1, len(chunk))) if len(chunk) >= 2 else 1
    a = [int(t) for s in chunk[:a_end] for t in s]
    b: list[int] = []
    label, b_doc, unused = 0, doc, 0
    single = len(chunk) == 1
    if cfg.objective == "sop" or (cfg.next_sentence == "balanced" and single):
        if single:  # one segment: cut it in two at a random token
            if len(a) < 2:
                return None
            cut = int(rng.integers(1, len(a)))
            a, b = a[:cut], a[cut:]
        else:
            b = [int(t) for s in chunk[a_end:] for t in s]
        if cfg.objective == "sop" and rng.random() < 0.5:
            a, b, label = b, a, 1
        elif cfg.objective == "bert" and rng.random() < 0.5:
            b, label, b_doc = _random_span(rng, doc, target - len(a), random_doc)
    elif single or rng.random() < 0.5:
        b, label, b_doc = _random_span(rng, doc, target - len(a), random_doc)
        unused = len(chunk) - a_end
    else:
        b = [int(t) for s in chunk[a_end:] for t in s]
    truncate_pair(a, b, max_tokens, rng)
    if not a or not b:
        return None
    return Pair(np.asarray(a), np.asarray(b), label, doc, b_doc, single), unused


def _random_span(
    rng: np.random.Generator, doc: int, target_b: int, random_doc: RandomDoc
) -> tuple[list[int], int, int]:
    other, sentences = random_doc(rng, doc)
    b: list[int] = []
    start = int(rng.integers(0, len(sentences)))
    for sentence in sentences[start:]:
        b.extend(int(t) for t in sentence)
        if len(b) >= target_b:
            break
    return b, 1, other


# ---- roberta: full sentences ----------------------------------------------------------------


def full_sentences(docs: EncodedDocs, max_tokens: int, sep: int) -> list[np.ndarray]:
    """Pack contiguous sentences into sequences of at most `max_tokens` ids (RoBERTa).

    Sentences are taken in order and may cross documents, with `sep` between two documents; a
    sentence longer than `max_tokens` is cut into pieces.
    """
    out: list[np.ndarray] = []
    current: list[np.ndarray] = []
    length = 0

    def flush() -> None:
        nonlocal current, length
        if current:
            out.append(np.concatenate(current))
        current, length = [], 0

    separator = np.asarray([sep], dtype=docs.ids.dtype)
    for d in range(docs.documents):
        if d > 0 and length:
            if length + 1 > max_tokens:
                flush()
            else:
                current.append(separator)
                length += 1
        for sentence in docs.sentences(d):
            for at in range(0, len(sentence), max_tokens):
                part = sentence[at : at + max_tokens]
                if length + len(part) > max_tokens:
                    flush()
                current.append(part)
                length += len(part)
    flush()
    return out


# ---- denoising: BART chunks of whole sentences ---------------------------------------------


def sentence_chunks(docs: EncodedDocs, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Group each document's consecutive sentences into chunks of at most `max_tokens` ids.

    Unlike `full_sentences`, a chunk never crosses a document. A sentence longer than
    `max_tokens` is cut into pieces, each then a sentence of its own.

    Returns:
        (P, 2) [start, stop) ranges into `docs.ids`, one per sentence (or piece) in order, and
        (P,) the chunk number of each.
    """
    pieces: list[tuple[int, int]] = []
    chunk_of: list[int] = []
    chunk = -1
    for d in range(docs.documents):
        length = max_tokens  # full: a document's first sentence opens a new chunk
        for s in range(int(docs.doc_offsets[d]), int(docs.doc_offsets[d + 1])):
            lo, hi = int(docs.sent_offsets[s]), int(docs.sent_offsets[s + 1])
            for at in range(lo, hi, max_tokens):
                stop = min(at + max_tokens, hi)
                if length + stop - at > max_tokens:
                    chunk, length = chunk + 1, 0
                pieces.append((at, stop))
                chunk_of.append(chunk)
                length += stop - at
    return np.asarray(pieces, dtype=np.int64).reshape(-1, 2), np.asarray(chunk_of, np.int64)


def sentence_rows(
    docs: EncodedDocs, length: int, first: int, last: int, pad: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay `sentence_chunks` out as `first sentences... last` padded to `length`.

    Returns ids (N, L) int64, sentence starts (N, L) bool (True at each sentence's first
    token) and real lengths (N,), specials included.
    """
    pieces, chunk = sentence_chunks(docs, length - 2)
    n = int(chunk[-1]) + 1 if len(chunk) else 0
    sizes = pieces[:, 1] - pieces[:, 0]  # (P,)
    before = np.cumsum(sizes) - sizes  # (P,) tokens of the earlier pieces
    content = np.bincount(chunk, weights=sizes, minlength=n).astype(np.int64)  # (N,)
    col = 1 + before - (np.cumsum(content) - content)[chunk]  # (P,) column in its row
    offset = np.arange(int(sizes.sum())) - np.repeat(before, sizes)  # (T,) inside its piece
    ids = np.full((n, length), pad, dtype=np.int64)  # (N, L)
    ids[np.repeat(chunk, sizes), np.repeat(col, sizes) + offset] = docs.ids[
        np.repeat(pieces[:, 0], sizes) + offset
    ]
    ids[:, 0] = first
    ids[np.arange(n), content + 1] = last
    starts = np.zeros((n, length), dtype=bool)  # (N, L)
    starts[chunk, col] = True
    return ids, starts, content + 2


# ---- causal: GPT blocks --------------------------------------------------------------------


def causal_blocks(
    docs: EncodedDocs, block_size: int, eot: int
) -> tuple[np.ndarray, pa.ListArray, int]:
    """Join documents, each followed by `eot`, and cut the stream into full blocks.

    Returns the blocks (B, block_size), for each block the positions where a document starts
    inside it (the position after an `eot`) as a `list<int32>` array, and the number of tail
    tokens dropped.
    """
    lengths = np.diff(docs.sent_offsets[docs.doc_offsets]) + 1  # (D,) with the eot
    ends = np.cumsum(lengths)  # (D,) stream position just after each eot
    stream = np.empty(int(ends[-1]) if len(ends) else 0, dtype=docs.ids.dtype)
    is_eot = np.zeros(len(stream), dtype=bool)
    if len(ends):
        is_eot[ends - 1] = True
        stream[is_eot] = eot
        stream[~is_eot] = docs.ids[: docs.sent_offsets[docs.doc_offsets[-1]]]
    n_blocks = len(stream) // block_size
    blocks = stream[: n_blocks * block_size].reshape(n_blocks, block_size)  # (B, L)
    starts = ends[ends < n_blocks * block_size]
    inside = starts[starts % block_size != 0]  # a start at offset 0 is no boundary
    per_block = np.bincount(inside // block_size, minlength=n_blocks)  # (B,)
    offsets = np.concatenate([[0], np.cumsum(per_block)]).astype(np.int32)  # (B + 1,)
    positions = pa.array((inside % block_size).astype(np.int32))
    starts_list = pa.ListArray.from_arrays(pa.array(offsets), positions)
    return blocks, starts_list, len(stream) - n_blocks * block_size


# ---- span corruption: T5 raw chunks --------------------------------------------------------


def t5_raw_length(cfg: ExamplesConfig) -> tuple[int, int]:
    """The raw tokens to take per example and the targets length (T5's length arithmetic)."""
    return random_spans_helper(
        cfg.max_seq_length, cfg.span.noise_density, cfg.span.mean_noise_span_length
    )


def raw_chunks(docs: EncodedDocs, raw_length: int) -> tuple[np.ndarray, int]:
    """Concatenate the documents (no separator, as T5 does) and cut chunks of `raw_length`.

    Returns the chunks (N, raw_length) and the number of tail tokens dropped.
    """
    stream = docs.ids[: docs.sent_offsets[docs.doc_offsets[-1]]] if docs.documents else docs.ids
    n = len(stream) // raw_length
    return stream[: n * raw_length].reshape(n, raw_length), len(stream) - n * raw_length


# ---- assembly: fixed-length rows, masks, Arrow tables ---------------------------------------


def pair_rows(
    pairs: list[Pair], sp: Specials, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Lay pairs out as `[CLS] A [SEP] B [SEP]` padded to `length`.

    Returns ids (N, L), token type ids (N, L), real lengths (N,) and segment starts (N, L), True
    at the first token of A and of B (word starts for whole-word masking).
    """
    assert sp.cls is not None
    assert sp.sep is not None
    n = len(pairs)
    ids = np.full((n, length), sp.pad, dtype=np.int64)  # (N, L)
    types = np.zeros((n, length), dtype=np.uint8)  # (N, L)
    starts = np.zeros((n, length), dtype=bool)  # (N, L)
    lengths = np.empty(n, dtype=np.int64)
    for row, pair in enumerate(pairs):
        la, lb = len(pair.a), len(pair.b)
        ids[row, 0] = sp.cls
        ids[row, 1 : 1 + la] = pair.a
        ids[row, 1 + la] = sp.sep
        ids[row, 2 + la : 2 + la + lb] = pair.b
        ids[row, 2 + la + lb] = sp.sep
        types[row, 2 + la : 3 + la + lb] = 1
        starts[row, [1, 2 + la]] = True
        lengths[row] = 3 + la + lb
    return ids, types, lengths, starts


def single_rows(
    sequences: list[np.ndarray], first: int, last: int, pad: int, length: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lay sequences out as `first x last` padded to `length`: ids (N, L), lengths, starts."""
    n = len(sequences)
    ids = np.full((n, length), pad, dtype=np.int64)  # (N, L)
    starts = np.zeros((n, length), dtype=bool)  # (N, L)
    lengths = np.empty(n, dtype=np.int64)
    for row, seq in enumerate(sequences):
        ids[row, 0] = first
        ids[row, 1 : 1 + len(seq)] = seq
        ids[row, 1 + len(seq)] = last
        starts[row, 1] = True
        lengths[row] = 2 + len(seq)
    return ids, starts, lengths


def maskable_positions(ids: np.ndarray, lengths: np.ndarray, sp: Specials) -> np.ndarray:
    """(N, L) bool: real, non-special tokens, the only ones masking may choose."""
    real = np.arange(ids.shape[1])[None, :] < lengths[:, None]  # (N, L)
    return real & ~np.isin(ids, np.fromiter(sp.special_ids, np.int64))


def fixed(values: np.ndarray, type_: pa.DataType) -> pa.FixedSizeListArray:
    """A (N, L) array as an Arrow `fixed_size_list<type, L>` column (one copy, no Python)."""
    width = values.shape[1]
    flat = pa.array(values.reshape(-1).astype(type_.to_pandas_dtype()), type_)
    return pa.FixedSizeListArray.from_arrays(flat, width)


@dataclass(frozen=True)
class ShardContext:
    """What cutting one shard needs besides its documents: seeds, ids, lookups."""

    seed: int
    shard: int  # the shard's number in its split: part of every example's seed
    doc_base: int  # number of the shard's first document within its split
    specials: Specials
    ids: pa.DataType
    word_starts: np.ndarray | None  # (V,) bool, for whole-word masking
    random_ids: np.ndarray  # ids a random replacement is drawn from


def shard_seed(seed: int, shard: int, copy: int) -> int:
    """The 64-bit seed of one copy of one shard's examples."""
    return int(np.random.SeedSequence([seed, shard, copy]).generate_state(1, np.uint64)[0])


def cut_examples(
    docs: EncodedDocs, cfg: ExamplesConfig, ctx: ShardContext, random_doc: RandomDoc
) -> tuple[pa.Table, dict[str, int]]:
    """Cut one shard's documents into `cfg.objective` examples; return them and their counts.

    The counts (examples, real and padded tokens, masking, labels, spans, dropped tokens) add
    up across shards into the manifest's realised statistics.
    """
    if cfg.objective in ("bert", "sop"):
        return _pair_examples(docs, cfg, ctx, random_doc)
    if cfg.objective == "roberta":
        return _roberta_examples(docs, cfg, ctx)
    if cfg.objective == "causal":
        return _causal_examples(docs, cfg, ctx)
    if cfg.objective == "denoising":
        return _denoising_examples(docs, cfg, ctx)
    return _span_examples(docs, cfg, ctx)


def _mlm_columns(
    ids: np.ndarray,
    lengths: np.ndarray,
    starts: np.ndarray,
    cfg: ExamplesConfig,
    ctx: ShardContext,
    copy: int,
) -> tuple[dict[str, pa.Array], dict[str, int]]:
    """`input_ids` (masked when masking is static), `length` and static `labels`; counts."""
    stats = _token_stats(lengths, ids.shape[1])
    columns = {schema.LENGTH: pa.array(lengths.astype(np.int32))}
    if cfg.masking == "static":
        sp = ctx.specials
        assert sp.mask is not None
        maskable = maskable_positions(ids, lengths, sp)
        word_starts = None
        if cfg.mask.whole_word and ctx.word_starts is not None:
            word_starts = ctx.word_starts[ids] | starts
        keys = sample_keys(shard_seed(ctx.seed, ctx.shard, copy), 0, np.arange(len(ids)))
        result = mask_tokens(ids, maskable, word_starts, keys, cfg.mask, sp.mask, ctx.random_ids)
        ids = result.input_ids
        columns[schema.LABELS] = fixed(result.labels, pa.int32())
        stats |= {
            "maskable_tokens": result.maskable,
            "chosen_tokens": result.chosen,
            "mask_token": result.masked,
            "random_token": result.randomized,
            "kept_token": result.kept,
        }
    return {schema.INPUT_IDS: fixed(ids, ctx.ids), **columns}, stats


def _pair_examples(
    docs: EncodedDocs, cfg: ExamplesConfig, ctx: ShardContext, random_doc: RandomDoc
) -> tuple[pa.Table, dict[str, int]]:
    label = schema.NEXT_SENTENCE_LABEL if cfg.objective == "bert" else schema.SENTENCE_ORDER_LABEL
    out_schema = schema.examples_schema(
        cfg.objective, cfg.max_seq_length, ctx.ids, labels=cfg.masking == "static"
    )
    tables: list[pa.Table] = []
    totals: dict[str, int] = {}
    for copy in range(cfg.dupe_factor):
        pairs: list[Pair] = []
        for d in range(docs.documents):
            rng = example_rng(ctx.seed, ctx.shard, copy, d)
            pairs += document_pairs(docs.sentences(d), ctx.doc_base + d, cfg, rng, random_doc)
        ids, types, lengths, starts = pair_rows(pairs, ctx.specials, cfg.max_seq_length)
        columns, stats = _mlm_columns(ids, lengths, starts, cfg, ctx, copy)
        labels = np.fromiter((p.label for p in pairs), np.int8, len(pairs))
        stats["positive_labels"] = int(labels.sum())
        stats["single_segment_pairs"] = sum(p.single for p in pairs)
        columns |= {
            schema.TOKEN_TYPE_IDS: fixed(types, pa.uint8()),
            label: pa.array(labels),
            schema.SOURCE_DOC: pa.array(np.fromiter((p.doc for p in pairs), np.int64, len(pairs))),
            schema.PAIR_DOC: pa.array(np.fromiter((p.b_doc for p in pairs), np.int64, len(pairs))),
        }
        tables.append(pa.table(columns, schema=out_schema))
        totals = _add(totals, stats)
    return pa.concat_tables(tables), totals


def _roberta_examples(
    docs: EncodedDocs, cfg: ExamplesConfig, ctx: ShardContext
) -> tuple[pa.Table, dict[str, int]]:
    sp = ctx.specials
    assert sp.cls is not None
    assert sp.sep is not None
    sequences = full_sentences(docs, cfg.max_seq_length - 2, sp.sep)
    ids, starts, lengths = single_rows(sequences, sp.cls, sp.sep, sp.pad, cfg.max_seq_length)
    out_schema = schema.examples_schema(
        "roberta", cfg.max_seq_length, ctx.ids, labels=cfg.masking == "static"
    )
    tables: list[pa.Table] = []
    totals: dict[str, int] = {}
    for copy in range(cfg.dupe_factor):
        columns, stats = _mlm_columns(ids, lengths, starts, cfg, ctx, copy)
        tables.append(pa.table(columns, schema=out_schema))
        totals = _add(totals, stats)
    return pa.concat_tables(tables), totals


def _causal_examples(
    docs: EncodedDocs, cfg: ExamplesConfig, ctx: ShardContext
) -> tuple[pa.Table, dict[str, int]]:
    eot = ctx.specials.eos
    assert eot is not None
    blocks, starts, dropped = causal_blocks(docs, cfg.block_size, eot)
    n = len(blocks)
    stats = _token_stats(np.full(n, cfg.block_size), cfg.block_size)
    stats |= {"dropped_tokens": dropped, "document_boundaries": len(starts.values)}
    arrays = {
        schema.INPUT_IDS: fixed(blocks, ctx.ids),
        schema.DOC_STARTS: starts,
    }
    out_schema = schema.examples_schema("causal", cfg.block_size, ctx.ids, labels=False)
    return pa.table(arrays, schema=out_schema), stats


def _span_examples(
    docs: EncodedDocs, cfg: ExamplesConfig, ctx: ShardContext
) -> tuple[pa.Table, dict[str, int]]:
    sp = ctx.specials
    assert sp.eos is not None
    assert sp.sentinel_top is not None
    raw_length, targets_length = t5_raw_length(cfg)
    chunks, dropped = raw_chunks(docs, raw_length)
    keys = sample_keys(shard_seed(ctx.seed, ctx.shard, 0), 0, np.arange(len(chunks)))
    inputs, targets, noise = span_corrupt(chunks, keys, cfg.span, sp.sentinel_top, sp.eos)
    decoder = np.concatenate(
        [np.full((len(targets), 1), sp.pad, dtype=targets.dtype), targets[:, :-1]], axis=1
    )
    spans = int((noise[:, 1:] & ~noise[:, :-1]).sum() + noise[:, 0].sum())
    stats = _token_stats(np.full(len(inputs), cfg.max_seq_length), cfg.max_seq_length)
    stats |= {
        "dropped_tokens": dropped,
        "raw_tokens": int(chunks.size),
        "noise_tokens": int(noise.sum()),
        "noise_spans": spans,
    }
    arrays = {
        schema.INPUT_IDS: fixed(inputs, ctx.ids),
        schema.LABELS: fixed(targets, ctx.ids),
        schema.DECODER_INPUT_IDS: fixed(decoder, ctx.ids),
    }
    out_schema = schema.examples_schema(
        "span_corruption", cfg.max_seq_length, ctx.ids, labels=True, targets_length=targets_length
    )
    return pa.table(arrays, schema=out_schema), stats


def _denoising_examples(
    docs: EncodedDocs, cfg: ExamplesConfig, ctx: ShardContext
) -> tuple[pa.Table, dict[str, int]]:
    sp = ctx.specials
    assert sp.cls is not None
    assert sp.eos is not None
    assert sp.mask is not None
    labels, starts, lengths = sentence_rows(docs, cfg.max_seq_length, sp.cls, sp.eos, sp.pad)
    # BART's decoder starts with </s> (decoder_start_token_id = eos), then the labels.
    decoder = np.concatenate(
        [np.full((len(labels), 1), sp.eos, dtype=labels.dtype), labels[:, :-1]], axis=1
    )
    out_schema = schema.examples_schema("denoising", cfg.max_seq_length, ctx.ids, labels=True)
    tables: list[pa.Table] = []
    totals: dict[str, int] = {}
    for copy in range(cfg.dupe_factor):
        keys = sample_keys(shard_seed(ctx.seed, ctx.shard, copy), 0, np.arange(len(labels)))
        shuffled, permuted = permute_sentences(labels, starts, lengths, keys, cfg.denoising)
        noised = text_infill(
            shuffled, lengths, keys, cfg.denoising, sp.mask, sp.pad, ctx.random_ids
        )
        arrays = {
            schema.INPUT_IDS: fixed(noised.input_ids, ctx.ids),
            schema.LENGTH: pa.array(noised.lengths.astype(np.int32)),
            schema.LABELS: fixed(labels, ctx.ids),
            schema.DECODER_INPUT_IDS: fixed(decoder, ctx.ids),
        }
        tables.append(pa.table(arrays, schema=out_schema))
        totals = _add(totals, _denoising_stats(lengths, noised, permuted, cfg.max_seq_length))
    return pa.concat_tables(tables), totals


def _denoising_stats(
    lengths: np.ndarray, noised: InfillResult, permuted: np.ndarray, width: int
) -> dict[str, int]:
    """Counts of one denoising copy: tokens, noise, spans and their lengths, permuted rows."""
    spans = noised.span_lengths[noised.span_lengths >= 0]
    histogram = np.bincount(np.minimum(spans, _SPAN_HISTOGRAM), minlength=_SPAN_HISTOGRAM + 1)
    return _token_stats(lengths, width) | {
        "encoder_tokens": int(noised.lengths.sum()),
        "content_tokens": int(lengths.sum()) - 2 * len(lengths),
        "masked_tokens": int(noised.masked_tokens.sum()),
        "noise_spans": int(noised.spans.sum()),
        "inserted_spans": int(noised.inserted.sum()),
        "noise_tokens": int(noised.noise_tokens.sum()),
        "random_tokens": int(noised.random_tokens.sum()),
        "permuted_rows": int(permuted.sum()),
        **{f"span_length_{k}": int(histogram[k]) for k in range(_SPAN_HISTOGRAM)},
        f"span_length_{_SPAN_HISTOGRAM}_or_more": int(histogram[_SPAN_HISTOGRAM]),
    }


def _token_stats(lengths: np.ndarray, width: int) -> dict[str, int]:
    return {
        "examples": len(lengths),
        "real_tokens": int(lengths.sum()),
        "slot_tokens": len(lengths) * width,
    }


def _add(total: dict[str, int], part: dict[str, int]) -> dict[str, int]:
    return {k: total.get(k, 0) + part.get(k, 0) for k in {*total, *part}}
