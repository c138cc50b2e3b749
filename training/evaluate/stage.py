"""The evaluate stage: intrinsic probes of a model and zero/few-shot prompting on a local task.

`evaluate_model` loads a model directory (a pretraining export, or any HF model of a supported
family), runs what fits its family (held-out perplexity / MLM accuracy when the pretraining
examples are known, fill-mask probes for encoders, generation samples for decoders and T5,
prompting on a classification task for causal LMs); `evaluation_report` writes
`evaluation.json` and a Markdown + HTML report. `evaluate_task` is the Prefect wrapper: it runs
both on the stage scaffold (`tasks/common/stage.py`; `plan_evaluation` fingerprints and places
the output) and logs it to an MLflow run: the resolved section and what it evaluated as params
(`evaluation_params`), the numbers as metrics, the report as artifacts.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from tasks.common import schema
from tasks.common.caching import stage_task
from tasks.common.io import fingerprint, read_downstream_dir, source_hash, write_json_atomic
from tasks.common.stage import StageOutput, complete_manifest, content_hash, file_entry
from tasks.common.workspace import relocate_record
from training.evaluate.config import EvaluateConfig as EvaluateConfig
from training.evaluate.intrinsic import (
    fill_mask_probes,
    generation_samples,
    heldout_metrics,
    sentence_embeddings,
)
from training.evaluate.prompting import classify_by_prompting
from training.models.export import load_export
from training.models.models import FAMILIES
from training.runtime.progress import ProgressSpec, artifact_key, local_progress
from training.runtime.run_context import RunContext
from training.scoring.metrics.metrics import compute_metrics, embedding_similarity_metrics
from training.scoring.report import html_page, markdown_table
from training.tracking.runs import DatasetRef, output_ref, tracked_run

log = logging.getLogger(__name__)

STAGE = "evaluate"
ENCODERS = tuple(family for family, spec in FAMILIES.items() if spec.kind == "encoder")


def evaluate_model(
    model_dir: Path,
    cfg: EvaluateConfig,
    *,
    seed: int = 0,
    examples: tuple[Path, Path] | None = None,
    task_dir: Path | None = None,
    progress: ProgressSpec | None = None,
) -> dict[str, Any]:
    """Evaluate the model in `model_dir`; return every result as plain data.

    Args:
        model_dir: A Hugging Face directory of family bert, roberta, gpt2, llama or t5.
        cfg: What to run.
        seed: Seed of the held-out split's masking.
        examples: (examples dir, tokenizer dir) of its pretraining, for held-out metrics.
        task_dir: A prepared classification task, for prompting.
        progress: How to show the parts done (None: not at all); each part's metrics are
            its log interval's.
    """
    family = json.loads((model_dir / "config.json").read_text())["model_type"]
    model, tok = load_export(model_dir, family)
    out: dict[str, Any] = {"model_dir": str(model_dir), "family": family}
    parts = _parts(model, tok, family, cfg, seed, examples, task_dir)
    with local_progress(progress, total=len(parts)) as shown:
        for done, (key, run) in enumerate(parts):
            shown.step(done, phase=key.replace("_", " "))
            out[key] = run()
            shown.log(done + 1, _part_metrics(key, out[key]))
    return out


def _parts(
    model: Any,
    tok: Any,
    family: str,
    cfg: EvaluateConfig,
    seed: int,
    examples: tuple[Path, Path] | None,
    task_dir: Path | None,
) -> list[tuple[str, Callable[[], Any]]]:
    """What `evaluate_model` runs for this model, in order: (result key, the work)."""
    intrinsic = cfg.intrinsic
    parts: list[tuple[str, Callable[[], Any]]] = []
    if examples is not None:
        ex, tk = examples
        parts.append(("heldout", lambda: heldout_metrics(model, ex, tk, seed, intrinsic)))
    if family in ENCODERS:
        probes = intrinsic.fill_mask
        parts.append(("fill_mask", lambda: fill_mask_probes(model, tok, probes, intrinsic.top_k)))
    else:
        prompts = intrinsic.prompts
        run = functools.partial(generation_samples, model, tok, prompts, intrinsic.decodings)
        parts.append(("generation", run))
    if task_dir is not None:
        manifest, tables = read_downstream_dir(task_dir)
        if manifest["task_type"] == "regression" and manifest.get("pair"):
            parts.append(("similarity", lambda: _similarity(model, tok, tables, cfg)))
        elif cfg.prompting is not None and family not in ENCODERS:
            parts.append(("prompting", lambda: _prompting(model, tok, task_dir, cfg)))
    return parts


def _part_metrics(key: str, value: Any) -> dict[str, float]:
    """The numbers a part's progress line shows: held-out metrics, a task's scores."""
    numbers = value.get("metrics", value) if isinstance(value, dict) else {}
    return {
        f"{key}_{k}": float(v)
        for k, v in numbers.items()
        if isinstance(v, int | float) and not k.endswith("_examples")
    }


def _similarity(
    model: Any, tok: Any, tables: dict[str, Any], cfg: EvaluateConfig
) -> dict[str, Any]:
    """Cosine of the two sentences' embeddings against the gold scores (STS protocol)."""
    if cfg.split not in tables:
        raise ValueError(f"similarity: no {cfg.split!r} split (has {sorted(tables)})")
    table = tables[cfg.split]
    if cfg.max_examples is not None:
        table = table.slice(0, cfg.max_examples)
    size = cfg.intrinsic.batch_size
    left = sentence_embeddings(model, tok, table.column(schema.TEXT).to_pylist(), size)
    right = sentence_embeddings(model, tok, table.column(schema.TEXT_PAIR).to_pylist(), size)
    gold = table.column(schema.LABEL).to_numpy()
    metrics = embedding_similarity_metrics(left, right, gold)
    return {"examples": table.num_rows, "metrics": metrics}


