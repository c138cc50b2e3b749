"""Decontamination: drop corpus documents that share a long n-gram with downstream eval sets.

Before pretraining uses a corpus, every document that shares any `n`-gram of normalised words
(default 13, as GPT-3 did: Brown et al. 2020, appendix C) with the validation or test texts of
the configured downstream tasks is removed, so that evaluation does not measure memorisation.
Normalisation: lower case, every run of characters that are not letters, marks, digits or
whitespace becomes a space, then split on whitespace ("Don't!" -> `don t`). An n-gram never
crosses a document (or eval text) boundary, so an eval text shorter than `n` words contributes
nothing: choose a smaller `n` for sets of short sentences (CoLA averages about 9 words).

Each word is hashed once per distinct word (xxh3-64); an n-gram's 64-bit hash is a polynomial of
its word hashes mod 2^64, computed for every position at once with NumPy. Eval n-grams are a
sorted array per eval set; a corpus shard is matched with one binary search per n-gram.
`decontaminate` and `eval_ngrams` are pure; `load_eval_ngrams` reads the task files.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash
from pydantic import BaseModel, ConfigDict, Field

from tasks.common import schema
from tasks.downstream.downstream import load_dataset_config, load_downstream

#: Column added to the removed documents: the eval sets they share an n-gram with.
CONTAMINATED_BY = "contaminated_by"
#: Characters that are not letters, combining marks, digits or whitespace (RE2 syntax).
_NOT_WORD = r"[^\p{L}\p{M}\p{N}\s]+"
#: Odd multiplier of the polynomial n-gram hash (odd: multiplication is invertible mod 2^64).
_BASE = np.uint64(0x9E3779B97F4A7C15)
#: Downstream columns whose text can leak into a corpus (every text-valued canonical column).
EVAL_TEXT_COLUMNS = (
    schema.TEXT,
    schema.TEXT_PAIR,
    schema.QUESTION,
    schema.CONTEXT,
    schema.TARGET,
    schema.PROMPT,
    schema.RESPONSE,
)


class EvalTask(BaseModel):
    """One downstream task whose evaluation splits the corpus must not contain."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    config: Path = Field(description="Task YAML file (configs/tasks/*.yaml).")
    base_dir: Path = Field(Path("."), description="Directory the task's relative paths use.")


class DecontaminateConfig(BaseModel):
    """Whether and how to remove corpus documents that overlap downstream eval sets."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    enabled: bool = Field(False, description="Remove contaminated documents before pretraining.")
    n: int = Field(13, ge=1, le=64, description="Words per n-gram (GPT-3 used 13).")
    tasks: list[EvalTask] = Field(
        default_factory=list, description="Downstream tasks whose eval splits are checked."
    )
    eval_splits: list[str] = Field(
        default_factory=lambda: ["validation", "test"],
        description="Which splits of each task count as evaluation data.",
    )


class DecontaminationReport(BaseModel):
    """How many documents were read, kept and removed, and which eval sets caused removals."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    n: int = Field(description="Words per n-gram.")
    documents_read: int = Field(description="Documents checked (= kept + removed).")
    documents_kept: int = Field(description="Documents without any shared n-gram.")
    documents_removed: int = Field(description="Documents removed.")
    removed_by: dict[str, int] = Field(
        description="Eval set -> documents it shares an n-gram with (one may count for several)."
    )
    eval_ngrams: dict[str, int] = Field(description="Eval set -> its distinct n-grams.")

    def merged(self, other: DecontaminationReport) -> DecontaminationReport:
        """Add the counts of another shard's report (same n-grams)."""
        removed_by = dict(self.removed_by)
        for name, count in other.removed_by.items():
            removed_by[name] = removed_by.get(name, 0) + count
        return self.model_copy(
            update={
                "documents_read": self.documents_read + other.documents_read,
                "documents_kept": self.documents_kept + other.documents_kept,
                "documents_removed": self.documents_removed + other.documents_removed,
                "removed_by": removed_by,
            }
        )


def normalized_words(texts: pa.Array | pa.ChunkedArray) -> pa.LargeListArray:
    """Split each text into normalised words: lower case, punctuation and symbols dropped."""
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks()
    cleaned = pc.replace_substring_regex(pc.utf8_lower(texts), _NOT_WORD, " ")
    split = pc.utf8_split_whitespace(cleaned)
    offsets = split.offsets.to_numpy().astype(np.int64)
    flat = split.flatten()
    # utf8_split_whitespace yields "" at the ends of a text with outer spaces; drop them.
    real = np.asarray(pc.greater(pc.binary_length(flat), 0).to_numpy(zero_copy_only=False))
    before = np.concatenate([[0], np.cumsum(real)])  # words kept before each position
    kept = before[offsets - offsets[0]]
    words: pa.LargeListArray = pa.LargeListArray.from_arrays(
        pa.array(kept, pa.int64()), flat.filter(real)
    )
    return words


def word_hashes(words: pa.Array) -> np.ndarray:
    """Return the xxh3-64 hash of each word (uint64), hashing each distinct word once."""
    encoded = pc.dictionary_encode(words)
    distinct = np.fromiter(
        (xxhash.xxh3_64_intdigest(w.encode()) for w in encoded.dictionary.to_pylist()),
        dtype=np.uint64,
        count=len(encoded.dictionary),
    )
    hashes: np.ndarray = distinct[encoded.indices.to_numpy(zero_copy_only=False)]
    return hashes


def ngram_hashes(texts: pa.Array | pa.ChunkedArray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Return the hash of every n-gram within each text and the index of its text.

    Returns:
        (hashes, text index): two arrays of the same length, uint64 and int64.
    """
    words = normalized_words(texts)
    offsets = words.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]
    hashes = word_hashes(words.flatten())
    starts = len(hashes) - n + 1
    if starts <= 0:
        return np.empty(0, np.uint64), np.empty(0, np.int64)
    grams = hashes[:starts].copy()
    for k in range(1, n):  # grams[i] = sum_k hashes[i + k] * BASE^(n - 1 - k), mod 2^64
        grams = grams * _BASE + hashes[k : k + starts]
    text = np.repeat(np.arange(len(words), dtype=np.int64), np.diff(offsets))[:starts]
    inside = np.arange(starts) + n <= offsets[1:][text]  # the n-gram ends inside its text
    return grams[inside], text[inside]


def eval_texts(table: pa.Table) -> pa.Array:
    """Every text of a downstream table that could leak: each text column, tokens joined."""
    parts = [table.column(c).combine_chunks() for c in EVAL_TEXT_COLUMNS if c in table.column_names]
    if schema.TOKENS in table.column_names:
        parts.append(pc.binary_join(table.column(schema.TOKENS), " ").combine_chunks())
    return (
        pa.concat_arrays([p.cast(pa.large_string()) for p in parts])
        if parts
        else pa.array([], pa.large_string())
    )


def eval_ngrams(texts: pa.Array | pa.ChunkedArray, n: int) -> np.ndarray:
    """Return the distinct n-gram hashes of eval texts, sorted (the form `decontaminate` needs)."""
    return np.unique(ngram_hashes(texts, n)[0])


def _hits(hashes: np.ndarray, grams: np.ndarray) -> np.ndarray:
    """True for each hash found in the sorted array `grams` (binary search, vectorised)."""
    if len(grams) == 0:
        return np.zeros(len(hashes), dtype=bool)
    pos = np.minimum(np.searchsorted(grams, hashes), len(grams) - 1)
    found: np.ndarray = grams[pos] == hashes
    return found


def decontaminate(
    table: pa.Table, ngrams: Mapping[str, np.ndarray], n: int
) -> tuple[pa.Table, pa.Table]:
    """Split documents into those that share no n-gram with any eval set and those that do.

    Args:
        table: Documents with a `text` column (e.g. a `schema.DOCUMENTS` shard).
        ngrams: Eval set name -> its sorted distinct n-gram hashes (`eval_ngrams`, same `n`).
        n: Words per n-gram.

    Returns:
        (kept, removed): `kept` has `table`'s schema; `removed` adds `contaminated_by`, the
        names of the eval sets each removed document overlaps.
    """
    schema.require_columns(table, schema.TEXT)
    for name, grams in ngrams.items():
        if len(grams) > 1 and not bool(np.all(grams[1:] > grams[:-1])):
            raise ValueError(f"n-grams of {name!r} must be sorted and distinct (use eval_ngrams)")
    hashes, doc = ngram_hashes(table.column(schema.TEXT), n)
    per_set = {}
    for name, grams in ngrams.items():
        touched = np.zeros(table.num_rows, dtype=bool)
        touched[doc[_hits(hashes, grams)]] = True
        per_set[name] = touched
    dirty = np.zeros(table.num_rows, dtype=bool)
    for touched in per_set.values():
        dirty |= touched
    rows = np.flatnonzero(dirty)
    by = [[name for name, touched in per_set.items() if touched[row]] for row in rows]
    removed = table.take(pa.array(rows, pa.int64())).append_column(
        CONTAMINATED_BY, pa.array(by, pa.list_(pa.string()))
    )
    return table.filter(pa.array(~dirty)), removed


def decontamination_report(
    kept: pa.Table, removed: pa.Table, ngrams: Mapping[str, np.ndarray], n: int
) -> DecontaminationReport:
    """Count what `decontaminate` did: read = kept + removed, removals per eval set."""
    removed_by = dict.fromkeys(ngrams, 0)
    if removed.num_rows:
        counts = pc.value_counts(pc.list_flatten(removed.column(CONTAMINATED_BY))).to_pylist()
        removed_by |= {c["values"]: c["counts"] for c in counts}
    return DecontaminationReport(
        n=n,
        documents_read=kept.num_rows + removed.num_rows,
        documents_kept=kept.num_rows,
        documents_removed=removed.num_rows,
        removed_by=removed_by,
        eval_ngrams={name: len(grams) for name, grams in ngrams.items()},
    )


def load_eval_ngrams(cfg: DecontaminateConfig) -> dict[str, np.ndarray]:
    """Read each configured task's eval splits and return `<task>/<split>` -> its n-grams.

    Splits of `eval_splits` that a task does not have are skipped.
    """
    ngrams: dict[str, np.ndarray] = {}
    for ref in cfg.tasks:
        data = load_downstream(load_dataset_config(ref.config), ref.base_dir)
        for split in cfg.eval_splits:
            if split in data.splits:
                texts = eval_texts(data.splits[split])
                ngrams[f"{data.name}/{split}"] = eval_ngrams(texts, cfg.n)
    return ngrams
