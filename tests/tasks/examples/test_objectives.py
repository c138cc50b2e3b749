"""Objective cores: T5 reference values, round trips, statistics and determinism.

Statistical checks use fixed seeds, so they are deterministic; each bound is 4 standard
errors of the statistic under the recipe, so a correct implementation passes with any seed
with probability ~0.9999 per check.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from tasks.examples.objectives.masking import (
    IGNORE_INDEX,
    MaskConfig,
    _choose_by_rank,
    _greedy_fill,
    mask_tokens,
    num_to_predict,
    word_start_table,
)
from tasks.examples.objectives.rng import counter_uniform, hash32, row_bases, sample_keys
from tasks.examples.objectives.spans import (
    SpanConfig,
    drop_noise_tokens,
    drop_nonnoise_tokens,
    noise_span_mask,
    noise_span_to_sentinel,
    noise_span_to_unique_sentinel,
    noise_token_to_sentinel,
    nonnoise_span_to_sentinel,
    nonnoise_span_to_unique_sentinel,
    random_spans_helper,
    span_corrupt,
)

REPO = Path(__file__).resolve().parents[3]
T5_CASES = Path("t5_span_corruption_reference") / "t5_span_corruption_cases.json"
CLS, SEP, PAD, MASK = 1, 2, 0, 3
SENTINEL_TOP, EOS = 32_099, 1  # T5's <extra_id_0> and </s>


@pytest.fixture(scope="module")
def t5_cases(shared_data: Path) -> dict[str, Any]:
    cases: dict[str, Any] = json.loads((shared_data / T5_CASES).read_text())
    return cases


def bert_rows(n: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] + content in [10, 1000) + [SEP], then padding; rows of random length."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(8, length + 1, n)  # (N,) with the specials
    col = np.arange(length)[None, :]
    ids = rng.integers(10, 1000, (n, length))
    ids = np.where(col == lens[:, None] - 1, SEP, ids)
    ids = np.where(col >= lens[:, None], PAD, ids)
    ids[:, 0] = CLS
    return ids, ids >= 10


def expected_counts(maskable: np.ndarray, keys: np.ndarray, cfg: MaskConfig) -> np.ndarray:
    """Per-row counts by the rule: floor or ceil of n * p, at least 1, at most the cap."""
    n = maskable.sum(axis=1)
    k = num_to_predict(n, keys, cfg)
    exact = n * cfg.masked_lm_prob
    lo = np.minimum(cfg.max_predictions_per_seq, np.maximum(1, np.floor(exact)))
    hi = np.minimum(cfg.max_predictions_per_seq, np.maximum(1, np.ceil(exact)))
    assert np.all(((k == lo) | (k == hi))[n > 0])
    assert np.all(k[n == 0] == 0)
    return k


def assert_within_4_se(observed: float, expected: float, se: float) -> None:
    assert abs(observed - expected) <= 4 * se, (observed, expected, se)


# --- counter-based randomness ---------------------------------------------------------


def test_sample_keys_are_distinct_and_depend_on_seed_epoch_and_index() -> None:
    keys = sample_keys(7, 0, np.arange(100_000))
    assert keys.dtype == np.uint64
    assert keys.shape == (100_000,)
    assert np.unique(keys).size == keys.size
    assert not np.array_equal(keys, sample_keys(8, 0, np.arange(100_000)))
    assert not np.array_equal(keys, sample_keys(7, 1, np.arange(100_000)))
    assert np.array_equal(keys[[5, 3]], sample_keys(7, 0, np.array([5, 3])))


@pytest.mark.parametrize(
    ("seed", "epoch", "indices"),
    [(-1, 0, [0]), (0, -1, [0]), (0, 0, [-1]), (0, 0, [0.5]), (0, 0, [[0]]), (2**64, 0, [0])],
)
def test_sample_keys_rejects_invalid_inputs(seed: int, epoch: int, indices: list[Any]) -> None:
    with pytest.raises(ValueError, match="must"):
        sample_keys(seed, epoch, np.array(indices))


def test_counter_uniform_row_does_not_depend_on_batch_or_width() -> None:
    keys = sample_keys(3, 2, np.array([11, 5, 999_999, 0, 42]))
    full = counter_uniform(keys, 64, stream=9)
    for i in range(keys.size):
        assert np.array_equal(counter_uniform(keys[i : i + 1], 64, stream=9)[0], full[i])
    assert np.array_equal(counter_uniform(keys[::-1], 32, stream=9), full[::-1, :32])
    assert not np.array_equal(counter_uniform(keys, 64, stream=10), full)


def test_counter_uniform_is_uniform_in_unit_interval() -> None:
    u = counter_uniform(sample_keys(0, 0, np.arange(2_000)), 100, stream=1).ravel()
    assert u.min() >= 0.0
    assert u.max() < 1.0
    counts = np.bincount((u * 100).astype(np.int64), minlength=100)  # 100 equal bins
    expected = u.size / 100
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 99 + 5 * math.sqrt(2 * 99)  # dof 99: mean 99, sd 14.1
    s, i = np.sort(u), np.arange(u.size)
    ks = max((((i + 1) / u.size) - s).max(), (s - i / u.size).max())  # sup |ECDF - x|
    assert ks * math.sqrt(u.size) < 1.95  # Kolmogorov: P(> 1.95) ~ 0.001


def test_counter_streams_and_neighbouring_samples_are_uncorrelated() -> None:
    keys = sample_keys(0, 0, np.arange(20_001))  # consecutive indices: the hardest case
    a = counter_uniform(keys, 8, stream=1)
    pairs = [
        (a.ravel(), counter_uniform(keys, 8, stream=2).ravel()),  # two streams, same spot
        (a[:-1].ravel(), a[1:].ravel()),  # neighbouring samples
        (a[:, :-1].ravel(), a[:, 1:].ravel()),  # neighbouring positions
    ]
    for x, y in pairs:
        assert abs(np.corrcoef(x, y)[0, 1]) < 4 / math.sqrt(x.size)


def test_hash32_rows_are_distinct_uniform_and_uncorrelated() -> None:
    keys = sample_keys(0, 0, np.arange(20_001))  # consecutive indices: the hardest case
    h = hash32(row_bases(keys, 1)[:, None], np.arange(64)[None, :])  # (N, 64) uint32
    assert h.dtype == np.uint32
    assert all(np.unique(row).size == row.size for row in h[:500])  # a bijection of the column
    counts = np.bincount((h >> np.uint32(24)).ravel(), minlength=256)  # the top byte
    expected = h.size / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 255 + 5 * math.sqrt(2 * 255)
    for bit in (0, 7, 16, 31):  # low bits too, though priorities use only the high ones
        ones = float(((h >> np.uint32(bit)) & np.uint32(1)).mean())
        assert_within_4_se(ones, 0.5, math.sqrt(0.25 / h.size))
    other = hash32(row_bases(keys, 2)[:, None], np.arange(64)[None, :])
    top = h >> np.uint32(28)  # joint law of the top 4 bits of neighbours: 256 equal cells
    for x, y in ((top[:-1], top[1:]), (top[:, :-1], top[:, 1:]), (top, other >> np.uint32(28))):
        pairs = np.bincount((x * np.uint32(16) + y).ravel(), minlength=256)
        expected = x.size / 256
        chi2 = float(((pairs - expected) ** 2 / expected).sum())
        assert chi2 < 255 + 5 * math.sqrt(2 * 255)  # rows, columns, streams


def test_choose_by_rank_draws_every_subset_uniformly() -> None:
    n, width, k = 30_000, 10, 3  # all C(10, 3) = 120 subsets equally likely
    keys = sample_keys(4, 0, np.arange(n))
    candidates = np.ones((n, width), dtype=bool)
    rows, cols = _choose_by_rank(keys, candidates, np.full(n, k), stream=1)
    assert np.array_equal(rows, np.repeat(np.arange(n), k))
    chosen = np.zeros((n, width), dtype=bool)
    chosen[rows, cols] = True
    assert (chosen.sum(axis=1) == k).all()  # distinct positions
    code = (chosen * (1 << np.arange(width))).sum(axis=1)  # the subset as a bit mask
    counts = np.unique(code, return_counts=True)[1]
    assert counts.size == math.comb(width, k)
    expected = n / counts.size
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 119 + 5 * math.sqrt(2 * 119)


def test_choose_by_rank_takes_only_candidates_and_exact_counts() -> None:
    rng = np.random.default_rng(3)
    n, width = 2_000, 200  # not a power of two: 8 column bits
    candidates = rng.random((n, width)) < rng.random((n, 1))
    count = np.minimum(candidates.sum(axis=1), rng.integers(0, 40, n))
    rows, cols = _choose_by_rank(sample_keys(1, 2, np.arange(n)), candidates, count, stream=1)
    assert candidates[rows, cols].all()
    assert np.bincount(rows, minlength=n).tolist() == count.tolist()
    assert np.unique(rows * width + cols).size == rows.size


# --- BERT masking ---------------------------------------------------------------------


def test_mask_tokens_labels_restore_originals_and_leave_the_rest_alone() -> None:
    ids, maskable = bert_rows(500, 64, seed=1)
    res = mask_tokens(
        ids,
        maskable,
        None,
        sample_keys(1, 0, np.arange(500)),
        MaskConfig(),
        MASK,
        np.arange(10, 1000),
    )
    chosen = res.labels != IGNORE_INDEX
    assert np.array_equal(res.labels[chosen], ids[chosen])
    assert np.array_equal(res.input_ids[~chosen], ids[~chosen])
    assert res.input_ids.dtype == ids.dtype
    assert not (chosen & ~maskable).any()
    assert res.chosen == chosen.sum() == res.masked + res.randomized + res.kept
    assert res.maskable == maskable.sum()


def test_mask_tokens_never_chooses_non_maskable_and_respects_the_cap() -> None:
    rng = np.random.default_rng(2)
    n, length = 400, 1_024
    ids = rng.integers(10, 1000, (n, length))
    maskable = rng.random((n, length)) < rng.random((n, 1))  # densities from 0 to 1
    maskable[:3] = False  # empty rows predict nothing
    maskable[3, :] = False
    maskable[3, 17] = True  # a single maskable token is always predicted
    cfg = MaskConfig(max_predictions_per_seq=60)
    res = mask_tokens(
        ids, maskable, None, sample_keys(5, 0, np.arange(n)), cfg, MASK, np.arange(10, 20)
    )
    chosen = res.labels != IGNORE_INDEX
    assert not (chosen & ~maskable).any()
    want = expected_counts(maskable, sample_keys(5, 0, np.arange(n)), cfg)
    assert chosen.sum(axis=1).tolist() == want.tolist()
    assert max(want) == 60  # the cap did bind
    assert chosen[3, 17]


def test_mask_tokens_statistics_follow_the_bert_recipe() -> None:
    n, length = 10_000, 128
    ids, maskable = bert_rows(n, length, seed=3)
    cfg = MaskConfig()
    pool = np.arange(1_000, 1_100)  # disjoint from the originals, so randomised spots show
    res = mask_tokens(ids, maskable, None, sample_keys(11, 0, np.arange(n)), cfg, MASK, pool)
    chosen = res.labels != IGNORE_INDEX
    n_maskable = maskable.sum(axis=1)
    k = expected_counts(maskable, sample_keys(11, 0, np.arange(n)), cfg)
    assert (k < cfg.max_predictions_per_seq).all()
    assert np.array_equal(chosen.sum(axis=1), k)
    # Random rounding makes the rate unbiased: 15 % within 4 SE of the rounding noise alone.
    frac = np.modf(n_maskable * 0.15)[0]
    expected = np.maximum(1, n_maskable * 0.15).sum()
    assert_within_4_se(k.sum(), expected, math.sqrt((frac * (1 - frac)).sum()))
    # Each maskable position is chosen with probability k/n, independently across rows.
    p = k / n_maskable
    last = n_maskable  # content runs from column 1 to column n_maskable
    for col in (np.ones(n, dtype=np.int64), 1 + n_maskable // 2, last):
        hits = chosen[np.arange(n), col].sum()
        assert_within_4_se(hits, p.sum(), math.sqrt((p * (1 - p)).sum()))
    # 80/10/10: one independent draw per chosen position.
    m = int(chosen.sum())
    masked = chosen & (res.input_ids == MASK)
    randomized = chosen & (res.input_ids >= 1_000)
    kept = chosen & (res.input_ids == ids)
    assert (masked | randomized | kept)[chosen].all()
    assert (res.masked, res.randomized, res.kept) == (masked.sum(), randomized.sum(), kept.sum())
    for count, share in ((masked.sum(), 0.8), (randomized.sum(), 0.1), (kept.sum(), 0.1)):
        assert_within_4_se(count / m, share, math.sqrt(share * (1 - share) / m))
    drawn = np.bincount(res.input_ids[randomized] - 1_000, minlength=pool.size)
    expected = randomized.sum() / pool.size
    chi2 = float(((drawn - expected) ** 2 / expected).sum())
    assert chi2 < 99 + 5 * math.sqrt(2 * 99)


def test_mask_tokens_row_results_do_not_depend_on_the_batch() -> None:
    ids, maskable = bert_rows(60, 96, seed=4)
    keys = sample_keys(2, 3, np.arange(1_000, 1_060))
    cfg, pool = MaskConfig(), np.arange(10, 1000)
    whole = mask_tokens(ids, maskable, None, keys, cfg, MASK, pool)
    pick = np.array([59, 0, 31, 30])
    part = mask_tokens(ids[pick], maskable[pick], None, keys[pick], cfg, MASK, pool)
    assert np.array_equal(part.input_ids, whole.input_ids[pick])
    assert np.array_equal(part.labels, whole.labels[pick])
    alone = mask_tokens(ids[7:8], maskable[7:8], None, keys[7:8], cfg, MASK, pool)
    assert np.array_equal(alone.labels[0], whole.labels[7])


@pytest.mark.parametrize(
    ("mask_prob", "random_prob", "expect"),
    [(1.0, 0.0, "masked"), (0.0, 1.0, "randomized"), (0.0, 0.0, "kept"), (0.2, 0.8, None)],
)
def test_mask_tokens_shares_at_the_edges(
    mask_prob: float, random_prob: float, expect: str | None
) -> None:
    ids, maskable = bert_rows(200, 32, seed=8)
    cfg = MaskConfig(mask_token_prob=mask_prob, random_token_prob=random_prob)
    pool = np.arange(1_000, 1_100)
    res = mask_tokens(ids, maskable, None, sample_keys(3, 0, np.arange(200)), cfg, MASK, pool)
    counts = {"masked": res.masked, "randomized": res.randomized, "kept": res.kept}
    if expect is not None:
        assert counts[expect] == res.chosen > 0
    else:
        assert res.kept == 0
        assert res.masked > 0
    assert (res.input_ids[res.labels != IGNORE_INDEX] >= 1_000).sum() == res.randomized


def test_mask_config_rejects_shares_over_one_and_unknown_fields() -> None:
    with pytest.raises(ValidationError):
        MaskConfig(mask_token_prob=0.9, random_token_prob=0.2)
    with pytest.raises(ValidationError):
        MaskConfig(mlm_probability=0.15)  # type: ignore[call-arg]


def test_mask_tokens_whole_word_needs_word_starts() -> None:
    ids, maskable = bert_rows(2, 16, seed=0)
    with pytest.raises(ValueError, match="word_starts"):
        mask_tokens(
            ids,
            maskable,
            None,
            sample_keys(0, 0, np.arange(2)),
            MaskConfig(whole_word=True),
            MASK,
            np.arange(10, 20),
        )


# --- whole-word masking ---------------------------------------------------------------

SPECIALS = ["<pad>", "<s>", "</s>", "<mask>", "<unk>"]  # ids 0-4 in every vocabulary
VOCABS = {  # (non-special tokens, their expected word-start flags)
    "wordpiece": (
        ["the", "cat", "##s", "run", "##ning", "##ly", "un", "##believ", "##able", ".", ","],
        [1, 1, 0, 1, 0, 0, 1, 0, 0, 1, 1],
    ),
    "bpe": (
        ["Ġthe", "the", "Ġcat", "s", "Ġrun", "ning", "ly", "Ġun", "believ", "able", ".", "Ġ,", "Ġ"],
        [1, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 1],
    ),
    "unigram": (
        ["▁the", "the", "▁cat", "s", "▁run", "ning", "ly", "▁un", "believ", "able", ".", "▁", ","],
        [1, 0, 1, 0, 1, 0, 0, 1, 0, 0, 0, 1, 0],
    ),
}


def vocab(family: str) -> tuple[list[str], set[int], list[bool]]:
    words, starts = VOCABS[family]
    return (
        SPECIALS + words,
        set(range(len(SPECIALS))),
        [True] * len(SPECIALS) + [bool(s) for s in starts],
    )


@pytest.mark.parametrize("family", sorted(VOCABS))
def test_word_start_table_marks_word_starts_per_family(family: str) -> None:
    tokens, specials, expected = vocab(family)
    table = word_start_table(tokens, family, specials)  # type: ignore[arg-type]
    assert table.dtype == np.bool_
    assert table.tolist() == expected


def test_word_start_table_rejects_unknown_family_and_foreign_special_ids() -> None:
    with pytest.raises(ValueError, match="family"):
        word_start_table(["a"], "bytes", set())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="special_ids"):
        word_start_table(["a"], "bpe", {1})


def words_of_row(maskable: np.ndarray, starts: np.ndarray) -> list[list[int]]:
    """Each word's positions, by the definition: a start plus the following continuations."""
    words: list[list[int]] = []
    for j in range(maskable.size):
        if not maskable[j]:
            continue
        if starts[j] or j == 0 or not maskable[j - 1]:
            words.append([j])
        else:
            words[-1].append(j)
    return words


