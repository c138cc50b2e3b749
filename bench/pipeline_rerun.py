"""Wall time of `lmpipe run` on the demo: the first run, then cached reruns with nothing changed.

Usage: python bench/pipeline_rerun.py [--work bench/results/pipeline_rerun] [--reruns 3]
                                      [--fresh] [--json FILE] [KEY=VALUE ...]

Target: the demo pipeline must finish in under 10 minutes on a 2-core machine (`make demo`
minus set-up), and a rerun with nothing changed (every stage a cache hit) in under 30 seconds.
Each run is the real command in a new process (`.venv/bin/lmpipe run configs/demo.yaml`, with
an ephemeral Prefect API under the work directory, local Ray, MLflow on SQLite), so a rerun
pays everything a user pays: imports, the Prefect API start, Ray start, MLflow logging of one
nested run per stage. After each run the MLflow parent run is read back to count the stages
that were cache hits. The baseline is the first run in the same invocation (ratio =
rerun / first run). `--fresh` deletes the work directory first.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LMPIPE = Path(sys.executable).parent / "lmpipe"


def isolated_env(work: Path) -> dict[str, str]:
    """The environment of an `lmpipe` run under `work`, isolated from outside services.

    Its own Prefect home and temporary API, local Ray and MLflow, no telemetry.
    """
    env = os.environ | {
        "PREFECT_HOME": str(work / ".prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_AUTH_MODE": "token",
        "RAY_USAGE_STATS_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
    }
    for key in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS"):
        env.pop(key, None)
    return env


def run_pipeline(work: Path, overrides: list[str]) -> float:
    """Run `lmpipe run` on the demo recipe in a new process; return its wall time (s)."""
    env = isolated_env(work)
    command = [
        str(LMPIPE),
        "run",
        str(ROOT / "configs" / "demo.yaml"),
        f"workspace={work / 'ws'}",
        f"ingest.sources.0.path={work / 'demo_data' / 'corpus'}",
        f"task.base_dir={work / 'demo_data'}",
        *overrides,
    ]
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def last_pipeline(work: Path) -> dict[str, Any]:
    """The newest pipeline parent run: its metrics and which stages were cache hits."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'ws' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("lmpipe")
    runs = client.search_runs(
        [experiment.experiment_id],
        "tags.`lmpipe.stage` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    run = runs[0]
    return {
        "stages": int(run.data.metrics["stages"]),
        "stages_reused": int(run.data.metrics["stages_reused"]),
        "reused": run.data.tags.get("lmpipe.stages_reused", ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "bench/results/pipeline_rerun")
    parser.add_argument("--reruns", type=int, default=3)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. train.max_steps=200")
    args = parser.parse_args()
    work = args.work.resolve()
    if args.fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "demo_data" / "corpus").is_dir():
        subprocess.run(
            [str(LMPIPE), "demo-corpus", "--out", str(work / "demo_data")],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
        )
    first = run_pipeline(work, args.overrides)
    first_record = last_pipeline(work)
    reruns = []
    for _ in range(args.reruns):
        seconds = run_pipeline(work, args.overrides)
        reruns.append({"seconds": round(seconds, 2), **last_pipeline(work)})
    best = min(r["seconds"] for r in reruns)
    result = {
        "first_run_s": round(first, 2),
        "first_run": first_record,
        "reruns": reruns,
        "best_rerun_s": best,
        "rerun_over_first": round(best / first, 4),
        "cpus": os.cpu_count(),
    }
    print("| run | wall s | stages reused |")
    print("|---|---:|---:|")
    print(f"| first | {first:.1f} | {first_record['stages_reused']}/{first_record['stages']} |")
    for i, r in enumerate(reruns, 1):
        print(f"| rerun {i} | {r['seconds']:.1f} | {r['stages_reused']}/{r['stages']} |")
    print(f"best rerun / first run = {result['rerun_over_first']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
