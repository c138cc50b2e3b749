"""The per-worker pretraining loop: `Worker.train_step` is the step, whole, top to bottom.

`run_worker(job, ctx)` is the loop for any `WorkerContext`: a Ray Train worker, the driver's own
process, or a plain process (a GPU benchmark without Ray); `PRETRAIN_LOOP` is how the launcher
calls it. A worker is built by `training/pretrain/build.py` (data, model, engine, schedule,
guard, telemetry) and stepped here: `train_step` holds everything that touches the weights
(forward, backward, clipping, the device-side skip, the optimizer and LR steps, the recorded
metrics); evaluation, checkpoints and tracking happen every N steps around it; fault injection
and anything else beside the step are hooks at named points (`training/runtime/hooks.py`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from training.pretrain.audit import log_sample_ids, write_pid
from training.pretrain.build import (
    build_parts,
    on_device,
    pinned,
    reference_indices,
    train_loss,
)
from training.pretrain.data import EVAL_EPOCH, Cursor, rank_micro_batches
from training.pretrain.job import WorkerJob
from training.pretrain.length_schedule import check_length_schedule, length_at
from training.pretrain.losses import export_loss, pretraining_loss
from training.pretrain.losses.common import StepOutput
from training.pretrain.prefetch import Prefetcher, StepPlan
from training.pretrain.telemetry import StepMeter
from training.runtime import checkpoint as ckpt
from training.runtime import faults
from training.runtime.engine import FusedUpdate, autocast_for
from training.runtime.hooks import Hooks
from training.runtime.worker_context import LoopEntry, WorkerContext, worker_threads

log = logging.getLogger(__name__)


def run_worker(job: WorkerJob, ctx: WorkerContext) -> dict[str, float]:
    """Train until `max_steps` (or `stop_at_step`); return the last evaluation's metrics."""
    torch.set_num_threads(worker_threads(job.train.scale.threads_per_worker))
    worker = Worker(job, ctx)
    return worker.run()


#: The pretraining loop as both launchers call it (training/runtime/launcher.py).
PRETRAIN_LOOP = LoopEntry(WorkerJob, run_worker)


