"""The pipeline's stages as steps: each runs one stage's Prefect task on the stages before it.

A step takes the run config and the summaries of the stages already run (`Stages`, keyed by
stage name) and returns its own. Every summary says where the output is, whether it was
`reused` (a cache hit: the stage's fingerprint over its inputs, config section and code matched
a complete output in the workspace) and its MLflow run. The stage flows and the `pipeline` flow
are compositions of these steps. Caching has one key, the fingerprint: every stage's task, the
training runs' and the evaluation's included, is Prefect-cached on it, guarded by the
workspace check (`tasks.common.caching`), with its JSON results under
`<workspace>/prefect-results/`; a `Cached` task run is a reused stage.

Each step also publishes its stage's Markdown summary as a Prefect artifact
(`pipelines/flows/summary.py`). The data stages and the downstream preparation are retried with
exponential back-off on a transient failure (`prefect.retries`); they are idempotent, a retry
resumes from the parts already committed. Training retries its workers through Ray Train
(`train.scale.max_failures`) instead, from its last checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from prefect import Task
from prefect.tasks import exponential_backoff

from pipelines.config import ConfigError, RunConfig
from pipelines.flows.stage_tracking import record_stage_task, recorded_run, track_stage_task
from pipelines.flows.summary import publish_stage
from pipelines.ops.warm_imports import await_warm_imports
from tasks.common.caching import in_workspace, stage_summary
from tasks.common.io import public_dump
from tasks.decontaminate.stage import decontaminate_task
from tasks.downstream.stage import prepare_downstream_task
from tasks.encode.stage import encode_task
from tasks.examples.stage import examples_task
from tasks.ingest.stage import ingest_task
from tasks.tokenizer.stage import tokenizer_task
from training.runtime.run_context import RunContext

Stages = dict[str, dict[str, Any]]
Step = Callable[[RunConfig, Stages], Stages]
P = ParamSpec("P")
R = TypeVar("R")


def retrying(task: Task[P, R], cfg: RunConfig) -> Task[P, R]:
    """The task with the run's retry policy: `prefect.retries`, exponential back-off."""
    if cfg.prefect.retries == 0:
        return task
    return task.with_options(
        retries=cfg.prefect.retries,
        retry_delay_seconds=exponential_backoff(backoff_factor=cfg.prefect.retry_delay_s),
        retry_jitter_factor=0.5,
    )


def cached(task: Task[P, dict[str, Any]], cfg: RunConfig) -> Task[P, dict[str, Any]]:
    """A data stage's task with the run's retry policy and the workspace's result store."""
    return retrying(in_workspace(task, cfg.workspace), cfg)


def run_context(cfg: RunConfig) -> RunContext:
    """The run context the training stages take: the run's workspace, seed, Ray, tracking, name."""
    return RunContext(
        workspace=cfg.workspace, seed=cfg.seed, ray=cfg.ray, tracking=cfg.tracking, name=cfg.name
    )


def corpus_path(stages: Stages) -> str:
    """Return the corpus the stages after ingestion read: decontaminated when that stage ran."""
    return str(stages.get("decontaminate", stages["ingest"])["path"])


def _tracked(cfg: RunConfig, result: dict[str, Any]) -> Stages:
    """Log a data stage's result to MLflow, publish its summary; return `{stage: summary}`.

    A cache hit whose output has a recorded MLflow run names that run and logs none
    (`recorded_run`).
    """
    run_id = recorded_run(cfg, result) or retrying(track_stage_task, cfg)(result, cfg)
    summary = result | {"mlflow_run_id": run_id}
    publish_stage(cfg, result["stage"], summary)
    return {result["stage"]: summary}


def ingest_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Ingest the corpus into fingerprinted Arrow shards (`{"ingest": summary}`)."""
    if cfg.ingest is None:
        raise ConfigError("this command needs an `ingest` section (the corpus to read)")
    state = cached(ingest_task, cfg)(cfg.ingest, cfg.ray, str(cfg.workspace), return_state=True)
    return _tracked(cfg, stage_summary(state, cfg.workspace))


def decontaminate_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Remove documents that overlap the evaluation sets, when `decontaminate.enabled`."""
    if not cfg.decontaminate.enabled:
        return {}
    task = cached(decontaminate_task, cfg)
    ingest = stages["ingest"]["path"]
    state = task(cfg.decontaminate, ingest, str(cfg.workspace), return_state=True)
    return _tracked(cfg, stage_summary(state, cfg.workspace))


def tokenizer_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Train or load the tokenizer on the corpus."""
    task = cached(tokenizer_task, cfg)
    state = task(cfg.tokenizer, corpus_path(stages), str(cfg.workspace), return_state=True)
    return _tracked(cfg, stage_summary(state, cfg.workspace))


def encode_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Encode the corpus the tokenizer trained on into token shards."""
    tokenizer = stages["tokenizer"]["path"]
    task = cached(encode_task, cfg)
    corpus, workspace = corpus_path(stages), str(cfg.workspace)
    state = task(cfg.encode, cfg.ray, corpus, tokenizer, workspace, return_state=True)
    return _tracked(cfg, stage_summary(state, cfg.workspace))