def _prompting(model: Any, tok: Any, task_dir: Path, cfg: EvaluateConfig) -> dict[str, Any]:
    assert cfg.prompting is not None
    manifest, tables = read_downstream_dir(task_dir)
    if manifest["task_type"] != "classification":
        raise ValueError(f"{task_dir}: prompting needs a classification task")
    if cfg.split not in tables:
        raise ValueError(f"{task_dir}: no {cfg.split!r} split (has {sorted(tables)})")
    table = tables[cfg.split]
    if cfg.max_examples is not None:
        table = table.slice(0, cfg.max_examples)
    labels = [str(x) for x in manifest["labels"]]
    scores = classify_by_prompting(model, tok, table, labels, cfg.prompting, tables.get("train"))
    gold = [labels[i] for i in table.column(schema.LABEL).to_pylist()]
    metrics = compute_metrics("classification", scores.probabilities(), gold, labels=labels)
    return {"k_shot": cfg.prompting.k_shot, "examples": table.num_rows, "metrics": metrics}


def evaluation_report(result: dict[str, Any], out: Path) -> tuple[list[Path], str]:
    """Write `evaluation.md` / `.html` for an `evaluate_model` result; return files and text."""
    sections: list[tuple[str, str]] = []
    if "heldout" in result:
        sections.append(
            ("Held-out", markdown_table(["metric", "value"], sorted(result["heldout"].items())))
        )
    for probe in result.get("fill_mask", []):
        fillers = [(f["token"], f["probability"]) for f in probe["fillers"]]
        sections.append((f"Fill-mask: {probe['text']}", markdown_table(["token", "p"], fillers)))
    if "generation" in result:
        samples = [
            (json.dumps(g["decoding"]), g["prompt"], g["output"]) for g in result["generation"]
        ]
        sections.append(
            ("Generation samples", markdown_table(["decoding", "prompt", "output"], samples))
        )
    if "similarity" in result:
        rows = sorted(result["similarity"]["metrics"].items())
        head = f"Sentence-embedding similarity ({result['similarity']['examples']} pairs)"
        sections.append((head, markdown_table(["metric", "value"], rows)))
    if "prompting" in result:
        p = result["prompting"]
        rows = sorted(p["metrics"].items())
        sections.append(
            (
                f"Prompting ({p['k_shot']}-shot, {p['examples']} examples)",
                markdown_table(["metric", "value"], rows),
            )
        )
    if "finetuned" in result:
        tuned = result["finetuned"]
        rows = [(f"test {k}", v) for k, v in sorted(tuned["test"].items())]
        rows += [
            (k.replace("_", " "), tuned[k]) for k in ("model_name", "model_version") if k in tuned
        ]
        sections.append(("Fine-tuned model", markdown_table(["what", "value"], rows)))
    title = f"Evaluation: {result['family']} at {result['model_dir']}"
    text = "\n\n".join([f"# {title}", *(f"## {h}\n\n{b}" for h, b in sections)]) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluation.md").write_text(text, encoding="utf-8")
    (out / "evaluation.html").write_text(html_page(title, sections, []), encoding="utf-8")
    write_json_atomic(out / "evaluation.json", result)
    return [out / "evaluation.md", out / "evaluation.html", out / "evaluation.json"], text


