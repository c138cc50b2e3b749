"""Stop-and-resume runs of the pretraining loop in this process, without Ray.

`training.pretrain.loop.Worker` on a `LocalContext` (one rank; the caller brings the process
group): the same steps, checkpoints (`Worker.save`) and resume (`Worker.restore`) that Ray
Train's workers run. The bf16 exact-resume tests on CPU (`test_pretrain.py`) and on one GPU
(`test_gpu.py`) share it; nothing here imports Ray, Prefect or MLflow, so it also runs on a
GPU machine that has only the training stack.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from training.models.export import gather_state_dict
from training.pretrain.config import TrainConfig
from training.pretrain.loop import Worker, WorkerJob
from training.runtime import checkpoint as ckpt
from training.runtime.worker_context import LocalContext
from training.scoring.plots import step_history

STOP_AT, MAX_STEPS = 2, 4


def bf16_resume_config(*, use_gpu: bool, zero_stage: int) -> TrainConfig:
    """Tiny BERT in bf16, one rank, `MAX_STEPS` steps; dropout on, so the RNG must resume too."""
    return TrainConfig.model_validate(
        {
            "model": {"family": "bert", "size": "tiny"},
            "max_steps": MAX_STEPS,
            "global_batch_size": 16,
            "zero_stage": zero_stage,
            "precision": "bf16",
            "allow_emulated_bf16": True,  # on a CPU without native bf16: tiny, on purpose
            "optim": {"lr": 3e-3, "warmup_steps": 1},
            "checkpoint": {"every_steps": MAX_STEPS, "keep_last": 2},
            "eval": {"every_steps": MAX_STEPS, "max_samples": 16},
            "scale": {"num_workers": 1, "use_gpu": use_gpu},
        }
    )


@dataclass(frozen=True)
class LocalRun:
    """A run directory after its last attempt, and the worker of that attempt."""

    run_dir: Path
    worker: Worker

    def losses(self) -> dict[int, float]:
        """Each step's logged training loss (a replayed step's later line wins)."""
        return {
            step: row["loss"] for step, row in step_history(self.run_dir / "steps.jsonl").items()
        }

    def weights(self) -> dict[str, torch.Tensor]:
        """The fp32 weights of the run's last checkpoint, as an export reads them."""
        step = self.worker.step
        return gather_state_dict(self.run_dir / ckpt.checkpoint_name(step), ckpt.TAG)


def train_locally(
    cfg: TrainConfig, data: dict[str, Path], run_dir: Path, stop_at_step: int | None = None
) -> LocalRun:
    """One attempt: resume from `run_dir`'s newest valid checkpoint if any, then train.

    A `stop_at_step` attempt ends after that step with a checkpoint, as a preempted run does.
    """
    job = WorkerJob(
        train=cfg,
        seed=0,
        examples_dir=data["examples"],
        tokenizer_dir=data["tokenizer"],
        config_hash="local-resume",  # the same run: a later attempt resumes it
        stop_at_step=stop_at_step,
    )
    worker = Worker(job, LocalContext(run_dir))
    worker.run()
    return LocalRun(run_dir, worker)


def whole_and_resumed(
    cfg: TrainConfig, data: dict[str, Path], root: Path
) -> tuple[LocalRun, LocalRun]:
    """An uninterrupted run, and one stopped after step `STOP_AT` and resumed by a new worker.

    The new worker builds a fresh model and engine and reseeds torch, as a new process does;
    everything it continues from comes from the checkpoint.
    """
    whole = train_locally(cfg, data, root / "whole")
    stopped = train_locally(cfg, data, root / "stopped", stop_at_step=STOP_AT)
    assert stopped.worker.step == STOP_AT
    resumed = train_locally(cfg, data, root / "stopped")
    assert resumed.worker.step == MAX_STEPS
    # Resumed, not restarted: a restart from step 0 would repeat the whole run's losses too.
    rows = (resumed.run_dir / "resumes.jsonl").read_text().splitlines()
    assert [json.loads(row)["step"] for row in rows] == [STOP_AT]
    return whole, resumed
