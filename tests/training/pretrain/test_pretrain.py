"""Pretraining acceptance on the demo corpus: learning, ZeRO-3 export, registry, resume, kills.

Real DeepSpeed on CPU, real MLflow (SQLite), the session's Ray and MLflow store
(tests/conftest.py). The tiny models that learn (and the teachers, exports and evaluations the
later tests take from them) and the distilled student train one worker in this process
(`train.scale.launcher` auto), without a Ray Train start each; learning is not what two ranks
change. ZeRO-3 needs 2 ranks: its run is on 2 Ray Train workers, exported, and the reference
of the stop-and-resume test, whose stopped and resumed runs (the latter from a new process)
are on 2 Ray Train workers too. The bf16 resume runs the loop in this process (local_runs.py),
as its GPU twin in test_gpu.py does.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from local_runs import MAX_STEPS, STOP_AT, bf16_resume_config, whole_and_resumed

from tasks.common.io import read_ipc_stream
from tasks.common.ray_runtime import RayConfig
from training.models.export import gather_state_dict, read_card
from training.pretrain.config import TrainConfig
from training.pretrain.driver import RunControl
from training.pretrain.stage import pretrain_stage
from training.pretrain.telemetry import _PEAK_CACHE, measure_peak_flops
from training.runtime.run_context import RunContext
from training.scoring.plots import step_history
from training.tracking.registry import download_model, resolve_version
from training.tracking.runs import TrackingConfig

pytestmark = [pytest.mark.slow, pytest.mark.integration]

_FAMILY = {"bert": "bert", "causal": "gpt2", "span_corruption": "t5"}
_RUNS: dict[str, dict[str, Any]] = {}


# One worker trains in this process (`train.scale.launcher` auto, docs/pretraining.md): no Ray
# Train start. Two workers run on the session's Ray, for what needs two ranks or Ray Train.
ONE_WORKER = {"num_workers": 1, "threads_per_worker": 2, "max_failures": 0}
TWO_WORKERS = {"num_workers": 2, "max_failures": 2}


def train_config(
    family: str, storage: Path, scale: dict[str, Any] = TWO_WORKERS, **extra: Any
) -> TrainConfig:
    base: dict[str, Any] = {
        "model": {"family": family, "size": "tiny"},
        "max_steps": 40,
        "global_batch_size": 32,
        "micro_batch_size": 16,
        "zero_stage": 2,
        "precision": "fp32",  # the resume test compares losses exactly
        "optim": {"lr": 3e-3, "warmup_steps": 4},
        "checkpoint": {"every_steps": 20, "storage_path": str(storage)},
        "eval": {"every_steps": 20, "max_samples": 96},
        "scale": dict(scale),
    }
    for key, value in extra.items():
        node = base
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return TrainConfig.model_validate(base)


def tracking(mlflow_uri: str) -> TrackingConfig:
    return TrackingConfig(tracking_uri=mlflow_uri, experiment="pretrain-acceptance")


def unigram_entropy(examples_dir: Path) -> float:
    """Entropy (nats) of the token distribution of the train split's real tokens."""
    counts: Counter[int] = Counter()
    manifest = json.loads((examples_dir / "manifest.json").read_text())
    for shard in manifest["splits"]["train"]["shards"]:
        table = read_ipc_stream(examples_dir / shard["name"], ["input_ids"])
        ids = table["input_ids"].combine_chunks().flatten().to_numpy()
        counts.update(ids.tolist())
    for special in manifest["specials"].values():
        if isinstance(special, int):
            counts.pop(special, None)
    total = sum(counts.values())
    return -sum(c / total * math.log(c / total) for c in counts.values())


def trained(objective: str, demo_data: Any, tmp_root: Path, mlflow_uri: str) -> dict[str, Any]:
    """Pretrain the objective's tiny model once per session; return paths and the summary."""
    if objective not in _RUNS:
        data = demo_data.examples(objective)
        storage = tmp_root / f"runs-{objective}"
        cfg = train_config(_FAMILY[objective], storage, ONE_WORKER)
        summary = demo_data.pretrain(cfg, data, tmp_root / "ws", mlflow_uri, f"acc-{objective}")
        _RUNS[objective] = {"summary": summary, "cfg": cfg, **data}
    return _RUNS[objective]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pretrain")


