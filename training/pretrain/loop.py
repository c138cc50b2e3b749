"""The per-worker pretraining loop: a DeepSpeed engine stepping over the seeded global order.

`run_worker(job, ctx)` is the loop for any `WorkerContext`: a Ray Train worker, the driver's own
process, or a plain process (a GPU benchmark without Ray); `PRETRAIN_LOOP` is how the launcher
calls it.
The engine comes from `training/runtime/engine.py`; Ray is reached only through the context. The
loop steps; checkpoints, evaluation and tracking happen every N steps.
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from tasks.common import schema
from training.models.distill import DistillationModel
from training.models.electra import ElectraPretrainer
from training.models.flops import CompanionModels, flops_per_token
from training.models.models import SEQ2SEQ_OBJECTIVES
from training.pretrain.audit import log_sample_ids, write_pid
from training.pretrain.config import TrainConfig, deepspeed_config
from training.pretrain.data import (
    EVAL_EPOCH,
    BatchBuilder,
    Cursor,
    ExampleShards,
    GlobalOrder,
    dynamic_masker,
    rank_micro_batches,
    read_manifest,
    sequence_length,
)
from training.pretrain.length_schedule import check_length_schedule, length_at
from training.pretrain.loss_common import StepOutput
from training.pretrain.losses import (
    export_loss,
    exported_model,
    pretraining_loss,
    varying_masked_positions,
)
from training.pretrain.prefetch import Prefetcher, StepPlan
from training.pretrain.pretraining_model import build_pretraining_model, zero3_leaf_modules
from training.pretrain.telemetry import StepMeter, Telemetry
from training.runtime import checkpoint as ckpt
from training.runtime import faults
from training.runtime.deepspeed import param_groups
from training.runtime.engine import DeviceUpdate, autocast_for, initialize_deepspeed
from training.runtime.guard import LossGuard
from training.runtime.progress import connect_progress
from training.runtime.schedule import GroupLRSchedule
from training.runtime.worker_context import LoopEntry, WorkerContext
from training.tracking.runs import MlflowTracker, NullTracker, Tracker

log = logging.getLogger(__name__)


class WorkerJob(BaseModel):
    """Everything a worker needs: the train config, its inputs, and where to report."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    train: TrainConfig
    seed: int
    examples_dir: Path
    tokenizer_dir: Path
    config_hash: str
    tracking_uri: str | None = None
    run_id: str | None = None
    stop_at_step: int | None = None  # end this attempt after that step, with a checkpoint
    fault: faults.FaultPlan | None = None  # the reliability suite's injected SIGKILL
    teacher_dir: Path | None = None  # distillation: the resolved local teacher
    progress: str | None = None  # the driver's progress sink (training/runtime/progress.py)


def run_worker(job: WorkerJob, ctx: WorkerContext) -> dict[str, float]:
    """Train until `max_steps` (or `stop_at_step`); return the last evaluation's metrics."""
    torch.set_num_threads(job.train.scale.threads_per_worker)
    worker = Worker(job, ctx)
    return worker.run()


#: The pretraining loop as both launchers call it (training/runtime/launcher.py).
PRETRAIN_LOOP = LoopEntry(WorkerJob, run_worker)


def _seed_for(seed: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, rank, 0xD70]).generate_state(1, np.uint32)[0])


