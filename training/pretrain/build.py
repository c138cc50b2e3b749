"""Building one pretraining worker: its data, model, engine and the objects that watch the step.

`build_parts(job, ctx)` does everything a worker needs before its first step, in order: open the
example shards, build the model (the same weights on every rank), seed the rank's own RNGs,
build the DeepSpeed engine, the learning-rate schedule, the loss guard, telemetry and progress.
Stepping is `training/pretrain/loop.py`'s; nothing here runs a step.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tasks.common import schema
from training.models.distill import DistillationModel
from training.models.electra import ElectraPretrainer
from training.models.flops import CompanionModels, flops_per_token
from training.models.models import SEQ2SEQ_OBJECTIVES
from training.pretrain.config import TrainConfig, deepspeed_config
from training.pretrain.data import (
    BatchBuilder,
    ExampleShards,
    GlobalOrder,
    dynamic_masker,
    read_manifest,
    sequence_length,
)
from training.pretrain.job import WorkerJob
from training.pretrain.losses import exported_model, varying_masked_positions
from training.pretrain.losses.common import StepOutput
from training.pretrain.pretraining_model import build_pretraining_model, zero3_leaf_modules
from training.pretrain.telemetry import Telemetry
from training.runtime import checkpoint as ckpt
from training.runtime.deepspeed import param_groups
from training.runtime.engine import fused_optimizer, initialize_deepspeed
from training.runtime.guard import LossGuard
from training.runtime.progress import Progress, connect_progress
from training.runtime.schedule import GroupLRSchedule
from training.runtime.worker_context import WorkerContext
from training.tracking.runs import MlflowTracker, NullTracker, Tracker

log = logging.getLogger(__name__)

#: A micro-batch's forward pass and loss: (batch, sparse masked-LM logits) -> the step's output.
LossFn = Callable[[dict[str, torch.Tensor], bool], StepOutput]


@dataclass(frozen=True)
class PretrainData:
    """The examples one worker reads, and how it turns them into batches."""

    manifest: dict[str, Any]
    objective: str
    train: ExampleShards
    validation: ExampleShards
    order: GlobalOrder  # the seeded global order of the training examples, epoch by epoch
    build: BatchBuilder  # rows -> tensors, with dynamic masking where the objective asks
    length: int  # the examples' sequence length


@dataclass(frozen=True)
class StepParts:
    """What one optimizer step touches besides the model: built once, used by every step.

    `direct` (ZeRO 0 on one rank, not fp16): there is nothing to reduce or partition, so the
    step's backward and update are a plain loop's (the loss over the accumulation steps, then
    the fused AdamW), and the DeepSpeed engine only saves and loads checkpoints; its own backward
    and step add gradient hooks, a flattened copy of every gradient for an all-reduce over one
    rank, and their Python. `clip` is the norm the loop clips to itself (0: the engine clips,
    as ZeRO does, or clipping is off).
    """

    engine: Any
    ds_config: dict[str, Any]
    optimizer: Any  # the fused torch AdamW under the engine (`fused_optimizer`)
    direct: bool
    clip: float
    accumulation: int  # micro-batches per rank per optimizer step
    micro: int  # samples per micro-batch
    schedule: GroupLRSchedule
    guard: LossGuard


@dataclass(frozen=True)
class WorkerParts:
    """Everything `build_parts` makes for one worker."""

    data: PretrainData
    step: StepParts
    telemetry: Telemetry
    progress: Progress
    prefetch: bool  # build the next step's batches in a thread while this one runs


def open_data(job: WorkerJob) -> PretrainData:
    """The example shards of `job`, their seeded order and the batch builder."""
    cfg = job.train
    manifest = read_manifest(job.examples_dir)
    objective: str = manifest["objective"]
    train = ExampleShards(job.examples_dir, "train", verify=cfg.verify_shards)
    return PretrainData(
        manifest=manifest,
        objective=objective,
        train=train,
        validation=ExampleShards(job.examples_dir, "validation", verify=False),
        order=GlobalOrder(len(train), job.seed, cfg.global_batch_size),
        build=BatchBuilder(
            objective, dynamic_masker(manifest, job.tokenizer_dir, job.seed), cfg.document_masking
        ),
        length=sequence_length(manifest),
    )


def rank_seed(seed: int, rank: int) -> int:
    """The seed of one rank's own RNGs (dropout), derived from the run's seed."""
    return int(np.random.SeedSequence([seed, rank, 0xD70]).generate_state(1, np.uint32)[0])


def build_model(job: WorkerJob, rank: int, data: PretrainData) -> torch.nn.Module:
    """The model to pretrain: the same initial weights on every rank, then per-rank RNGs.

    Both seeds are needed, one after the other: the run's seed makes every rank build the same
    initial weights (data parallelism starts from one model), and a seed of the rank's own
    then makes dropout draw differently on each rank (the same masks everywhere would waste
    the data's variety). Nothing drawn between the two, or after, reaches the weights.
    """
    torch.manual_seed(job.seed)
    specials = data.manifest["specials"]
    model = build_pretraining_model(
        job.train,
        data.objective,
        specials["vocab_size"],
        specials,
        data.length,
        job.teacher_dir,
        job.tokenizer_dir,
    )
    ckpt.seed_rngs(rank_seed(job.seed, rank))
    return model


def build_step(cfg: TrainConfig, model: torch.nn.Module, ctx: WorkerContext) -> StepParts:
    """The DeepSpeed engine over `model`, its fused optimizer, the LR schedule and the guard."""
    ds_config = deepspeed_config(cfg, ctx.world_size)
    leaves = zero3_leaf_modules(model) if cfg.zero_stage == 3 else []
    groups = param_groups(model.named_parameters(), cfg.optim.weight_decay)
    engine = initialize_deepspeed(model, groups, ds_config, leaves)
    opt = cfg.optim
    schedule = GroupLRSchedule(
        engine.optimizer,
        warmup_steps=min(opt.warmup_steps, cfg.max_steps),
        total_steps=cfg.max_steps,
        decay=opt.decay,
        min_lr_ratio=opt.min_lr_ratio,
    )
    guard = LossGuard(cfg.guard)
    guard.to(engine.device)
    return StepParts(
        engine=engine,
        ds_config=ds_config,
        optimizer=fused_optimizer(engine),
        direct=cfg.zero_stage == 0 and ctx.world_size == 1 and cfg.precision != "fp16",
        # Where the engine does not clip (`deepspeed_config`: ZeRO 0), the loop clips.
        clip=opt.grad_clip if ds_config.get("gradient_clipping", 0.0) == 0.0 else 0.0,
        accumulation=cfg.accumulation_steps(ctx.world_size),
        micro=cfg.micro_batch(ctx.world_size),
        schedule=schedule,
        guard=guard,
    )


def train_loss(forward: LossFn, cfg: TrainConfig, engine: Any) -> LossFn:
    """The loss the step calls: `forward`, or compiled when `train.compile` asks.

    Evaluation and the reference loss call `pretraining_loss` and `export_loss` themselves,
    uncompiled, as they did before.
    """
    if cfg.compile and cfg.compile_scope == "model_and_loss" and cfg.zero_stage < 3:
        # One graph from the ids to the loss: the padded-vocabulary masking, the float cast
        # and the cross-entropy fuse instead of each writing a (tokens x vocabulary) tensor.
        return varying_masked_positions(torch.compile(forward))
    if cfg.compile:  # ZeRO 3's gather hooks run around each module's forward
        for child in engine.module.children():
            child.compile()
    return forward


def flops_counter(cfg: TrainConfig, data: PretrainData, module: Any) -> Callable[[int], float]:
    """Model FLOPs per input token at a sequence length (cached: a few lengths per run)."""
    labels = data.train.columns.get(schema.LABELS)
    generator = module.generator.config if isinstance(module, ElectraPretrainer) else None
    teacher = module.teacher.config if isinstance(module, DistillationModel) else None
    seq2seq = bool(labels) and data.objective in SEQ2SEQ_OBJECTIVES

    def at(length: int) -> float:
        return flops_per_token(
            exported_model(module).config,
            length,
            data.objective,
            mlm_probability=data.manifest["config"]["mask"]["masked_lm_prob"],
            sparse_mlm=cfg.sparse_mlm,
            target_len=labels[0].shape[1] if seq2seq and labels else None,
            companions=CompanionModels(generator, teacher),
        )

    return functools.lru_cache(maxsize=8)(at)


def build_parts(job: WorkerJob, ctx: WorkerContext) -> WorkerParts:
    """Everything one worker needs before its first step (the module docstring's order)."""
    cfg = job.train
    data = open_data(job)
    model = build_model(job, ctx.rank, data)
    step = build_step(cfg, model, ctx)
    warn_if_zero_shards_nothing(cfg, ctx)
    tracker: Tracker = NullTracker()
    if ctx.rank == 0 and job.tracking_uri and job.run_id:
        tracker = MlflowTracker(job.tracking_uri, job.run_id)
    flops_at = flops_counter(cfg, data, step.engine.module)
    prefetch = cfg.prefetch == "on" or (
        cfg.prefetch == "auto" and step.engine.device.type == "cuda"
    )
    return WorkerParts(
        data=data,
        step=step,
        telemetry=Telemetry(cfg, ctx, tracker, flops_at(data.length), flops_at),
        progress=connect_progress(job.progress, ctx.rank, cfg.max_steps),
        prefetch=prefetch,
    )


def warn_if_zero_shards_nothing(cfg: TrainConfig, ctx: WorkerContext) -> None:
    """Say once (rank 0) that ZeRO on one worker shards nothing but still costs."""
    if cfg.zero_stage > 0 and ctx.world_size == 1 and ctx.rank == 0:
        log.warning(
            "train.zero_stage=%d on one worker shards nothing but still pays ZeRO's "
            "gradient bookkeeping (about 10%% of a CPU step, docs/pretraining.md); "
            "zero_stage 0 is the single-worker setting",
            cfg.zero_stage,
        )


def pinned(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`batch` in pinned host memory when it goes to a GPU (the copy then runs asynchronously)."""
    if device.type == "cuda":
        return {k: v.pin_memory() for k, v in batch.items()}
    return batch


def on_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`batch` on `device`, copied without waiting (from pinned memory on a GPU)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def reference_indices(size: int, count: int) -> np.ndarray:
    """The validation samples of the fixed reference batch: the first `count`."""
    return np.arange(min(size, count))
