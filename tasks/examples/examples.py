"""Pretraining examples of one shard: each objective's rows, masks and noise, as an Arrow table.

Pure cores over `EncodedDocs` (flat NumPy views of an encode shard) plus explicit seeds. How the
documents are cut is `tasks.examples.pairs` (bert, sop) and `tasks.examples.cutting` (the others);
the masking, span-corruption and denoising arithmetic is `tasks.examples.objectives`, shared with
the training loop.

Every random choice of an example comes from a generator seeded by (run seed, source shard,
copy, document or example index), never from a process-wide state, so a shard's examples are
the same whatever worker makes them and however many there are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from tasks.common import schema
from tasks.examples.config import ExamplesConfig
from tasks.examples.cutting import (
    causal_blocks,
    full_sentences,
    raw_chunks,
    sentence_rows,
    single_rows,
    t5_raw_length,
)
from tasks.examples.documents import EncodedDocs
from tasks.examples.objectives.denoising import InfillResult, permute_sentences, text_infill
from tasks.examples.objectives.masking import mask_tokens
from tasks.examples.objectives.rng import sample_keys
from tasks.examples.objectives.spans import span_corrupt
from tasks.examples.pairs import Pair, RandomDoc, document_pairs, pair_rows
from tasks.examples.specials import Specials

_SPAN_HISTOGRAM = 16  # denoising counts spans of length 0..15 one by one, longer ones together


def example_rng(seed: int, *counters: int) -> np.random.Generator:
    """A generator seeded by (run seed, counters...): the same tuple gives the same draws."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, *counters])))


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


def shift_right(labels: np.ndarray, start_id: int) -> np.ndarray:
    """Return the decoder inputs of `labels` (N, T): `start_id`, then each row's first T-1 ids."""
    start = np.full((len(labels), 1), start_id, dtype=labels.dtype)  # (N, 1)
    return np.concatenate([start, labels[:, :-1]], axis=1)  # (N, T)


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
    decoder = shift_right(targets, sp.pad)
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
    decoder = shift_right(labels, sp.eos)
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
