"""Data-stage chaos: SIGKILL ingestion, encoding and example creation at random points.

A clean run builds every data stage once per module, in one workspace, while a watcher notes
each stage's files as they appear. A trial deletes one stage's output there and starts that
stage's `lmpipe` command in a subprocess connected to the session's Ray and Prefect API (the
approach of tests/pipelines/flows/test_kill_resume.py). At a random point of the stage's writing,
drawn from the trial's own seeded RNG, it SIGKILLs either the driver (the subprocess's process
group) or the Ray worker executing one of the stage's tasks at that moment (found by its PID, see
`stage_worker`). The stage is then rerun in this process, as a user would rerun the command.
Every output file must have the clean run's bytes (sha256), no file may ever have been visible
under its final name with other bytes, and no temp or staging file may be left anywhere in the
workspace.

`make test` runs 2 trials (ingestion with a driver kill, encoding with a worker kill);
`make test-reliability` runs 10 per stage, alternating the victim. The figures go to
test-artifacts/reliability/<quick|full>/data_chaos.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from figures import FULL, REPO, record

from pipelines.config import RunConfig, load_config
from tasks.common.stage import StageResult
from tasks.demo.synthetic import SyntheticConfig, write_corpus
from tasks.encode.stage import run_encode
from tasks.examples.stage import run_examples
from tasks.ingest.stage import run_ingest

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.reliability]

STAGES = ("ingest", "encode", "examples")
# The Ray task functions each stage runs; a worker executing one is titled `ray::<name>`.
TASKS = {
    "ingest": ("process_unit", "write_shard"),
    "encode": ("encode_shard",),
    "examples": ("examples_shard",),
}
VICTIMS = ("driver", "worker")  # trial n kills VICTIMS[n % 2]
TRIALS = [(stage, n) for stage in STAGES for n in range(10)]
QUICK = [("ingest", 0), ("encode", 1)]
# Timing fields: a manifest records how long its run took, which differs from run to run by
# design. Every other manifest field must be identical; see `deterministic`.
TIMING_KEYS = ("elapsed_s", "throughput_mb_s")
POLL_S = 0.003
TAIL_FILES = 4  # never aim past the last 4 files: two shards and their staged parts, say
_FIGURES: list[dict[str, Any]] = []


def is_temp(path: Path) -> bool:
    """Whether `path` is a temp or staging name a finished stage must not leave behind."""
    return ".tmp-" in path.name or path.name == "_staging"


class OutputWatcher(threading.Thread):
    """Poll a stage's output directory (`<stage root>/<fingerprint>/`) while a run writes it.

    Notes when the first file appeared (temp files included) and when the manifest did; the
    run's progress, the count of finished files (staged parts and final outputs, the manifest
    and run_config.yaml aside) and its peak; and the sha256 of every final-named file each time
    it changed: everything a reader could have seen.
    """

    def __init__(self, stage_root: Path, fingerprint: str = "*") -> None:
        super().__init__(daemon=True)
        self.patterns = (f"{fingerprint}/*", f"{fingerprint}/_staging/*")
        self.root = stage_root
        self.stop = threading.Event()
        self.began_at: float | None = None
        self.finished_at: float | None = None
        self.progress = self.peak = 0
        self.seen: dict[str, set[str]] = {}

    def run(self) -> None:
        stamps: dict[Path, tuple[int, int]] = {}
        while not self.stop.is_set():
            progress = 0
            for path in [p for pattern in self.patterns for p in self.root.glob(pattern)]:
                if path.is_dir():
                    continue
                self.began_at = self.began_at or time.monotonic()
                if is_temp(path):
                    continue
                progress += path.name not in ("manifest.json", "run_config.yaml")
                if path.name == "manifest.json":
                    self.finished_at = self.finished_at or time.monotonic()
                if path.parent.name != "_staging":
                    self._hash(path, stamps)
            self.progress, self.peak = progress, max(self.peak, progress)
            time.sleep(POLL_S)

    def _hash(self, path: Path, stamps: dict[Path, tuple[int, int]]) -> None:
        try:
            stat = path.stat()
            if stamps.get(path) == (stat.st_ino, stat.st_size):
                return
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except FileNotFoundError:
            return  # renamed or removed between the listing and the read
        stamps[path] = (stat.st_ino, stat.st_size)
        self.seen.setdefault(path.name, set()).add(digest)


@dataclass(frozen=True)
class CleanRun:
    """The module's clean build: its recipe and, per stage, the output's bytes and write time."""

    recipe: Path
    overrides: list[str]
    workspace: Path
    outputs: dict[str, Path]  # per stage (the tokenizer's too): its output directory
    digests: dict[str, dict[str, str]]  # per stage: every file but manifest.json -> sha256
    manifests: dict[str, dict[str, Any]]  # per stage: the manifest's deterministic content
    files: dict[str, int]  # per stage: the watcher's peak progress (files finished)
    write_s: dict[str, float]  # per stage: first file written -> manifest visible

    def config(self) -> RunConfig:
        return load_config(self.recipe, self.overrides)


def deterministic(value: Any) -> Any:
    """`value` without its timing fields (`TIMING_KEYS`, at any depth)."""
    if isinstance(value, dict):
        return {k: deterministic(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list):
        return [deterministic(v) for v in value]
    return value


def digests(out: Path) -> dict[str, str]:
    """The sha256 of every file under `out` but its manifest and temp files, by relative name."""
    return {
        path.relative_to(out).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.name != "manifest.json" and not is_temp(path)
    }


def manifest_of(out: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((out / "manifest.json").read_text())
    return manifest


def temps_under(root: Path) -> list[str]:
    """Every temp file, temp directory or staging directory anywhere under `root`."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if is_temp(p))


