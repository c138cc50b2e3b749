"""BART denoising: Poisson spans, text infilling, sentence permutation and the example cut.

Statistical checks use fixed seeds, so they are deterministic; each bound is 4 standard errors
of the statistic under the recipe (or a chi-square p-value of 1e-4), so a correct
implementation passes with any seed with probability ~0.9999 per check.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
from pydantic import ValidationError
from scipy import stats
from tokenizers import Tokenizer

from tasks.common import schema
from tasks.common.schema import ObjectiveMismatchError
from tasks.encode.encode import encode_documents
from tasks.examples.config import ExamplesConfig
from tasks.examples.cutting import sentence_chunks, sentence_rows
from tasks.examples.documents import EncodedDocs, encoded_docs
from tasks.examples.examples import ShardContext, cut_examples
from tasks.examples.objectives.denoising import (
    DenoisingConfig,
    InfillResult,
    permute_sentences,
    poisson_span_lengths,
    text_infill,
)
from tasks.examples.objectives.rng import sample_keys
from tasks.examples.specials import objective_specials
from tasks.tokenizer.tokenizer import TokenizerConfig, special_tokens, train_tokenizer

BOS, PAD, EOS, MASK = 0, 1, 2, 3
POOL = np.arange(10, 1000)


def rows(n: int, width: int, seed: int, low: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Rows `<s> content </s>` then padding, content in [10, 1000), lengths in [low, width]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, width + 1, n)
    col = np.arange(width)[None, :]
    ids = np.where(col < lengths[:, None], rng.integers(10, 1000, (n, width)), PAD)
    ids[:, 0] = BOS
    ids[np.arange(n), lengths - 1] = EOS
    return ids, lengths


def infill(ids: np.ndarray, lengths: np.ndarray, seed: int = 0, **cfg: object) -> InfillResult:
    keys = sample_keys(seed, 0, np.arange(len(ids)))
    config = DenoisingConfig.model_validate(cfg)
    return text_infill(ids, lengths, keys, config, MASK, PAD, POOL)


def assert_within_4_se(observed: float, expected: float, se: float) -> None:
    assert abs(observed - expected) <= 4 * se, f"{observed} vs {expected} ± 4 * {se}"


# ---- span lengths ------------------------------------------------------------------------


@pytest.mark.parametrize("lam", [3.0, 0.7])
def test_span_lengths_follow_the_poisson_pmf_zero_included(lam: float) -> None:
    keys = sample_keys(11, 0, np.arange(4000))
    draws, used = poisson_span_lengths(keys, np.full(4000, 40), lam)
    spans = draws[np.arange(draws.shape[1])[None, :] < used[:, None]]  # every span, 0 included
    n = spans.size
    assert n > 30_000
    assert_within_4_se(spans.mean(), lam, math.sqrt(lam / n))
    # Var of the sample variance of a Poisson: (mu4 - sigma^4) / n = (lam + 2 lam^2) / n.
    assert_within_4_se(spans.var(), lam, math.sqrt((lam + 2 * lam**2) / n))
    top = int(lam + 4 * math.sqrt(lam)) + 1  # bins 0..top-1, then the tail
    observed = np.bincount(np.minimum(spans, top), minlength=top + 1)
    pmf = stats.poisson.pmf(np.arange(top), lam)
    expected = n * np.append(pmf, 1.0 - pmf.sum())
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(chi2, top) > 1e-4, (observed, expected.round())
    assert observed[0] > 0  # 0-length spans are drawn and kept


def test_poisson_draws_reach_the_budget_and_stop_there() -> None:
    keys = sample_keys(3, 0, np.arange(500))
    budget = np.random.default_rng(0).integers(0, 200, 500)
    draws, used = poisson_span_lengths(keys, budget, 3.0)
    total = np.cumsum(draws, axis=1)
    rows_ = np.arange(500)
    assert np.all(used[budget == 0] == 0)
    hit = budget > 0
    assert np.all(total[rows_[hit], used[hit] - 1] >= budget[hit])
    assert np.all(np.where(used[hit] >= 2, total[rows_[hit], used[hit] - 2], 0) < budget[hit])


# ---- text infilling ----------------------------------------------------------------------


def test_each_span_becomes_one_mask_and_the_kept_text_is_unchanged() -> None:
    ids, lengths = rows(600, 64, seed=1)
    r = infill(ids, lengths)
    out = r.input_ids
    assert ((out == MASK).sum(axis=1) == r.spans).all()
    assert (r.masked.sum(axis=1) == r.masked_tokens).all()
    spans = r.span_lengths
    assert (np.where(spans > 0, spans, 0).sum(axis=1) == r.masked_tokens).all()
    for i in range(len(ids)):
        n, m = lengths[i], r.lengths[i]
        assert out[i, 0] == BOS
        assert out[i, m - 1] == EOS
        assert (out[i, m:] == PAD).all()
        assert not r.masked[i, 0]
        assert not r.masked[i, n - 1 :].any()
        noised = out[i, 1 : m - 1]
        kept = ids[i, 1 : n - 1][~r.masked[i, 1 : n - 1]]
        assert np.array_equal(noised[noised != MASK], kept)
        assert m - 2 == (n - 2) - r.masked_tokens[i] + r.spans[i]


def test_realised_mask_ratio_is_the_configured_share() -> None:
    ids, lengths = rows(3000, 128, seed=2)
    content = lengths - 2
    r = infill(ids, lengths, mask_ratio=0.3)
    budget = r.masked_tokens
    assert np.all((budget == np.floor(content * 0.3)) | (budget == np.ceil(content * 0.3)))
    # Each row rounds n * p up with probability equal to its fraction: variance <= 1/4 a row.
    assert_within_4_se(budget.sum(), 0.3 * content.sum(), 0.5 * math.sqrt(len(ids)))


def test_zero_length_spans_insert_a_mask_without_removing_a_token() -> None:
    ids, lengths = rows(800, 40, seed=3, low=20)
    ids = np.pad(ids, ((0, 0), (0, 40)), constant_values=PAD)  # room for every insertion
    r = infill(ids, lengths, poisson_lambda=0.5)
    inserted = r.inserted
    assert inserted.sum() > 100
    spans = r.span_lengths
    assert ((spans == 0).sum(axis=1) == inserted).all()
    masks = (r.input_ids == MASK).sum(axis=1)
    assert (masks == r.spans).all()
    # Share of 0-length spans: e^-lambda (Wald: every drawn span counts; the trimmed last
    # one is never 0).
    n = int(r.spans.sum())
    p0 = math.exp(-0.5)
    assert_within_4_se(inserted.sum() / n, p0, math.sqrt(p0 * (1 - p0) / n))
    # Without room (full rows) insertions are dropped rather than overflow the row.
    full_ids, full_lengths = rows(800, 40, seed=3, low=40)
    full = infill(full_ids, full_lengths, poisson_lambda=0.5)
    assert (full.lengths <= 40).all()
    assert full.inserted.sum() < inserted.sum()


@pytest.mark.parametrize("replace_length", [0, -1])
def test_replace_length_deletes_spans_or_masks_every_token(replace_length: int) -> None:
    ids, lengths = rows(400, 64, seed=4, low=10)
    r = infill(ids, lengths, replace_length=replace_length)
    out, m = r.input_ids, r.lengths
    content, masked, inserted = lengths - 2, r.masked_tokens, r.inserted
    masks = (out == MASK).sum(axis=1)
    if replace_length == 0:
        assert (masks == inserted).all()
        assert (m - 2 == content - masked + inserted).all()
    else:
        assert (masks == masked + inserted).all()
        assert (m - 2 == content + inserted).all()
    assert (m <= ids.shape[1]).all()


def test_random_ratio_replaces_that_share_of_mask_tokens_from_the_pool() -> None:
    ids, lengths = rows(2000, 64, seed=5)
    r = infill(ids, lengths, random_ratio=0.25)
    noise, rand = r.noise_tokens.sum(), r.random_tokens.sum()
    assert_within_4_se(rand / noise, 0.25, math.sqrt(0.25 * 0.75 / noise))
    assert (r.input_ids == MASK).sum() == noise - rand
    everything = infill(ids, lengths, random_ratio=1.0)
    assert not (everything.input_ids == MASK).any()
    real = np.arange(64)[None, :] < everything.lengths[:, None]
    inner = everything.input_ids[real]
    assert np.isin(inner, [BOS, EOS, *POOL]).all()


def test_infill_is_deterministic_per_key_and_changes_with_the_seed() -> None:
    ids, lengths = rows(300, 64, seed=6)
    a = infill(ids, lengths, seed=1).input_ids.tobytes()
    assert a == infill(ids, lengths, seed=1).input_ids.tobytes()
    assert a != infill(ids, lengths, seed=2).input_ids.tobytes()
    # A row's noise depends on its key only, not on the batch around it.
    keys = sample_keys(1, 0, np.arange(300))[7:8]
    alone = text_infill(ids[7:8], lengths[7:8], keys, DenoisingConfig(), MASK, PAD, POOL)
    assert np.array_equal(alone.input_ids[0], infill(ids, lengths, seed=1).input_ids[7])


def test_short_rows_empty_rows_and_empty_batches() -> None:
    ids = np.array([[BOS, 55, EOS, PAD], [BOS, EOS, PAD, PAD], [BOS, 66, 77, EOS]])
    lengths = np.array([3, 2, 4])
    r = infill(ids, lengths, mask_ratio=1.0, poisson_lambda=20.0)  # spans longer than rows
    assert r.input_ids[0].tolist() == [BOS, MASK, EOS, PAD]
    assert r.input_ids[1].tolist() == [BOS, EOS, PAD, PAD]
    assert r.masked_tokens.tolist() == [1, 0, 2]
    empty = infill(ids[:0], lengths[:0])
    assert empty.input_ids.shape == (0, 4)


# ---- sentence permutation ----------------------------------------------------------------


def sentence_batch(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of 1-6 sentences of 1-8 tokens; a token's id // 10 names its row and sentence."""
    rng = np.random.default_rng(seed)
    ids: list[list[list[int]]] = []
    for d in range(n):
        sizes = rng.integers(1, 9, rng.integers(1, 7))
        ids.append([[10 + 100 * d + 10 * j + t for t in range(s)] for j, s in enumerate(sizes)])
    width = 2 + max(sum(len(s) for s in doc) for doc in ids)
    out = np.full((n, width), PAD)
    starts = np.zeros((n, width), dtype=bool)
    lengths = np.empty(n, dtype=np.int64)
    for i, doc in enumerate(ids):
        flat = [t for s in doc for t in s]
        out[i, : len(flat) + 2] = [BOS, *flat, EOS]
        for at in np.cumsum([0, *[len(s) for s in doc[:-1]]]):
            starts[i, 1 + at] = True
        lengths[i] = len(flat) + 2
    return out, starts, lengths


