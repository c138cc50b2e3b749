"""The pretraining stage: train on Ray, export to Hugging Face format, check, register in MLflow.

`pretrain_stage` drives one run end to end, in `<storage>/<key>/` (`training/runtime/driver.py`),
and keeps its MLflow run open across resumes (the run id lives in the run's `record.json`); the
export goes to the run's `export/`. `export_checkpoint` turns any valid checkpoint into a
checked Hugging Face directory (`lmpipe export`), a run's of the older layout included.
`pretrain_task` is the Prefect wrapper.
Paths read back from a run record or a checkpoint's `meta.json` are relocated into the workspace
where they are read (`tasks.common.workspace.relocate`): a copied workspace reuses its runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from prefect import get_run_logger

from tasks.common.caching import stage_task
from tasks.common.io import code_version, flatten
from tasks.common.stage import StageOutput, complete_manifest
from tasks.common.workspace import relocate, workspace_of
from training.models.export import (
    DataRef,
    ModelCard,
    TokenizerRef,
    export_model,
    gather_state_dict,
    reload_check,
)
from training.models.models import count_parameters
from training.models.vocab import unpad_vocab
from training.pretrain.config import TrainConfig
from training.pretrain.data import (
    EVAL_EPOCH,
    BatchBuilder,
    ExampleShards,
    dynamic_masker,
    read_manifest,
    sequence_length,
)
from training.pretrain.driver import STAGE, RunControl, TrainingRun, plan_pretrain, train
from training.pretrain.losses import export_loss
from training.pretrain.pretraining_model import build_export_model
from training.runtime import checkpoint as ckpt
from training.runtime.config import ScaleConfig
from training.runtime.driver import EXPORT_DIR, published
from training.runtime.launcher import describe_scale, resolve_scale, scale_params
from training.runtime.progress import ProgressSpec, artifact_key
from training.runtime.run_context import RunContext
from training.scoring.plots import loss_curve_png, step_history
from training.tracking.model_ref import resolve_base_model
from training.tracking.registry import Registration, register_export
from training.tracking.runs import MlflowTracker, NullTracker, output_ref, tracked_run

log = logging.getLogger(__name__)


def export_checkpoint(checkpoint: Path, out_dir: Path) -> tuple[Path, ModelCard]:
    """Gather a checkpoint's full weights (any ZeRO stage), export them, check the reload.

    The export must reproduce, in fp32, the loss the training workers computed on the fixed
    reference batch when they saved this checkpoint (rtol 1e-4 in fp32, 5e-2 in bf16/fp16).
    """
    meta = ckpt.validate(checkpoint)  # hashes first: DeepSpeed's files are pickles
    cfg = TrainConfig.model_validate(meta["train"])
    workspace = workspace_of(checkpoint)  # the paths in meta are where the run was
    examples_dir = Path(relocate(meta["examples_dir"], workspace))
    tokenizer_dir = Path(relocate(meta["tokenizer_dir"], workspace))
    manifest = read_manifest(examples_dir)
    specials = manifest["specials"]
    objective = manifest["objective"]
    length = sequence_length(manifest)
    teacher = meta.get("teacher_dir") and relocate(meta["teacher_dir"], workspace)
    model, prefix = build_export_model(
        cfg, objective, specials["vocab_size"], specials, length, Path(teacher) if teacher else None
    )
    state = gather_state_dict(checkpoint, ckpt.TAG)
    if prefix:  # ELECTRA's generator, or nothing else: keep only the exported part
        state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(model, k)}
    if set(missing) - tied or unexpected:
        raise ckpt.CheckpointError(
            f"{checkpoint}: weights do not fit the model: missing {sorted(set(missing) - tied)}, "
            f"unexpected {sorted(unexpected)}"
        )
    unpad_vocab(model)  # the export has the tokenizer's rows only
    card = _card(cfg, meta, manifest, tokenizer_dir, model)
    export_model(model, tokenizer_dir, out_dir, card)
    batch = reference_batch(meta, examples_dir, tokenizer_dir, cfg)

    def loss_fn(m: Any, b: Any) -> float:
        return float(export_loss(m, objective, b, cfg.sparse_mlm))

    rtol = ckpt.reference_rtol(cfg.precision)
    reload_check(out_dir, cfg.model.family, batch, meta["reference"]["loss"], loss_fn, rtol)
    return out_dir, card


def _is_tied(model: torch.nn.Module, key: str) -> bool:
    # Tied output weights (GPT-2, T5) are not saved separately; load_state_dict reports them.
    return key.endswith(("lm_head.weight", "decoder.weight")) and bool(
        getattr(model.config, "tie_word_embeddings", False)
    )


def reference_batch(
    meta: dict[str, Any], examples_dir: Path, tokenizer_dir: Path, cfg: TrainConfig
) -> dict[str, torch.Tensor]:
    """The fixed validation batch the workers computed `meta['reference']['loss']` on."""
    manifest = read_manifest(examples_dir)
    data = ExampleShards(examples_dir, "validation", verify=False)
    indices = np.asarray(meta["reference"]["indices"], dtype=np.int64)
    build = BatchBuilder(
        manifest["objective"],
        dynamic_masker(manifest, tokenizer_dir, int(meta["seed"])),
        cfg.document_masking,
    )
    return build(data.take(indices), indices, EVAL_EPOCH)


def _card(
    cfg: TrainConfig,
    meta: dict[str, Any],
    manifest: dict[str, Any],
    tokenizer_dir: Path,
    model: torch.nn.Module,
) -> ModelCard:
    tok = json.loads((tokenizer_dir / "manifest.json").read_text())
    ds = meta["deepspeed"]
    return ModelCard(
        family=cfg.model.family,
        size=cfg.model.size,
        parameters=count_parameters(model),
        objective=manifest["objective"],
        steps=int(meta["step"]),
        tokens_seen=int(meta.get("tokens_seen", 0)),
        data=DataRef(path=meta["examples_dir"], fingerprint=manifest["fingerprint"]),
        tokenizer=TokenizerRef(
            fingerprint=tok["fingerprint"],
            family=tok["config"]["family"],
            vocab_size=int(manifest["specials"]["vocab_size"]),
        ),
        metrics={k: float(v) for k, v in meta.get("metrics", {}).items()},
        deepspeed={
            "zero_stage": int(ds["zero_optimization"]["stage"]),
            "precision": cfg.precision,
            "train_batch_size": int(ds["train_batch_size"]),
            "world_size": int(meta["world_size"]),
        },
        git_commit=code_version("training")["git_commit"] or "unknown",
    )


def lineage_tags(meta: dict[str, Any], examples_dir: Path, tokenizer_dir: Path) -> dict[str, str]:
    """Registry tags that trace a model version back to its data, tokenizer and code."""
    examples = read_manifest(examples_dir)
    encode_dir = relocate(examples["encode"]["path"], workspace_of(examples_dir))
    encode = json.loads((Path(encode_dir) / "manifest.json").read_text())
    tok = json.loads((tokenizer_dir / "manifest.json").read_text())
    return {
        "corpus_manifest": str(encode["inputs"]["ingest"]),
        "tokenizer_sha256": str(tok.get("tags", {}).get("tokenizer_sha256", "")),
        "tokenizer_fingerprint": str(tok["fingerprint"]),
        "examples_fingerprint": str(examples["fingerprint"]),
        "examples_config": json.dumps(examples["config"], sort_keys=True)[:5000],
        "deepspeed_config": json.dumps(meta["deepspeed"], sort_keys=True)[:5000],
        "git_commit": code_version("training")["git_commit"] or "unknown",
        "train_run": str(meta["config_hash"]),
        "step": str(meta["step"]),
    }


def pretrain_stage(
    cfg: TrainConfig,
    examples_dir: Path,
    tokenizer_dir: Path,
    *,
    run: RunContext,
    control: RunControl | None = None,
) -> dict[str, Any]:
    """Train (or reuse a finished run), export, check the export and register it.

    The run is `<storage>/<key>/` (`plan_pretrain`); a finished and published one is reused
    (registered, when tracking is on). Returns a summary: run directory, checkpoint, export
    directory, MLflow run id, registered model version, final metrics. `control` is passed to
    `train` (resume, stop step, planned fault, how this process shows the progress; None:
    `RunControl`'s defaults). A run stopped at `control.stop_at_step` is neither exported nor
    registered; resume it with `RunControl(resume=True)`: it logs into the same MLflow run.
    """
    control = control or RunControl()
    teacher_dir = _teacher_dir(cfg, run)
    run_dir = plan_pretrain(cfg, examples_dir, tokenizer_dir, run=run, teacher_dir=teacher_dir)
    done = run_dir.reuse(registered=run.tracking_uri is not None)
    if done is not None and not control.stop_at_step:
        return done | {"reused": True}
    scale = resolve_scale(cfg.scale, run.ray)
    log.info(
        "pretraining run %s: %s, attention %s (train.attention %s), %s",
        run_dir.key,
        cfg.precision_choice(),
        cfg.document_attention(),
        cfg.attention,
        describe_scale(scale),
    )
    tags = {"stage": STAGE, "train_run": run_dir.key, "family": cfg.model.family}
    name, resumed = f"{run.name}-pretrain", run_dir.record().get("mlflow_run_id")
    with tracked_run(
        run.tracking, run.workspace, name, tags, run_id=resumed, system_metrics=True
    ) as tracker:
        mlflow_run = tracker.run_id or resumed
        if resumed is None:
            _log_start(tracker, cfg, scale, (examples_dir, tokenizer_dir))
        resolved = cfg.model_copy(update={"scale": scale})
        trained = train(run_dir, resolved, run=run, mlflow_run_id=mlflow_run, control=control)
        summary = _summary(trained) | {"mlflow_run_id": mlflow_run}
        if trained.finished:
            summary |= _publish(trained, cfg, run, mlflow_run, examples_dir, tokenizer_dir)
        else:
            tracker.end_status = "KILLED"  # stopped early: resumed later into the same run
    if trained.finished:
        run_dir.commit(summary)
    return summary | {"reused": False}


def _log_start(
    tracker: MlflowTracker | NullTracker,
    cfg: TrainConfig,
    scale: ScaleConfig,
    inputs: tuple[Path, Path],
) -> None:
    """Log a new run's params and its inputs: the examples and the tokenizer it trains on.

    `cfg` as asked for, and what its `auto` settings resolved to: precision, attention, and
    `scale`'s CPUs and threads per worker.
    """
    examples_dir, tokenizer_dir = inputs
    tracker.log_params(
        flatten({"train": cfg.model_dump(mode="json")})
        | {"resolved_precision": cfg.precision, "requested_precision": cfg.requested_precision}
        | {"resolved_attention": cfg.document_attention()}
        | scale_params(scale)
    )
    tracker.log_inputs(
        [
            output_ref("examples", examples_dir, "training"),
            output_ref("tokenizer", tokenizer_dir, "training"),
        ]
    )


def _summary(run: TrainingRun) -> dict[str, Any]:
    return {
        "run_dir": str(run.run_dir),
        "checkpoint": str(run.checkpoint),
        "step": int(run.meta["step"]),
        "finished": run.finished,
        "metrics": run.meta.get("metrics", {}),
    }


def _teacher_dir(cfg: TrainConfig, run: RunContext) -> Path | None:
    """The local teacher of a distillation run (downloaded when a registry version), else None."""
    if cfg.distillation is None:
        return None
    teacher_dir, _ = resolve_base_model(cfg.distillation.teacher, run.tracking_uri, run.workspace)
    return teacher_dir


def _publish(
    trained: TrainingRun,
    cfg: TrainConfig,
    run: RunContext,
    mlflow_run: str | None,
    examples_dir: Path,
    tokenizer_dir: Path,
) -> dict[str, Any]:
    export_dir = trained.run_dir / EXPORT_DIR
    export_checkpoint(trained.checkpoint, export_dir)
    out: dict[str, Any] = {"export_dir": str(export_dir)}
    uri = run.tracking_uri
    if uri is None or mlflow_run is None:
        return out
    tracker = MlflowTracker(uri, mlflow_run)
    run_dir = trained.run_dir
    history = step_history(run_dir / "evals.jsonl")
    evals = [(step, float(row["eval_loss"])) for step, row in history.items()]
    png = loss_curve_png(run_dir / "steps.jsonl", evals, run_dir / "loss_curve.png")
    tracker.log_artifact(png, "plots")
    name = cfg.model_name or f"{run.name}-{cfg.model.family}"
    tags = lineage_tags(trained.meta, examples_dir, tokenizer_dir)
    ref = register_export(
        export_dir, cfg.model.family, uri, mlflow_run, Registration(name, cfg.alias, tags)
    )
    return out | {"model_name": ref.name, "model_version": ref.version, "model_uri": ref.model_uri}


def plan_pretrain_task(
    cfg: TrainConfig, examples_dir: str, tokenizer_dir: str, run: RunContext
) -> StageOutput | None:
    """The run a `pretrain_task` call reuses, for the task's Prefect cache (`StageCache`).

    None (no cache key: the task runs and decides) when the run is finished but not yet
    registered while tracking is on: this call registers it.
    """
    teacher_dir = _teacher_dir(cfg, run)
    run_dir = plan_pretrain(
        cfg, Path(examples_dir), Path(tokenizer_dir), run=run, teacher_dir=teacher_dir
    )
    done = run_dir.reuse()
    if done is not None and not published(done, registered=run.tracking_uri is not None):
        return None
    return run_dir.out


@stage_task(STAGE, plan_pretrain_task, complete_manifest)
def pretrain_task(
    cfg: TrainConfig,
    examples_dir: str,
    tokenizer_dir: str,
    *,
    run: RunContext,
    resume: bool = False,
) -> dict[str, Any]:
    """Prefect task: `pretrain_stage` on paths (a finished, registered run is reused).

    Cached in Prefect on the run's key while the run's manifest is complete, as the data stages
    are (`tasks.common.caching`): a rerun of a finished run is a `Cached` task run, its summary
    the recorded one (`stage_summary` marks it reused). The training's progress is a live line
    on a terminal, else a log line per `train.log_every_steps`, and a Prefect progress artifact.
    """
    logger = get_run_logger()
    logger.info("pretraining: %s", cfg.precision_choice())  # shown on the console
    title = f"pretrain {cfg.model.family}-{cfg.model.size}"
    progress = ProgressSpec(title, logger, artifact_key(f"{run.name}-pretrain-progress"))
    control = RunControl(resume=resume, progress=progress)
    return pretrain_stage(cfg, Path(examples_dir), Path(tokenizer_dir), run=run, control=control)
