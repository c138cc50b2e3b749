"""Launch a training loop: `fit` on Ray Train workers, or as the one worker in this process.

`fit` runs a loop (pretraining's or fine-tuning's `LoopEntry`) where `scale.launcher` says
(`resolve_launcher`): on Ray Train, whose controller restarts failed workers from the last
checkpoint, or in this process without starting Ray Train. What a run is (its identity, its
directory, reuse and resume) is the drivers' business: `training/pretrain/driver.py` and
`training/finetune/stage.py`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from tasks.common.ray_runtime import (
    LOOPBACK_HOSTS,
    RESERVED_CPUS,
    RayConfig,
    address_host,
    ensure_ray,
    usable_cores,
)
from training.runtime.config import ScaleConfig
from training.runtime.progress import ProgressSpec, driver_progress, in_process_progress
from training.runtime.worker_context import (
    Job,
    LocalContext,
    LoopEntry,
    in_process_rank,
    torch_backend,
)

log = logging.getLogger(__name__)


class RunStateError(RuntimeError):
    """A run exists and is unfinished but resuming was not asked for (or the reverse)."""


POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
AUTO_RESTARTS = 2  # `max_failures: auto` on Ray Train


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

    `auto` runs in this process when that loses nothing: one worker (`num_workers` 1, or
    `auto` resolving to one), no restarts asked for (`max_failures` 0 or `auto`) and no Ray
    cluster to run on (`ray.address`, `RAY_ADDRESS`). Starting Ray Train costs a one-worker
    run 15-30 s on a small machine (docs/pretraining.md).
    """
    if scale.launcher != "auto":
        return scale.launcher
    one = resolve_workers(scale, ray_cfg) == 1
    if one and scale.max_failures in (0, "auto") and not _on_cluster(ray_cfg):
        return "in_process"
    return "ray"


def resolve_workers(scale: ScaleConfig, ray_cfg: RayConfig) -> int:
    """`scale.num_workers`, with `auto` made a number: a worker per GPU, or one on CPUs.

    With `use_gpu`, the GPUs of the Ray cluster at `ray.address` (`RAY_ADDRESS`), else this
    machine's. Without, one worker: on CPUs it takes every usable core as torch threads, and
    more processes would only add the gradients' all-reduce to the same cores.
    """
    if scale.num_workers != "auto":
        return scale.num_workers
    if not scale.use_gpu:
        return 1
    if _on_cluster(ray_cfg):
        import ray

        ensure_ray(ray_cfg)
        gpus = sum(float(n["Resources"].get("GPU", 0)) for n in ray.nodes() if n.get("Alive"))
        return max(1, int(gpus))
    import torch

    return max(1, torch.cuda.device_count())


def resolve_scale(scale: ScaleConfig, ray_cfg: RayConfig) -> ScaleConfig:
    """`scale` with every `auto` made a number for where its workers run.

    Workers: `resolve_workers`. Restarts: 2 on Ray Train, none in this process. CPUs per
    worker in this process (`resolve_launcher`): the usable cores (`usable_cores`: the CPU
    affinity, capped by the cgroup's CPU quota). On Ray Train: the CPUs each worker can have,
    on a Ray of this machine (no address, or a loopback one) the usable cores, at most Ray's
    own CPUs less those it keeps for the tasks that feed the workers, divided among the
    workers; on a cluster, the smallest node's CPUs divided among the workers it hosts.
    Threads: the worker's CPUs. Connects to Ray (or starts the local one) when the workers
    run there.
    """
    workers = resolve_workers(scale, ray_cfg)
    in_process = resolve_launcher(scale, ray_cfg) == "in_process"
    failures = scale.max_failures
    if failures == "auto":
        failures = 0 if in_process else AUTO_RESTARTS
    cpus, threads = scale.cpus_per_worker, scale.threads_per_worker
    if cpus == "auto":
        each = usable_cores() if in_process else _ray_cpus_per_worker(workers, ray_cfg)
        cpus = float(each)
    if threads == "auto":
        threads = max(1, int(cpus))
    update = {"num_workers": workers, "max_failures": failures, "cpus_per_worker": cpus}
    return scale.model_copy(update=update | {"threads_per_worker": threads})


