"""`lmpipe gc`: keep what a registered model or a recent run needs, with its inputs."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from pipelines.cli.main import main
from pipelines.ops.gc import Reference, plan_gc, scan_workspace
from tasks.common.workspace import WORKSPACE_FILE, open_workspace

DAY_S = 86400
FP = {  # stage outputs of the fake workspace, named by 16-hex fingerprints
    "ingest": "1111111111111111",
    "ingest_old": "1111111111112222",
    "decon": "dddddddddddddddd",
    "tokenizer": "2222222222222222",
    "encode": "3333333333333333",
    "encode_old": "3333333333334444",
    "examples": "4444444444444444",
    "examples_old": "4444444444445555",
}
RUN, OLD_RUN, FT_RUN = "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)


def _stage(ws: Path, stage: str, fp: str, **extra: object) -> Path:
    out = ws / stage / fp
    _write(out / "manifest.json", {"stage": stage, "fingerprint": fp, **extra})
    _write(out / "part-0.arrow", "x" * 100)
    return out


def _upstream(ws: Path, stage: str, fp: str) -> dict[str, str]:
    return {"fingerprint": fp, "path": str(ws / stage / fp)}


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A workspace laid out as the stages write it, with hand-written manifests, a month old."""
    ws = (tmp_path / "ws").resolve()
    files = [{"uri": "/corpus/a.jsonl", "xxh3_128": "ff"}]
    _stage(ws, "ingest", FP["ingest"], inputs=files)
    _stage(ws, "ingest", FP["ingest_old"], inputs=files)
    _stage(ws, "decontaminate", FP["decon"], inputs=files, decontaminated_from=FP["ingest_old"])
    tok = {"ingest": FP["ingest"], "split": "train"}
    _stage(
        ws, "tokenizer", FP["tokenizer"], inputs=tok, ingest=_upstream(ws, "ingest", FP["ingest"])
    )
    for name, corpus in (("encode", "ingest"), ("encode_old", "decon")):
        _stage(
            ws,
            "encode",
            FP[name],
            inputs={"ingest": FP[corpus], "tokenizer": FP["tokenizer"]},
            tokenizer=_upstream(ws, "tokenizer", FP["tokenizer"]),
        )
    for name, encode in (("examples", "encode"), ("examples_old", "encode_old")):
        _stage(
            ws,
            "examples",
            FP[name],
            inputs={"encode": FP[encode], "tokenizer": FP["tokenizer"]},
            encode=_upstream(ws, "encode", FP[encode]),
        )
    for run, examples in ((RUN, "examples"), (OLD_RUN, "examples_old")):
        meta = {"examples_dir": str(ws / "examples" / FP[examples]), "step": 10}
        meta["tokenizer_dir"] = str(ws / "tokenizer" / FP["tokenizer"])
        _write(ws / "pretrain" / run / "checkpoint_step-000000010" / "meta.json", meta)
        _write(ws / "pretrain" / f"{run}.export" / "model.safetensors", "w" * 1000)
        _write(ws / "pretrain" / f"{run}.run.json", {"registered": True})
    card = f"| field | value |\n|---|---|\n| base model | {ws / 'pretrain' / f'{RUN}.export'} |\n"
    _write(ws / "finetune" / FT_RUN / "export" / "README.md", card)
    _write(ws / "finetune" / f"{FT_RUN}.run.json", {})
    _stage(ws, "downstream", "demo_residence")
    _write(ws / "evaluate" / "demo" / "evaluation.json", {"model_dir": str(ws / "pretrain" / RUN)})
    _write(ws / "ingest" / ".9999999999999999.tmp-12-ab", "partial")
    _write(ws / "examples" / FP["examples"] / ".part-1.arrow.tmp-12-cd", "partial")
    _age(ws, days=30)
    return ws


def _age(root: Path, days: float) -> None:
    then = time.time() - days * DAY_S
    for path in [root, *root.rglob("*")]:
        os.utime(path, (then, then), follow_symlinks=False)


def _decisions(ws: Path, refs: list[Reference], **kwargs: float) -> dict[str, tuple[bool, str]]:
    plan = plan_gc(ws, refs, **kwargs)
    return {f"{d.output.kind}/{d.output.name}": (d.keep, d.why) for d in plan.decisions}


def _kept(decisions: dict[str, tuple[bool, str]]) -> set[str]:
    return {name for name, (keep, _) in decisions.items() if keep}


def test_scan_groups_a_pretraining_run_with_its_export_and_record(workspace: Path) -> None:
    runs = {o.name: o for o in scan_workspace(workspace) if o.kind == "pretrain"}
    assert [p.name for p in runs[RUN].paths] == [RUN, f"{RUN}.export", f"{RUN}.run.json"]
    assert runs[RUN].bytes > 1000
    assert str(workspace / "examples" / FP["examples"]) in runs[RUN].needs


def test_plan_keeps_a_registered_models_run_and_its_upstream_closure(workspace: Path) -> None:
    decisions = _decisions(workspace, [Reference(RUN, "model demo-bert v1")])
    assert _kept(decisions) == {
        f"pretrain/{RUN}",
        f"examples/{FP['examples']}",
        f"encode/{FP['encode']}",
        f"tokenizer/{FP['tokenizer']}",
        f"ingest/{FP['ingest']}",
    }
    assert decisions[f"pretrain/{RUN}"][1] == "model demo-bert v1"
    assert decisions[f"encode/{FP['encode']}"][1] == f"input of examples/{FP['examples']}"
    assert decisions["temp/.9999999999999999.tmp-12-ab"] == (
        False,
        "temp leftover of an interrupted write",
    )
    assert not decisions[f"pretrain/{OLD_RUN}"][0]
    assert not decisions["evaluate/demo"][0]


