import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from pydantic import BaseModel, SecretStr

from tasks.common.io import (
    DigestSink,
    UnsafePathError,
    arrow_of,
    atomic_writer,
    digest_file,
    file_matches,
    fingerprint,
    numpy_of,
    public_dump,
    read_ipc_stream,
    repeat_string,
    safe_join,
    sha256_file,
    write_ipc_stream,
)


@pytest.mark.parametrize(
    "name",
    [
        "../escape",
        "a/../../b",
        "/etc/passwd",
        "~/x",
        "C:/win",
        "a\\..\\b",
        "%2e%2e/x",
        "%252e%252e/x",
        "a/%2E%2E/%2E%2E/b",
        "\uff0e\uff0e/x",
        "a\x00b",
        "",
        "a//b",
        "./a",
    ],
)
def test_safe_join_refuses_names_that_escape(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafePathError):
        safe_join(tmp_path, name)


def test_safe_join_accepts_plain_relative_names(tmp_path: Path) -> None:
    assert (
        safe_join(tmp_path, "runs/bert-tiny/ckpt.pt")
        == (tmp_path / "runs/bert-tiny/ckpt.pt").resolve()
    )


def test_safe_join_refuses_symlink_out_of_root(tmp_path: Path) -> None:
    (tmp_path / "link").symlink_to("/")
    with pytest.raises(UnsafePathError, match="outside"):
        safe_join(tmp_path, "link/etc/passwd")


def test_atomic_writer_leaves_nothing_under_final_name_on_error(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"

    def crash_mid_write() -> None:
        with atomic_writer(target) as handle:
            handle.write(b"partial")
            raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        crash_mid_write()
    assert list(tmp_path.iterdir()) == []


def test_ipc_stream_round_trips_and_is_byte_stable(tmp_path: Path) -> None:
    table = pa.table({"a": [1, 2, 3], "b": ["x", "y", "z"]})
    write_ipc_stream(table, tmp_path / "one.arrow")
    write_ipc_stream(table, tmp_path / "two.arrow")
    assert read_ipc_stream(tmp_path / "one.arrow").equals(table)
    assert (tmp_path / "one.arrow").read_bytes() == (tmp_path / "two.arrow").read_bytes()


def test_fingerprint_ignores_key_order_and_sees_values() -> None:
    assert fingerprint({"a": 1, "b": 2}) == fingerprint({"b": 2, "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})


class _Creds(BaseModel):
    user: str
    password: SecretStr
    options: dict[str, SecretStr]


def test_public_dump_leaves_secrets_out() -> None:
    creds = _Creds(user="u", password=SecretStr("hunter2"), options={"key": SecretStr("s3cr3t")})
    dump = public_dump(creds)
    assert dump == {"user": "u", "options": ["key"]}
    assert "hunter2" not in repr(dump)
    assert "s3cr3t" not in repr(dump)


@pytest.mark.parametrize(
    "arrow_type", [pa.int8(), pa.uint16(), pa.int32(), pa.uint64(), pa.float32(), pa.float64()]
)
def test_numpy_of_equals_to_numpy_for_chunked_sliced_and_empty_columns(
    arrow_type: pa.DataType,
) -> None:
    values = pa.array(np.arange(50).astype(arrow_type.to_pandas_dtype()), arrow_type)
    columns = [
        values,
        values.slice(7, 20),  # an offset into the buffer
        pa.chunked_array([values.slice(0, 5), values.slice(30, 0), values.slice(12, 9)]),
        pa.chunked_array([values.slice(3, 11)]),
        pa.chunked_array([], arrow_type),
    ]
    for column in columns:
        got = numpy_of(column)
        assert got.dtype == np.dtype(arrow_type.to_pandas_dtype())
        np.testing.assert_array_equal(got, column.to_numpy())
        assert np.array_equal(numpy_of(arrow_of(got)), got)
        assert arrow_of(got).equals(pa.array(got, arrow_type))


def test_numpy_of_and_arrow_of_refuse_what_they_cannot_convert() -> None:
    with pytest.raises(ValueError, match="1 nulls"):
        numpy_of(pa.array([1, None, 3], pa.int64()))
    with pytest.raises(TypeError, match="string"):
        numpy_of(pa.array(["a"]))
    with pytest.raises(TypeError, match="bool"):
        arrow_of(np.array([True, False]))
    with pytest.raises(TypeError, match="1-D"):
        arrow_of(np.zeros((2, 2), np.int64))


def test_atomic_writer_fsyncs_only_durable_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    with atomic_writer(tmp_path / "durable.bin") as handle:
        handle.write(b"kept")
    assert len(synced) == 1
    with atomic_writer(tmp_path / "staged.bin", durable=False) as handle:
        handle.write(b"scratch")
    assert len(synced) == 1
    assert (tmp_path / "staged.bin").read_bytes() == b"scratch"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["durable.bin", "staged.bin"]


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3_128"])
@pytest.mark.parametrize("writeback_bytes", [0, 1000])
def test_digest_sink_hashes_and_counts_what_reaches_the_file(
    tmp_path: Path, algorithm: str, writeback_bytes: int
) -> None:
    """Through pyarrow's IPC writer, with the early writeback every 1000 bytes or never."""
    table = pa.table({"a": np.arange(5000), "b": [f"row {i}" for i in range(5000)]})
    target = tmp_path / "t.arrow"
    with atomic_writer(target) as handle:
        sink = DigestSink(handle, algorithm, writeback_bytes=writeback_bytes)
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=700)
    assert sink.bytes_written == target.stat().st_size
    assert sink.hexdigest() == digest_file(target, algorithm)
    if algorithm == "sha256":
        assert sink.hexdigest() == sha256_file(target)
    assert read_ipc_stream(target).equals(table)
    entry = sink.entry()
    assert entry == {"bytes": target.stat().st_size, algorithm: sink.hexdigest()}
    assert file_matches(target, entry)
    data = bytearray(target.read_bytes())
    data[-10] ^= 1
    target.write_bytes(bytes(data))
    assert not file_matches(target, entry)
    target.write_bytes(bytes(data[:-1]))
    assert not file_matches(target, entry)
    assert not file_matches(tmp_path / "missing.arrow", entry)


@pytest.mark.parametrize("value", ["train.jsonl", "", "dossier/ünïcode €.txt"])
@pytest.mark.parametrize("n", [0, 1, 7])
def test_repeat_string_equals_a_list_of_copies(value: str, n: int) -> None:
    got = repeat_string(value, n)
    assert got.type == pa.string()
    assert got.to_pylist() == [value] * n
    got.validate(full=True)
