"""What a pretraining rank leaves for audits: its process id and the samples of each step."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from training.runtime.worker_context import WorkerContext


def write_pid(run_dir: Path, rank: int) -> None:
    """Write this process's id to `<run_dir>/pids/rank-NNNNN.pid`.

    Operators (and the fault tests) find a rank's process there.
    """
    path = run_dir / "pids" / f"rank-{rank:05d}.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()}\n")


def log_sample_ids(ctx: WorkerContext, step: int, ids: np.ndarray) -> None:
    """Append step `step`'s global sample ids of this rank to `samples/rank-NNNNN.jsonl`.

    A later attempt's line for a step replaces an earlier one (`train.log_sample_ids`).
    """
    path = ctx.run_dir / "samples" / f"rank-{ctx.rank:05d}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    line = {"step": step, "world": ctx.world_size, "time": time.time(), "ids": ids.tolist()}
    with open(path, "a") as handle:
        handle.write(json.dumps(line) + "\n")