class Worker:
    """One rank's model, data and engine, and the steps it takes."""

    def __init__(self, job: WorkerJob, ctx: WorkerContext) -> None:
        """Open the data, build the model (same weights on every rank) and the engine."""
        self.job, self.ctx, self.cfg = job, ctx, job.train
        manifest = read_manifest(job.examples_dir)
        self.objective: str = manifest["objective"]
        self.train_data = ExampleShards(job.examples_dir, "train", verify=self.cfg.verify_shards)
        self.eval_data = ExampleShards(job.examples_dir, "validation", verify=False)
        self.order = GlobalOrder(len(self.train_data), job.seed, self.cfg.global_batch_size)
        self.build = BatchBuilder(
            self.objective,
            dynamic_masker(manifest, job.tokenizer_dir, job.seed),
            self.cfg.document_masking,
        )
        torch.manual_seed(job.seed)  # identical initial weights on every rank
        length = sequence_length(manifest)
        specials = manifest["specials"]
        model = build_pretraining_model(
            self.cfg,
            self.objective,
            specials["vocab_size"],
            specials,
            length,
            job.teacher_dir,
            job.tokenizer_dir,
        )
        self._build_engine(model)
        opt = self.cfg.optim
        self.schedule = GroupLRSchedule(
            self.engine.optimizer,
            warmup_steps=min(opt.warmup_steps, self.cfg.max_steps),
            total_steps=self.cfg.max_steps,
            decay=opt.decay,
            min_lr_ratio=opt.min_lr_ratio,
        )
        self.accum = self.cfg.accumulation_steps(ctx.world_size)
        self.micro = self.cfg.micro_batch(ctx.world_size)
        self._warn_if_zero_shards_nothing()
        self.guard = LossGuard(self.cfg.guard)
        self.guard.to(self.engine.device)
        direct = self.cfg.zero_stage == 0 and ctx.world_size == 1 and self.cfg.precision != "fp16"
        self.update = DeviceUpdate(self.engine, self.cfg.optim.grad_clip, self.ds_config, direct)
        self.precision = functools.partial(autocast_for, self.ds_config, self.engine.device)
        flops_at = functools.lru_cache(maxsize=8)(lambda seq: self._flops(manifest, seq))
        tracker: Tracker = NullTracker()
        if ctx.rank == 0 and job.tracking_uri and job.run_id:
            tracker = MlflowTracker(job.tracking_uri, job.run_id)
        self.telemetry = Telemetry(self.cfg, ctx, tracker, flops_at(length), flops_at)
        self.progress = connect_progress(job.progress, ctx.rank, self.cfg.max_steps)
        self.step, self.cursor, self.tokens_seen = 0, Cursor(), 0
        ahead = self.cfg.prefetch == "on" or (
            self.cfg.prefetch == "auto" and self.engine.device.type == "cuda"
        )
        self.batches = Prefetcher(self._plan, ahead)
        ckpt.seed_rngs(_seed_for(job.seed, ctx.rank))  # dropout differs across ranks

    def _build_engine(self, model: torch.nn.Module) -> None:
        """The DeepSpeed engine over `model`, and the loss function (compiled if asked)."""
        self.ds_config = deepspeed_config(self.cfg, self.ctx.world_size)
        leaves = zero3_leaf_modules(model) if self.cfg.zero_stage == 3 else []
        self.engine = initialize_deepspeed(
            model,
            param_groups(model.named_parameters(), self.cfg.optim.weight_decay),
            self.ds_config,
            leaves,
        )
        self.loss: Callable[[dict[str, torch.Tensor], bool], StepOutput] = self._forward
        if (
            self.cfg.compile
            and self.cfg.compile_scope == "model_and_loss"
            and self.cfg.zero_stage < 3
        ):
            # One graph from the ids to the loss: the padded-vocabulary masking, the float cast
            # and the cross-entropy fuse instead of each writing a (tokens x vocabulary) tensor.
            self.loss = varying_masked_positions(torch.compile(self.loss))
        elif self.cfg.compile:  # ZeRO 3's gather hooks run around each module's forward
            for child in self.engine.module.children():
                child.compile()

    def _warn_if_zero_shards_nothing(self) -> None:
        if self.cfg.zero_stage > 0 and self.ctx.world_size == 1 and self.ctx.rank == 0:
            log.warning(
                "train.zero_stage=%d on one worker shards nothing but still pays ZeRO's "
                "gradient bookkeeping (about 10%% of a CPU step, docs/pretraining.md); "
                "zero_stage 0 is the single-worker setting",
                self.cfg.zero_stage,
            )

    def _forward(self, batch: dict[str, torch.Tensor], sparse_mlm: bool) -> StepOutput:
        """The model's forward pass and loss on one micro-batch (what `compile` compiles)."""
        return pretraining_loss(self.engine.module, self.objective, batch, sparse_mlm)

    def _flops(self, manifest: dict[str, Any], length: int) -> float:
        labels = self.train_data.columns.get(schema.LABELS)
        module = self.engine.module
        generator = module.generator.config if isinstance(module, ElectraPretrainer) else None
        teacher = module.teacher.config if isinstance(module, DistillationModel) else None
        return flops_per_token(
            exported_model(module).config,
            length,
            self.objective,
            mlm_probability=manifest["config"]["mask"]["masked_lm_prob"],
            sparse_mlm=self.cfg.sparse_mlm,
            target_len=labels[0].shape[1]
            if labels and self.objective in SEQ2SEQ_OBJECTIVES
            else None,
            companions=CompanionModels(generator, teacher),
        )

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

        Nothing here reads a tensor value on the host: the guard's skip flag, the gradient norm
        and the step's statistics stay on the device until `flush`.
        """
        plan = self.batches.take(self.step + 1, self.cursor)
        length, micro = plan.length, plan.micro
        meter = StepMeter()
        lr = self.schedule.get_last_lr()[0]
        for i, host in enumerate(plan.batches):
            batch = self._to_device(host)
            with self.precision():
                out = self.loss(batch, self.cfg.sparse_mlm)
            self.guard.observe(out.loss)
            self.update.backward(out.loss)
            boundary = i == len(micro) - 1
            if boundary:  # the update's boundary: decide, clip, then step
                skip, record = self.guard.decide()
                grad_norm = self.update.prepare(skip)
            self.update.step(boundary)
            meter.add(out, batch)
        self.schedule.step()  # the next step's rates
        self.cursor = plan.after
        self.step += 1
        self._fault("step")
        # Host values only: the step's samples (all ranks) and their token positions.
        samples = self.cfg.global_batch_size
        self.progress.step(self.step, samples=samples, tokens=samples * length)
        if grad_norm is None:  # ZeRO computes the norm inside its step
            grad_norm = self.engine.get_global_grad_norm()
        if self.telemetry.record(self.step, meter, lr, grad_norm, skip, record, length):
            self.flush()
        if self.cfg.log_sample_ids:
            log_sample_ids(self.ctx, self.step, np.concatenate(micro))

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
        batches = [
            self._host(self.build(self.train_data.take(ids), ids, epoch, length)) for ids in micro
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
                batch = self._device(self.build(self.eval_data.take(ids), ids, EVAL_EPOCH))
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
        self._fault("after_shard")
        reference = self.reference_loss()
        _barrier()
        if self.ctx.rank == 0:
            self._fault("before_meta")
            ckpt.write_meta(path, self._meta(metrics) | {"reference": reference})
            self._fault("before_latest")
            ckpt.write_latest(self.ctx.run_dir, path)
            self._fault("after_latest")
        _barrier()
        self.ctx.report({"step": self.step, **metrics}, path)
        if self.ctx.rank == 0:
            ckpt.prune(
                self.ctx.run_dir,
                self.cfg.checkpoint.keep_last,
                on_uncommitted=lambda _: self._fault("during_purge"),
            )

    def _fault(self, point: faults.FaultPoint) -> None:
        faults.hit(self.job.fault, point, self.step, self.ctx.rank)

    def reference_loss(self, indices: np.ndarray | None = None) -> dict[str, Any]:
        """The eval-mode loss of the fixed batch an export must reproduce (every rank runs it).

        `indices`: the validation samples of the batch; default the first micro-batch's worth.
        """
        if indices is None:
            indices = reference_indices(len(self.eval_data), self.micro)
        batch = self._device(self.build(self.eval_data.take(indices), indices, EVAL_EPOCH))
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

    def _host(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.engine.device.type == "cuda":  # pinned: the copy to the GPU runs asynchronously
            return {k: v.pin_memory() for k, v in batch.items()}
        return batch

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.engine.device, non_blocking=True) for k, v in batch.items()}

    def _device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._to_device(self._host(batch))


def reference_indices(size: int, count: int) -> np.ndarray:
    """The validation samples of the fixed reference batch: the first `count`."""
    return np.arange(min(size, count))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