def sentences_of(row: np.ndarray) -> list[tuple[int, ...]]:
    """Split a row's content into sentences by the tens digit of the ids (one per sentence)."""
    groups: dict[int, list[int]] = {}
    for t in row:
        if t >= 10:
            groups.setdefault(int(t) // 10, []).append(int(t))
    return sorted(tuple(g) for g in groups.values())


def test_sentence_permutation_is_a_permutation_of_whole_sentences() -> None:
    ids, starts, lengths = sentence_batch(500, seed=7)
    keys = sample_keys(0, 0, np.arange(len(ids)))
    out, permuted = permute_sentences(ids, starts, lengths, keys, DenoisingConfig())
    changed = 0
    for i in range(len(ids)):
        n = lengths[i]
        assert out[i, 0] == BOS
        assert out[i, n - 1] == EOS
        assert (out[i, n:] == PAD).all()
        content = out[i, 1 : n - 1]
        # Sentences stay whole and in their own order inside: each is a contiguous run.
        runs = [tuple(g) for g in np.split(content, np.flatnonzero(np.diff(content // 10)) + 1)]
        assert sorted(runs) == sentences_of(ids[i, 1 : n - 1])
        assert all(list(r) == sorted(r) for r in runs)
        changed += not np.array_equal(out[i], ids[i])
    counts = starts.sum(axis=1)
    assert np.array_equal(permuted, counts >= 2)  # permute_sentences=1.0: every row
    assert changed > 0.6 * (counts >= 2).sum()


def test_permutation_share_of_rows_and_one_sentence_rows() -> None:
    ids, starts, lengths = sentence_batch(4000, seed=8)
    keys = sample_keys(0, 0, np.arange(len(ids)))
    out, permuted = permute_sentences(
        ids, starts, lengths, keys, DenoisingConfig(permute_sentences=0.5)
    )
    several = starts.sum(axis=1) >= 2
    share = permuted[several].mean()
    assert_within_4_se(share, 0.5, math.sqrt(0.25 / several.sum()))
    assert np.array_equal(out[~permuted], ids[~permuted])
    assert not permuted[~several].any()  # one sentence: nothing to shuffle
    none = permute_sentences(ids, starts, lengths, keys, DenoisingConfig(permute_sentences=0.0))
    assert np.array_equal(none[0], ids)
    assert not none[1].any()


def test_no_masking_keeps_the_multiset_of_sentences_after_both_steps() -> None:
    ids, starts, lengths = sentence_batch(300, seed=9)
    keys = sample_keys(5, 0, np.arange(len(ids)))
    cfg = DenoisingConfig(mask_ratio=0.0)
    shuffled, _ = permute_sentences(ids, starts, lengths, keys, cfg)
    r = text_infill(shuffled, lengths, keys, cfg, MASK, PAD, POOL)
    assert np.array_equal(r.input_ids, shuffled)
    assert r.spans.sum() == 0
    for i in range(len(ids)):
        assert sentences_of(r.input_ids[i]) == sentences_of(ids[i])


# ---- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("mask_ratio", 1.5),
        ("poisson_lambda", 0.0),
        ("permute_sentences", -0.1),
        ("replace_length", 2),
        ("random_ratio", 2.0),
        ("mask_prob", 0.3),  # misspelt: extra fields are refused
    ],
)
def test_bad_denoising_config_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValidationError, match=field):
        DenoisingConfig.model_validate({field: value})
    with pytest.raises(ValidationError, match=rf"denoising\.{field}"):
        ExamplesConfig.model_validate({"objective": "denoising", "denoising": {field: value}})


def test_denoising_refuses_dynamic_masking() -> None:
    with pytest.raises(ValidationError, match=r"examples\.masking=dynamic"):
        ExamplesConfig(objective="denoising", masking="dynamic")


# ---- examples: chunks and the cut of one shard ---------------------------------------------


def docs_from(sentences_per_doc: list[list[list[int]]]) -> EncodedDocs:
    ids = [t for doc in sentences_per_doc for s in doc for t in s]
    sent_lengths = [len(s) for doc in sentences_per_doc for s in doc]
    return EncodedDocs(
        ids=np.asarray(ids, dtype=np.uint16),
        sent_offsets=np.concatenate([[0], np.cumsum(sent_lengths)]).astype(np.int64),
        doc_offsets=np.concatenate([[0], np.cumsum([len(d) for d in sentences_per_doc])]).astype(
            np.int64
        ),
    )


def test_chunks_hold_whole_sentences_of_one_document() -> None:
    docs = docs_from([[[1, 2, 3], [4, 5]], [[6, 7, 8, 9]], [[10] * 13, [11]]])
    pieces, chunk = sentence_chunks(docs, max_tokens=6)
    got = [docs.ids[a:b].tolist() for a, b in pieces]
    assert got == [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10] * 6, [10] * 6, [10], [11]]
    assert chunk.tolist() == [0, 0, 1, 2, 3, 4, 4]
    ids, starts, lengths = sentence_rows(docs, 8, BOS, EOS, PAD)
    assert ids[0].tolist() == [BOS, 1, 2, 3, 4, 5, EOS, PAD]
    assert np.flatnonzero(starts[0]).tolist() == [1, 4]
    assert ids[4].tolist() == [BOS, 10, 11, EOS, PAD, PAD, PAD, PAD]
    assert lengths.tolist() == [7, 6, 8, 8, 4]


WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "big", "red"]


