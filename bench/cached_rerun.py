"""Wall time of `lmpipe examples` when every stage is already built (all cache hits).

Usage: python bench/cached_rerun.py [--root DIR] [--work DIR] [--runs 5] [--json OUT]

Builds the data stages of a small recipe once (a 2,000-document synthetic corpus: ingest,
tokenizer, encode, examples), then reruns `lmpipe examples` with nothing changed, each run the
real command in a new process (`python -m pipelines.cli.main`, what the `lmpipe` entry point
runs, in the checkout --root: default this one; a `git archive` of an older commit, with the
compiled `tasks/ingest/_textscan*.so` copied in, gives the baseline on the same interpreter and
packages). Two ways, --runs times each after one untimed warm-up:

- `temporary`: no servers; Prefect starts its temporary API in the command, MLflow is SQLite;
- `up`: with the servers of `lmpipe up` running (Prefect and MLflow), the command only talks to
  them. After these runs the newest task run of each data stage is read from that Prefect
  API, and its state printed (Cached, where Prefect's cache answered).

Prints the median wall time per way, and the load average; docs/benchmarks.md, "Cached rerun",
has the figures. Target: under 5 s with the servers up, on a 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

from harness import time_lmpipe  # bench/, the script's folder, is on sys.path
from pipeline_rerun import isolated_env

REPO = Path(__file__).resolve().parents[1]
STAGES = ("ingest", "tokenizer", "encode", "examples")


def recipe(work: Path) -> Path:
    """Write the corpus and the recipe under `work` (once); return the recipe's path."""
    path = work / "recipe.yaml"
    if path.is_file():
        return path
    from tasks.demo.synthetic import SyntheticConfig, write_corpus

    write_corpus(work / "data", SyntheticConfig(seed=0, documents=2000))
    path.write_text(
        "\n".join(
            [
                "name: rerun",
                f"workspace: {work / 'ws'}",
                f"ingest: {{sources: [{{path: {work / 'data' / 'corpus'}, format: jsonl}}]}}",
                "tokenizer: {family: wordpiece, vocab_size: 1024}",
                "examples: {objective: bert, max_seq_length: 64}",
                "",
            ]
        )
    )
    return path


def timed(root: Path, cfg: Path, env: dict[str, str], runs: int) -> list[float]:
    time_lmpipe(root, ["examples", str(cfg)], env)  # warm-up: file cache, byte-compiled modules
    return [time_lmpipe(root, ["examples", str(cfg)], env)[0] for _ in range(runs)]


def stage_states(api_url: str) -> dict[str, str]:
    """The newest run of each data stage task and its state, from the Prefect API at `api_url`."""
    os.environ["PREFECT_API_URL"] = api_url
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import TaskRunSort

    async def read() -> dict[str, str]:
        async with get_client() as client:
            runs = await client.read_task_runs(sort=TaskRunSort.EXPECTED_START_TIME_DESC, limit=50)
        newest: dict[str, str] = {}
        for run in runs:
            stage = run.name.split("-")[0]
            if stage in STAGES and stage not in newest:
                newest[stage] = run.state.name if run.state else "?"
        return newest

    return asyncio.run(read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to time")
    parser.add_argument("--work", type=Path, default=REPO / "bench" / "results" / "cached_rerun")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg = recipe(work)
    env = isolated_env(work)
    build_s, _ = time_lmpipe(args.root, ["examples", str(cfg)], env)
    temporary = timed(args.root, cfg, env, args.runs)
    _, said = time_lmpipe(args.root, ["up", str(cfg)], env)
    urls = dict(re.findall(r"export (PREFECT_API_URL|MLFLOW_TRACKING_URI)=(\S+)", said))
    try:
        up = timed(args.root, cfg, env | urls, args.runs)
        states = stage_states(urls["PREFECT_API_URL"])
    finally:
        time_lmpipe(args.root, ["down", str(cfg)], env)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    result: dict[str, Any] = {
        "root": str(args.root),
        "first_build_s": round(build_s, 2),
        "temporary_s": [round(t, 2) for t in temporary],
        "temporary_median_s": round(statistics.median(temporary), 2),
        "up_s": [round(t, 2) for t in up],
        "up_median_s": round(statistics.median(up), 2),
        "stage_states_with_up": states,
        "load_at_end": load,
    }
    print(json.dumps(result, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
