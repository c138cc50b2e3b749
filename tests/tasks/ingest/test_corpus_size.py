"""`local_corpus_bytes`: what a command weighs before deciding whether its stages need Ray."""

from pathlib import Path

from tasks.ingest.sources import COMPRESSED_WEIGHT, SourceConfig, local_corpus_bytes


def _source(path: Path | str) -> SourceConfig:
    return SourceConfig(path=str(path))


def test_files_directories_and_globs_are_summed_with_compressed_files_weighted(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.txt").write_bytes(b"x" * 100)
    nested = tmp_path / "dir" / "deeper"
    nested.mkdir(parents=True)
    (nested / "b.jsonl").write_bytes(b"y" * 50)
    (nested / "LICENSE").write_bytes(b"w" * 1000)  # no known format: the stage skips it too
    (tmp_path / "c.txt.gz").write_bytes(b"z" * 10)
    never = 1 << 40
    assert local_corpus_bytes([_source(tmp_path / "a.txt")], never) == 100
    assert local_corpus_bytes([_source(tmp_path / "dir")], never) == 50
    assert local_corpus_bytes([_source(tmp_path / "*.txt*")], never) == 100 + 10 * COMPRESSED_WEIGHT
    both = [_source(tmp_path / "a.txt"), _source(f"file://{tmp_path / 'dir'}")]
    assert local_corpus_bytes(both, never) == 150


def test_counting_stops_past_the_limit_and_unknown_sizes_are_none(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / f"{i}.txt").write_bytes(b"x" * 100)
    total = local_corpus_bytes([_source(tmp_path)], 150)
    assert total is not None
    assert 150 < total < 500  # stopped early, but over the limit
    assert local_corpus_bytes([_source("s3://bucket/corpus/*.jsonl")], 150) is None
    assert local_corpus_bytes([_source(tmp_path / "missing.txt")], 150) is None


def test_a_saved_dataset_counts_its_folders_bytes(tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["one document", "another"]}).save_to_disk(str(folder))
    stored = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert local_corpus_bytes([_source(folder)], 1 << 40) == stored