class Worker:
    """One rank's model, data and engine (built by `build_parts`), and the steps it takes."""

    def __init__(self, job: WorkerJob, ctx: WorkerContext, hooks: Hooks | None = None) -> None:
        """Build this rank's parts; `hooks` run beside the step (default: `job.fault`'s)."""
        self.job, self.ctx, self.cfg = job, ctx, job.train
        parts = build_parts(job, ctx)
        data, step = parts.data, parts.step
        self.objective, self.build = data.objective, data.build
        self.train_data, self.eval_data, self.order = data.train, data.validation, data.order
        self.engine, self.ds_config, self.optimizer = step.engine, step.ds_config, step.optimizer
        self.direct, self.clip = step.direct, step.clip
        self.accum, self.micro = step.accumulation, step.micro
        self.schedule, self.guard = step.schedule, step.guard
        self.telemetry, self.progress = parts.telemetry, parts.progress
        self.hooks = hooks if hooks is not None else faults.fault_hooks(job.fault, ctx.rank)
        # The step's loss (compiled when asked); evaluation calls `pretraining_loss` uncompiled.
        self.train_loss = train_loss(self._forward, self.cfg, self.engine)
        self.step, self.cursor, self.tokens_seen = 0, Cursor(), 0
        self.batches = Prefetcher(self._plan, parts.prefetch)
        # What the loop clips, listed once: `Module.parameters()` walks the module tree, a
        # measurable cost at every step of a small model.
        self.trainable = [p for p in self.engine.module.parameters() if p.requires_grad]
        # The direct step's update (training/runtime/engine.py): the stock calls' kernels
        # without their per-call Python.
        self.update = FusedUpdate(self.optimizer, self.trainable, self.clip)

    def _forward(self, batch: dict[str, torch.Tensor], sparse_mlm: bool) -> StepOutput:
        """The model's forward pass and loss on one micro-batch (what `compile` compiles)."""
        return pretraining_loss(self.engine.module, self.objective, batch, sparse_mlm)

    def precision(self) -> Any:
        """The autocast DeepSpeed's own forward would enter (the loop calls the model itself)."""
        return autocast_for(self.ds_config, self.engine.device)

    # -- resume ---------------------------------------------------------------------------

    def restore(self) -> None:
        """Load the newest valid checkpoint (chosen by rank 0, the same on every rank)."""
        choice: list[Any] = [None]
        if self.ctx.rank == 0:
            found = ckpt.find_resumable(
                self.ctx.run_dir, self.ctx.reported_checkpoint(), self.job.config_hash
            )
            ckpt.remove_incomplete(self.ctx.run_dir, found.path if found else None)
            choice = [None if found is None else (str(found.path), found.meta)]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return
        path, meta = Path(choice[0][0]), choice[0][1]
        checked = self._load(path, meta)
        self.step = int(meta["step"])
        self.schedule.steps_done = self.step
        self.schedule.refresh()
        self.cursor = Cursor(**meta["cursor"])
        self.tokens_seen = int(meta["tokens_seen"])
        self.guard.load_state(meta["guard"])
        self.guard.to(self.engine.device)
        rng = path / ckpt.rng_file(self.ctx.rank)
        if meta["world_size"] == self.ctx.world_size and rng.is_file():
            ckpt.set_rng_state(ckpt.load_rng_state(rng))
        else:
            log.warning(
                "resuming %d ranks from %d: fresh dropout RNG",
                self.ctx.world_size,
                meta["world_size"],
            )
        log.info("resumed from %s (step %d, epoch %d)", path.name, self.step, self.cursor.epoch)
        if self.ctx.rank == 0:  # the run's resume history, for operators and the fault tests
            row = {"checkpoint": path.name, "step": self.step, "world": self.ctx.world_size}
            row |= checked
            with open(self.ctx.run_dir / "resumes.jsonl", "a") as handle:
                handle.write(json.dumps(row | {"time": time.time()}) + "\n")
        self.telemetry.resumed(self.step)

    def _load(self, path: Path, meta: dict[str, Any]) -> dict[str, float]:
        """Load the engine's state from `path`; at another worker count, check the weights.

        Returns the reference-batch loss measured after a load at another worker count (for
        the resume history), else nothing.
        """
        saved_world = int(meta["world_size"])
        if saved_world == self.ctx.world_size:
            self.engine.load_checkpoint(str(path), tag=ckpt.TAG)
            return {}
        if self.cfg.zero_stage > 0:
            self._load_resharded(path, saved_world)
        else:  # ZeRO-0: one file holds the whole model and optimizer, at any worker count
            self.engine.load_checkpoint(str(path), tag=ckpt.TAG)
        # One forward on every rank (ZeRO-3 gathers): the weights must give the saved loss.
        saved = meta.get("reference", {}).get("indices")  # the batch the saved loss is of
        loss = self.reference_loss(None if saved is None else np.asarray(saved))["loss"]
        ckpt.check_resharded(path, meta, loss, self.ctx.world_size)
        return {"reference_loss": loss}

    def _load_resharded(self, path: Path, saved_world: int) -> None:
        """Load a ZeRO checkpoint saved at another worker count, through the universal format."""
        universal = self.ctx.run_dir / "universal" / path.name
        if self.ctx.rank == 0:
            log.info(
                "resharding %s from %d to %d ranks", path.name, saved_world, self.ctx.world_size
            )
            ckpt.to_universal(path, universal)
        _barrier()
        # DeepSpeed reads the switch at load time; the engine was built before the checkpoint
        # was chosen, so it is set for this one load only.
        self.engine._config.load_universal_checkpoint = True
        try:
            self.engine.load_checkpoint(str(universal), tag=ckpt.TAG)
        finally:
            self.engine._config.load_universal_checkpoint = False
        _barrier()
        if self.ctx.rank == 0:
            shutil.rmtree(universal.parent, ignore_errors=True)

    # -- steps ----------------------------------------------------------------------------

    def run(self) -> dict[str, float]:
        """Resume if a checkpoint exists, then step, evaluate and save until done."""
        self.restore()
        write_pid(self.ctx.run_dir, self.ctx.rank)
        try:
            return self._run()
        finally:
            self.batches.close()

    def _run(self) -> dict[str, float]:
        last = self.job.stop_at_step or self.cfg.max_steps
        metrics: dict[str, float] = {}
        if self.step == 0:  # the starting point of the held-out curve
            metrics = self.evaluate()
        while self.step < min(last, self.cfg.max_steps):
            self.train_step()
            final = self.step == min(last, self.cfg.max_steps)
            evaluate = final or self.step % self.cfg.eval.every_steps == 0
            save = final or self.step % self.cfg.checkpoint.every_steps == 0
            if evaluate or save:
                self.flush()
            if evaluate:
                metrics = self.evaluate()
            if save:
                self.save(metrics)
            elif evaluate:
                self.ctx.report({"step": self.step, **metrics}, None)
        self.progress.close()
        return metrics

    def train_step(self) -> None:
        """One optimizer step over this rank's share of the next global batch.

        Everything that touches the weights, in order. Nothing here reads a tensor value on the
        host: the guard's skip flag, the gradient norm and the step's statistics stay on the
        device until `flush` (a test counts the reads).
        """
        plan = self.batches.take(self.step + 1, self.cursor)  # built on the host, maybe ahead
        lr = self.schedule.get_last_lr()[0]
        meter = StepMeter()
        for i, host in enumerate(plan.batches):
            if i and not self.direct:
                self.engine.step()  # DeepSpeed counts micro-batches; it updates at the last only
            batch = on_device(host, self.engine.device)
            with self.precision():
                out = self.train_loss(batch, self.cfg.sparse_mlm)  # forward and loss
            self.guard.observe(out.loss)
            if self.direct:  # one rank, ZeRO 0: a plain backward over the accumulation steps
                (out.loss / self.accum).backward()  # type: ignore[no-untyped-call]
            else:  # DeepSpeed scales, reduces and (ZeRO) partitions the gradients
                self.engine.backward(out.loss)
            meter.add(out, batch)
        # The guard's verdict on the step's losses, on the device: 1 skips the update. As
        # torch.amp's GradScaler does, it reaches the fused AdamW as `found_inf`, and at 1 the
        # kernel leaves every weight and its moments and step count as they were.
        skip, guard_record = self.guard.decide()
        self.optimizer.found_inf = skip
        grad_norm = None
        if self.direct:  # clip, fused AdamW, zero the gradients: one call
            grad_norm = self.update()
        else:  # the engine clips (ZeRO), then steps the same fused AdamW
            if self.clip > 0:  # ZeRO 0 on several ranks: the engine does not clip
                params = [p for p in self.trainable if p.grad is not None]
                grad_norm = torch.nn.utils.clip_grad_norm_(params, self.clip, foreach=True)
            self.engine.step()
        self.schedule.step()  # the next step's learning rates
        self.cursor, self.step = plan.after, self.step + 1
        self.hooks.run("step", self.step)
        # What the step records: host values for the progress line, device values kept.
        samples = self.cfg.global_batch_size
        self.progress.step(self.step, samples=samples, tokens=samples * plan.length)
        if grad_norm is None:  # ZeRO computes the norm inside its step
            grad_norm = self.engine.get_global_grad_norm()
        if self.telemetry.record(self.step, meter, lr, grad_norm, skip, guard_record, plan.length):
            self.flush()
        if self.cfg.log_sample_ids:
            log_sample_ids(self.ctx, self.step, np.concatenate(plan.micro))

    def flush(self) -> None:
        """Read the steps recorded since the last flush: log, replay the guard, show the loss."""
        if not self.telemetry.pending:
            return
        self.tokens_seen += int(self.telemetry.flush(self.guard.replay))
        row = self.telemetry.latest  # read just now: showing it costs no synchronisation
        self.progress.log(int(row["step"]), {k: row[k] for k in ("loss", "lr") if k in row})

    def _seq_len(self, step: int) -> int:
        """Step `step`'s sequence length: `train.length_schedule`'s, else the examples' own.

        `step` counts the steps done before it (0 for the first), as the schedule does.
        """
        schedule, full = self.cfg.length_schedule, self.train_data.width
        # Checked every step (a few comparisons), so a stage that cannot work fails at the
        # first step of any attempt, not when the schedule reaches it.
        check_length_schedule(schedule, self.objective, full)
        return length_at(schedule, step, full)

    def _plan(self, step: int, cursor: Cursor) -> StepPlan:
        """Step `step`'s batches on the host, from `cursor` (what `Prefetcher` builds ahead)."""
        epoch, indices, after = self.order.next_batch(cursor)
        length = self._seq_len(step - 1)
        micro = rank_micro_batches(indices, self.ctx.rank, self.ctx.world_size, self.micro)
        device = self.engine.device
        starts = self.build.reads_doc_starts
        batches = [
            pinned(self.build(self.train_data.take(ids, starts), ids, epoch, length), device)
            for ids in micro
        ]
        return StepPlan(step, cursor, epoch, after, length, micro, batches)

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics over the first `eval.max_samples` validation examples."""
        self.engine.module.eval()
        n = min(len(self.eval_data), self.cfg.eval.max_samples)
        indices = np.arange(n - n % self.ctx.world_size)
        meter = StepMeter()
        with torch.no_grad():
            for ids in rank_micro_batches(indices, self.ctx.rank, self.ctx.world_size, self.micro):
                rows = self.build(
                    self.eval_data.take(ids, self.build.reads_doc_starts), ids, EVAL_EPOCH
                )
                batch = on_device(pinned(rows, self.engine.device), self.engine.device)
                with self.precision():
                    out = pretraining_loss(
                        self.engine.module, self.objective, batch, self.cfg.sparse_mlm
                    )
                meter.add(out, batch)
        self.engine.module.train()
        metrics = self.telemetry.evaluation(self.step, meter)
        self.progress.log(self.step, {"eval_loss": metrics["eval_loss"]})
        return metrics

    def save(self, metrics: dict[str, float]) -> None:
        """Commit a checkpoint (shards, RNG, then meta.json last), report it, prune old ones."""
        path = self.ctx.run_dir / ckpt.checkpoint_name(self.step)
        path.mkdir(parents=True, exist_ok=True)
        client = {"lmpipe_step": self.step}
        self.engine.save_checkpoint(str(path), tag=ckpt.TAG, client_state=client, save_latest=False)
        torch.save(ckpt.rng_state(), path / ckpt.rng_file(self.ctx.rank))
        self.hooks.run("after_shard", self.step)
        reference = self.reference_loss()
        _barrier()
        if self.ctx.rank == 0:
            self.hooks.run("before_meta", self.step)
            ckpt.write_meta(path, self._meta(metrics) | {"reference": reference})
            self.hooks.run("before_latest", self.step)
            ckpt.write_latest(self.ctx.run_dir, path)
            self.hooks.run("after_latest", self.step)
        _barrier()
        self.ctx.report({"step": self.step, **metrics}, path)
        if self.ctx.rank == 0:
            ckpt.prune(
                self.ctx.run_dir,
                self.cfg.checkpoint.keep_last,
                on_uncommitted=lambda _: self.hooks.run("during_purge", self.step),
            )

    def reference_loss(self, indices: np.ndarray | None = None) -> dict[str, Any]:
        """The eval-mode loss of the fixed batch an export must reproduce (every rank runs it).

        `indices`: the validation samples of the batch; default the first micro-batch's worth.
        """
        if indices is None:
            indices = reference_indices(len(self.eval_data), self.micro)
        rows = self.build(self.eval_data.take(indices), indices, EVAL_EPOCH)
        batch = on_device(pinned(rows, self.engine.device), self.engine.device)
        self.engine.module.eval()
        with torch.no_grad():
            loss = export_loss(self.engine.module, self.objective, batch, self.cfg.sparse_mlm)
        self.engine.module.train()
        return {"indices": indices.tolist(), "loss": float(loss)}

    def _meta(self, metrics: dict[str, float]) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursor": vars(self.cursor),
            "seed": self.job.seed,
            "world_size": self.ctx.world_size,
            "tokens_seen": self.tokens_seen,
            "config_hash": self.job.config_hash,
            "objective": self.objective,
            "guard": self.guard.state(),
            "deepspeed": self.ds_config,
            "train": self.cfg.model_dump(mode="json"),
            "metrics": metrics,
            "examples_dir": str(self.job.examples_dir),
            "tokenizer_dir": str(self.job.tokenizer_dir),
            "teacher_dir": str(self.job.teacher_dir) if self.job.teacher_dir else None,
        }


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
