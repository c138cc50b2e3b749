"""The runtime's configs: workers (`ScaleConfig`), loss guard, checkpoints.

Shared by pretraining's `train` section and fine-tuning's `finetune` section. Only config
models live here, so that a recipe validates without importing torch (`lmpipe config`); the
code they configure is in `launcher.py`, `guard.py` and `checkpoint.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class GuardConfig(BaseModel):
    """What a non-finite or spiking loss does."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A NaN/inf loss stops the run (stop) or leaves the weights as they "
        "were for that step (skip).",
    )
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="A loss above this factor times the running mean is a spike; "
        "None turns spike detection off.",
    )
    spike_window: int = Field(20, ge=2, description="Steps in the running mean of the loss.")
    on_spike: Literal["stop", "skip"] = Field("skip", description="What a spike does.")
    max_skips: int = Field(10, ge=0, description="Skipped steps in a row before the run stops.")


class ScaleConfig(BaseModel):
    """How many workers, what each gets, and where they run (Ray Train or this process)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    num_workers: int | Literal["auto"] = Field(
        "auto",
        description="Data-parallel workers (ranks). auto: with use_gpu, one per GPU (this "
        "machine's, or the Ray cluster's at ray.address); without, one, which takes every "
        "usable core (threads_per_worker auto).",
    )
    launcher: Literal["auto", "ray", "in_process"] = Field(
        "auto",
        description="Where the workers run. ray: Ray Train workers, restarted from the last "
        "checkpoint on failure (max_failures), on a cluster when ray.address is set. "
        "in_process: one worker in this process, without starting Ray Train (no restarts). "
        "auto: in_process for one worker with max_failures 0 or auto and no Ray cluster "
        "address, else ray.",
    )
    use_gpu: bool = Field(False, description="One GPU per worker.")
    cpus_per_worker: float | Literal["auto"] = Field(
        "auto",
        description="Logical CPUs Ray reserves per worker. auto: on a local Ray, the usable "
        "cores (CPU affinity, capped by the cgroup's CPU quota) divided among the workers; on "
        "a cluster, the smallest node's CPUs divided among the workers it hosts.",
    )
    threads_per_worker: int | Literal["auto"] = Field(
        "auto",
        description="torch intra-op threads per worker. auto: the CPUs the worker has (in "
        "this process: the usable cores).",
    )
    max_failures: int | Literal["auto"] = Field(
        "auto",
        description="Worker-group restarts from the latest checkpoint on Ray Train (-1: no "
        "limit). auto: 2 on Ray Train, 0 in this process (which cannot restart).",
    )
    backend: Literal["gloo", "nccl"] | None = Field(
        None,
        description="torch.distributed backend; default nccl on GPU, gloo on CPU. nccl runs "
        "with gloo beside it for CPU tensors (cpu:gloo,cuda:nccl).",
    )
    report_poll_s: float = Field(
        0.2,
        gt=0,
        le=60,
        description="How often Ray Train's controller polls the workers "
        "(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S). It takes one report per poll and a worker's next "
        "report waits for it, so every checkpoint or epoch report can wait this long; Ray's "
        "own default of 2 s dominated short runs.",
    )

    @model_validator(mode="after")
    def _positive_counts(self) -> Self:
        if self.num_workers != "auto" and self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1 or auto, not {self.num_workers}")
        if self.max_failures != "auto" and self.max_failures < -1:
            raise ValueError(f"max_failures must be >= -1 or auto, not {self.max_failures}")
        if self.cpus_per_worker != "auto" and self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be > 0 or auto, not {self.cpus_per_worker}")
        if self.threads_per_worker != "auto" and self.threads_per_worker < 1:
            raise ValueError(
                f"threads_per_worker must be >= 1 or auto, not {self.threads_per_worker}"
            )
        return self

    @model_validator(mode="after")
    def _in_process_is_one_worker(self) -> Self:
        if self.launcher != "in_process":
            return self
        if self.num_workers not in (1, "auto"):
            raise ValueError(
                f"launcher in_process runs one worker in this process, not num_workers "
                f"{self.num_workers}: set num_workers to 1, or launcher to ray"
            )
        if self.max_failures not in (0, "auto"):
            raise ValueError(
                f"launcher in_process cannot restart a failed worker (max_failures "
                f"{self.max_failures}): set max_failures to 0, or launcher to ray"
            )
        return self


class CheckpointConfig(BaseModel):
    """Where and how often checkpoints are written."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    every_steps: int = Field(50, ge=1, description="Save every N optimizer steps (and at the end).")
    keep_last: int = Field(
        2, ge=1, description="Complete checkpoints kept; older ones are removed."
    )
    storage_path: Path | None = Field(
        None, description="Directory (local or shared) for runs; default <workspace>/pretrain."
    )