def stage_flows() -> dict[str, Callable[[RunConfig], dict[str, dict[str, Any]]]]:
    """The flow a user reruns for each stage (it reuses the finished stages before it)."""
    from pipelines.flows.encode_flow import encode_flow
    from pipelines.flows.examples_flow import examples_flow
    from pipelines.flows.ingest_flow import ingest_flow

    return {"ingest": ingest_flow, "encode": encode_flow, "examples": examples_flow}


@contextmanager
def watching(stage_root: Path, fingerprint: str = "*") -> Iterator[OutputWatcher]:
    watcher = OutputWatcher(stage_root, fingerprint)
    watcher.start()
    try:
        yield watcher
    finally:
        watcher.stop.set()
        watcher.join()


def torn(watcher: OutputWatcher, want: dict[str, str]) -> list[str]:
    """Final names the watcher saw with bytes other than `want`'s (the manifest left out)."""
    # The manifest's timing fields differ by design; its other content is compared on its own.
    return sorted(
        name
        for name, seen in watcher.seen.items()
        if name != "manifest.json" and seen != {want.get(name)}
    )


@pytest.fixture(scope="module")
def clean(ray_session: str, prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> CleanRun:
    """Build every data stage once, cleanly, in the workspace the trials then damage."""
    root = tmp_path_factory.mktemp("data-chaos")
    write_corpus(root / "demo", SyntheticConfig(documents=6000, parts=6, task_examples=10))
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(chaos_recipe(root)))
    overrides = [f"ray.address={ray_session}"]
    started = time.monotonic()
    with ExitStack() as stack:
        watchers = {s: stack.enter_context(watching(root / "ws" / s)) for s in STAGES}
        stages = stage_flows()["examples"](load_config(recipe, overrides))
    build_s = time.monotonic() - started
    outputs = {stage: Path(stages[stage]["path"]) for stage in (*STAGES, "tokenizer")}
    run = CleanRun(
        recipe=recipe,
        overrides=overrides,
        workspace=root / "ws",
        outputs=outputs,
        digests={s: digests(outputs[s]) for s in STAGES},
        manifests={s: deterministic(manifest_of(outputs[s])) for s in STAGES},
        files={s: w.peak for s, w in watchers.items()},
        write_s={s: (w.finished_at or 0) - (w.began_at or 0) for s, w in watchers.items()},
    )
    assert not temps_under(run.workspace), "the clean run left temp or staging files"
    for stage, watcher in watchers.items():
        assert not torn(watcher, run.digests[stage]), f"clean {stage}: a partial file was visible"
    clean_figures = {
        s: {
            "outputs": len(run.digests[s]) + 1,
            "files": run.files[s],
            "write_s": round(run.write_s[s], 2),
        }
        for s in STAGES
    }
    record("data_chaos", {"clean_build_s": round(build_s, 1), "clean": clean_figures})
    return run


def chaos_recipe(root: Path) -> dict[str, Any]:
    """A small recipe whose every stage writes several shards with several Ray tasks."""
    return {
        "name": "data-chaos",
        "workspace": str(root / "ws"),
        "tracking": {"enabled": False},
        "prefect": {"retries": 0},
        "ray": {"num_workers": 2},
        "ingest": {
            "sources": [{"path": str(root / "demo" / "corpus"), "format": "jsonl"}],
            "split": {"validation": 0.1, "test": 0.05},
            "shard_size_mb": 0.1,
            "unit_size_mb": 0.05,
        },
        "tokenizer": {"family": "wordpiece", "vocab_size": 512, "model_max_length": 128},
        "encode": {"shard_documents": 400, "batch_documents": 100},
        "examples": {"objective": "bert", "max_seq_length": 32},
    }


