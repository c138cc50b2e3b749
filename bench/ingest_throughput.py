"""Ingestion throughput and peak memory, against pyarrow alone reading the same bytes.

Usage: python bench/ingest_throughput.py [--mb 200] [--out bench/results] [--profile]
                                         [--only 1:rules,2:rules:double]

Generates a JSON-Lines corpus of unique ~1 kB documents (--mb MiB, and a doubled one for the
memory check), then for each setting runs the real stage (Ray tasks, dedup on) in a fresh local
Ray and a fresh workspace, sampling the summed RSS of this driver and every process under it
(the local Ray: GCS, raylet, workers) every 0.2 s. The floors are pyarrow alone: reading the
bytes, and parsing them with pyarrow.json.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import random
import shutil
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psutil
import pyarrow as pa
import pyarrow.json as pajson
import ray

from tasks.common.ray_runtime import RayConfig
from tasks.demo.synthetic import SyntheticConfig, fact_sentence, grammar_sentence, make_world
from tasks.ingest.ingest import IngestConfig, UnitJob, process_unit
from tasks.ingest.readers import plan_units
from tasks.ingest.sources import SourceConfig, expand_source
from tasks.ingest.stage import run_ingest


def generate(path: Path, mib: int, seed: int = 0) -> Path:
    """Write unique ~1 kB documents as JSON Lines until the corpus holds `mib` MiB."""
    if path.exists() and path.stat().st_size >= mib << 20:
        return path
    rng = random.Random(seed)
    world = make_world(SyntheticConfig(people=600))
    pool = [grammar_sentence(rng) for _ in range(5000)]
    pool += [fact_sentence(p, k) for p in world for k in ("city", "job", "pet")]
    pool += ["Mr. Smith paid $3.50 at 5 p.m. on Jan. 3.", '"Stop!" he said. Then he left.']
    path.parent.mkdir(parents=True, exist_ok=True)
    written, i = 0, 0
    with open(path, "w") as handle:
        while written < mib << 20:
            lines = []
            for _ in range(1000):
                text = f"Document {i}. " + " ".join(rng.choices(pool, k=16))
                lines.append(json.dumps({"id": i, "text": text}))
                i += 1
            block = "\n".join(lines) + "\n"
            handle.write(block)
            written += len(block)
    return path


def process_role(proc: psutil.Process, me: int) -> str:
    """What a process under the benchmark is: the driver, a Ray daemon, or a Ray worker."""
    if proc.pid == me:
        return "driver"
    line = " ".join(proc.cmdline())
    for needle, role in (
        ("gcs_server", "gcs_server"),
        ("raylet", "raylet"),
        ("dashboard/agent.py", "dashboard_agent"),
        ("runtime_env", "runtime_env_agent"),
        ("log_monitor", "log_monitor"),
        ("ray::", "workers"),
        ("default_worker.py", "workers"),
    ):
        if needle in line:
            return role
    return "other"


class PeakRss(threading.Thread):
    """Sample the summed RSS of this process and all its descendants.

    `breakdown` is the RSS per process role (driver, Ray daemons, workers) at the peak.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()
        self.breakdown: dict[str, float] = {}

    def run(self) -> None:  # noqa: D102
        me = psutil.Process()
        while not self.stop.is_set():
            total, roles = 0, {}
            for proc in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss = proc.memory_info().rss
                    role = process_role(proc, me.pid)
                    total += rss
                    roles[role] = roles.get(role, 0) + rss
                    if role == "workers":
                        roles["worker_count"] = roles.get("worker_count", 0) + 1
            if total > self.peak:
                self.peak = total
                self.breakdown = {
                    k: (v if k == "worker_count" else round(v / 2**20)) for k, v in roles.items()
                }
            time.sleep(0.2)


def floors(path: Path) -> dict[str, float]:
    """Time pyarrow alone: reading the bytes, and parsing them with pyarrow.json."""
    start = time.perf_counter()
    with pa.OSFile(str(path)) as handle:
        while handle.read(64 << 20):
            pass
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    opts = pajson.ReadOptions(block_size=16 << 20, use_threads=False)
    pajson.read_json(str(path), read_options=opts)
    parse_s = time.perf_counter() - start
    mib = path.stat().st_size / 2**20
    return {"pyarrow_read_mb_s": mib / read_s, "pyarrow_json_parse_1thread_mb_s": mib / parse_s}


