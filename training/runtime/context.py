"""Where a training worker runs: inside Ray Train, or as a plain process (one GPU benchmark).

The loop talks to a `WorkerContext` only: its rank, the run directory, the checkpoint to resume
from, and `report`. `RayWorkerContext` is the one place that calls `ray.train.report` and
`ray.train.get_checkpoint`; `LocalContext` lets the same loop run without Ray.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

#: NCCL moves CUDA tensors only. The loops' small reductions of Python numbers (step and
#: evaluation sums, fine-tuning statistics) are CPU tensors, so a GPU group carries gloo too.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def torch_backend(backend: str | None, use_gpu: bool) -> str:
    """The process-group backend for `train.scale.backend` (None: nccl on GPU, gloo on CPU).

    nccl becomes `GPU_BACKEND`: nccl for CUDA tensors, gloo for CPU ones.
    """
    choice = backend or ("nccl" if use_gpu else "gloo")
    return GPU_BACKEND if choice == "nccl" else choice


class WorkerContext(Protocol):
    """What the loop needs from the process that runs it."""

    rank: int
    world_size: int
    run_dir: Path

    def reported_checkpoint(self) -> Path | None: ...  # noqa: D102
    def report(self, metrics: dict[str, Any], checkpoint: Path | None) -> None: ...  # noqa: D102


class RayWorkerContext:
    """A Ray Train v2 worker: checkpoints are written in place under the run's storage path."""

    def __init__(self) -> None:
        """Read rank, world size and the run directory from Ray Train's context."""
        import ray.train

        context = ray.train.get_context()
        self.rank: int = context.get_world_rank()
        self.world_size: int = context.get_world_size()
        # A local or shared filesystem path: DeepSpeed writes each rank's shards straight into
        # it and the report does not copy (NO_UPLOAD), so one write commits a checkpoint.
        self.run_dir = Path(context.get_storage().experiment_fs_path)

    def reported_checkpoint(self) -> Path | None:
        """The checkpoint Ray registered last for this run, if any."""
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        return Path(checkpoint.path) if checkpoint is not None else None

    def report(self, metrics: dict[str, Any], checkpoint: Path | None) -> None:
        """Report to Ray (a barrier: every rank calls it at the same steps)."""
        import ray.train
        from ray.train import Checkpoint
        from ray.train.v2.api.report_config import CheckpointUploadMode

        if checkpoint is None:
            ray.train.report(metrics)
            return
        ray.train.report(
            metrics,
            checkpoint=Checkpoint.from_directory(str(checkpoint)),
            checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
        )


class LocalContext:
    """One process without Ray (world size from torch.distributed if it is initialised)."""

    def __init__(self, run_dir: Path) -> None:
        """Use `run_dir` for checkpoints; resume from its newest valid one."""
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.run_dir = run_dir
        self.reports: list[dict[str, Any]] = []

    def reported_checkpoint(self) -> Path | None:
        """No registry outside Ray: the run directory is scanned instead."""
        return None

    def report(self, metrics: dict[str, Any], checkpoint: Path | None) -> None:
        """Keep the metrics in memory."""
        self.reports.append({**metrics, "checkpoint": str(checkpoint) if checkpoint else None})


def init_single_process() -> None:
    """Initialise a one-rank process group for a loop run without Ray (`torch_backend`)."""
    import os
    import socket

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }.items():
        os.environ.setdefault(key, value)
    import torch

    if torch.cuda.is_available():  # as Ray Train does for its GPU workers
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(torch_backend(None, torch.cuda.is_available()))