def start_stage(
    stage: str, clean: CleanRun, prefect_api: str, log: Path
) -> subprocess.Popen[bytes]:
    """Start `lmpipe <stage>` on the clean recipe in a new process group; output goes to `log`.

    It connects to the session's Ray (`ray.address`) and Prefect API (`PREFECT_API_URL`).
    """
    with open(log, "wb") as sink:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipelines.cli.main",
                stage,
                str(clean.recipe),
                *clean.overrides,
            ],
            env=os.environ | {"PREFECT_API_URL": prefect_api},
            start_new_session=True,  # its group is exactly what a driver kill takes down
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def parent_pid(pid: int) -> int:
    # The command name in /proc/<pid>/stat may hold spaces or parentheses: split after the last ')'.
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def stage_worker(stage: str) -> int | None:
    """The PID of a Ray worker of this session executing one of `stage`'s tasks now, if any.

    Ray titles a worker `ray::<function>` while it runs a task and `ray::IDLE` between tasks. A
    worker of this session is a child of the raylet that this test process started, so a worker
    of any other Ray on the machine (another test session's) is never chosen.
    """
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if title.strip().removeprefix("ray::") not in TASKS[stage]:
                continue
            if not title.startswith("ray::") or parent_pid(parent_pid(int(entry.name))) != me:
                continue
        except (OSError, ValueError):
            continue  # the process ended while we looked
        return int(entry.name)
    return None


def wait_until(
    done: Callable[[], bool], process: subprocess.Popen[bytes], what: str, log: Path
) -> None:
    """Poll until `done()`, failing with the run's log if it exits first or takes over 240 s."""
    deadline = time.monotonic() + 240
    while not done():
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            pytest.fail(f"{what} (exit {process.returncode}); the run's log ends:\n{tail}")
        time.sleep(POLL_S)


