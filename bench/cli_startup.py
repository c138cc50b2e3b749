"""Start-up time of the `lmpipe` command line: how long until a command that does no work answers.

Usage: python bench/cli_startup.py [--runs 7] [--root DIR] [--json OUT]

Runs each command below --runs times, each in a fresh process (`python -m pipelines.cli.main`,
what the `lmpipe` entry point runs, in the checkout --root: default this one; another checkout,
e.g. a `git archive` of an older commit, gives the baseline on the same interpreter and
packages), after one untimed warm-up run that fills the file cache, and prints
per command the median wall time, the median CPU time (user + system of the process and its
children: less sensitive than wall time to other load on the machine), the exit code and the
load average at the end. None of the commands starts Ray, Prefect or MLflow: they validate a
recipe, print help or list config keys. docs/benchmarks.md, "CLI start-up", has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = "configs/demo.yaml"
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("--help",),
    ("--version",),
    ("pretrain", "--help"),
    ("config", DEMO),
    ("config", DEMO, "train.max_steps=0"),  # a refused value
    ("config", DEMO, "train.optimm.lr=1"),  # a misspelled key
    ("config", "--keys", "train.optim"),
)


def time_once(command: list[str], root: Path) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (user + system, children included) and exit code of one run."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(command, cwd=root, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to time")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    base = [sys.executable, "-m", "pipelines.cli.main"]  # cwd first on sys.path: --root's code
    rows = []
    print(f"{'command':48} {'wall s':>7} {'cpu s':>7} {'exit':>4}")
    for extra in COMMANDS:
        command = [*base, *extra]
        time_once(command, args.root)  # warm-up: file cache, byte-compiled modules
        runs = [time_once(command, args.root) for _ in range(args.runs)]
        row = {
            "command": " ".join(["lmpipe", *extra]),
            "wall_s": round(statistics.median(r[0] for r in runs), 3),
            "cpu_s": round(statistics.median(r[1] for r in runs), 3),
            "exit": sorted({r[2] for r in runs}),
        }
        rows.append(row)
        print(f"{row['command']:48} {row['wall_s']:7.2f} {row['cpu_s']:7.2f} {row['exit']}")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"root: {args.root}; runs per command: {args.runs}; load average at the end: {load}")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": args.runs, "load": load, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
