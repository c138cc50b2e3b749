"""The per-worker fine-tuning loop: strategy, engine, epochs, validation, early stopping, export.

`run_finetune_worker(job, ctx)` is the loop for any `WorkerContext` (a Ray Train worker or the
driver's own process); `FINETUNE_LOOP` is how the launcher calls it. It reuses the pretraining
loop's pieces: the context (Ray reporting), the engine (DeepSpeed or DDP,
`training/runtime/engine.py`), the DeepSpeed optimizer entry and the tracker. Every rank
evaluates its share of the validation split; predictions are gathered so every rank takes the
same early-stopping decision.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from tasks.common.io import git_commit
from training.finetune.config import FinetuneConfig
from training.finetune.data import TaskData, read_prepared
from training.finetune.early_stopping import EarlyStopping
from training.finetune.evaluation import METRIC_PREFIX, Evaluator
from training.finetune.outputs import confusion_entry, run_result, write_outputs
from training.finetune.strategies import apply_strategy, head_prefixes_for
from training.models.cards import DataRef, FinetuneCard, render_finetune_card
from training.models.export import max_length
from training.models.task_models import load_task_model
from training.runtime.deepspeed import adamw_section, engine_config, merge
from training.runtime.engine import Engine, TorchEngine, initialize_deepspeed
from training.runtime.progress import connect_progress
from training.runtime.schedule import GroupLRSchedule
from training.runtime.worker_context import LoopEntry, WorkerContext, worker_threads
from training.tracking.runs import MlflowTracker, NullTracker, Tracker

log = logging.getLogger(__name__)


class FinetuneJob(BaseModel):
    """Everything a fine-tuning worker needs."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    finetune: FinetuneConfig
    seed: int
    data_dir: Path
    model_dir: Path
    config_hash: str
    tracking_uri: str | None = None
    mlflow_run_id: str | None = None
    progress: str | None = None  # the driver's progress sink (training/runtime/progress.py)


def run_finetune_worker(job: FinetuneJob, ctx: WorkerContext) -> dict[str, Any]:
    """Fine-tune, stop early on the validation metric, restore the best weights, export.

    Returns the result rank 0 writes to `<run_dir>/result.json` (every rank returns it).
    """
    torch.set_num_threads(worker_threads(job.finetune.scale.threads_per_worker))
    return FinetuneWorker(job, ctx).run()


#: The fine-tuning loop as both launchers call it (training/runtime/launcher.py).
FINETUNE_LOOP = LoopEntry(FinetuneJob, run_finetune_worker)


def _engine(job: FinetuneJob, model: torch.nn.Module, groups: list[dict[str, Any]]) -> Engine:
    cfg, world = job.finetune, dist.get_world_size() if dist.is_initialized() else 1
    accum = cfg.accumulation_steps(world)
    if not cfg.deepspeed:
        return TorchEngine(
            model,
            groups,
            betas=cfg.betas,
            eps=cfg.eps,
            accumulation_steps=accum,
            grad_clip=cfg.grad_clip,
        )
    ds = engine_config(
        global_batch=cfg.batch_size,
        micro_batch=cfg.micro_batch_size,
        accumulation=accum,
        grad_clip=cfg.grad_clip,
        zero_stage=cfg.zero_stage,
        precision=cfg.precision,
        optimizer=adamw_section(cfg.lr, cfg.betas, cfg.eps, cfg.weight_decay),
    )
    ds["zero_allow_untested_optimizer"] = True
    return initialize_deepspeed(model, groups, merge(ds, cfg.deepspeed_extra))  # type: ignore[no-any-return]


def check_max_length(model: torch.nn.Module, cfg: FinetuneConfig) -> None:
    """Refuse features longer than the model's position table (T5 has none: no limit).

    Raises:
        ValueError: naming `finetune.features.max_length` and the model's limit.
    """
    limit = max_length(model, default=1 << 30)  # type: ignore[arg-type]
    if cfg.features.max_length > limit:
        raise ValueError(
            f"finetune.features.max_length={cfg.features.max_length} is longer than the "
            f"model's {limit} positions; set it to {limit} or less (long inputs are windowed)"
        )


