"""The pretraining driver: one training run per (inputs, train config), in MLflow, and `fit`.

`fit` runs a loop (pretraining's or fine-tuning's `LoopEntry`) on Ray Train workers, or as the
one worker in this process when `train.scale.launcher` says so (`resolve_launcher`).

A run lives in `<storage>/<run id>/` where the run id is a hash of the example and tokenizer
outputs, the train config and the seed: the same inputs find the same run, which is reused when
finished and resumed (with `RunControl(resume=True)`) when it stopped.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tasks.common.io import fingerprint, sha256_file, source_hash
from tasks.common.ray_runtime import RayConfig, ensure_ray
from tasks.common.stage import content_hash
from training.pretrain.config import ScaleConfig, TrainConfig
from training.pretrain.data import read_manifest
from training.pretrain.loop import PRETRAIN_LOOP, WorkerJob
from training.runtime import checkpoint as ckpt
from training.runtime.context import LocalContext, LoopEntry, in_process_rank, torch_backend
from training.runtime.faults import FaultPlan
from training.runtime.progress import ProgressSpec, driver_progress, in_process_progress
from training.runtime.run_context import RunContext

log = logging.getLogger(__name__)


class RunStateError(RuntimeError):
    """A run exists and is unfinished but resuming was not asked for (or the reverse)."""


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
    config = job.model_dump(mode="json")
    fit(PRETRAIN_LOOP, config, job.train.scale, root / run_id, ray_cfg, progress)


POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def set_report_poll(scale: ScaleConfig) -> None:
    """Make the next Ray Train run's controller poll its workers every `scale.report_poll_s`.

    The driver reads the variable at `fit` and passes it to the controller it starts (Ray
    Train's `get_env_vars_to_propagate`). The controller takes one `ray.train.report` per poll
    and a worker's next report blocks until then, so at Ray's default of 2 s a short
    fine-tuning epoch or a frequent checkpoint waits longer than it computes.
    """
    os.environ[POLL_ENV] = f"{scale.report_poll_s:g}"


def resolve_launcher(scale: ScaleConfig, ray_cfg: RayConfig) -> Literal["ray", "in_process"]:
    """Where `scale`'s workers run: `scale.launcher`, with `auto` resolved.

    `auto` runs in this process when that loses nothing: one worker, no restarts asked for
    (`max_failures` 0) and no Ray cluster to run on (`ray.address`, `RAY_ADDRESS`). Starting
    Ray Train costs a one-worker run 15-30 s on a small machine (docs/pretraining.md).
    """
    if scale.launcher != "auto":
        return scale.launcher
    cluster = ray_cfg.address is not None or bool(os.environ.get("RAY_ADDRESS"))
    if scale.num_workers == 1 and scale.max_failures == 0 and not cluster:
        return "in_process"
    return "ray"


def fit(
    entry: LoopEntry,
    loop_config: dict[str, Any],
    scale: ScaleConfig,
    run_dir: Path,
    ray_cfg: RayConfig,
    progress: ProgressSpec | None = None,
) -> None:
    """Run a training loop on the launcher `resolve_launcher` picks; `run_dir` is its run's.

    Raises:
        RuntimeError: training failed (on Ray, after `scale.max_failures` restarts).
    """
    if resolve_launcher(scale, ray_cfg) == "in_process":
        fit_in_process(entry, loop_config, scale, run_dir, progress)
    else:
        fit_on_ray(entry.on_ray, loop_config, scale, run_dir, ray_cfg, progress)


def fit_in_process(
    entry: LoopEntry,
    loop_config: dict[str, Any],
    scale: ScaleConfig,
    run_dir: Path,
    progress: ProgressSpec | None = None,
) -> None:
    """Run `entry`'s loop as the one worker, in this process, without Ray Train.

    The loop sees the same job as on Ray, a `LocalContext` on `run_dir` (it resumes from the
    newest valid checkpoint there) and the one-rank world of `in_process_rank`. torch's thread
    count, which the loop sets to `scale.threads_per_worker`, is restored afterwards.

    Raises:
        RuntimeError: the loop raised (its exception is the cause).
    """
    import torch

    log.info("%s: one worker in this process (no Ray Train start)", run_dir.name)
    threads = torch.get_num_threads()
    with in_process_progress(progress) as address, in_process_rank(scale.backend, scale.use_gpu):
        config = loop_config if address is None else loop_config | {"progress": address}
        try:
            entry.in_process(config, LocalContext(run_dir))
        except Exception as exc:
            raise RuntimeError(f"training failed in this process ({run_dir}): {exc}") from exc
        finally:
            torch.set_num_threads(threads)


def fit_on_ray(
    loop: Callable[[dict[str, Any]], None],
    loop_config: dict[str, Any],
    scale: ScaleConfig,
    run_dir: Path,
    ray_cfg: RayConfig,
    progress: ProgressSpec | None = None,
) -> None:
    """Run `loop(loop_config)` on `scale.num_workers` Ray Train workers; `run_dir` is theirs.

    Checkpoints are written in place by the loop (`RayWorkerContext`) and pruned by lmpipe.
    With `progress`, this driver shows what rank 0 reports (`training/runtime/progress.py`):
    the loop finds the sink at `loop_config["progress"]`, a field of its job model.

    Raises:
        RuntimeError: training failed after `scale.max_failures` restarts.
    """
    import ray.train

    ensure_ray(ray_cfg)
    set_report_poll(scale)
    with driver_progress(progress) as address:
        config = loop_config if address is None else loop_config | {"progress": address}
        trainer = _trainer(loop, config, scale, run_dir)
        try:
            result = trainer.fit()
        except ray.train.TrainingFailedError as exc:
            raise RuntimeError(
                f"training failed after {scale.max_failures} restart(s) "
                f"(train.scale.max_failures) in {run_dir}: {exc}"
            ) from exc
    if result.error is not None:
        raise RuntimeError(f"training failed: {result.error}") from result.error


def _trainer(
    loop: Callable[[dict[str, Any]], None],
    loop_config: dict[str, Any],
    scale: ScaleConfig,
    run_dir: Path,
) -> Any:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    return TorchTrainer(
        loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=scale.num_workers,
            use_gpu=scale.use_gpu,
            resources_per_worker={
                "CPU": scale.cpus_per_worker,
                **({"GPU": 1} if scale.use_gpu else {}),
            },
        ),
        torch_config=TorchConfig(backend=torch_backend(scale.backend, scale.use_gpu)),
        run_config=RunConfig(
            name=run_dir.name,
            storage_path=str(run_dir.parent),
            # lmpipe prunes (training/runtime/checkpoint.py), orphans included; Ray deleting too
            # raced with it ("Path not found" in the controller).
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            failure_config=FailureConfig(max_failures=scale.max_failures),
        ),
    )