def _numbers(result: dict[str, Any]) -> dict[str, float]:
    metrics = {f"heldout_{k}": float(v) for k, v in result.get("heldout", {}).items()}
    sim = result.get("similarity", {}).get("metrics", {})
    metrics |= {f"similarity_{k}": float(v) for k, v in sim.items()}
    tuned = result.get("finetuned", {}).get("test", {})
    metrics |= {f"finetuned_test_{k}": float(v) for k, v in tuned.items()}
    if "prompting" in result:
        k = result["prompting"]["k_shot"]
        metrics |= {
            f"prompt{k}shot_{m}": float(v) for m, v in result["prompting"]["metrics"].items()
        }
    return metrics


def plan_evaluation(
    model_dir: Path,
    cfg: EvaluateConfig,
    examples: tuple[Path, Path] | None,
    task_dir: Path | None,
    finetuned: dict[str, Any] | None,
    *,
    run: RunContext,
) -> StageOutput:
    """Fingerprint an evaluation and place its output at `<workspace>/evaluate/<fingerprint>/`.

    The fingerprint is the evaluation's identity: the model's files, its data, the config, the
    run seed, the fine-tuned model and the code of `tasks/` and `training/` (not only `tasks/`,
    as `plan_output` keys data stages), so the evaluations made before are still found.
    """
    from training.finetune.stage import model_fingerprint

    def manifest_fp(path: Path) -> str:
        return str(json.loads((path / "manifest.json").read_text())["fingerprint"])

    config = cfg.model_dump(mode="json")
    inputs = {
        "model": model_fingerprint(model_dir),
        "seed": run.seed,
        # The tokenizer by its bytes, as every stage that reads one keys it.
        "examples": [manifest_fp(examples[0]), content_hash(examples[1])] if examples else None,
        "task": manifest_fp(task_dir) if task_dir else None,
        # A fine-tuning run directory is named by its own identity (data, model, config, seed).
        "finetuned": Path(finetuned["run_dir"]).name if finetuned else None,
    }
    code = source_hash("tasks", "training")
    fp = fingerprint(inputs | {"evaluate": config, "code": code})
    path = run.workspace / STAGE / fp
    return StageOutput(STAGE, path, fp, config, {"source_hash": code}, inputs)


def evaluate_inputs(
    model_dir: Path, examples: tuple[Path, Path] | None, task_dir: Path | None
) -> list[DatasetRef]:
    """What an evaluation reads: the model, and the examples, tokenizer and task when given."""
    from training.finetune.stage import model_fingerprint

    refs = [DatasetRef("model", model_fingerprint(model_dir), str(model_dir), "evaluation")]
    if examples is not None:
        refs += [output_ref("examples", examples[0], "evaluation")]
        refs += [output_ref("tokenizer", examples[1], "evaluation")]
    if task_dir is not None:
        refs.append(output_ref("downstream", task_dir, "evaluation"))
    return refs


def _finetuned_section(finetuned: dict[str, Any]) -> dict[str, Any]:
    """What the report shows of the fine-tuned model: its test metrics and where it is."""
    keys = ("export_dir", "model_name", "model_version", "strategy", "best_epoch")
    return {k: finetuned[k] for k in keys if k in finetuned} | {"test": finetuned["test"]}


def plan_evaluate_task(
    model_dir: str,
    cfg: EvaluateConfig,
    run: RunContext,
    examples: tuple[str, str] | None = None,
    task_dir: str | None = None,
    finetuned: dict[str, Any] | None = None,
) -> StageOutput:
    """The evaluation an `evaluate_task` call reuses, for the task's Prefect cache."""
    examples_paths = (Path(examples[0]), Path(examples[1])) if examples else None
    task_path = Path(task_dir) if task_dir else None
    return plan_evaluation(Path(model_dir), cfg, examples_paths, task_path, finetuned, run=run)


