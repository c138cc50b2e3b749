"""A training run as a stage output: key, record, manifest, reuse; and the layout before it.

The scaffold's steps are checked on a hand-made run directory; a tiny pretraining run (one
worker in this process) then shows the layout the stages write, and, rearranged into the layout
runs had before (`<run>/`, `<run>.export/`, `<run>.run.json`), that such a run is still listed
by `lmpipe gc`, exportable, and usable as a fine-tuning base.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from pipelines.ops.gc import plan_gc, scan_workspace
from tasks.common.io import write_json_atomic
from tasks.common.ray_runtime import RayConfig
from tasks.common.stage import plan_output
from training.pretrain.config import TrainConfig
from training.pretrain.driver import run_id_for
from training.runtime.driver import RECORD_FILE, RunDirectory, RunIdentity, upstream_ref
from training.runtime.run_context import RunContext
from training.tracking.runs import TrackingConfig

REPO = Path(__file__).resolve().parents[3]


def _identity(tmp_path: Path, seed: int = 0) -> RunIdentity:
    upstream = {"examples": upstream_ref("e" * 16, tmp_path / "examples" / ("e" * 16))}
    return RunIdentity("pretrain", {"examples": "e" * 16}, {"lr": 1e-3}, seed, upstream)


def test_a_run_key_covers_the_training_code_and_not_where_the_run_lies(tmp_path: Path) -> None:
    identity = _identity(tmp_path)
    run_dir = identity.place(tmp_path / "a", tmp_path)
    assert run_dir.path == (tmp_path / "a" / identity.key).resolve()
    assert identity.place(tmp_path / "b", tmp_path).key == identity.key
    data_stage = plan_output("pretrain", identity.inputs, identity.config, path=tmp_path, seed=0)
    assert data_stage.fingerprint != identity.key  # a data stage's key covers tasks/ only
    assert run_dir.out.code["source_hash"] != data_stage.code["source_hash"]
    assert _identity(tmp_path, seed=1).key != identity.key


def test_a_run_opens_with_its_record_and_is_reused_once_committed_whole(tmp_path: Path) -> None:
    run_dir = _identity(tmp_path).place(tmp_path / "pretrain", tmp_path)
    run_dir.open(keep=False, mlflow_run_id="m1")
    record = json.loads((run_dir.path / RECORD_FILE).read_text())
    assert record["mlflow_run_id"] == "m1"
    assert record["examples"]["path"] == str((tmp_path / "examples" / ("e" * 16)).resolve())
    assert run_dir.record()["mlflow_run_id"] == "m1"
    assert run_dir.reuse() is None  # opened, not finished
    (run_dir.path / "checkpoint_step-000000002").mkdir()
    run_dir.open(keep=True, mlflow_run_id="m1")  # a resume keeps what the run left
    assert (run_dir.path / "checkpoint_step-000000002").is_dir()
    (run_dir.export_dir / "sub").mkdir(parents=True)
    (run_dir.export_dir / "model.safetensors").write_bytes(b"w" * 64)
    (run_dir.export_dir / "sub" / "config.json").write_text("{}")
    run_dir.commit({"export_dir": str(run_dir.export_dir), "step": 2})
    manifest = json.loads((run_dir.path / "manifest.json").read_text())
    names = [entry["name"] for entry in manifest["files"]]
    assert names == ["export/model.safetensors", "export/sub/config.json"]
    assert manifest["examples"] == record["examples"]  # what `lmpipe gc` follows
    assert run_dir.reuse() == {"export_dir": str(run_dir.export_dir), "step": 2}
    assert run_dir.reuse(registered=True) is None  # published while tracking was off
    (run_dir.export_dir / "model.safetensors").write_bytes(b"w" * 10)
    assert run_dir.reuse() is None  # a truncated export is not a finished run
    run_dir.open(keep=False, mlflow_run_id=None)  # a restart starts clean
    assert sorted(p.name for p in run_dir.path.iterdir()) == [RECORD_FILE]


def _fake_upstream(tmp_path: Path) -> tuple[Path, Path]:
    examples, tokenizer = tmp_path / "examples" / "x", tmp_path / "tokenizer" / "y"
    write_json_atomic(examples / "manifest.json", {"stage": "examples", "fingerprint": "x" * 16})
    (tokenizer / "vocab.txt").parent.mkdir(parents=True)
    (tokenizer / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    files = [{"name": "vocab.txt", "bytes": 12, "sha256": ""}]
    write_json_atomic(tokenizer / "manifest.json", {"stage": "tokenizer", "files": files})
    return examples, tokenizer


def test_the_pretraining_key_leaves_out_what_does_not_change_the_result(tmp_path: Path) -> None:
    examples, tokenizer = _fake_upstream(tmp_path)
    cfg = TrainConfig()
    key = run_id_for(cfg, 0, examples, tokenizer)
    same = cfg.model_copy(
        update={
            "scale": cfg.scale.model_copy(update={"num_workers": 4}),
            "checkpoint": cfg.checkpoint.model_copy(update={"every_steps": 7}),
            "eval": cfg.eval.model_copy(update={"every_steps": 3}),
            "prefetch": "off",
            "log_every_steps": 1,
        }
    )
    assert run_id_for(same, 0, examples, tokenizer) == key
    assert run_id_for(cfg.model_copy(update={"max_steps": 7}), 0, examples, tokenizer) != key
    assert run_id_for(cfg, 1, examples, tokenizer) != key
    (tokenizer / "vocab.txt").write_text("[PAD]\n[XXX]\n")  # another vocabulary, another run
    assert run_id_for(cfg, 0, examples, tokenizer) != key


def test_a_run_is_a_prefect_cache_key_once_published_as_the_call_asks(tmp_path: Path) -> None:
    from training.pretrain.stage import plan_pretrain_task

    examples, tokenizer = _fake_upstream(tmp_path)
    cfg, ws = TrainConfig(), tmp_path / "ws"
    off = RunContext(ws, 0, RayConfig(), TrackingConfig(enabled=False), "t")
    on = RunContext(ws, 0, RayConfig(), TrackingConfig(tracking_uri="sqlite:///t.db"), "t")
    out = plan_pretrain_task(cfg, str(examples), str(tokenizer), off)
    assert out is not None
    assert out.path.parent == (ws / "pretrain").resolve()
    run_dir = RunDirectory(out, {}, ws)
    run_dir.open(keep=False, mlflow_run_id=None)
    run_dir.commit({"step": 1})  # published with tracking off
    assert plan_pretrain_task(cfg, str(examples), str(tokenizer), off) == out
    assert plan_pretrain_task(cfg, str(examples), str(tokenizer), on) is None  # to register
    run_dir.commit({"step": 1, "model_version": "1"})
    assert plan_pretrain_task(cfg, str(examples), str(tokenizer), on) == out


def test_gc_lists_a_run_of_the_stage_layout_with_the_inputs_its_record_names(
    tmp_path: Path,
) -> None:
    ws = (tmp_path / "ws").resolve()
    examples = ws / "examples" / ("e" * 16)
    write_json_atomic(examples / "manifest.json", {"stage": "examples", "fingerprint": "e" * 16})
    identity = RunIdentity("pretrain", {}, {}, 0, {"examples": upstream_ref("e" * 16, examples)})
    run_dir = identity.place(ws / "pretrain", ws)
    run_dir.open(keep=False, mlflow_run_id=None)  # unfinished: only its record names inputs
    [run] = [o for o in scan_workspace(ws) if o.kind == "pretrain"]
    assert run.paths == (run_dir.path,)
    assert str(examples) in run.needs
    month_ago = time.time() - 30 * 86400
    for path in (examples, examples / "manifest.json"):
        os.utime(path, (month_ago, month_ago))
    decisions = {d.output.kind: d for d in plan_gc(ws, []).decisions}
    assert decisions["pretrain"].keep  # written just now: it may be running
    assert decisions["examples"].keep  # a month old, but the recent run trains on it
    assert decisions["examples"].why == f"input of pretrain/{run_dir.key}"


# What follows trains: a tiny causal model, 10 steps, one worker in this process.


@pytest.fixture(scope="module")
def pretrained(demo_data: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from training.pretrain.stage import pretrain_stage

    data = demo_data.examples("causal")
    ws = tmp_path_factory.mktemp("layout") / "ws"
    cfg = TrainConfig.model_validate(
        {
            "model": {"family": "gpt2", "size": "tiny"},
            "max_steps": 10,
            "global_batch_size": 16,
            "micro_batch_size": 16,
            "zero_stage": 0,
            "precision": "fp32",
            "checkpoint": {"every_steps": 10},
            "eval": {"every_steps": 10, "max_samples": 32},
            "scale": {"num_workers": 1, "max_failures": 0, "threads_per_worker": 2},
        }
    )
    run = RunContext(
        ws, seed=0, ray=RayConfig(), tracking=TrackingConfig(enabled=False), name="layout"
    )
    summary = pretrain_stage(cfg, data["examples"], data["tokenizer"], run=run)
    again = pretrain_stage(cfg, data["examples"], data["tokenizer"], run=run)
    return {"summary": summary, "again": again, "ws": ws, "run": run, **data}


def _legacy(run_dir: Path, into: Path) -> Path:
    """`run_dir` (the stage layout) rearranged into the layout runs had before, under `into`."""
    legacy = into / "pretrain" / "0123456789abcdef"
    new_only = {"export", RECORD_FILE, "manifest.json"}

    def top_level(directory: str, names: list[str]) -> set[str]:
        return new_only & set(names) if Path(directory) == run_dir else set()

    shutil.copytree(run_dir, legacy, ignore=top_level)
    shutil.copytree(run_dir / "export", legacy.with_name(f"{legacy.name}.export"))
    summary = json.loads((run_dir / "manifest.json").read_text())["summary"]
    record = {"mlflow_run_id": None, "registered": False, "summary": summary}
    write_json_atomic(legacy.with_name(f"{legacy.name}.run.json"), record)
    return legacy


@pytest.mark.slow
@pytest.mark.integration
def test_a_pretraining_run_is_one_directory_reused_when_finished(pretrained: Any) -> None:
    summary, ws = pretrained["summary"], pretrained["ws"]
    run_dir = Path(summary["run_dir"])
    assert run_dir.parent == (ws / "pretrain").resolve()
    assert Path(summary["export_dir"]) == run_dir / "export"
    assert Path(summary["checkpoint"]).parent == run_dir
    assert {RECORD_FILE, "manifest.json", "export", "steps.jsonl"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert pretrained["again"]["reused"] is True
    assert pretrained["again"]["export_dir"] == summary["export_dir"]
    [run] = [o for o in scan_workspace(ws) if o.kind == "pretrain"]
    assert run.paths == (run_dir,)
    assert str(pretrained["examples"].resolve()) in run.needs
    assert str(pretrained["tokenizer"].resolve()) in run.needs


@pytest.mark.slow
@pytest.mark.integration
def test_a_run_of_the_older_layout_is_listed_exportable_and_a_finetuning_base(
    pretrained: Any, shared_data: Path, tmp_path: Path
) -> None:
    from tasks.downstream.config import load_dataset_config
    from tasks.downstream.stage import prepare_downstream
    from training.finetune.config import FinetuneConfig
    from training.finetune.stage import run_finetune
    from training.pretrain.stage import export_checkpoint

    ws = (tmp_path / "old").resolve()
    legacy = _legacy(Path(pretrained["summary"]["run_dir"]), ws)
    [run] = [o for o in scan_workspace(ws) if o.kind == "pretrain"]
    assert [p.name for p in run.paths] == [
        legacy.name,
        f"{legacy.name}.export",
        f"{legacy.name}.run.json",
    ]
    assert str(pretrained["examples"].resolve()) in run.needs

    [checkpoint] = sorted(legacy.glob("checkpoint_step-*"))
    out, card = export_checkpoint(checkpoint, tmp_path / "exported")
    assert card.steps == 10
    old_export = legacy.with_name(f"{legacy.name}.export")
    assert (
        load_file(out / "model.safetensors").keys()
        == load_file(old_export / "model.safetensors").keys()
    )

    task = load_dataset_config(REPO / "configs" / "tasks" / "instructions.yaml")
    caps = {"train": 16, "validation": 8, "test": 8}
    task = task.model_copy(
        update={"max_examples": {k: v for k, v in caps.items() if k in task.split_names()}}
    )
    data = tmp_path / "task"
    prepare_downstream(task, shared_data, data)
    cfg = FinetuneConfig.model_validate(
        {
            "epochs": 1,
            "batch_size": 8,
            "micro_batch_size": 8,
            "features": {"max_length": 64, "stride": 16},
        }
        | {"generation": {"max_new_tokens": 4}}
    )
    done = run_finetune(cfg, data, old_export, ws / "finetune", run=pretrained["run"])
    assert done.result["epochs_run"] == 1
    assert (done.export_dir / "config.json").is_file()
    assert json.loads((done.run_dir / RECORD_FILE).read_text())["base_model"]["path"] == str(
        old_export
    )