@pytest.mark.parametrize("family", sorted(VOCABS))
@pytest.mark.parametrize("cap", [80, 4])
def test_whole_word_masking_never_splits_a_word(family: str, cap: int) -> None:
    tokens, specials, _ = vocab(family)
    table = word_start_table(tokens, family, specials)  # type: ignore[arg-type]
    n, length = 1_000, 48
    rng = np.random.default_rng(6)
    ids = rng.integers(5, len(tokens), (n, length))  # any non-special token, in any order
    lens = rng.integers(4, length + 1, n)
    col = np.arange(length)[None, :]
    ids = np.where(col == lens[:, None] // 2, 2, ids)  # a separator between two segments
    ids = np.where(col == lens[:, None] - 1, 2, np.where(col >= lens[:, None], 0, ids))
    ids[:, 0] = 1
    maskable = ids >= 5
    cfg = MaskConfig(whole_word=True, max_predictions_per_seq=cap, masked_lm_prob=0.25)
    res = mask_tokens(
        ids,
        maskable,
        table[ids],
        sample_keys(9, 0, np.arange(n)),
        cfg,
        3,
        np.arange(5, len(tokens)),
    )
    chosen = res.labels != IGNORE_INDEX
    assert not (chosen & ~maskable).any()
    want = expected_counts(maskable, sample_keys(9, 0, np.arange(n)), cfg)
    for i in range(n):
        k = int(want[i])
        taken = int(chosen[i].sum())
        assert taken <= k
        for word in words_of_row(maskable[i], table[ids[i]]):
            picked = chosen[i, word]
            assert picked.all() or not picked.any(), (i, word)
            # BERT skips a word only when it no longer fits, and the room only shrinks.
            if not picked.any():
                assert len(word) > k - taken
    assert chosen.any(axis=1).sum() > 0.9 * n


def test_greedy_fill_matches_berts_sequential_rule() -> None:
    rng = np.random.default_rng(8)
    sizes = rng.integers(1, 7, (500, 40))
    sizes[rng.random((500, 40)) < 0.2] = 0  # padding slots hold no word
    budget = rng.integers(0, 40, 500)
    taken = _greedy_fill(sizes, budget)
    for i in range(500):
        left, want = int(budget[i]), []
        for s in sizes[i].tolist():
            fits = 0 < s <= left
            want.append(fits)
            left -= s if fits else 0
        assert taken[i].tolist() == want


# --- T5 span corruption: reference values ---------------------------------------------


def test_random_spans_helper_reproduces_the_reference_cases(t5_cases: dict[str, Any]) -> None:
    cases = t5_cases["random_spans_helper"]["cases"]
    assert len(cases) == 2
    for case in cases:
        got = random_spans_helper(
            case["inputs_length"],
            case["noise_density"],
            case["mean_noise_span_length"],
            case["extra_tokens_per_span_inputs"],
            case["extra_tokens_per_span_targets"],
        )
        assert got == tuple(case["expected"])


def lengths_by_definition(raw: int, density: float, mean: float) -> tuple[int, int]:
    """(inputs, targets) lengths of a raw length, word for word from the reference JSON."""
    num_noise = round(raw * density)
    num_spans = round(num_noise / mean)
    return raw - num_noise + num_spans + 1, num_noise + num_spans + 1


GRID = [
    (inputs, density, mean)
    for inputs in (5, 20, 64, 101, 512, 513)
    for density in (0.1, 0.15, 0.25, 0.5)
    for mean in (1.0, 2.0, 3.0)
]


def test_random_spans_helper_follows_the_reference_definition_with_bankers_rounding() -> None:
    for inputs, density, mean in GRID:
        fits = [
            t
            for t in range(inputs - 1, 3 * inputs)
            if lengths_by_definition(t, density, mean)[0] <= inputs
        ]
        raw = max([inputs - 1, *fits])
        targets = lengths_by_definition(raw, density, mean)[1]
        if density == 0.5 and targets > lengths_by_definition(raw, density, mean)[0]:
            raw, targets = raw - 1, targets - 1
        assert random_spans_helper(inputs, density, mean) == (raw, targets), (inputs, density)
    # Ties go to even: 10 * 0.25 = 2.5 noise tokens round to 2 (half-up would say 3 and 7).
    assert random_spans_helper(11, 0.25, 1.0) == (10, 5)


def test_span_corrupt_lengths_are_the_ones_the_helper_promises() -> None:
    # From 20 tokens on no count needs T5's clipping to at least one noise token and span.
    for inputs, density, mean in [case for case in GRID if case[0] >= 20]:
        raw, targets = random_spans_helper(inputs, density, mean)
        tokens = np.random.default_rng(inputs).integers(5, 32_000, (3, raw))
        cfg = SpanConfig(noise_density=density, mean_noise_span_length=mean)
        got_in, got_tg, _ = span_corrupt(
            tokens, sample_keys(0, 0, np.arange(3)), cfg, SENTINEL_TOP, EOS
        )
        assert got_in.shape[1] == lengths_by_definition(raw, density, mean)[0] <= inputs
        assert got_tg.shape[1] <= targets if density == 0.5 else got_tg.shape[1] == targets


def test_span_corrupt_fills_the_published_512_and_114(t5_cases: dict[str, Any]) -> None:
    ref = t5_cases["pretraining_sequence_lengths"]
    defaults = ref["span_corruption_defaults"]
    cfg = SpanConfig(
        noise_density=defaults["noise_density"],
        mean_noise_span_length=defaults["mean_noise_span_length"],
    )
    assert cfg == SpanConfig()
    raw, targets_len = random_spans_helper(
        ref["sequence_length"]["inputs"], cfg.noise_density, cfg.mean_noise_span_length
    )
    assert (raw, targets_len) == (568, ref["sequence_length"]["targets"])
    tokens = np.random.default_rng(0).integers(5, 32_000, (16, raw))
    inputs, targets, noise = span_corrupt(
        tokens, sample_keys(0, 0, np.arange(16)), cfg, SENTINEL_TOP, EOS
    )
    assert inputs.shape == (16, 512)
    assert targets.shape == (16, 114)
    assert noise.shape == (16, 568)
    empty = span_corrupt(tokens[:0], sample_keys(0, 0, np.arange(0)), cfg, SENTINEL_TOP, EOS)
    assert [a.shape for a in empty] == [(0, 512), (0, 114), (0, 568)]


def test_noise_span_mask_reference_facts(t5_cases: dict[str, Any]) -> None:
    case, zero = t5_cases["random_spans_noise_mask"]["cases"]
    facts = case["rng_independent_checks"]
    cfg = SpanConfig(
        noise_density=case["noise_density"], mean_noise_span_length=case["mean_noise_span_length"]
    )
    masks = noise_span_mask(case["length"], sample_keys(0, 0, np.arange(1_000)), cfg)
    tf_mask = np.array([case["expected_mask_tf_stateless_rng"]], dtype=bool)
    for m in (masks, tf_mask):  # ours and TensorFlow's satisfy the same facts
        starts = m & ~np.pad(m, ((0, 0), (1, 0)))[:, :-1]
        assert (m.sum(axis=1) == facts["num_noise_tokens"]).all()
        assert (starts.sum(axis=1) == facts["num_noise_spans"]).all()
        assert (m[:, 0] == facts["first_position_is_noise"]).all()
    assert len({r.tobytes() for r in masks}) > 900  # the layout itself is random
    zero_cfg = SpanConfig(
        noise_density=zero["noise_density"], mean_noise_span_length=zero["mean_noise_span_length"]
    )
    got = noise_span_mask(zero["length"], sample_keys(0, 0, np.arange(3)), zero_cfg)
    assert np.array_equal(got, np.tile(np.array(zero["expected_mask"], dtype=bool), (3, 1)))


def test_sentinel_transforms_match_the_reference(t5_cases: dict[str, Any]) -> None:
    ref = t5_cases["sentinel_transforms"]
    tokens, noise, vocab = np.array(ref["tokens"]), np.array(ref["noise_mask"]), ref["vocab_size"]
    with_vocab = {
        "noise_token_to_sentinel": noise_token_to_sentinel,
        "noise_span_to_sentinel": noise_span_to_sentinel,
        "nonnoise_span_to_sentinel": nonnoise_span_to_sentinel,
        "noise_span_to_unique_sentinel": noise_span_to_unique_sentinel,
    }
    without_vocab = {
        "drop_noise_tokens": drop_noise_tokens,
        "drop_nonnoise_tokens": drop_nonnoise_tokens,
    }
    assert set(ref["expected"]) == set(with_vocab) | set(without_vocab)
    for name, expected in ref["expected"].items():
        if name in with_vocab:
            one, two = (
                with_vocab[name](tokens, noise, vocab),
                with_vocab[name](np.stack([tokens] * 3), np.stack([noise] * 3), vocab),
            )
        else:
            one, two = (
                without_vocab[name](tokens, noise),
                without_vocab[name](np.stack([tokens] * 3), np.stack([noise] * 3)),
            )
        assert one.tolist() == expected, name
        assert two.tolist() == [expected] * 3, name
    # Not in the reference: the targets side of span_corruption, by the same rule.
    assert nonnoise_span_to_unique_sentinel(tokens, noise, vocab).tolist() == [10, 11, 999, 14, 998]


def test_sentinel_transforms_reject_rows_of_different_span_counts() -> None:
    tokens = np.arange(12).reshape(2, 6)
    noise = np.array([[1, 0, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], dtype=bool)
    with pytest.raises(ValueError, match="rows keep different"):
        noise_span_to_unique_sentinel(tokens, noise, 100)


# --- T5 span corruption: round trip and statistics ------------------------------------


def merge_at_sentinels(inputs: list[int], targets: list[int]) -> list[int]:
    """Put each target span back in place of its sentinel in the inputs (EOS dropped)."""
    spans: dict[int, list[int]] = {}
    for t in targets[:-1]:
        if t > 32_000:
            current = spans.setdefault(t, [])
        else:
            current.append(t)
    out: list[int] = []
    for t in inputs[:-1]:
        out.extend(spans.pop(t) if t > 32_000 else [t])
    assert not spans  # every target span was used
    return out


@pytest.mark.parametrize(
    ("raw", "density", "mean"), [(568, 0.15, 3.0), (101, 0.3, 1.0), (40, 0.5, 5.0)]
)
def test_span_corrupt_inputs_and_targets_merge_back_to_the_tokens(
    raw: int, density: float, mean: float
) -> None:
    tokens = np.random.default_rng(raw).integers(5, 32_000, (200, raw)).astype(np.int32)
    cfg = SpanConfig(noise_density=density, mean_noise_span_length=mean)
    inputs, targets, noise = span_corrupt(
        tokens, sample_keys(4, 0, np.arange(200)), cfg, SENTINEL_TOP, EOS
    )
    assert inputs.dtype == targets.dtype == np.int32
    assert (inputs[:, -1] == EOS).all()
    assert (targets[:, -1] == EOS).all()
    for i in range(200):
        assert merge_at_sentinels(inputs[i].tolist(), targets[i].tolist()) == tokens[i].tolist()
    n_spans = int((noise[0] & ~np.pad(noise[0], (1, 0))[:-1]).sum())
    sentinels = inputs[:, :-1][inputs[:, :-1] > 32_000].reshape(200, n_spans)
    assert (sentinels == SENTINEL_TOP - np.arange(n_spans)).all()  # counting down, in order


def composition_pmf(items: int, parts: int) -> np.ndarray:
    """P(a given part has length l) when `items` is cut into `parts` uniform positive parts."""
    total = math.comb(items - 1, parts - 1)
    return np.array(
        [0.0]
        + [math.comb(items - size - 1, parts - 2) / total for size in range(1, items - parts + 2)]
    )


def test_noise_span_statistics_over_ten_thousand_rows() -> None:
    n, length = 10_000, 568
    noise = noise_span_mask(length, sample_keys(12, 0, np.arange(n)), SpanConfig())
    assert (noise.sum(axis=1) == 85).all()  # round(568 * 0.15) in every row
    assert abs(85 / 568 - 0.15) <= 0.5 / 568
    edges = np.diff(noise.astype(np.int8), axis=1, prepend=0, append=0)  # +1 start, -1 end
    cols = np.nonzero(edges)[1]
    cols = cols.reshape(n, 56)  # 28 noise spans per row: start, end, start, end, ...
    noise_lens, gap_lens = cols[:, 1::2] - cols[:, ::2], cols[:, 2::2] - cols[:, 1:-1:2]
    assert (noise_lens.sum(axis=1) == 85).all()
    assert noise_lens.mean() == pytest.approx(85 / 28)  # mean span length ~3, exactly
    assert not noise[:, 0].any()
    assert noise[:, -1].all()  # the interleaving ends with a noise span
    assert (gap_lens > 0).all()
    # The first noise span and the first kept span follow T5's uniform segmentation.
    for observed, items in ((noise_lens[:, 0], 85), (cols[:, 0], 483)):
        pmf = composition_pmf(items, 28)
        support = np.arange(pmf.size)
        mean = float((pmf * support).sum())
        sd = math.sqrt(float((pmf * support**2).sum()) - mean**2)
        assert_within_4_se(observed.mean(), mean, sd / math.sqrt(n))
        for size in (1, 2, 3, 5):
            p = pmf[size]
            assert_within_4_se((observed == size).mean(), p, math.sqrt(p * (1 - p) / n))
    assert np.unique(noise_lens).size >= 8  # not degenerate


def test_noise_span_mask_handles_tiny_lengths_like_t5() -> None:
    keys = sample_keys(0, 0, np.arange(4))
    assert noise_span_mask(1, keys, SpanConfig()).tolist() == [[False]] * 4
    assert noise_span_mask(2, keys, SpanConfig()).tolist() == [[False, True]] * 4
    with pytest.raises(ValueError, match="noise spans"):
        noise_span_mask(10, keys, SpanConfig(noise_density=0.9, mean_noise_span_length=1.0))


def test_span_corrupt_row_results_do_not_depend_on_the_batch() -> None:
    tokens = np.random.default_rng(1).integers(5, 32_000, (40, 114))
    keys = sample_keys(1, 1, np.arange(40))
    inputs, targets, _ = span_corrupt(tokens, keys, SpanConfig(), SENTINEL_TOP, EOS)
    pick = np.array([39, 3, 17])
    part_in, part_tg, _ = span_corrupt(tokens[pick], keys[pick], SpanConfig(), SENTINEL_TOP, EOS)
    assert np.array_equal(part_in, inputs[pick])
    assert np.array_equal(part_tg, targets[pick])


# --- determinism across processes -----------------------------------------------------

FINGERPRINT = """
import hashlib
import numpy as np
from tasks.examples.objectives.masking import MaskConfig, mask_tokens, word_start_table
from tasks.examples.objectives.rng import counter_uniform, sample_keys
from tasks.examples.objectives.spans import SpanConfig, span_corrupt

def fingerprint():
    h = hashlib.sha256()
    keys = sample_keys(2024, 3, np.arange(5_000, 5_064))
    rng = np.random.default_rng(0)
    ids = rng.integers(5, 18, (64, 96))
    table = word_start_table(
        ["<pad>", "<s>", "</s>", "<mask>", "<unk>"] + ["Ġa", "b", "Ġc", "d"] * 3 + ["e"], "bpe",
        {0, 1, 2, 3, 4},
    )
    for arr in (
        keys,
        counter_uniform(keys, 33, 5),
        mask_tokens(ids, ids > 6, None, keys, MaskConfig(), 3, np.arange(5, 18)).input_ids,
        mask_tokens(ids, ids > 6, table[ids], keys, MaskConfig(whole_word=True), 3,
                    np.arange(5, 18)).labels,
        *span_corrupt(ids, keys, SpanConfig(), 32099, 1),
    ):
        h.update(np.ascontiguousarray(arr).tobytes())
    return h.hexdigest()
"""


def test_results_are_identical_in_a_separate_process() -> None:
    namespace: dict[str, Any] = {}
    exec(FINGERPRINT, namespace)  # the same code in this process ...
    here = namespace["fingerprint"]()
    there = subprocess.run(  # ... and in a fresh interpreter, with another hash seed
        [sys.executable, "-c", FINGERPRINT + "\nprint(fingerprint())"],
        cwd=REPO,
        env={"PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert there == here
    assert len(here) == len(hashlib.sha256().hexdigest())