@stage_task(STAGE, plan_evaluate_task, complete_manifest)
def evaluate_task(
    model_dir: str,
    cfg: EvaluateConfig,
    *,
    run: RunContext,
    examples: tuple[str, str] | None = None,
    task_dir: str | None = None,
    finetuned: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Prefect task: evaluate (or reuse), write the report, log it to MLflow, publish it.

    The output is `<workspace>/evaluate/<fingerprint>/` (`plan_evaluation`); an evaluation with
    the same model, data, config, seed, fine-tuned model and code is reused as it is (`reused:
    true`). With `finetuned` (a fine-tuning summary), the report also shows the fine-tuned
    model's test metrics. Cached in Prefect on the fingerprint while the output is complete,
    as the data stages are (`tasks.common.caching`).
    """
    out = plan_evaluate_task(model_dir, cfg, run, examples, task_dir, finetuned)
    done = out.reuse(complete_manifest)
    if done is not None:
        log.info("evaluation %s already done: reused", out.fingerprint)
        summary = relocate_record(done["summary"], run.workspace)  # the workspace may have moved
        return dict(summary) | {"path": str(out.path), "reused": True}
    tmp = out.open_temp_dir()
    examples_paths = (Path(examples[0]), Path(examples[1])) if examples else None
    task_path = Path(task_dir) if task_dir else None
    key = artifact_key(f"{run.name}-evaluate-progress")
    result = evaluate_model(
        Path(model_dir),
        cfg,
        seed=run.seed,
        examples=examples_paths,
        task_dir=task_path,
        progress=ProgressSpec("evaluate", get_run_logger(), key),
    )
    if finetuned:
        result["finetuned"] = _finetuned_section(finetuned)
    files, text = evaluation_report(result, tmp)
    inputs = evaluate_inputs(Path(model_dir), examples_paths, task_path)
    params = evaluation_params(cfg, result, examples_paths, task_path, seed=run.seed)
    result |= _log_evaluation(result, files, out.fingerprint, inputs, params, run=run)
    summary = {"stage": STAGE, "fingerprint": out.fingerprint, **result}
    manifest = {
        "stage": STAGE,
        "fingerprint": out.fingerprint,
        "files": [file_entry(tmp, path) for path in files],
        "metrics": _numbers(result),
        "summary": summary,
    }
    out.commit(manifest, built_in=tmp)
    create_markdown_artifact(text, key="evaluation", description="Model evaluation")
    return summary | {"path": str(out.path), "reused": False}


def evaluation_params(
    cfg: EvaluateConfig,
    result: dict[str, Any],
    examples: tuple[Path, Path] | None,
    task_dir: Path | None,
    *,
    seed: int,
) -> dict[str, Any]:
    """An evaluation run's MLflow params: the resolved `evaluate` section and what it evaluated.

    What it evaluated: the model directory and family, the examples and tokenizer of the
    held-out metrics, the prepared task, and the fine-tuned model the report shows (its export,
    and its registered name and version when it has one); what it did not read is left out.
    """
    tuned = result.get("finetuned", {})
    name = tuned.get("model_name")
    what = {
        "model_dir": result["model_dir"],
        "family": result["family"],
        "examples": str(examples[0]) if examples else None,
        "tokenizer": str(examples[1]) if examples else None,
        "task_dir": str(task_dir) if task_dir else None,
        "finetuned_export": tuned.get("export_dir"),
        "finetuned_model": f"{name}/{tuned.get('model_version')}" if name else None,
    }
    params = {"evaluate": cfg.model_dump(mode="json"), "seed": seed}
    return params | {k: v for k, v in what.items() if v is not None}


def _log_evaluation(
    result: dict[str, Any],
    files: list[Path],
    fp: str,
    inputs: list[DatasetRef],
    params: dict[str, Any],
    *,
    run: RunContext,
) -> dict[str, Any]:
    """Log an evaluation's params, inputs, metrics and report to its MLflow run; its run id."""
    tags = {"stage": STAGE, "lmpipe.stage": STAGE, "lmpipe.fingerprint": fp}
    with tracked_run(run.tracking, run.workspace, f"{run.name}-evaluate", tags) as tracker:
        if tracker.run_id is not None:
            tracker.log_inputs(inputs)
        tracker.log_params(params)
        tracker.log_metrics(_numbers(result))
        for path in files:
            tracker.log_artifact(path, "evaluation")
    return {} if tracker.run_id is None else {"mlflow_run_id": tracker.run_id}