def test_plan_follows_a_decontaminated_corpus_to_its_ingest(workspace: Path) -> None:
    kept = _kept(_decisions(workspace, [Reference(OLD_RUN, "recent run")]))
    assert {f"decontaminate/{FP['decon']}", f"ingest/{FP['ingest_old']}"} <= kept
    assert f"ingest/{FP['ingest']}" in kept  # the tokenizer trained on it
    assert f"examples/{FP['examples']}" not in kept


def test_a_path_under_an_output_or_a_finetune_base_names_it(workspace: Path) -> None:
    checkpoint = workspace / "pretrain" / RUN / "checkpoint_step-000000010"
    assert f"pretrain/{RUN}" in _kept(_decisions(workspace, [Reference(str(checkpoint), "x")]))
    kept = _kept(_decisions(workspace, [Reference(FT_RUN, "model demo-demo_residence v1")]))
    assert {f"finetune/{FT_RUN}", f"pretrain/{RUN}", f"ingest/{FP['ingest']}"} <= kept


def test_a_copied_workspace_follows_the_paths_its_records_name_where_it_was(
    workspace: Path, tmp_path: Path
) -> None:
    open_workspace(workspace)
    moved = tmp_path / "moved"
    shutil.copytree(workspace, moved, symlinks=True)  # times kept: the outputs stay a month old
    shutil.rmtree(workspace)
    open_workspace(moved)
    old_checkpoint = workspace / "pretrain" / OLD_RUN / "checkpoint_step-000000010"
    refs = [Reference(FT_RUN, "model demo-demo_residence v1"), Reference(str(old_checkpoint), "x")]
    kept = _kept(_decisions(moved, refs))
    # The fine-tune's card names its base, the runs' meta.json their examples, by old paths.
    assert {
        f"finetune/{FT_RUN}",
        f"pretrain/{RUN}",
        f"pretrain/{OLD_RUN}",
        f"examples/{FP['examples']}",
        f"examples/{FP['examples_old']}",
        f"ingest/{FP['ingest']}",
    } <= kept


def test_recently_modified_outputs_and_temps_are_kept(workspace: Path) -> None:
    _age(workspace / "ingest", days=1)
    decisions = _decisions(workspace, [], keep_recent_s=7 * DAY_S)
    assert decisions[f"ingest/{FP['ingest_old']}"][0]
    assert decisions["temp/.9999999999999999.tmp-12-ab"][0]
    assert not decisions[f"encode/{FP['encode']}"][0]


@pytest.mark.slow
def test_gc_cli_dry_run_removes_nothing_and_delete_removes_only_unneeded(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("lmpipe", artifact_location=(tmp_path / "art").as_uri())
    now_ms = int(time.time() * 1000)
    pretrain = client.create_run(exp, run_name="demo-pretrain", tags={"train_run": RUN})
    client.set_terminated(pretrain.info.run_id, "FINISHED")
    client.create_registered_model("demo-bert")
    client.create_model_version(
        "demo-bert",
        source=(tmp_path / "art" / "model").as_uri(),
        run_id=pretrain.info.run_id,
        tags={"examples_fingerprint": FP["examples"], "train_run": RUN},
    )
    for name, tags, age_days in (
        ("demo-evaluate", {"stage": "evaluate"}, 1),
        ("demo-encode", {"lmpipe.stage": "encode", "lmpipe.fingerprint": FP["encode_old"]}, 30),
    ):
        run = client.create_run(exp, start_time=now_ms - age_days * DAY_S * 1000, run_name=name)
        for key, value in tags.items():
            client.set_tag(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id, "FINISHED")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {"name": "demo", "workspace": str(workspace), "tracking": {"tracking_uri": uri}}
        )
    )
    before = sorted(str(p) for p in workspace.rglob("*"))

    assert main(["gc", str(recipe)]) == 0
    # Every command opens the workspace (records where it is in `workspace.json`); the dry run
    # changes nothing else.
    assert sorted(str(p) for p in workspace.rglob("*") if p.name != WORKSPACE_FILE) == before
    out = capsys.readouterr().out
    assert "dry run: nothing removed" in out
    # old run, examples, encode, decontaminated and raw corpus; fine-tune, task data, 2 temps
    assert "9 to remove" in out

    assert main(["gc", str(recipe), "--delete", "--keep-days", "7"]) == 0
    left = {p.relative_to(workspace).as_posix() for p in workspace.glob("*/*")}
    assert left == {
        f"pretrain/{RUN}",
        f"pretrain/{RUN}.export",
        f"pretrain/{RUN}.run.json",
        f"examples/{FP['examples']}",
        f"encode/{FP['encode']}",
        f"tokenizer/{FP['tokenizer']}",
        f"ingest/{FP['ingest']}",
        "evaluate/demo",  # its run `demo-evaluate` is a day old
    }
    assert not list(workspace.glob("examples/*/.*.tmp-*"))
