from pathlib import Path

import pyarrow as pa
import pytest
from pydantic import BaseModel, SecretStr

from tasks.io import (
    UnsafePathError,
    atomic_writer,
    fingerprint,
    public_dump,
    read_ipc_stream,
    safe_join,
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
