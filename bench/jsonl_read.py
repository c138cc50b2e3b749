"""JSON Lines reading alone: the line splitter of `tasks.ingest.readers` against the general path.

Usage: python bench/jsonl_read.py [--mb 32] [--rounds 5]

Generates --mb MiB of JSON Lines (about 400-byte English-like documents with an `id` and a
`text` field) in memory, then reads it with `tasks.ingest.readers._read_delimited` twice per round,
alternating: once with the line separator (`_emit_lines`: one `bytes.split` per block, orjson
first) and once with an equivalent separator regex that takes the general per-match path (a
regex match, a line count and `emit_bounded`'s checks per record). Both give the same records
(`tests/tasks/ingest/test_readers.py`). Prints the best time of each and the ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.ingest import readers
from tasks.ingest.sources import InputFile, WorkUnit

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "a",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
]


def corpus(mib: int) -> bytes:
    """About `mib` MiB of JSON Lines, seeded."""
    rng = random.Random(0)
    lines, size = [], 0
    while size < mib << 20:
        text = " ".join(rng.choice(WORDS) for _ in range(80)) + '. Mr. Smith said "hello".'
        line = json.dumps({"id": len(lines), "text": text}).encode()
        lines.append(line)
        size += len(line) + 1
    return b"\n".join(lines) + b"\n"


def read(data: bytes, sep: re.Pattern[bytes]) -> tuple[float, int]:
    """Seconds to read every record of `data` with `sep`, and the records read."""
    file = InputFile("bench", "a.jsonl", "a.jsonl", "jsonl", None, len(data))
    unit = WorkUnit(0, file, 0, len(data), False)
    start, records = time.perf_counter(), 0
    for batch in readers._read_delimited(io.BytesIO(data), unit, sep, 1 << 20, "text"):
        records += len(batch.texts)
    return time.perf_counter() - start, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    data = corpus(args.mb)
    paths = {"line splitter": readers._SEPARATORS["line"], "general path": re.compile(rb"(?:\n)")}
    times: dict[str, list[float]] = {name: [] for name in paths}
    counts = set()
    for _ in range(args.rounds):
        for name, sep in paths.items():
            seconds, records = read(data, sep)
            times[name].append(seconds)
            counts.add(records)
    assert len(counts) == 1, counts
    mib = len(data) / 2**20
    for name, values in times.items():
        best = min(values)
        rounded = [round(v, 3) for v in values]
        print(f"{name}: best {best:.3f} s ({mib / best:.0f} MiB/s), all {rounded}")
    print(
        f"{mib:.1f} MiB, {counts.pop():,} records; ratio general/line "
        f"{min(times['general path']) / min(times['line splitter']):.2f}x"
    )


if __name__ == "__main__":
    main()