def run_one(path: Path, workers: int, splitter: str, workdir: Path) -> dict[str, float]:
    cfg = IngestConfig(
        sources=[SourceConfig(path=str(path), format="jsonl")],
        sentences={"splitter": splitter},  # type: ignore[arg-type]
        shard_size_mb=64,
        unit_size_mb=32,
        incremental=False,
    )
    shutil.rmtree(workdir, ignore_errors=True)
    ray_cfg = RayConfig(num_workers=workers, num_cpus=workers + 2, object_store_mb=256)
    sampler = PeakRss()
    sampler.start()
    start = time.perf_counter()
    from tasks.common.ray_runtime import ensure_ray

    ensure_ray(ray_cfg)
    ray_start = time.perf_counter() - start
    start = time.perf_counter()
    phases: dict[str, float] = {}  # when the first unit, the last unit, the last shard finished

    def progress(phase: str, done: int, total: int) -> None:
        now = round(time.perf_counter() - start, 2)
        phases.setdefault(f"{phase}_first_s", now)
        phases[f"{phase}_last_s"] = now

    result = run_ingest(cfg, ray_cfg, workdir, progress)
    elapsed = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    ray.shutdown()
    mib = path.stat().st_size / 2**20
    return {
        "input_mib": round(mib, 1),
        "workers": workers,
        "splitter": splitter,
        "elapsed_s": round(elapsed, 2),
        "ray_start_s": round(ray_start, 2),
        "mb_s": round(mib / elapsed, 2),
        "mb_s_per_worker": round(mib / elapsed / workers, 2),
        "peak_rss_mib": round(sampler.peak / 2**20),
        "peak_breakdown_mib": sampler.breakdown,
        "documents": result.manifest["counts"]["read"],
        **phases,
    }


def profile_unit(path: Path, workdir: Path) -> str:
    """Profile one 32 MiB work unit in-process (no Ray, after one unprofiled run of it).

    Returns the share of each part (`profile_split`) and the top functions by own time.
    """
    cfg = IngestConfig(sources=[SourceConfig(path=str(path), format="jsonl")], unit_size_mb=32)
    files = expand_source(cfg.sources[0], 0)
    unit = plan_units(files, "line", 32 << 20, {files[0].source: {}})[0]
    jobs = {}
    for name in ("warm-up", "profile"):
        staging = workdir / name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        jobs[name] = UnitJob(unit, cfg, str(staging), {})
    process_unit(jobs["warm-up"])  # keeps one-time imports out of the profile
    profiler = cProfile.Profile()
    profiler.enable()
    process_unit(jobs["profile"])
    profiler.disable()
    out = workdir / "profile.txt"
    with open(out, "w") as handle:
        stats = pstats.Stats(profiler, stream=handle)
        handle.write(profile_split(stats.stats) + "\n")
        stats.sort_stats("tottime").print_stats(15)
    return out.read_text()


# The parts of a unit: (label, [(file suffix, function)]) whose cumulative times add up.
PARTS = [
    ("sentence splitting (split_sentences)", [("tasks/ingest/text.py", "split_sentences")]),
    ("text clean-up (clean_texts)", [("tasks/ingest/text.py", "clean_texts")]),
    ("reading + JSON decoding (read_unit)", [("tasks/ingest/readers.py", "read_unit")]),
]


def profile_split(stats: dict[tuple[str, int, str], tuple[int, int, float, float, object]]) -> str:
    """Return the time and share of each part of the unit (cumulative cProfile times).

    The rest is content hashing, Arrow assembly and the staging writes.
    """

    def cumulative(file: str, name: str) -> float:
        return sum(v[3] for k, v in stats.items() if k[0].endswith(file) and k[2] == name)

    total = cumulative("tasks/ingest/ingest.py", "process_unit")
    lines, rest = [f"unit total {total:.3f} s (cProfile on)"], total
    for label, functions in PARTS:
        part = sum(cumulative(file, name) for file, name in functions)
        rest -= part
        lines.append(f"{label:45s} {part:6.3f} s {part / total:6.1%}")
    lines.append(
        f"{'the rest (hashing, Arrow assembly, staging)':45s} {rest:6.3f} s {rest / total:6.1%}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--only",
        default=None,
        help="Comma-separated WORKERS:SPLITTER[:double] settings (e.g. 1:rules,2:rules:double); "
        "default: all five.",
    )
    args = parser.parse_args()
    data = args.out / "data"
    small = generate(data / f"corpus-{args.mb}.jsonl", args.mb)
    big = generate(data / f"corpus-{2 * args.mb}.jsonl", 2 * args.mb, seed=1)
    machine = {
        "cpus": os.cpu_count(),
        "mem_gib": round(psutil.virtual_memory().total / 2**30),
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "ray": ray.__version__,
    }
    results: dict[str, object] = {"machine": machine, "floor": floors(small), "runs": []}
    runs = results["runs"]
    assert isinstance(runs, list)
    settings = [
        (1, "rules", small),
        (2, "rules", small),
        (1, "none", small),
        (2, "none", small),
        (2, "rules", big),
    ]
    if args.only:
        wanted = {tuple(item.split(":")) for item in args.only.split(",")}
        settings = [
            (w, sp, c)
            for w, sp, c in settings
            if (str(w), sp, *(("double",) if c is big else ())) in wanted
        ]
    for workers, splitter, corpus in settings:
        run = run_one(corpus, workers, splitter, args.out / "ws")
        print(json.dumps(run), flush=True)
        runs.append(run)
    if args.profile:
        results["profile"] = profile_unit(small, args.out)
        print(results["profile"])
    (args.out / "ingest_throughput.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["floor"]))


if __name__ == "__main__":
    main()
