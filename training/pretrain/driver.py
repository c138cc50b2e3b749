"""The pretraining driver: one training run per (inputs, train config), launched, then found.

A run lives in `<storage>/<run id>/` where the run id is a hash of the example and tokenizer
outputs, the train config, the seed and the code: the same inputs find the same run, which is
reused when finished and resumed (with `RunControl(resume=True)`) when it stopped. The run
itself is launched by `training/runtime/launcher.py` (`fit`), on Ray Train or in this process.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.io import fingerprint, sha256_file, source_hash
from tasks.common.ray_runtime import RayConfig
from tasks.common.stage import content_hash
from training.pretrain.config import TrainConfig
from training.pretrain.data import read_manifest
from training.pretrain.job import WorkerJob
from training.pretrain.loop import PRETRAIN_LOOP
from training.runtime import checkpoint as ckpt
from training.runtime.faults import FaultPlan
from training.runtime.launcher import RunStateError, fit, resolve_launcher
from training.runtime.progress import ProgressSpec
from training.runtime.run_context import RunContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunControl:
    """How one call drives a training run, apart from what it trains (none of it is in the run id).

    Attributes:
        resume: Continue an unfinished run found under the same run id (else that is an error).
        stop_at_step: End after this step with a checkpoint, as a preempted run does; None: run
            to `max_steps`.
        fault: One planned SIGKILL of a worker (training/runtime/faults.py; the reliability
            suite's).
        progress: How this driver shows the run's progress; None: not at all.
    """

    resume: bool = False
    stop_at_step: int | None = None
    fault: FaultPlan | None = None
    progress: ProgressSpec | None = None


@dataclass(frozen=True)
class TrainingRun:
    """What a finished (or stopped) training run left: its directory and last checkpoint."""

    run_dir: Path
    checkpoint: Path
    meta: dict[str, Any]
    mlflow_run_id: str | None
    finished: bool


def run_id_for(
    cfg: TrainConfig,
    seed: int,
    examples_dir: Path,
    tokenizer_dir: Path,
    teacher_dir: Path | None = None,
) -> str:
    """The run's identity: a hash of its inputs' fingerprints, the train config, seed and code.

    A distillation run's inputs include its teacher's weights (sha256 of its safetensors), so
    a registry alias that moves to another version starts another run.
    """
    inputs = {
        "examples": read_manifest(examples_dir)["fingerprint"],
        "tokenizer": content_hash(tokenizer_dir),  # its bytes: another vocabulary, another run
    }
    if teacher_dir is not None:
        weights = sorted(teacher_dir.glob("*.safetensors"))
        inputs["teacher"] = {shard.name: sha256_file(shard) for shard in weights}
    # Where checkpoints go, how often we log, how many workers share the global batch and when
    # the batches are built do not change what is trained: a run resumes at another worker
    # count (docs/pretraining.md). Nor does where a local teacher lies: its weights are keyed
    # above, so a copied or moved workspace keeps its runs.
    skip = ("checkpoint", "log_every_steps", "eval", "scale", "prefetch")
    train = cfg.model_dump(
        mode="json", exclude={**dict.fromkeys(skip, True), "distillation": {"teacher": {"path"}}}
    )
    code = source_hash("tasks", "training")
    return fingerprint({"inputs": inputs, "train": train, "seed": seed, "code": code})


def storage_root(cfg: TrainConfig, workspace: Path) -> Path:
    """The directory that holds every training run."""
    return (cfg.checkpoint.storage_path or workspace / "pretrain").resolve()


def run_training(
    cfg: TrainConfig,
    examples_dir: Path,
    tokenizer_dir: Path,
    *,
    run: RunContext,
    mlflow_run_id: str | None,
    control: RunControl | None = None,
    teacher_dir: Path | None = None,
) -> TrainingRun:
    """Train on Ray Train with DeepSpeed until `max_steps` (or `control.stop_at_step`).

    `run` gives the seed, the workspace (unless `train.checkpoint.storage_path` is set), Ray and
    the tracking URI the workers log to; `control` whether to resume, where to stop, a planned
    fault and how this driver shows the run's progress (None: `RunControl`'s defaults);
    `teacher_dir` is the resolved local teacher of a distillation run (`train.distillation`).

    Raises:
        RunStateError: the run stopped earlier and `control.resume` is False.
        RuntimeError: training failed after `scale.max_failures` restarts.
    """
    control = control or RunControl()
    run_id = run_id_for(cfg, run.seed, examples_dir, tokenizer_dir, teacher_dir)
    root = storage_root(cfg, run.workspace)
    run_dir = root / run_id
    found = ckpt.find_resumable(run_dir, None, run_id) if run_dir.is_dir() else None
    if found is not None and found.meta["step"] >= cfg.max_steps:
        log.info("run %s already finished at step %d: reused", run_id, found.meta["step"])
        return TrainingRun(run_dir, found.path, found.meta, mlflow_run_id, True)
    if found is not None and not control.resume:
        raise RunStateError(
            f"{run_dir} holds an unfinished run (step {found.meta['step']} of {cfg.max_steps}): "
            "pass --resume to continue it, or remove the directory to start over"
        )
    if found is None and run_dir.is_dir():
        shutil.rmtree(run_dir)  # nothing valid to resume: start clean, no stale Ray state
    run_dir.mkdir(parents=True, exist_ok=True)
    job = WorkerJob(
        train=cfg,
        seed=run.seed,
        examples_dir=examples_dir.resolve(),
        tokenizer_dir=tokenizer_dir.resolve(),
        config_hash=run_id,
        tracking_uri=run.tracking_uri,
        run_id=mlflow_run_id,
        stop_at_step=control.stop_at_step,
        fault=control.fault,
        teacher_dir=teacher_dir.resolve() if teacher_dir is not None else None,
    )
    _fit(job, root, run_id, run.ray, control.progress)
    last = ckpt.find_resumable(run_dir, None, run_id)
    if last is None:
        raise RuntimeError(f"{run_dir}: training ended without a valid checkpoint")
    finished = last.meta["step"] >= cfg.max_steps
    return TrainingRun(run_dir, last.path, last.meta, mlflow_run_id, finished)


def _fit(
    job: WorkerJob, root: Path, run_id: str, ray_cfg: RayConfig, progress: ProgressSpec | None
) -> None:
    if job.fault is not None and resolve_launcher(job.train.scale, ray_cfg) == "in_process":
        raise ValueError(
            "a planned worker fault needs Ray Train workers (the in-process launcher would kill "
            "this process): set train.scale.launcher to ray"
        )
    fit(PRETRAIN_LOOP, job, job.train.scale, root / run_id, ray_cfg, progress)