@pytest.mark.parametrize("objective", ["bert", "causal", "span_corruption"])
def test_tiny_model_learns_more_than_word_frequencies(
    objective: str, demo_data: Any, tmp_root: Path, mlflow_uri: str
) -> None:
    run = trained(objective, demo_data, tmp_root, mlflow_uri)
    summary = run["summary"]
    evals = step_history(Path(summary["run_dir"]) / "evals.jsonl")
    first, last = evals[0], evals[max(evals)]
    token_loss = {"bert": "eval_mlm_loss", "causal": "eval_lm_loss"}.get(
        objective, "eval_span_loss"
    )
    assert last["eval_loss"] <= 0.8 * first["eval_loss"], (first, last)
    assert last[token_loss] < unigram_entropy(run["examples"]), last
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_uri)
    mlflow_run = client.get_run(summary["mlflow_run_id"])
    assert mlflow_run.info.status == "FINISHED"
    assert "train_loss" in mlflow_run.data.metrics
    assert "eval_loss" in mlflow_run.data.metrics
    assert any(a.path == "plots" for a in client.list_artifacts(summary["mlflow_run_id"]))
    version = resolve_version(mlflow_uri, summary["model_name"], "newest")
    assert version.version == summary["model_version"]
    card = read_card(Path(summary["export_dir"]))
    assert card.steps == 40
    assert card.family == _FAMILY[objective]


# The resume test's runs: ZeRO-3 on 2 Ray workers, whose weights, gradients and optimizer state
# are all partitioned across the ranks; checkpoints at 4 and 8.
RESUMED = {"zero_stage": 3, "max_steps": 8, "checkpoint.every_steps": 4, "eval.every_steps": 8}


@pytest.fixture(scope="module")
def zero3_whole(demo_data: Any, tmp_root: Path, mlflow_uri: str) -> dict[str, Any]:
    """The uninterrupted ZeRO-3 run, exported and registered (in MLflow).

    The ZeRO-3 export test checks its export; the resume test compares a stopped and resumed
    run of the same config with it.
    """
    data = demo_data.examples("bert")
    cfg = train_config("bert", tmp_root / "whole", **RESUMED)
    ray_cfg = RayConfig(num_workers=2, num_cpus=4)
    ctx = RunContext(tmp_root / "ws", 0, ray_cfg, tracking(mlflow_uri), "acc-zero3")
    return pretrain_stage(cfg, data["examples"], data["tokenizer"], run=ctx)


def test_zero3_run_exports_and_passes_the_reload_check(zero3_whole: dict[str, Any]) -> None:
    export = Path(zero3_whole["export_dir"])
    assert (export / "model.safetensors").is_file()
    assert (export / "README.md").is_file()
    assert not list(export.glob("*.bin"))
    assert not list(export.glob("*.pt"))
    assert read_card(export).deepspeed["zero_stage"] == 3


def _in_memory_model(run: dict[str, Any]) -> torch.nn.Module:
    """The model before export: the final checkpoint's gathered weights in a fresh model."""
    from training.models.export import AUTO_CLASSES

    summary = run["summary"]
    model = AUTO_CLASSES[run["cfg"].model.family].from_pretrained(summary["export_dir"])
    state = gather_state_dict(Path(summary["checkpoint"]), "ds")
    # Training pads the vocabulary rows (model.pad_vocab_to_multiple_of); the export has the
    # tokenizer's rows only, as the first rows of the trained ones.
    embedding = model.get_input_embeddings().weight
    name = next(n for n, p in model.named_parameters() if p is embedding)
    real = embedding.shape[0]
    model.resize_token_embeddings(state[name].shape[0])
    model.load_state_dict(state, strict=False)
    model.resize_token_embeddings(real)
    return model.eval()


def _registered(run: dict[str, Any], mlflow_uri: str, dst: Path) -> Path:
    summary = run["summary"]
    ref = resolve_version(mlflow_uri, summary["model_name"], "newest")
    return download_model(mlflow_uri, ref, dst)


def test_exported_bert_fills_masks_from_the_registry(
    demo_data: Any, tmp_root: Path, mlflow_uri: str, tmp_path: Path
) -> None:
    from transformers import pipeline

    run = trained("bert", demo_data, tmp_root, mlflow_uri)
    local = _registered(run, mlflow_uri, tmp_path / "bert")
    fill = pipeline("fill-mask", model=str(local), tokenizer=str(local))
    answers = fill(f"alice lives in the city of {fill.tokenizer.mask_token} .")
    assert len(answers) == 5
    assert all(a["token_str"] for a in answers)
    reloaded = fill.model
    ids = fill.tokenizer("bruno works as a [MASK] .", return_tensors="pt")
    with torch.no_grad():
        before = _in_memory_model(run)(**ids).prediction_logits.argmax(-1)
        after = reloaded(**ids).logits.argmax(-1)
    assert torch.equal(before, after)


