"""A SIGKILLed `lmpipe ingest`, rerun, gives a clean run's bytes; no partial file is visible."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from pipelines.config import load_config
from tasks.demo.synthetic import SyntheticConfig, write_corpus
from tasks.ingest.stage import run_ingest

pytestmark = [pytest.mark.slow, pytest.mark.integration]


class Watcher(threading.Thread):
    """Hash every final-named file (no leading '.', outside _staging) whenever it changes."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root, self.seen, self.stop = root, {}, threading.Event()
        self.first_shard_at: float | None = None

    def run(self) -> None:
        stamps: dict[Path, tuple[int, int]] = {}
        while not self.stop.is_set():
            for path in self.root.glob("ingest/*/*"):
                if path.name.startswith(".") or not path.is_file():
                    continue
                try:
                    stat = path.stat()
                    if stamps.get(path) == (stat.st_ino, stat.st_size):
                        continue
                    digest = hashlib.sha256(path.read_bytes()).hexdigest()
                except FileNotFoundError:
                    continue
                stamps[path] = (stat.st_ino, stat.st_size)
                self.seen.setdefault(path.name, set()).add(digest)
                if path.suffix == ".arrow" and path.name != "dedup_index.arrow":
                    self.first_shard_at = self.first_shard_at or time.monotonic()
            time.sleep(0.002)

    def has_shard_without_manifest(self) -> bool:
        names = set(self.seen)
        shards = {n for n in names if n.endswith(".arrow") and n != "dedup_index.arrow"}
        return bool(shards) and "manifest.json" not in names


def test_sigkilled_ingest_reruns_to_byte_identical_shards(
    tmp_path: Path, ray_session: str, prefect_api: str
) -> None:
    write_corpus(tmp_path / "demo", SyntheticConfig(documents=40000, parts=8, task_examples=10))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "killed",
                "workspace": str(tmp_path / "ws"),
                "tracking": {"enabled": False},
                "ingest": {
                    "sources": [{"path": str(tmp_path / "demo" / "corpus"), "format": "jsonl"}],
                    "shard_size_mb": 0.02,
                    "unit_size_mb": 0.5,
                },
            }
        )
    )
    overrides = [f"ray.address={ray_session}", "ray.num_workers=1"]
    env = os.environ | {"PREFECT_API_URL": prefect_api}
    watcher = Watcher(tmp_path / "ws")
    watcher.start()
    process = subprocess.Popen(
        [sys.executable, "-m", "pipelines.cli.main", "ingest", str(recipe), *overrides],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        deadline = time.monotonic() + 300
        while not watcher.has_shard_without_manifest() and process.poll() is None:
            assert time.monotonic() < deadline, "no shard appeared within 300 s"
            time.sleep(0.002)
        os.killpg(process.pid, signal.SIGKILL)  # the group this test started, and only it
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    time.sleep(0.2)
    [out] = (tmp_path / "ws" / "ingest").iterdir()
    assert process.returncode == -signal.SIGKILL, "the run finished before the kill landed"
    assert not (out / "manifest.json").exists(), "the kill landed after the manifest"
    assert watcher.has_shard_without_manifest()

    cfg = load_config(recipe, overrides)
    resumed = run_ingest(cfg.ingest, cfg.ray, tmp_path / "ws")
    watcher.stop.set()
    watcher.join()
    clean = run_ingest(cfg.ingest, cfg.ray, tmp_path / "clean")
    assert resumed.path.name == clean.path.name == out.name

    def digests(manifest: dict) -> dict[str, str]:
        files = {s["name"]: s["sha256"] for sp in manifest["splits"].values() for s in sp["shards"]}
        files[manifest["quarantine"]["name"]] = manifest["quarantine"]["sha256"]
        files[manifest["dedup_index"]["name"]] = manifest["dedup_index"]["sha256"]
        return files

    final = digests(resumed.manifest)
    assert final == digests(clean.manifest)
    assert len(final) > 20
    for name, hashes in watcher.seen.items():
        if name in ("manifest.json", "run_config.yaml"):
            continue
        assert name in final, f"{name} was visible under a final name but is not an output"
        assert hashes == {final[name]}, f"{name} was visible with other content"
    for name, digest in final.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert json.loads((out / "manifest.json").read_text())["counts"] == clean.manifest["counts"]
