"""Where a training worker runs: inside Ray Train, or in the driver's own process.

The loop talks to a `WorkerContext` only: its rank, the run directory, the checkpoint to resume
from, and `report`. `RayWorkerContext` is the one place that calls `ray.train.report` and
`ray.train.get_checkpoint`; `LocalContext` lets the same loop run without Ray (the in-process
launcher, `train.scale.launcher`, and the GPU benchmark's plain process), on the one-rank world
`in_process_rank` makes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import torch.distributed as dist
from pydantic import BaseModel

from tasks.common.ray_runtime import scoped_environ, usable_cores

#: NCCL moves CUDA tensors only. The loops' small reductions of Python numbers (step and
#: evaluation sums, fine-tuning statistics) are CPU tensors, so a GPU group carries gloo too.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def torch_backend(backend: str | None, use_gpu: bool) -> str:
    """The process-group backend for `train.scale.backend` (None: nccl on GPU, gloo on CPU).

    nccl becomes `GPU_BACKEND`: nccl for CUDA tensors, gloo for CPU ones.
    """
    choice = backend or ("nccl" if use_gpu else "gloo")
    return GPU_BACKEND if choice == "nccl" else choice


def worker_threads(threads_per_worker: int | Literal["auto"]) -> int:
    """The torch threads this worker uses: the number given, or for `auto` the CPUs it has.

    A Ray Train worker has the CPUs Ray assigned it; a worker in the driver's process (or in
    a plain process) has the usable cores (`usable_cores`). The launchers resolve `auto`
    before the job starts (`training.runtime.launcher.resolve_scale`); this is for a loop
    started with an unresolved job.
    """
    if threads_per_worker != "auto":
        return threads_per_worker
    ray = sys.modules.get("ray")  # a Ray worker has imported it; a plain process need not
    if ray is not None and ray.is_initialized():
        context = ray.get_runtime_context()
        if context.worker.mode == ray.WORKER_MODE:  # a Ray actor or task, not the driver
            return max(1, int(context.get_assigned_resources().get("CPU", 1)))
    return usable_cores()


class WorkerContext(Protocol):
    """What the loop needs from the process that runs it."""

    rank: int
    world_size: int
    run_dir: Path

    def reported_checkpoint(self) -> Path | None: ...  # noqa: D102
    def report(self, metrics: dict[str, Any], checkpoint: Path | None) -> None: ...  # noqa: D102


#: A loop's job: the frozen pydantic model of everything its workers need.
Job = TypeVar("Job", bound=BaseModel)


@dataclass(frozen=True)
class LoopEntry(Generic[Job]):
    """A training loop and the job model it takes, as each launcher calls it.

    The in-process launcher calls `run(job, LocalContext)` with the model itself. Ray Train
    carries the job to its workers as a plain dict (`TorchTrainer(train_loop_config=...)`, the
    one place the job is a dict) and calls `on_ray(config)` on each, which validates it back
    into `job_type` before the loop sees it.
    """

    job_type: type[Job]
    run: Callable[[Job, WorkerContext], object]

    def on_ray(self, config: dict[str, Any]) -> None:
        """Ray Train's per-worker entry: the job validated back from its dict, Ray's context."""
        job = self.job_type.model_validate(config)
        self.run(job, RayWorkerContext())


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

    import torch

    if dist.is_initialized():
        return
    for key, value in _single_rank_env().items():
        os.environ.setdefault(key, value)
    if torch.cuda.is_available():  # as Ray Train does for its GPU workers
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(torch_backend(None, torch.cuda.is_available()))


@contextlib.contextmanager
def in_process_rank(backend: str | None, use_gpu: bool) -> Iterator[None]:
    """Make this process rank 0 of a one-rank world while the block runs a training loop.

    The process group stays for the process's life once made: DeepSpeed keeps a clone of the
    world group (`deepspeed.utils.groups`) that a destroyed group would leave stale, and a
    second loop in this process then uses the same group. One made for another device kind
    is refused rather than replaced. The rank's environment (`RANK`, `MASTER_PORT`, ...) is
    set for the block and restored after it.

    Raises:
        RuntimeError: this process already belongs to a larger world, or to one whose
            backend does not match `backend` / `use_gpu`.
    """
    import torch

    wanted = torch_backend(backend, use_gpu)
    needed = "nccl" if use_gpu else "gloo"  # what carries the loop's tensors
    if dist.is_initialized() and (
        dist.get_world_size() != 1 or needed not in str(dist.get_backend())
    ):
        raise RuntimeError(
            f"this process is already rank {dist.get_rank()} of a world of "
            f"{dist.get_world_size()} over {dist.get_backend()}; a loop in it needs one rank "
            f"over {wanted}: set scale.launcher to ray"
        )
    with scoped_environ(_single_rank_env()):
        if use_gpu:
            torch.cuda.set_device(0)
        if not dist.is_initialized():
            dist.init_process_group(wanted, rank=0, world_size=1)
        yield


def _single_rank_env() -> dict[str, str]:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