@pytest.mark.parametrize("objective", ["causal", "span_corruption"])
def test_exported_generators_answer_generate_from_the_registry(
    objective: str, demo_data: Any, tmp_root: Path, mlflow_uri: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

    run = trained(objective, demo_data, tmp_root, mlflow_uri)
    local = _registered(run, mlflow_uri, tmp_path / objective)
    auto = AutoModelForCausalLM if objective == "causal" else AutoModelForSeq2SeqLM
    model = auto.from_pretrained(local, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(local, local_files_only=True)
    prompt = tok("Alice lives in", return_tensors="pt")
    greedy = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    before = _in_memory_model(run).generate(**prompt, max_new_tokens=8, do_sample=False)
    assert torch.equal(greedy, before)
    for sampling in ({"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}):
        torch.manual_seed(0)
        out = model.generate(**prompt, max_new_tokens=8, do_sample=True, **sampling)
        assert out.shape[0] == 1
        assert out.shape[1] > (0 if objective != "causal" else 3)
        assert isinstance(tok.decode(out[0], skip_special_tokens=True), str)


def test_run_stopped_at_step_k_resumes_in_a_new_process_with_identical_losses(
    zero3_whole: dict[str, Any],
    demo_data: Any,
    tmp_root: Path,
    ray_session: str,
    prefect_api: str,
    tmp_path: Path,
) -> None:
    data = demo_data.examples("bert")
    ray_cfg = RayConfig(num_workers=2, num_cpus=4)
    args = (data["examples"], data["tokenizer"])
    off = TrackingConfig(enabled=False)
    ctx = RunContext(tmp_root / "ws", seed=0, ray=ray_cfg, tracking=off, name="s")
    whole = zero3_whole  # the same config, uninterrupted
    cfg = train_config("bert", tmp_root / "stopped", **RESUMED)
    stopped = pretrain_stage(cfg, *args, run=ctx, control=RunControl(stop_at_step=4))
    assert stopped["step"] == 4
    assert not stopped["finished"]
    script = (
        "import sys; from pathlib import Path; from training.pretrain.config import TrainConfig; "
        "from training.pretrain.stage import pretrain_stage; from tasks.common.ray_runtime import "
        "RayConfig; "
        "from training.tracking.runs import TrackingConfig; "
        "from training.pretrain.driver import RunControl; "
        "from training.runtime.run_context import RunContext; "
        "cfg = TrainConfig.model_validate_json(sys.argv[1]); "
        "ctx = RunContext(Path(sys.argv[4]), 0, RayConfig(address=sys.argv[5]), "
        "TrackingConfig(enabled=False), 's'); "
        "s = pretrain_stage(cfg, Path(sys.argv[2]), Path(sys.argv[3]), run=ctx, "
        "control=RunControl(resume=True)); "
        "print(s['step'])"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            cfg.model_dump_json(),
            str(data["examples"]),
            str(data["tokenizer"]),
            str(tmp_root / "ws"),
            ray_session,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = step_history(Path(stopped["run_dir"]) / "steps.jsonl")
    reference = step_history(Path(whole["run_dir"]) / "steps.jsonl")
    assert [resumed[s]["loss"] for s in range(5, 9)] == [reference[s]["loss"] for s in range(5, 9)]
    a = gather_state_dict(Path(whole["checkpoint"]), "ds")
    b = gather_state_dict(Path(stopped["run_dir"]) / "checkpoint_step-000000008", "ds")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_bf16_run_stopped_at_step_k_resumes_with_identical_losses_and_weights(
    zero_stage: int,
    demo_data: Any,
    single_process_dist: None,
    one_thread: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fp32 test above covers Ray Train and the new process; this one the bf16 state a
    # checkpoint must carry, through the same loop in this process (local_runs.py): at ZeRO 0
    # torch autocast over fp32 weights, at ZeRO 2 DeepSpeed's bf16 weights with fp32 masters.
    # MFU's CPU peak is the faster of bf16 and fp32; emulated bf16 is far below fp32, so its
    # 1024^3 measurement (12-25 s here) is skipped: the peak stays fp32's.
    monkeypatch.setitem(_PEAK_CACHE, torch.bfloat16, measure_peak_flops(torch.float32))
    cfg = bf16_resume_config(use_gpu=False, zero_stage=zero_stage)
    whole, resumed = whole_and_resumed(cfg, demo_data.examples("bert"), tmp_path)
    after = range(STOP_AT + 1, MAX_STEPS + 1)
    assert [resumed.losses()[s] for s in after] == [whole.losses()[s] for s in after]
    a, b = whole.weights(), resumed.weights()
    assert a.keys() == b.keys()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


@pytest.mark.parametrize("objective", ["bert", "causal", "span_corruption"])
def test_evaluate_reproduces_the_last_held_out_evaluation_and_probes_the_export(
    objective: str, demo_data: Any, tmp_root: Path, mlflow_uri: str
) -> None:
    from training.evaluate.intrinsic import IntrinsicConfig
    from training.evaluate.stage import EvaluateConfig, evaluate_model
    from training.pretrain.data import ExampleShards

    run = trained(objective, demo_data, tmp_root, mlflow_uri)
    summary = run["summary"]
    evals = step_history(Path(summary["run_dir"]) / "evals.jsonl")
    last = evals[max(evals)]
    # The loop evaluated the first min(split, eval.max_samples) samples, cut to whole ranks.
    count = min(len(ExampleShards(run["examples"], "validation", verify=False)), 96)
    count -= count % run["cfg"].scale.num_workers
    intrinsic = IntrinsicConfig(heldout_max_samples=count, prompts=["Alice"])
    cfg = EvaluateConfig(intrinsic=intrinsic)
    result = evaluate_model(
        Path(summary["export_dir"]), cfg, seed=0, examples=(run["examples"], run["tokenizer"])
    )
    # Same samples, same fixed masking, same loss as the training-time evaluation.
    assert result["heldout"]["loss"] == pytest.approx(last["eval_loss"], rel=1e-4)
    assert result["heldout"]["perplexity"] == pytest.approx(last["eval_perplexity"], rel=1e-3)
    if objective == "bert":
        assert result["heldout"]["mlm_accuracy"] == pytest.approx(last["eval_mlm_accuracy"])
        fillers = result["fill_mask"][0]["fillers"]
        assert len(fillers) == 5
        assert fillers[0]["probability"] >= fillers[-1]["probability"]
    else:
        samples = result["generation"]
        assert len(samples) == 4  # one prompt under four decoding settings
        assert all(isinstance(s["output"], str) for s in samples)


def test_distilled_student_has_half_the_teachers_layers_and_learns(
    demo_data: Any, tmp_root: Path, mlflow_uri: str, tmp_path: Path
) -> None:
    teacher = trained("bert", demo_data, tmp_root, mlflow_uri)
    teacher_dir = Path(teacher["summary"]["export_dir"])
    # The student reads single-segment MLM rows cut with the teacher's own tokenizer.
    data = demo_data.examples("roberta", tokenizer={"family": "wordpiece"})
    assert data["tokenizer"] == teacher["tokenizer"]
    cfg = train_config(
        "distilbert",
        tmp_path / "runs",
        ONE_WORKER,
        max_steps=24,
        **{
            "checkpoint.every_steps": 24,
            "eval.every_steps": 12,
            "distillation": {"teacher": {"path": str(teacher_dir)}},
        },
    )
    summary = demo_data.pretrain(cfg, data, tmp_path / "ws", mlflow_uri, "acc-distil")
    evals = step_history(Path(summary["run_dir"]) / "evals.jsonl")
    first, last = evals[min(evals)], evals[max(evals)]
    for key in ("eval_loss", "eval_mlm_loss"):
        assert last[key] < first[key], (key, first, last)
    # Initialised from every other teacher layer, the student starts close to the teacher's
    # soft targets and stays there while its MLM loss falls.
    assert last["eval_kd_loss"] < 0.2, last
    student = json.loads((Path(summary["export_dir"]) / "config.json").read_text())
    teacher_config = json.loads((teacher_dir / "config.json").read_text())
    assert student["model_type"] == "distilbert"
    assert student["n_layers"] * 2 == teacher_config["num_hidden_layers"]
    assert student["dim"] == teacher_config["hidden_size"]
    assert read_card(Path(summary["export_dir"])).family == "distilbert"