def _ray_cpus_per_worker(num_workers: int, ray_cfg: RayConfig) -> int:
    import ray

    ensure_ray(ray_cfg)
    nodes = [float(n["Resources"].get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS")
    if address is None or address_host(address) in LOOPBACK_HOSTS:  # a Ray on this machine
        free = min(usable_cores(), int(sum(nodes)) - RESERVED_CPUS)
        return max(1, free // num_workers)
    per_node = -(-num_workers // max(1, len(nodes)))  # the workers of the fullest node
    return max(1, int(min(nodes, default=1)) // per_node)


def _on_cluster(ray_cfg: RayConfig) -> bool:
    return ray_cfg.address is not None or bool(os.environ.get("RAY_ADDRESS"))


def describe_scale(scale: ScaleConfig) -> str:
    """`scale` in words, for the first line of a run: workers, CPUs and threads each."""
    workers = f"{scale.num_workers} worker{'s' if scale.num_workers != 1 else ''}"
    cpus = scale.cpus_per_worker
    cpus_text = cpus if isinstance(cpus, str) else f"{cpus:g}"
    return f"{workers} of {cpus_text} CPU(s), {scale.threads_per_worker} thread(s) each"


def scale_params(scale: ScaleConfig) -> dict[str, Any]:
    """The MLflow params of what `resolve_scale` chose: workers, restarts, CPUs, threads."""
    return {
        "resolved_num_workers": scale.num_workers,
        "resolved_max_failures": scale.max_failures,
        "resolved_cpus_per_worker": scale.cpus_per_worker,
        "resolved_threads_per_worker": scale.threads_per_worker,
    }


def fit(
    entry: LoopEntry[Job],
    job: Job,
    scale: ScaleConfig,
    run_dir: Path,
    ray_cfg: RayConfig,
    progress: ProgressSpec | None = None,
) -> None:
    """Run `entry`'s loop on `job` where `resolve_launcher` says; `run_dir` is its run's.

    `auto` CPUs and threads in `scale` are resolved first (`resolve_scale`).

    Raises:
        RuntimeError: training failed (on Ray, after `scale.max_failures` restarts).
    """
    scale = resolve_scale(scale, ray_cfg)
    if resolve_launcher(scale, ray_cfg) == "in_process":
        fit_in_process(entry, job, scale, run_dir, progress)
    else:
        fit_on_ray(entry, job, scale, run_dir, ray_cfg, progress)


def fit_in_process(
    entry: LoopEntry[Job],
    job: Job,
    scale: ScaleConfig,
    run_dir: Path,
    progress: ProgressSpec | None = None,
) -> None:
    """Run `entry`'s loop as the one worker, in this process, without Ray Train.

    The loop gets `job` itself (the model, never a dict), a `LocalContext` on `run_dir` (it
    resumes from the newest valid checkpoint there) and the one-rank world of
    `in_process_rank`. torch's thread count, which the loop sets to `scale.threads_per_worker`,
    is restored afterwards.

    Raises:
        RuntimeError: the loop raised (its exception is the cause).
    """
    import torch

    log.info("%s: one worker in this process (no Ray Train start)", run_dir.name)
    threads = torch.get_num_threads()
    with in_process_progress(progress) as address, in_process_rank(scale.backend, scale.use_gpu):
        here = job if address is None else job.model_copy(update={"progress": address})
        try:
            entry.run(here, LocalContext(run_dir))
        except Exception as exc:
            raise RuntimeError(f"training failed in this process ({run_dir}): {exc}") from exc
        finally:
            torch.set_num_threads(threads)


def fit_on_ray(
    entry: LoopEntry[Job],
    job: Job,
    scale: ScaleConfig,
    run_dir: Path,
    ray_cfg: RayConfig,
    progress: ProgressSpec | None = None,
) -> None:
    """Run `entry`'s loop on `scale.num_workers` Ray Train workers; `run_dir` is theirs.

    The job crosses into Ray Train as its JSON dict and is validated back on each worker
    (`LoopEntry.on_ray`). Checkpoints are written in place by the loop (`RayWorkerContext`) and
    pruned by lmpipe. With `progress`, this driver shows what rank 0 reports
    (`training/runtime/progress.py`): the loop finds the sink in the job's `progress` field.

    Raises:
        RuntimeError: training failed after `scale.max_failures` restarts.
    """
    import ray.train

    ensure_ray(ray_cfg)
    set_report_poll(scale)
    with driver_progress(progress) as address:
        config = job.model_dump(mode="json") | ({} if address is None else {"progress": address})
        trainer = _trainer(entry.on_ray, config, scale, run_dir)
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
    from ray.train import CheckpointConfig, FailureConfig, ScalingConfig
    from ray.train import RunConfig as RayRunConfig
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
        run_config=RayRunConfig(
            name=run_dir.name,
            storage_path=str(run_dir.parent),
            # lmpipe prunes (training/runtime/checkpoint.py), orphans included; Ray deleting too
            # raced with it ("Path not found" in the controller).
            checkpoint_config=CheckpointConfig(num_to_keep=None),
            failure_config=FailureConfig(max_failures=scale.max_failures),
        ),
    )