def kill_at_random_point(
    rng: random.Random,
    victim: str,
    stage: str,
    process: subprocess.Popen[bytes],
    watcher: OutputWatcher,
    clean: CleanRun,
    log: Path,
) -> dict[str, Any]:
    """Once the stage writes, wait for a seeded random point of its progress, then SIGKILL.

    The point: the k-th of the clean run's N finished files (k uniform over all but the last
    `TAIL_FILES`, so that the kill lands before the stage finishes), then a random fraction of
    the clean run's mean time between two files, so that kills land mid-write too. A worker
    victim's k is drawn from the first half of that range: near the end the Ray tasks may all
    have returned while the driver commits the last files, leaving no worker to kill. Returns it.
    """
    # The output directory is the fingerprint of inputs, config and the tasks/ code: if the
    # code changed since the clean run, the subprocess writes elsewhere and this fails.
    wait_until(lambda: watcher.began_at is not None, process, f"{stage} wrote nothing", log)
    began_at = watcher.began_at or 0.0
    total = clean.files[stage]
    span = max(total - TAIL_FILES, 1)
    k = rng.randrange(span if victim == "driver" else max(span // 2, 1))
    jitter_s = rng.random() * clean.write_s[stage] / max(total, 1)

    def reached() -> bool:
        return watcher.progress >= k or watcher.finished_at is not None

    wait_until(reached, process, f"{stage} stopped before file {k}", log)
    due = time.monotonic() + jitter_s
    while time.monotonic() < due and watcher.progress < total - TAIL_FILES:
        time.sleep(POLL_S)
    pid: int | None = process.pid
    if victim == "driver":
        os.killpg(process.pid, signal.SIGKILL)  # the group this test started, and only it
    else:
        while (pid := stage_worker(stage)) is None and watcher.finished_at is None:
            assert process.poll() is None, f"lmpipe {stage} exited ({process.returncode})"
            time.sleep(POLL_S)  # e.g. ingestion between reading units and writing shards
        if pid is not None:
            os.kill(pid, signal.SIGKILL)  # the one worker found above, by its PID
    return {
        "victim": victim,
        "killed": pid is not None and watcher.finished_at is None,
        "kill_point": f"{watcher.progress}/{total} files",
        "target_file": k,
        "jitter_s": round(jitter_s, 4),
        "kill_after_s": round(time.monotonic() - began_at, 3),
    }


def chaos_trial(
    stage: str, trial: int, clean: CleanRun, prefect_api: str, log: Path
) -> dict[str, Any]:
    """Delete `stage`'s output, kill a run of it at a random point, rerun it; return figures."""
    rng = random.Random(f"data-chaos/{stage}/{trial}")  # a trial replays exactly
    out = clean.outputs[stage]
    shutil.rmtree(out)
    with watching(out.parent, out.name) as watcher:
        started = time.monotonic()
        process = start_stage(stage, clean, prefect_api, log)
        try:
            victim = VICTIMS[trial % 2]
            point = kill_at_random_point(rng, victim, stage, process, watcher, clean, log)
            killed_at = time.monotonic()
            process.wait(timeout=300)  # a worker kill: the driver goes on, Ray retries the task
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=60)
        exited_at = time.monotonic()
        stages = stage_flows()[stage](clean.config())
        rerun_s = time.monotonic() - exited_at
    assert Path(stages[stage]["path"]) == out
    row = {
        "stage": stage,
        "trial": trial,
        **point,
        "first_write_s": round((watcher.began_at or started) - started, 2),
        "driver_exit": process.returncode,
        "driver_exit_after_kill_s": round(exited_at - killed_at, 2),
        "rerun_reused": stages[stage]["reused"],
        "rerun_s": round(rerun_s, 2),
        **verdict(stage, clean, watcher),
    }
    return row | {"survived": row["killed"] and row["intact"]}


def verdict(stage: str, clean: CleanRun, watcher: OutputWatcher) -> dict[str, Any]:
    """Compare the rerun's output with the clean run's; list what was torn or left behind."""
    out, want = clean.outputs[stage], clean.digests[stage]
    now = digests(out)
    differing = sorted(n for n in now.keys() | want.keys() if now.get(n) != want.get(n))
    if deterministic(manifest_of(out)) != clean.manifests[stage]:
        differing.append("manifest.json")
    seen_torn, left = torn(watcher, want), temps_under(clean.workspace)
    return {
        "byte_identical": not differing,
        "differing": differing,
        "torn_visible": seen_torn,
        "temp_files_left": left,
        "intact": not (differing or seen_torn or left),
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage: trials survived N/N, and the trials themselves."""
    per_stage = {}
    for stage in STAGES:
        mine = [row for row in rows if row["stage"] == stage]
        if mine:
            per_stage[stage] = {
                "survived": f"{sum(r['survived'] for r in mine)}/{len(mine)}",
                "byte_identical": f"{sum(r['byte_identical'] for r in mine)}/{len(mine)}",
                "temp_files_left": sum(len(r["temp_files_left"]) for r in mine),
                "worker_kills": sum(r["victim"] == "worker" for r in mine),
                "rerun_s_max": max(r["rerun_s"] for r in mine),
            }
    return {"stages": per_stage, "trials": rows}


@pytest.mark.parametrize(("stage", "trial"), TRIALS if FULL else QUICK)
def test_killed_stage_reruns_to_clean_bytes_and_leaves_no_temp(
    stage: str, trial: int, clean: CleanRun, prefect_api: str, tmp_path: Path
) -> None:
    log = tmp_path / f"lmpipe-{stage}.log"
    figures = chaos_trial(stage, trial, clean, prefect_api, log)
    _FIGURES.append(figures)
    record("data_chaos", summary(_FIGURES))
    assert figures["killed"], f"the kill did not land before {stage} finished: {figures}"
    assert figures["byte_identical"], f"rerun differs from the clean run: {figures['differing']}"
    assert not figures["torn_visible"], f"visible with other bytes: {figures['torn_visible']}"
    assert not figures["temp_files_left"], f"left behind: {figures['temp_files_left']}"


def run_stage(stage: str, clean: CleanRun) -> StageResult:
    """Run one stage's driver directly on the clean run's inputs and workspace."""
    cfg, out = clean.config(), clean.outputs
    if stage == "ingest":
        assert cfg.ingest is not None
        return run_ingest(cfg.ingest, cfg.ray, clean.workspace)
    if stage == "encode":
        return run_encode(cfg.encode, cfg.ray, out["ingest"], out["tokenizer"], clean.workspace)
    return run_examples(
        cfg.examples, cfg.seed, cfg.ray, out["encode"], out["tokenizer"], clean.workspace
    )


@pytest.mark.parametrize("stage", STAGES)
def test_reused_output_sweeps_what_a_kill_after_its_manifest_left(
    stage: str, clean: CleanRun
) -> None:
    # A driver killed between writing the manifest and sweeping leaves a finished output that
    # still holds `_staging/` and a dead worker's temp file; the next run reuses it and sweeps.
    out = clean.outputs[stage]
    (out / "_staging").mkdir(exist_ok=True)
    (out / "_staging" / "part.json").write_text("{}")
    (out / ".part.arrow.tmp-999999-0123abcd").write_bytes(b"half a shard")
    result = run_stage(stage, clean)
    assert result.reused
    assert result.path == out
    assert temps_under(out) == []
    assert digests(out) == clean.digests[stage]