@pytest.fixture(scope="module")
def roberta_shard() -> tuple[EncodedDocs, Tokenizer, TokenizerConfig]:
    """A roberta-style byte-level BPE trained on a small corpus, and 60 documents encoded."""
    rng = random.Random(0)

    def sentence() -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(3, 12))).capitalize() + "."

    docs = [[sentence() for _ in range(rng.randint(1, 9))] for _ in range(60)]
    cfg = TokenizerConfig(family="bpe", bpe_style="roberta", vocab_size=300, min_frequency=1)
    tok = train_tokenizer(iter([" ".join(d) for d in docs] * 3), cfg)
    table = pa.table(
        {
            schema.DOC_ID: [f"d{i}" for i in range(len(docs))],
            schema.TEXT: [" ".join(d) for d in docs],
            schema.SENTENCES: docs,
        }
    )
    return encoded_docs(encode_documents(table, tok, pa.uint16())), tok, cfg


def cut(
    shard: tuple[EncodedDocs, Tokenizer, TokenizerConfig], seed: int, **overrides: object
) -> tuple[pa.Table, dict[str, int], ShardContext]:
    docs, tok, tok_cfg = shard
    ids = {t: i for t in special_tokens(tok_cfg) if (i := tok.token_to_id(t)) is not None}
    specials = objective_specials("denoising", tok_cfg, ids, tok.get_vocab_size())
    pool = np.setdiff1d(np.arange(tok.get_vocab_size()), list(specials.special_ids))
    ctx = ShardContext(seed, 0, 0, specials, pa.uint16(), None, pool)
    cfg = ExamplesConfig.model_validate(
        {"objective": "denoising", "max_seq_length": 48, **overrides}
    )

    def no_random_doc(rng: np.random.Generator, current: int) -> tuple[int, list[np.ndarray]]:
        raise AssertionError("denoising never draws another document")

    table, counts = cut_examples(docs, cfg, ctx, no_random_doc)
    return table, counts, ctx


