"""Where a training loop runs: `train.scale.launcher` (Ray Train workers or this process).

A one-worker run in this process must train what the same worker trains on Ray Train (to float
rounding), and stop and resume from its checkpoints exactly, without starting Ray Train.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from safetensors.torch import load_file

from tasks.common.io import flatten
from tasks.common.ray_runtime import RayConfig
from tasks.downstream.config import load_dataset_config
from tasks.downstream.stage import prepare_downstream
from training.finetune.config import FinetuneConfig
from training.finetune.stage import finetune_run_id, run_finetune
from training.models.export import gather_state_dict
from training.pretrain.config import TrainConfig
from training.pretrain.driver import RunControl, run_training
from training.runtime import launcher
from training.runtime.config import ScaleConfig
from training.runtime.launcher import resolve_launcher
from training.runtime.run_context import RunContext
from training.runtime.worker_context import LoopEntry
from training.tracking.runs import TrackingConfig

REPO = Path(__file__).resolve().parents[3]
NO_CLUSTER = RayConfig(num_workers=2, num_cpus=4)


@pytest.mark.parametrize(
    ("scale", "ray_cfg", "env", "expected"),
    [
        ({"num_workers": 1, "max_failures": 0}, NO_CLUSTER, None, "in_process"),
        ({}, NO_CLUSTER, None, "in_process"),  # the defaults: one worker, no restarts asked
        ({}, RayConfig(address="ray://h:10001"), None, "ray"),
        ({"max_failures": 2}, NO_CLUSTER, None, "ray"),
        ({"num_workers": 2}, NO_CLUSTER, None, "ray"),
        ({"num_workers": 1, "max_failures": 0}, RayConfig(address="ray://h:10001"), None, "ray"),
        ({"num_workers": 1, "max_failures": 0}, NO_CLUSTER, "10.0.0.1:6379", "ray"),
        ({"num_workers": 1, "max_failures": 2}, NO_CLUSTER, None, "ray"),
        ({"num_workers": 2, "max_failures": 0}, NO_CLUSTER, None, "ray"),
        ({"num_workers": 1, "max_failures": 0, "launcher": "ray"}, NO_CLUSTER, None, "ray"),
        (
            {"num_workers": 1, "max_failures": 0, "launcher": "in_process"},
            RayConfig(address="ray://h:10001"),
            None,
            "in_process",
        ),
    ],
)
def test_auto_runs_in_process_only_when_ray_would_add_nothing(
    scale: dict[str, Any],
    ray_cfg: RayConfig,
    env: str | None,
    expected: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if env is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", env)
    assert resolve_launcher(ScaleConfig.model_validate(scale), ray_cfg) == expected


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        ({"num_workers": 2, "max_failures": 0}, "not num_workers 2: set num_workers to 1"),
        ({"num_workers": 1, "max_failures": 2}, "cannot restart a failed worker (max_failures 2)"),
    ],
)
def test_in_process_refuses_what_it_cannot_do(scale: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ScaleConfig.model_validate(scale | {"launcher": "in_process"})


def test_auto_cpus_and_threads_follow_the_cores_where_the_workers_run(
    ray_session: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launcher, "usable_cores", lambda: 3)
    here = launcher.resolve_scale(ScaleConfig(num_workers=1, max_failures=0), NO_CLUSTER)
    assert (here.cpus_per_worker, here.threads_per_worker) == (3, 3)  # the one worker: all
    ray_cpus = int(ray.cluster_resources()["CPU"])  # the session's local Ray
    for workers in (1, 2):
        on_ray = ScaleConfig(num_workers=workers, max_failures=2)  # restarts: Ray Train
        scale = launcher.resolve_scale(on_ray, NO_CLUSTER)
        each = max(1, min(3, ray_cpus - 2) // workers)  # 2 kept for the tasks that feed them
        assert (scale.cpus_per_worker, scale.threads_per_worker) == (each, each)
        # The same Ray joined by its loopback address is this machine's too: the same numbers.
        joined = RayConfig(address=ray_session)
        assert launcher.resolve_scale(on_ray, joined) == scale
    given = ScaleConfig(num_workers=2, max_failures=1, cpus_per_worker=1.5, threads_per_worker=4)
    assert launcher.resolve_scale(given, NO_CLUSTER) == given
    half = launcher.resolve_scale(ScaleConfig(num_workers=2, cpus_per_worker=2.5), NO_CLUSTER)
    assert half.threads_per_worker == 2
    assert launcher.describe_scale(half) == "2 workers of 2.5 CPU(s), 2 thread(s) each"
    assert launcher.scale_params(half) == {
        "resolved_num_workers": 2,
        "resolved_max_failures": 2,  # auto on Ray Train
        "resolved_cpus_per_worker": 2.5,
        "resolved_threads_per_worker": 2,
    }
    with pytest.raises(ValidationError, match="threads_per_worker must be >= 1 or auto"):
        ScaleConfig(threads_per_worker=0)


def test_the_default_scale_is_one_in_process_worker_on_every_usable_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(launcher, "usable_cores", lambda: 3)
    scale = launcher.resolve_scale(ScaleConfig(), NO_CLUSTER)
    assert (scale.num_workers, scale.max_failures) == (1, 0)
    assert (scale.cpus_per_worker, scale.threads_per_worker) == (3, 3)
    assert launcher.resolve_launcher(scale, NO_CLUSTER) == "in_process"
    # use_gpu without a GPU here: one worker per GPU, at least one.
    assert launcher.resolve_workers(ScaleConfig(use_gpu=True), NO_CLUSTER) == 1
    assert ScaleConfig(launcher="in_process").max_failures == "auto"  # auto fits in_process
    with pytest.raises(ValidationError, match="num_workers must be >= 1 or auto"):
        ScaleConfig(num_workers=0)


def test_a_ray_train_worker_started_with_auto_threads_takes_the_cpus_ray_gave_it(
    ray_session: str,
) -> None:
    import ray

    from training.runtime.worker_context import worker_threads

    @ray.remote(num_cpus=2)
    def threads() -> int:
        return worker_threads("auto")

    assert ray.get(threads.remote()) == 2
    assert worker_threads(3) == 3


class _Job(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    seed: int
    run_dir: Path
    progress: str | None = None


def test_a_ray_worker_validates_the_job_back_from_its_dict_before_the_loop_runs() -> None:
    ran: list[object] = []
    entry = LoopEntry(_Job, lambda job, ctx: ran.append(job))
    job = _Job(seed=1, run_dir=Path("/tmp/run"))
    with pytest.raises(ValidationError, match="extra_key"):
        entry.on_ray(job.model_dump(mode="json") | {"extra_key": 1})
    with pytest.raises(ValidationError, match="seed"):
        entry.on_ray({"seed": "not a number", "run_dir": "/tmp/run"})
    assert ran == []  # refused before a Ray context was asked for or the loop ran


def test_the_in_process_launcher_hands_the_loop_the_job_model_itself(tmp_path: Path) -> None:
    seen: list[object] = []
    entry = LoopEntry(_Job, lambda job, ctx: seen.append((job, ctx.run_dir)))
    job = _Job(seed=3, run_dir=tmp_path)
    scale = ScaleConfig(num_workers=1, max_failures=0, launcher="in_process")
    launcher.fit(entry, job, scale, tmp_path, NO_CLUSTER)
    assert seen == [(job, tmp_path)]
    assert seen[0][0] is job  # no dict on the way: the very object the driver built


def same_training(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Assert two results (or epoch rows) agree: floats to 1e-6, everything else exactly.

    Wall-clock fields (`..._s`) are left out (no two runs share them), and so is the history,
    which is compared row by row.
    """
    flat_a, flat_b = (
        {k: v for k, v in flatten(row).items() if not k.endswith("_s") and k != "history"}
        for row in (a, b)
    )
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        if isinstance(value, float):
            assert flat_b[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert flat_b[key] == value, key


def no_ray_train(*_args: Any, **_kwargs: Any) -> None:
    raise AssertionError("Ray Train was started for an in-process run")


@pytest.mark.slow
@pytest.mark.integration
def test_one_worker_fine_tunes_in_process_as_on_ray_train_without_starting_it(
    ray_session: str,
    tiny_base_models: dict[str, Path],
    shared_data: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    task = load_dataset_config(REPO / "configs" / "tasks" / "cola.yaml")
    caps = {"train": 48, "validation": 16, "test": 16}
    data = tmp_path / "data"
    prepare_downstream(task.model_copy(update={"max_examples": caps}), shared_data, data)

    def cfg(launcher: str) -> FinetuneConfig:
        return FinetuneConfig.model_validate(
            {
                "epochs": 1,
                "batch_size": 8,
                "micro_batch_size": 8,
                "lr": 1e-3,
                "features": {"max_length": 64, "stride": 16},
                "scale": {"num_workers": 1, "max_failures": 0, "launcher": launcher},
            }
        )

    on_ray, here = cfg("ray"), cfg("in_process")
    model = tiny_base_models["bert"]
    assert finetune_run_id(on_ray, 0, data, model) == finetune_run_id(here, 0, data, model)
    ctx = RunContext(
        tmp_path, seed=0, ray=NO_CLUSTER, tracking=TrackingConfig(enabled=False), name="t"
    )
    ray_run = run_finetune(on_ray, data, model, tmp_path / "ray", run=ctx)
    monkeypatch.setattr(launcher, "fit_on_ray", no_ray_train)
    threads = torch.get_num_threads()
    local_run = run_finetune(here, data, model, tmp_path / "local", run=ctx)
    assert torch.get_num_threads() == threads  # the worker's thread count did not leak
    # The same loop on the same data and seed: the same metrics and weights up to float
    # rounding. Bit-identity is not asked for: the driver's torch state (kernels chosen and
    # warmed by earlier work in this process) can round a reduction differently, by 1e-9.
    same_training(ray_run.result, local_run.result)
    history = [
        [json.loads(line) for line in (r.run_dir / "history.jsonl").read_text().splitlines()]
        for r in (ray_run, local_run)
    ]
    assert len(history[0]) == len(history[1]) == 1
    same_training(history[0][0], history[1][0])
    a, b = (load_file(r.export_dir / "model.safetensors") for r in (ray_run, local_run))
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


@pytest.mark.slow
@pytest.mark.integration
def test_in_process_pretraining_stops_and_resumes_to_the_same_losses_and_weights_prefetched_or_not(
    demo_data: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "fit_on_ray", no_ray_train)
    data = demo_data.examples("bert")

    def cfg(storage: str) -> TrainConfig:
        return TrainConfig.model_validate(
            {
                # The uninterrupted run builds each step's batches ahead in a thread; the
                # stopped and resumed one builds them in the step: the same losses either way.
                "prefetch": "on" if storage == "whole" else "off",
                "model": {"family": "bert", "size": "tiny"},
                "max_steps": 8,
                "global_batch_size": 16,
                "micro_batch_size": 8,
                "zero_stage": 2,
                "precision": "fp32",
                "optim": {"lr": 3e-3, "warmup_steps": 2},
                "checkpoint": {"every_steps": 4, "storage_path": str(tmp_path / storage)},
                "eval": {"every_steps": 8, "max_samples": 32},
                "scale": {"num_workers": 1, "max_failures": 0},
            }
        )

    def train(storage: str, **kwargs: Any) -> launcher.TrainingRun:
        off = TrackingConfig(enabled=False)
        ctx = RunContext(tmp_path / "ws", seed=0, ray=NO_CLUSTER, tracking=off, name="t")
        return run_training(
            cfg(storage),
            data["examples"],
            data["tokenizer"],
            run=ctx,
            mlflow_run_id=None,
            control=RunControl(**kwargs),
        )

    whole = train("whole")
    stopped = train("stopped", stop_at_step=4)
    assert (whole.finished, stopped.finished, stopped.meta["step"]) == (True, False, 4)
    resumed = train("stopped", resume=True)
    assert resumed.finished
    assert resumed.run_dir == stopped.run_dir

    def losses(run: launcher.TrainingRun) -> dict[int, float]:
        rows = [json.loads(line) for line in (run.run_dir / "steps.jsonl").read_text().splitlines()]
        return {row["step"]: row["loss"] for row in rows}

    assert [losses(resumed)[s] for s in range(5, 9)] == [losses(whole)[s] for s in range(5, 9)]
    a = gather_state_dict(whole.checkpoint, "ds")
    b = gather_state_dict(resumed.checkpoint, "ds")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
