"""The stat cache of the ingest inputs' hashes: a digest is reused only on a full stat match."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tasks.ingest.input_hashes import CACHE_FILE, InputHashes, file_digest
from tasks.ingest.sources import InputFile

STAT_FIELDS = ("path", "size", "mtime_ns", "inode", "ctime_ns")


def later() -> int:
    """A clock ten seconds ahead: every file looks settled (not changed just now)."""
    return time.time_ns() + 10 * 10**9


class Counting:
    """`file_digest`, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, file: InputFile, storage: dict[str, str]) -> str:
        self.calls += 1
        return file_digest(file, storage)


def input_file(path: Path) -> InputFile:
    return InputFile("s", str(path), path.name, "txt", None, path.stat().st_size)


def hashed_once(path: Path, workspace: Path, count: Counting) -> str:
    """Hash `path` through the workspace's cache and save the cache."""
    cache = InputHashes.of_workspace(workspace, clock=later)
    digest = cache.digest(input_file(path), {}, count)
    cache.save()
    return digest


def test_an_unchanged_file_is_not_hashed_again(tmp_path: Path) -> None:
    corpus = tmp_path / "a.txt"
    corpus.write_text("One document. Two sentences.\n")
    count = Counting()
    digest = hashed_once(corpus, tmp_path / "ws", count)
    assert hashed_once(corpus, tmp_path / "ws", count) == digest
    assert count.calls == 1
    assert digest == file_digest(input_file(corpus), {})
    entry = json.loads((tmp_path / "ws" / CACHE_FILE).read_text())[str(corpus)]
    st = corpus.stat()
    assert entry["stats"] == [[str(corpus), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns]]


@pytest.mark.parametrize("field", range(len(STAT_FIELDS)), ids=STAT_FIELDS)
def test_a_file_is_hashed_again_when_any_stat_field_differs(tmp_path: Path, field: int) -> None:
    corpus = tmp_path / "a.txt"
    corpus.write_text("One document.\n")
    count = Counting()
    hashed_once(corpus, tmp_path / "ws", count)
    cache_file = tmp_path / "ws" / CACHE_FILE
    entries = json.loads(cache_file.read_text())
    stat = entries[str(corpus)]["stats"][0]
    stat[field] = f"{stat[field]}x" if field == 0 else stat[field] + 1
    cache_file.write_text(json.dumps(entries))
    hashed_once(corpus, tmp_path / "ws", count)
    assert count.calls == 2
    hashed_once(corpus, tmp_path / "ws", count)  # recorded again, as it is now
    assert count.calls == 2


def test_a_copied_or_rewritten_file_is_hashed_again(tmp_path: Path) -> None:
    corpus = tmp_path / "a.txt"
    corpus.write_text("One document.\n")
    count = Counting()
    first = hashed_once(corpus, tmp_path / "ws", count)
    copy = tmp_path / "copy.txt"
    shutil.copy2(corpus, copy)  # same bytes, same mtime; another path, inode and ctime
    assert hashed_once(copy, tmp_path / "ws", count) == first
    assert count.calls == 2
    aside = tmp_path / "aside.txt"
    shutil.copy2(corpus, aside)
    os.replace(aside, corpus)  # the same path and mtime, a new inode and ctime
    assert hashed_once(corpus, tmp_path / "ws", count) == first
    assert count.calls == 3
    corpus.write_text("Another document.\n")
    assert hashed_once(corpus, tmp_path / "ws", count) != first
    assert count.calls == 4


def test_a_file_changed_just_now_is_not_recorded(tmp_path: Path) -> None:
    corpus = tmp_path / "a.txt"
    corpus.write_text("One document.\n")
    cache = InputHashes.of_workspace(tmp_path / "ws")  # the real clock: changed under 1 s ago
    cache.digest(input_file(corpus), {})
    cache.save()
    assert cache.entries == {}
    assert not (tmp_path / "ws" / CACHE_FILE).exists()


def test_entries_of_inputs_that_are_gone_are_dropped(tmp_path: Path) -> None:
    kept, gone = tmp_path / "kept.txt", tmp_path / "gone.txt"
    kept.write_text("Kept.\n")
    gone.write_text("Gone.\n")
    count = Counting()
    hashed_once(gone, tmp_path / "ws", count)
    gone.unlink()
    hashed_once(kept, tmp_path / "ws", count)
    assert list(json.loads((tmp_path / "ws" / CACHE_FILE).read_text())) == [str(kept)]


def test_a_remote_input_is_always_hashed(tmp_path: Path) -> None:
    import fsspec

    with fsspec.open("memory://corpus/a.txt", "wb") as handle:
        handle.write(b"One remote document.\n")
    remote = InputFile("s", "memory://corpus/a.txt", "a.txt", "txt", None, 21)
    count = Counting()
    cache = InputHashes.of_workspace(tmp_path / "ws", clock=later)
    assert cache.digest(remote, {}, count) == cache.digest(remote, {}, count)
    assert count.calls == 2
    assert cache.entries == {}
