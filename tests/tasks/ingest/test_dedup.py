"""Content hashes and document ids computed on Arrow buffers against their plain definitions."""

import numpy as np
import pyarrow as pa
import pytest
import xxhash

from tasks.ingest.dedup import content_hashes, hex_ids

TEXTS = ["", "a", "Doc 1. Two sentences.", "ünïcödé and emoji 🙂", "a" * 5000, "line\nbreak", ""]


def reference(texts: list[str]) -> tuple[list[int], list[int]]:
    digests = [xxhash.xxh3_128_intdigest(t.encode()) for t in texts]
    return [d >> 64 for d in digests], [d & (2**64 - 1) for d in digests]


@pytest.mark.parametrize("arrow_type", [pa.string(), pa.large_string()])
def test_content_hashes_equal_xxh3_128_of_the_utf8_bytes(arrow_type: pa.DataType) -> None:
    values = pa.array(TEXTS * 3, arrow_type)
    columns = {
        "whole": values,
        "sliced": values.slice(5, 9),
        "chunked": pa.chunked_array([values.slice(0, 4), values.slice(4, 0), values.slice(10, 8)]),
        "empty": pa.array([], arrow_type),
    }
    for name, column in columns.items():
        hi, lo = content_hashes(column)
        want_hi, want_lo = reference(column.to_pylist())
        assert hi.dtype == lo.dtype == np.uint64, name
        assert hi.tolist() == want_hi, name
        assert lo.tolist() == want_lo, name


def test_content_hashes_refuse_nulls_and_other_types() -> None:
    with pytest.raises(ValueError, match="1 nulls"):
        content_hashes(pa.array(["a", None]))
    with pytest.raises(TypeError, match="string column"):
        content_hashes(pa.array([1, 2]))


def test_hex_ids_equal_the_formatted_128_bit_value() -> None:
    rng = np.random.default_rng(0)
    hi = rng.integers(0, 2**64, 200, dtype=np.uint64)
    lo = rng.integers(0, 2**64, 200, dtype=np.uint64)
    hi[:3] = [0, 2**64 - 1, 1]
    lo[:3] = [0, 2**64 - 1, 2**63]
    got = hex_ids(hi, lo)
    got.validate(full=True)
    assert got.type == pa.string()
    assert got.to_pylist() == [
        f"{(int(h) << 64) | int(low):032x}" for h, low in zip(hi, lo, strict=True)
    ]
    assert hex_ids(hi[:0], lo[:0]).to_pylist() == []
    with pytest.raises(ValueError, match="one length"):
        hex_ids(hi, lo[:5])
