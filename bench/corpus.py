"""The synthetic JSON-Lines corpus of the data-stage benchmarks, built from the real texts.

bench/tokenizer_encode.py and bench/examples_throughput.py measure lmpipe's stages on the
same corpus: documents of real sentences from ../shared/data (the Gutenberg books, Tiny
Shakespeare and the IMDB reviews), one word in five swapped for a pseudo-word, up to a size
in MiB (`write_corpus`), ingested with the same config (`jsonl_ingest_config`), and read back
from the ingest's shards (`documents`, and `segments_of`: the sentence segments the encode
stage cuts). It imports `tasks`: import it after a script has put the repository on sys.path.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from harness import SHARED

from tasks.common import schema
from tasks.common.io import read_ipc_stream
from tasks.common.stage import shards_of
from tasks.encode.encode import sentence_segments
from tasks.ingest.text import SentenceConfig, split_sentences

_ONSETS = [
    *("", "b", "br", "c", "ch", "d", "f", "g", "gr", "h", "k", "l", "m", "n"),
    *("p", "pr", "qu", "r", "s", "sh", "st", "t", "th", "tr", "v", "w", "z"),
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y"]
_CODAS = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck"]


def real_sentences() -> list[list[str]]:
    """Sentences of each real text in ../shared/data, one list per source document."""
    texts = []
    for book in sorted((SHARED / "gutenberg_books").glob("*.txt")):
        raw = book.read_text(encoding="utf-8-sig").replace("\r\n", "\n")
        texts.append(" ".join(raw.split()))
    texts.append(" ".join((SHARED / "tiny_shakespeare" / "input.txt").read_text().split()))
    with open(SHARED / "imdb_sample" / "texts.csv", newline="", encoding="utf-8") as handle:
        texts += [row["text"] for row in csv.DictReader(handle)]
    column = split_sentences(pa.array(texts, pa.large_string()), SentenceConfig())
    return [s for s in column.to_pylist() if s]


def pseudo_words(count: int, rng: random.Random) -> list[str]:
    """`count` distinct pronounceable pseudo-words of 1-4 syllables."""
    words: set[str] = set()
    while len(words) < count:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        words.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    return sorted(words)


def write_corpus(path: Path, mib: int, seed: int = 0) -> Path:
    """Write documents of 4-40 real sentences until `mib` MiB, a fifth of their words swapped.

    The sentences come from the real texts, drawn at random (not as windows of consecutive
    ones, which repeat long passages and make suffix-array trainers like sentencepiece far
    slower than real text does). One word in five is replaced by a pseudo-word drawn from a
    Zipf law over a 2-million-word lexicon, so the vocabulary keeps growing with the corpus as
    real text does (Heaps' law) instead of stopping at the few megabytes of real text.
    """
    if path.exists() and path.stat().st_size >= mib << 20:
        return path
    rng = random.Random(seed)
    pool = [sentence.split(" ") for source in real_sentences() for sentence in source]
    lexicon = pseudo_words(2_000_000, rng)
    np_rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with open(path, "w", encoding="utf-8") as handle:
        while written < mib << 20:
            lines = []
            for _ in range(1000):
                words = [w for s in rng.choices(pool, k=rng.randint(4, 40)) for w in s]
                swap = np.flatnonzero(np_rng.random(len(words)) < 0.2)
                picks = (np_rng.zipf(1.2, len(swap)) - 1) % len(lexicon)
                for i, pick in zip(swap, picks, strict=True):
                    words[i] = lexicon[pick]
                lines.append(json.dumps({"text": " ".join(words)}))
            block = "\n".join(lines) + "\n"
            handle.write(block)
            written += len(block.encode())
    return path


def jsonl_ingest_config(corpus: Path) -> Any:
    """Build the ingest config of the corpus: no near-duplicate pass, 64 MB shards."""
    from tasks.ingest.ingest import IngestConfig
    from tasks.ingest.sources import SourceConfig

    return IngestConfig(
        sources=[SourceConfig(path=str(corpus), format="jsonl")],
        dedup={"near": {"enabled": False}},  # type: ignore[arg-type]
        shard_size_mb=64,
        unit_size_mb=32,
    )


def documents(ingest: Path, split: str | None) -> list[str]:
    """The ingested texts of one split (or all), in shard order, as a Python list."""
    manifest = json.loads((ingest / "manifest.json").read_text())
    texts: list[str] = []
    for _, shard in shards_of(manifest, split):
        texts += read_ipc_stream(ingest / shard["name"], [schema.TEXT]).column(0).to_pylist()
    return texts


def segments_of(ingest: Path) -> tuple[list[str], list[str], np.ndarray]:
    """Every document's id and sentence segments as the encode stage cuts them, in shard order.

    Returns the document ids, the segments of all documents in order, and each document's
    segment count; the segments of a document join back to its text exactly.
    """
    manifest = json.loads((ingest / "manifest.json").read_text())
    doc_ids: list[str] = []
    segments: list[str] = []
    counts = []
    for _, shard in shards_of(manifest):
        columns = [schema.DOC_ID, schema.TEXT, schema.SENTENCES]
        table = read_ipc_stream(ingest / shard["name"], columns)
        ids = table.column(schema.DOC_ID).to_pylist()
        texts = table.column(schema.TEXT).to_pylist()
        segs, count = sentence_segments(ids, texts, table.column(schema.SENTENCES).to_pylist())
        doc_ids += ids
        segments += segs
        counts.append(count)
    return doc_ids, segments, np.concatenate(counts)
