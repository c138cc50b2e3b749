"""The pretraining driver: one training run per (inputs, train config), planned, launched, found.

A run is a stage output (`training/runtime/driver.py`): `plan_pretrain` keys it on the example
and tokenizer outputs, the train config, the seed and the code, and places it in
`<storage>/<key>/`; the same inputs find the same run, which is reused when finished and resumed
(with `RunControl(resume=True)`) when it stopped. `train` launches it
(`training/runtime/launcher.py`, on Ray Train or in this process) and finds its last checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.common.io import fingerprint, sha256_file
from tasks.common.stage import content_hash
from training.pretrain.config import TrainConfig
from training.pretrain.data import read_manifest
from training.pretrain.job import WorkerJob
from training.pretrain.loop import PRETRAIN_LOOP
from training.runtime import checkpoint as ckpt
from training.runtime.driver import RunDirectory, RunIdentity, upstream_ref
from training.runtime.faults import FaultPlan
from training.runtime.launcher import RunStateError, resolve_launcher
from training.runtime.progress import ProgressSpec
from training.runtime.run_context import RunContext

log = logging.getLogger(__name__)

STAGE = "pretrain"


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


def pretrain_identity(
    cfg: TrainConfig,
    seed: int,
    examples_dir: Path,
    tokenizer_dir: Path,
    teacher_dir: Path | None = None,
) -> RunIdentity:
    """What keys a pretraining run: its inputs' fingerprints, the train config, seed and code.

    The tokenizer is keyed by its bytes (another vocabulary, another run). A distillation run's
    inputs include its teacher's weights (sha256 of its safetensors), so a registry alias that
    moves to another version starts another run.
    """
    examples = read_manifest(examples_dir)["fingerprint"]
    tokenizer = content_hash(tokenizer_dir)
    inputs: dict[str, Any] = {"examples": examples, "tokenizer": tokenizer}
    upstream = {
        "examples": upstream_ref(examples, examples_dir),
        "tokenizer": upstream_ref(tokenizer, tokenizer_dir),
    }
    if teacher_dir is not None:
        weights = sorted(teacher_dir.glob("*.safetensors"))
        inputs["teacher"] = {shard.name: sha256_file(shard) for shard in weights}
        upstream["teacher"] = upstream_ref(fingerprint(inputs["teacher"]), teacher_dir)
    # Where checkpoints go, how often we log, how many workers share the global batch and when
    # the batches are built do not change what is trained: a run resumes at another worker
    # count (docs/pretraining.md). Nor does where a local teacher lies: its weights are keyed
    # above, so a copied or moved workspace keeps its runs.
    skip = ("checkpoint", "log_every_steps", "eval", "scale", "prefetch")
    train = cfg.model_dump(
        mode="json", exclude={**dict.fromkeys(skip, True), "distillation": {"teacher": {"path"}}}
    )
    return RunIdentity(STAGE, inputs, train, seed, upstream)


def run_id_for(
    cfg: TrainConfig,
    seed: int,
    examples_dir: Path,
    tokenizer_dir: Path,
    teacher_dir: Path | None = None,
) -> str:
    """The run's key (its directory's name): `pretrain_identity`'s."""
    return pretrain_identity(cfg, seed, examples_dir, tokenizer_dir, teacher_dir).key


def storage_root(cfg: TrainConfig, workspace: Path) -> Path:
    """The directory that holds every training run."""
    return (cfg.checkpoint.storage_path or workspace / STAGE).resolve()


def plan_pretrain(
    cfg: TrainConfig,
    examples_dir: Path,
    tokenizer_dir: Path,
    *,
    run: RunContext,
    teacher_dir: Path | None = None,
) -> RunDirectory:
    """The run directory of this pretraining run in `storage_root` (nothing is created)."""
    identity = pretrain_identity(cfg, run.seed, examples_dir, tokenizer_dir, teacher_dir)
    return identity.place(storage_root(cfg, run.workspace), run.workspace)


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
    """Plan the run (`plan_pretrain`) and `train` it until `max_steps` or `control.stop_at_step`.

    `run` gives the seed, the workspace (unless `train.checkpoint.storage_path` is set), Ray and
    the tracking URI the workers log to; `teacher_dir` is the resolved local teacher of a
    distillation run (`train.distillation`).
    """
    planned = plan_pretrain(cfg, examples_dir, tokenizer_dir, run=run, teacher_dir=teacher_dir)
    return train(planned, cfg, run=run, mlflow_run_id=mlflow_run_id, control=control)


def train(
    run_dir: RunDirectory,
    cfg: TrainConfig,
    *,
    run: RunContext,
    mlflow_run_id: str | None,
    control: RunControl | None = None,
) -> TrainingRun:
    """Train the planned run on Ray Train with DeepSpeed, or find it finished.

    A run whose newest valid checkpoint is at `max_steps` is finished (nothing runs); one that
    stopped earlier continues from it when `control.resume`; anything else starts clean. `control`
    also says where to stop, a planned fault and how this driver shows the progress (None:
    `RunControl`'s defaults).

    Raises:
        RunStateError: the run stopped earlier and `control.resume` is False.
        RuntimeError: training failed after `scale.max_failures` restarts.
    """
    control = control or RunControl()
    path, key = run_dir.path, run_dir.key
    found = ckpt.find_resumable(path, None, key) if path.is_dir() else None
    if found is not None and found.meta["step"] >= cfg.max_steps:
        log.info("run %s already finished at step %d: reused", key, found.meta["step"])
        return TrainingRun(path, found.path, found.meta, mlflow_run_id, True)
    if found is not None and not control.resume:
        raise RunStateError(
            f"{path} holds an unfinished run (step {found.meta['step']} of {cfg.max_steps}): "
            "pass --resume to continue it, or remove the directory to start over"
        )
    run_dir.open(keep=found is not None, mlflow_run_id=mlflow_run_id)
    upstream = run_dir.upstream
    job = WorkerJob(
        train=cfg,
        seed=run.seed,
        examples_dir=Path(upstream["examples"]["path"]),
        tokenizer_dir=Path(upstream["tokenizer"]["path"]),
        config_hash=key,
        tracking_uri=run.tracking_uri,
        run_id=mlflow_run_id,
        stop_at_step=control.stop_at_step,
        fault=control.fault,
        teacher_dir=Path(upstream["teacher"]["path"]) if "teacher" in upstream else None,
    )
    if job.fault is not None and resolve_launcher(cfg.scale, run.ray) == "in_process":
        raise ValueError(
            "a planned worker fault needs Ray Train workers (the in-process launcher would kill "
            "this process): set train.scale.launcher to ray"
        )
    run_dir.fit(PRETRAIN_LOOP, job, cfg.scale, run.ray, control.progress)
    last = ckpt.find_resumable(path, None, key)
    if last is None:
        raise RuntimeError(f"{path}: training ended without a valid checkpoint")
    finished = last.meta["step"] >= cfg.max_steps
    return TrainingRun(path, last.path, last.meta, mlflow_run_id, finished)
