"""A command's own overhead: wall time of `lmpipe examples` minus its stages' own time.

Usage: python bench/fixed_cost.py [--root DIR] [--work DIR] [--mib 9] [--rounds 2]
                                  [--reruns 3] [--json OUT]

Issue 38's target: on a corpus of about 10 MB, a cold command's overhead (imports, the Prefect
API, MLflow's store, Ray) at most 2 s, an all-cached rerun's at most 1 s. Two arms of the same
checkout (--root, default this one), each command a new process, interleaved round by round
(the order alternates):

- `in-process`: `LMPIPE_DAEMON=0`, the command imports Prefect, MLflow and its flows itself
  and starts its own temporary Prefect API (what every command did before the daemon);
- `daemon`: `python -m pipelines.daemon.client`, what the `lmpipe` entry point runs: the
  command runs in a fork of the warm daemon, which serves each workspace's temporary API.

Per round and arm:

- cold: a new workspace (and so a new Prefect home, `<workspace>/.prefect`) through ingest,
  tokenizer, encode and BERT examples. Overhead = wall minus the sum of the four stages' own
  `elapsed_s` (their manifests). Ray's start happens inside the ingest stage, so it counts as
  the stage's time in both arms; `ray_start_s` times a bare `ray.init()` beside it.
- rerun: --reruns all-cached reruns of the same command; no stage runs, so overhead = wall.

Both arms share the per-user cache (`LMPIPE_CACHE_DIR`, under --work). One untimed cold run
per arm comes first: it fills the file cache, makes the store templates once, and starts the
daemon; its figures are reported as `first` (for the daemon arm: the first command after a
daemon start, which waits for the daemon's imports). The daemon is stopped at the end.
docs/benchmarks.md, "A command's fixed cost", has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from harness import time_lmpipe  # bench/, the script's folder, is on sys.path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("ingest", "tokenizer", "encode", "examples")


def write_recipe(work: Path, mib: int) -> Path:
    """The corpus (about `mib` MiB of text) and a recipe template under `work`, once."""
    corpus = work / "data" / "corpus.jsonl"
    if not corpus.is_file():
        sys.path[:0] = [str(REPO / "bench"), str(REPO)]
        from corpus import write_corpus  # bench/corpus.py: real sentences, pseudo-words

        write_corpus(corpus, mib)
    path = work / "recipe.yaml"
    path.write_text(
        "\n".join(
            [
                "name: fixed",
                f"ingest: {{sources: [{{path: {corpus}, format: jsonl}}]}}",
                "tokenizer: {family: wordpiece, vocab_size: 8000}",
                "examples: {objective: bert, max_seq_length: 128}",
                "",
            ]
        )
    )
    return path


#: arm -> (the module run, LMPIPE_DAEMON)
ARMS = {"in-process": ("pipelines.cli.main", "0"), "daemon": ("pipelines.daemon.client", "1")}


def environment(work: Path, arm: str) -> dict[str, str]:
    """An isolated environment: no outside services, each workspace's own Prefect home."""
    env = os.environ | {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "LMPIPE_CACHE_DIR": str(work / "cache"),
        "LMPIPE_DAEMON": ARMS[arm][1],
    }
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "PREFECT_HOME"):
        env.pop(key, None)
    return env


def run_examples(root: Path, recipe: Path, workspace: Path, arm: str, work: Path) -> float:
    """One `lmpipe examples` from checkout `root` in a new process; its wall time (s)."""
    args = ["examples", str(recipe), f"workspace={workspace}"]
    return time_lmpipe(root, args, environment(work, arm), entry=ARMS[arm][0])[0]


def stage_seconds(workspace: Path) -> float:
    """The sum of the four stages' own `elapsed_s`, from their manifests."""
    total = 0.0
    for stage in STAGES:
        (manifest,) = (workspace / stage).glob("*/manifest.json")
        data = json.loads(manifest.read_text())
        total += float(data.get("elapsed_s") or data["metrics"]["elapsed_s"])
    return total


def ray_start_s() -> float:
    """Wall time of a bare local `ray.init()` (2 CPUs) in a new process, as the stages start it."""
    code = "import time, ray; t = time.perf_counter(); ray.init(num_cpus=2); "
    code += "print(time.perf_counter() - t); ray.shutdown()"
    env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


def one_arm(root: Path, recipe: Path, work: Path, arm: str, reruns: int) -> dict[str, Any]:
    """A cold command in a new workspace, then `reruns` all-cached reruns."""
    workspace = work / f"ws-{arm}"
    shutil.rmtree(workspace, ignore_errors=True)
    wall = run_examples(root, recipe, workspace, arm, work)
    stages = stage_seconds(workspace)
    again = [run_examples(root, recipe, workspace, arm, work) for _ in range(reruns)]
    return {
        "cold_wall_s": round(wall, 2),
        "cold_stages_s": round(stages, 2),
        "cold_overhead_s": round(wall - stages, 2),
        "rerun_s": [round(t, 2) for t in again],
        "rerun_median_s": round(statistics.median(again), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to time")
    parser.add_argument("--work", type=Path, default=REPO / "bench" / "results" / "fixed_cost")
    parser.add_argument("--mib", type=int, default=9, help="corpus text size (9: ~10 MB)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reruns", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    recipe = write_recipe(work, args.mib)
    root = args.root.resolve()
    try:
        # Untimed: file cache, byte code, store templates, the daemon's start.
        first = {arm: one_arm(root, recipe, work, arm, reruns=1) for arm in ARMS}
        rounds = []
        for i in range(args.rounds):
            row: dict[str, Any] = {"round": i + 1, "ray_start_s": round(ray_start_s(), 2)}
            for arm in list(ARMS) if i % 2 == 0 else reversed(ARMS):
                row[arm] = one_arm(root, recipe, work, arm, args.reruns)
            row["load"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
            rounds.append(row)
            print(json.dumps(row), flush=True)
    finally:
        time_lmpipe(root, ["daemon", "stop"], environment(work, "daemon"), ARMS["daemon"][0])
    result = {"corpus_bytes": (work / "data" / "corpus.jsonl").stat().st_size, "first": first}
    result |= {"rounds": rounds, "root": str(root)}
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