def examples_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Cut the encoded corpus into pretraining examples of `examples.objective`."""
    encode, tokenizer = stages["encode"]["path"], stages["tokenizer"]["path"]
    task = cached(examples_task, cfg)
    workspace = str(cfg.workspace)
    state = task(cfg.examples, cfg.seed, cfg.ray, encode, tokenizer, workspace, return_state=True)
    return _tracked(cfg, stage_summary(state, cfg.workspace))


#: The data stages in the order they run; a step that is off (decontaminate) returns `{}`.
DATA_STEPS: dict[str, Step] = {
    "ingest": ingest_step,
    "decontaminate": decontaminate_step,
    "tokenizer": tokenizer_step,
    "encode": encode_step,
    "examples": examples_step,
}


def run_data_steps(cfg: RunConfig, last: str) -> Stages:
    """Run the data steps in order up to and including `last`; returns each stage's summary.

    They run as tasks of the calling flow, not as nested flows: a flow run costs its own
    parameter schema, API round trips and engine start, which a cache-hit rerun would pay once
    per upstream stage.
    """
    names = list(DATA_STEPS)
    stages: Stages = {}
    for name in names[: names.index(last) + 1]:
        stages |= DATA_STEPS[name](cfg, stages)
    return stages


def pretrain_step(cfg: RunConfig, stages: Stages, resume: bool = False) -> Stages:
    """Pretrain, export to Hugging Face format and register the model (reused when done)."""
    await_warm_imports()  # before this thread imports torch (pipelines/ops/warm_imports.py)
    from training.pretrain.stage import pretrain_task  # torch: only where it trains

    examples, tokenizer = stages["examples"]["path"], stages["tokenizer"]["path"]
    task = in_workspace(pretrain_task, cfg.workspace)  # Ray Train retries its workers instead
    run = run_context(cfg)
    state = task(cfg.train, examples, tokenizer, run=run, resume=resume, return_state=True)
    return _trained(cfg, "pretrain", stage_summary(state, cfg.workspace))


#: The config section each training stage runs from: a cache hit's MLflow params.
TRAINED_SECTIONS = {"pretrain": "train", "finetune": "finetune", "evaluate": "evaluate"}


def _trained(cfg: RunConfig, stage: str, result: dict[str, Any]) -> Stages:
    """Record a training stage's cache hit in MLflow, publish its summary.

    The cache hit's run gets params too, as every run does: the stage's config section, the
    run's name and seed.
    """
    if result.get("reused"):
        section = TRAINED_SECTIONS[stage]
        params = {section: public_dump(cfg)[section], "name": cfg.name, "seed": cfg.seed}
        result = result | {"mlflow_run_id": record_stage_task(cfg, stage, result, params)}
    publish_stage(cfg, stage, result)
    return {stage: result}


def downstream_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Prepare (or reuse) the configured downstream task under `<workspace>/downstream/`."""
    if cfg.task is None:
        raise ConfigError("this command needs a `task` section (the downstream dataset)")
    dataset = cfg.task.resolved()
    out = cfg.workspace / "downstream" / dataset.name
    task = cached(prepare_downstream_task, cfg)
    state = task(dataset, str(cfg.task.base_dir), str(out), return_state=True)
    result = stage_summary(state, cfg.workspace)
    rows = {f"{split}_rows": float(entry["rows"]) for split, entry in result["splits"].items()}
    params = {"task": public_dump(dataset)}
    run_id = retrying(record_stage_task, cfg)(cfg, "downstream", result, params, rows)
    result = result | {"mlflow_run_id": run_id}
    publish_stage(cfg, "downstream", result)
    return {"downstream": result}


def base_model(cfg: RunConfig, stages: Stages) -> tuple[str, dict[str, str]]:
    """The model to fine-tune or evaluate, and the lineage tags that name it.

    `finetune.base` when set (a local directory or a registry version), else the model the
    `pretrain` stage in `stages` exported.
    """
    await_warm_imports()
    from training.finetune.stage import resolve_base_model_task

    if cfg.finetune.base is not None:
        path, lineage = resolve_base_model_task(cfg.finetune.base, cfg.tracking, str(cfg.workspace))
        return path, lineage
    if "pretrain" not in stages:
        raise ConfigError("no base model: set `finetune.base` or run the pretrain stage first")
    pre = stages["pretrain"]
    lineage = {
        "base_model_name": str(pre.get("model_name")),
        "base_model_version": str(pre.get("model_version")),
        "base_model_path": str(pre["export_dir"]),
    }
    return str(pre["export_dir"]), lineage


def finetune_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Fine-tune the base model on the prepared task; export and register it with lineage."""
    await_warm_imports()
    from training.finetune.stage import finetune_task

    model_dir, lineage = base_model(cfg, stages)
    data_dir = stages["downstream"]["path"]
    task, run = in_workspace(finetune_task, cfg.workspace), run_context(cfg)
    state = task(cfg.finetune, data_dir, model_dir, run=run, lineage=lineage, return_state=True)
    return _trained(cfg, "finetune", stage_summary(state, cfg.workspace))


def evaluate_step(cfg: RunConfig, stages: Stages) -> Stages:
    """Evaluate the base model (and report the fine-tuned one when the pipeline made it)."""
    await_warm_imports()
    from training.evaluate.stage import evaluate_task

    model_dir, _ = base_model(cfg, stages)
    examples = None
    if "examples" in stages and cfg.finetune.base is None:
        examples = (stages["examples"]["path"], stages["tokenizer"]["path"])
    task_dir = stages["downstream"]["path"] if "downstream" in stages else None
    state = cached(evaluate_task, cfg)(
        model_dir,
        cfg.evaluate,
        run=run_context(cfg),
        examples=examples,
        task_dir=task_dir,
        finetuned=stages.get("finetune"),
        return_state=True,
    )
    result = stage_summary(state, cfg.workspace)
    return _trained(cfg, "evaluate", result | {"report_dir": result["path"]})