class FinetuneWorker:
    """One rank's task model, strategy, engine, data and evaluator."""

    def __init__(self, job: FinetuneJob, ctx: WorkerContext) -> None:
        """Load data and model, apply the strategy, build engine and schedule."""
        self.job, self.ctx, self.cfg = job, ctx, job.finetune
        self.data: TaskData = read_prepared(job.data_dir, job.model_dir, self.cfg)
        torch.manual_seed(job.seed)  # the same new head on every rank
        model = load_task_model(
            job.model_dir, self.data.spec, random_init=self.cfg.random_init, seed=job.seed
        )
        check_max_length(model, self.cfg)
        self.plan = apply_strategy(model, self.cfg.strategy, head_prefixes_for(model))
        groups = self.plan.param_groups(self.cfg.lr, self.cfg.weight_decay)
        self.engine = _engine(job, self.plan.model, groups)
        steps_per_epoch = self._batches_per_epoch()
        total = max(1, steps_per_epoch * self.cfg.epochs)
        self.schedule = GroupLRSchedule(
            self.engine.optimizer,
            warmup_steps=round(self.cfg.warmup_ratio * total),
            total_steps=total,
            decay=self.cfg.decay,
        )
        self.evaluator = Evaluator(self.data, self.cfg, ctx.rank, ctx.world_size)
        stop = self.cfg.early_stopping
        metric, higher = self.evaluator.watched_metric(stop.metric if stop else None)
        self.stopper = EarlyStopping(
            metric,
            higher_is_better=higher,
            patience=stop.patience if stop else self.cfg.epochs + 1,
            min_delta=stop.min_delta if stop else 0.0,
        )
        self.tracker: Tracker = NullTracker()
        if ctx.rank == 0 and job.tracking_uri and job.mlflow_run_id:
            self.tracker = MlflowTracker(job.tracking_uri, job.mlflow_run_id)
        self.step = 0
        self.progress = connect_progress(job.progress, ctx.rank, total)
        # Dropout differs across ranks; shuffling does not (one seeded order, split by rank).
        torch.manual_seed(job.seed * 1000 + 17 + ctx.rank)

    def _batches_per_epoch(self) -> int:
        per_rank = len(self.data.train) // self.ctx.world_size
        return max(1, per_rank // self.cfg.micro_batch_size) // self.cfg.accumulation_steps(
            self.ctx.world_size
        )

    def _epoch_order(self, epoch: int) -> np.ndarray:
        """This rank's feature indices for `epoch`: a seeded permutation, split by rank."""
        rng = np.random.default_rng([self.job.seed, epoch, 0xF17E])
        order = rng.permutation(len(self.data.train))
        accum = self.cfg.accumulation_steps(self.ctx.world_size)
        per_step = self.cfg.micro_batch_size * self.ctx.world_size * accum
        usable = max(per_step, len(order) - len(order) % per_step)
        order = np.resize(order, usable)  # a tiny split wraps around instead of giving 0 steps
        return order[self.ctx.rank :: self.ctx.world_size]

    def run(self) -> dict[str, Any]:
        """Train epoch by epoch until done or stopped; restore the best; test; export."""
        history: list[dict[str, Any]] = []
        started = time.perf_counter()
        for epoch in range(self.cfg.epochs):
            self.plan.on_epoch_start(epoch)
            train_loss = self.train_epoch(epoch)
            metrics = self.evaluator.evaluate(self.engine.module, "validation")
            decision = self.stopper.update(epoch, metrics[self.stopper.metric], self.plan.model)
            row = {"epoch": epoch, "step": self.step, "train_loss": train_loss, **metrics}
            history.append(row)
            self._log(row)
            self._show(row)
            self.ctx.report({k: v for k, v in row.items() if _is_number(v)}, None)
            if decision.stop:
                break
        self.stopper.restore(self.plan.model)
        train_time = time.perf_counter() - started
        test = self.evaluator.evaluate(self.engine.module, "test", keep_predictions=True)
        preds = self.evaluator.predictions.get("test")
        result = run_result(
            self.data, history, self.stopper, test, self.plan, train_time, self.cfg.random_init
        ) | confusion_entry(self.data, preds)
        if self.ctx.rank == 0:
            write_outputs(self.ctx.run_dir, self.data, self.plan, result, preds, self._card(result))
        shown = {f"test_{k}": v for k, v in test.items() if k in ("loss", self.stopper.metric)}
        self.progress.log(self.step, shown, phase="tested")
        self.progress.close()
        _barrier()
        return result

    def _card(self, result: dict[str, Any]) -> str:
        """The export's README: the Hub metadata block, then base model, task, test metrics."""
        metric, higher = self.evaluator.watched_metric(None)  # the task's primary metric
        manifest = self.data.manifest
        card = FinetuneCard(
            task_type=self.data.task_type,
            task_name=str(manifest.get("name", self.data.task_type)),
            labels=self.data.labels,
            strategy=self.cfg.strategy.name,
            random_init=self.cfg.random_init,
            base_model=str(self.job.model_dir),
            data=DataRef(path=str(self.job.data_dir), fingerprint=manifest.get("fingerprint", "")),
            best_epoch=result["best_epoch"] + 1,
            metric=metric,
            higher_is_better=higher,
            test={k: float(v) for k, v in result["test"].items() if _is_number(v)},
            git_commit=git_commit() or "unknown",
        )
        return render_finetune_card(card)

    def train_epoch(self, epoch: int) -> float:
        """One pass over this rank's share of the training features; the mean loss.

        The loss sum stays on the device until the epoch ends (one read, as pretraining reads
        at its log interval), so a step does not wait for the host.
        """
        self.engine.module.train()
        order = self._epoch_order(epoch)
        total, count = torch.zeros((), dtype=torch.float64, device=self.engine.device), 0
        phase = f"epoch {epoch + 1}/{self.cfg.epochs}"
        for start in range(0, len(order), self.cfg.micro_batch_size):
            ids = order[start : start + self.cfg.micro_batch_size]
            batch = self.data.batch("train", ids, self.engine.device)
            loss = self.data.loss(self.engine, batch)
            self.engine.backward(loss)
            boundary = self.engine.is_gradient_accumulation_boundary()
            self.engine.step()
            if boundary:
                self.schedule.step()
                self.step += 1
                self.progress.step(self.step, samples=self.cfg.batch_size, phase=phase)
            total += loss.detach().double()
            count += 1
        stats = torch.stack([total.cpu(), torch.tensor(float(count), dtype=torch.float64)])
        if dist.is_initialized():
            dist.all_reduce(stats)
        return float(stats[0]) / max(float(stats[1]), 1.0)

    def _show(self, row: dict[str, Any]) -> None:
        """Report an epoch's losses and watched metric to the driver's progress line."""
        watched = self.stopper.metric
        shown = {"train_loss": row["train_loss"], "val_loss": row.get("loss")}
        shown[f"val_{watched}"] = row.get(watched)
        numbers = {k: float(v) for k, v in shown.items() if _is_number(v)}
        self.progress.log(self.step, numbers, phase=f"epoch {row['epoch'] + 1}/{self.cfg.epochs}")

    def _log(self, row: dict[str, Any]) -> None:
        """Log an epoch (rank 0): to MLflow at the step it ended on, and to `history.jsonl`."""
        if self.ctx.rank != 0:
            return
        metrics = epoch_metrics(row)
        self.tracker.log_metrics(metrics, step=int(row["step"]))
        with open(self.ctx.run_dir / "history.jsonl", "a") as handle:
            handle.write(json.dumps(row) + "\n")
        log.info("epoch %d: %s", row["epoch"], {k: round(v, 4) for k, v in metrics.items()})


def epoch_metrics(row: dict[str, Any]) -> dict[str, float]:
    """An epoch's MLflow metrics: `train_loss`, and each validation metric as `val_<name>`.

    The epoch and its step are no metrics: the step is the MLflow step they are logged at,
    and `history.jsonl` pairs it with the epoch.
    """
    val = METRIC_PREFIX["validation"]
    numbers = {k: float(v) for k, v in row.items() if _is_number(v)}
    metrics = {"train_loss": numbers.pop("train_loss")} if "train_loss" in numbers else {}
    return metrics | {f"{val}{k}": v for k, v in numbers.items() if k not in ("epoch", "step")}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
