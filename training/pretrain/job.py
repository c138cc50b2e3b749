"""What a pretraining worker is given: `WorkerJob`, the typed job that crosses into Ray Train.

The driver (`training/pretrain/driver.py`) builds it; the launcher hands it to the loop as the
model itself, or, on Ray Train, as its JSON dict validated back on each worker
(`training/runtime/worker_context.py`, `LoopEntry.on_ray`).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

from training.pretrain.config import TrainConfig
from training.runtime import faults


class WorkerJob(BaseModel):
    """Everything a worker needs: the train config, its inputs, and where to report."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    train: TrainConfig
    seed: int
    examples_dir: Path
    tokenizer_dir: Path
    config_hash: str
    tracking_uri: str | None = None
    run_id: str | None = None
    stop_at_step: int | None = None  # end this attempt after that step, with a checkpoint
    fault: faults.FaultPlan | None = None  # the reliability suite's injected SIGKILL
    teacher_dir: Path | None = None  # distillation: the resolved local teacher
    progress: str | None = None  # the driver's progress sink (training/runtime/progress.py)
