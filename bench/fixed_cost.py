"""A command's own overhead: wall time of `lmpipe examples` minus its stages' own time.

Usage: python bench/fixed_cost.py --before DIR [--root DIR] [--work DIR] [--mib 9]
                                  [--rounds 2] [--reruns 3] [--json OUT]

Issue 38's target: on a corpus of about 10 MB, a cold command's overhead (imports, the Prefect
API, MLflow's store, Ray) at most 2 s, an all-cached rerun's at most 1 s. Each arm is a
checkout run as `python -m pipelines.cli.main` (what the `lmpipe` entry point runs) in a new
process: --before (e.g. a `git archive HEAD` copy with the compiled
`tasks/ingest/_textscan*.so` copied in) and --root (default: this checkout), interleaved
round by round on the same interpreter and packages. Per round and arm:

- cold: a new workspace and a new Prefect home (`<workspace>/.prefect`: set explicitly for the
  before arm, whose default was ~/.prefect; the after arm's own default) through ingest,
  tokenizer, encode and BERT examples. Overhead = wall minus the sum of the four stages' own
  `elapsed_s` (their manifests). Ray's start happens inside the ingest stage, so it counts as
  the stage's time in both arms; `ray_start_s` times a bare `ray.init()` beside it.
- rerun: --reruns all-cached reruns of the same command; no stage runs, so overhead = wall.

Both arms share the per-user cache (`LMPIPE_CACHE_DIR`, under --work): one untimed cold run
per arm first fills the file cache and lets the after arm make its store templates once.
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


def environment(work: Path, workspace: Path, before: bool) -> dict[str, str]:
    """An isolated environment: no outside services, the workspace's own Prefect home."""
    env = os.environ | {
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
        "LMPIPE_CACHE_DIR": str(work / "cache"),
    }
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS", "PREFECT_HOME"):
        env.pop(key, None)
    if before:  # its default was ~/.prefect, shared by every workspace
        env["PREFECT_HOME"] = str(workspace / ".prefect")
        (workspace / ".prefect").mkdir(parents=True)  # Prefect makes only the last level
    return env


def run_examples(root: Path, recipe: Path, workspace: Path, env: dict[str, str]) -> float:
    """One `lmpipe examples` from checkout `root` in a new process; its wall time (s)."""
    return time_lmpipe(root, ["examples", str(recipe), f"workspace={workspace}"], env)[0]


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


def one_arm(root: Path, recipe: Path, work: Path, name: str, reruns: int) -> dict[str, Any]:
    """A cold command in a new workspace, then `reruns` all-cached reruns."""
    workspace = work / f"ws-{name}"
    shutil.rmtree(workspace, ignore_errors=True)
    env = environment(work, workspace, before=name == "before")
    wall = run_examples(root, recipe, workspace, env)
    stages = stage_seconds(workspace)
    again = [run_examples(root, recipe, workspace, env) for _ in range(reruns)]
    return {
        "cold_wall_s": round(wall, 2),
        "cold_stages_s": round(stages, 2),
        "cold_overhead_s": round(wall - stages, 2),
        "rerun_s": [round(t, 2) for t in again],
        "rerun_median_s": round(statistics.median(again), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the baseline checkout")
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
    arms = {"before": args.before.resolve(), "after": args.root.resolve()}
    for name, root in arms.items():  # untimed: file cache, byte code, the after arm's templates
        one_arm(root, recipe, work, name, reruns=1)
    rounds = []
    for i in range(args.rounds):
        row: dict[str, Any] = {"round": i + 1, "ray_start_s": round(ray_start_s(), 2)}
        for name, root in arms.items() if i % 2 == 0 else reversed(arms.items()):
            row[name] = one_arm(root, recipe, work, name, args.reruns)
        row["load"] = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        rounds.append(row)
        print(json.dumps(row), flush=True)
    result = {"corpus_bytes": (work / "data" / "corpus.jsonl").stat().st_size, "rounds": rounds}
    result["arms"] = {name: str(root) for name, root in arms.items()}
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