def ipc_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def test_cut_examples_writes_bart_rows_with_a_real_roberta_tokenizer(
    roberta_shard: tuple[EncodedDocs, Tokenizer, TokenizerConfig],
) -> None:
    docs, tok, _ = roberta_shard
    table, counts, ctx = cut(roberta_shard, seed=0)
    sp = ctx.specials
    assert (sp.cls, sp.eos, sp.pad, sp.mask) == tuple(
        tok.token_to_id(t) for t in ["<s>", "</s>", "<pad>", "<mask>"]
    )
    assert table.schema == schema.examples_schema("denoising", 48, pa.uint16(), labels=True)
    inputs = np.stack(table[schema.INPUT_IDS].to_numpy(zero_copy_only=False)).astype(np.int64)
    labels = np.stack(table[schema.LABELS].to_numpy(zero_copy_only=False)).astype(np.int64)
    decoder = np.stack(table[schema.DECODER_INPUT_IDS].to_numpy(zero_copy_only=False))
    length = table[schema.LENGTH].to_numpy()
    # Labels: <s> original </s> pad; in order they give back every document's ids.
    real = labels != sp.pad
    label_len = real.sum(axis=1)
    assert (labels[:, 0] == sp.cls).all()
    assert (labels[np.arange(len(labels)), label_len - 1] == sp.eos).all()
    assert (np.diff(real.astype(int), axis=1) <= 0).all()  # no pad inside the text
    content = [labels[i, 1 : label_len[i] - 1] for i in range(len(labels))]
    assert np.array_equal(np.concatenate(content), docs.ids.astype(np.int64))
    row_starts = set(np.cumsum([0, *map(len, content)]).tolist())
    assert set(docs.sent_offsets[docs.doc_offsets].tolist()) <= row_starts  # one document each
    # Decoder inputs: the labels shifted right behind </s>.
    assert (decoder[:, 0] == sp.eos).all()
    assert np.array_equal(decoder[:, 1:], labels[:, :-1])
    # Inputs: <s> noised </s> pad, `length` real tokens; the kept text is a sub-multiset.
    assert (inputs[:, 0] == sp.cls).all()
    assert (inputs[np.arange(len(inputs)), length - 1] == sp.eos).all()
    assert all((inputs[i, length[i] :] == sp.pad).all() for i in range(len(inputs)))
    for i in range(len(inputs)):
        kept = Counter(inputs[i, 1 : length[i] - 1].tolist())
        kept.pop(sp.mask, None)
        assert not kept - Counter(content[i].tolist())
    assert counts["noise_spans"] == int((inputs == sp.mask).sum())  # replace_length=1
    assert counts["examples"] == table.num_rows == len(content)
    assert counts["encoder_tokens"] == int(length.sum())
    assert counts["real_tokens"] == int(label_len.sum())
    assert counts["content_tokens"] == docs.ids.size
    histogram = [counts[f"span_length_{k}"] for k in range(16)] + [counts["span_length_16_or_more"]]
    assert sum(histogram) == counts["noise_spans"]
    assert counts["inserted_spans"] == histogram[0]
    assert 0.2 < counts["masked_tokens"] / counts["content_tokens"] < 0.4
    assert sp.cls is not None
    assert sp.eos is not None
    _, starts, _ = sentence_rows(docs, 48, sp.cls, sp.eos, sp.pad)
    assert counts["permuted_rows"] == int((starts.sum(axis=1) >= 2).sum()) > 0


def test_cut_examples_is_deterministic_and_the_seed_changes_only_the_noise(
    roberta_shard: tuple[EncodedDocs, Tokenizer, TokenizerConfig],
) -> None:
    a, counts_a, _ = cut(roberta_shard, seed=0)
    b, counts_b, _ = cut(roberta_shard, seed=0)
    c, _, _ = cut(roberta_shard, seed=1)
    assert ipc_bytes(a) == ipc_bytes(b)
    assert counts_a == counts_b
    assert not a[schema.INPUT_IDS].equals(c[schema.INPUT_IDS])
    assert a[schema.LABELS].equals(c[schema.LABELS])
    doubled, counts_2, _ = cut(roberta_shard, seed=0, dupe_factor=2)
    assert doubled.num_rows == 2 * a.num_rows
    assert doubled.slice(0, a.num_rows).equals(a)
    assert counts_2["examples"] == 2 * counts_a["examples"]


def test_denoising_needs_a_roberta_style_or_wordpiece_tokenizer() -> None:
    gpt2 = TokenizerConfig(family="bpe", bpe_style="gpt2")
    with pytest.raises(ObjectiveMismatchError, match=r"examples\.objective=denoising.*bpe_style"):
        objective_specials("denoising", gpt2, {"<|endoftext|>": 0}, 300)
    wordpiece = TokenizerConfig(family="wordpiece")
    ids = {t: i for i, t in enumerate(special_tokens(wordpiece))}
    sp = objective_specials("denoising", wordpiece, ids, 300)
    assert (sp.cls, sp.eos, sp.mask, sp.pad) == (
        ids["[CLS]"],
        ids["[SEP]"],
        ids["[MASK]"],
        ids["[PAD]"],
    )
