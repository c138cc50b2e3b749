"""The `pipeline` flow end to end: every stage once, cached reruns, nested MLflow runs, a copy.

Real Prefect (the session API), Ray and MLflow on the workspace's own SQLite store, on the demo
recipe shortened to a few pretraining steps (one worker, in this process) and one fine-tuning
epoch. Last, the finished workspace and its inputs are copied elsewhere and the originals moved
away: the copy reuses every stage and loads its registered models from its own store, each
version through MLflow's pyfunc, answering with its task.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from workspace_bits import workspace_differences

pytestmark = [pytest.mark.slow, pytest.mark.integration]

RECIPE = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
STAGES = ("ingest", "tokenizer", "encode", "examples", "pretrain", "downstream", "finetune")
OUTPUT_DIRS = (*STAGES, "evaluate")
# The Prefect tasks cached on their output's fingerprint: every stage's, training's included.
CACHED_TASKS = (
    *("ingest", "tokenizer", "encode", "examples", "prepare-downstream"),
    *("pretrain", "finetune", "evaluate"),
)
# What a run in a copied workspace may rewrite: the MLflow store (re-rooted, then the runs that
# record the cache hits), the workspace's roots and the stat cache of its (copied) inputs.
BOOKKEEPING = ("mlflow.db", "workspace.json", ".cache/input-hashes.json")
ALIASES = ("newest", "candidate")  # `newest` always moves; `candidate` when no worse


def mtimes(workspace: Path, dirs: tuple[str, ...] = OUTPUT_DIRS) -> dict[str, int]:
    """Every file under the stage output directories, with its modification time (ns)."""
    return {
        str(path.relative_to(workspace)): path.stat().st_mtime_ns
        for name in dirs
        for path in (workspace / name).rglob("*")
        if path.is_file()
    }


def stamps(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` (links not followed), with its modification time and size."""
    return {
        str(path.relative_to(root)): (path.lstat().st_mtime_ns, path.lstat().st_size)
        for path in root.rglob("*")
        if not path.is_dir() or path.is_symlink()
    }


def task_states(flow_run_id: Any) -> dict[str, str]:
    """The state name of each task run of a flow run, by task name, read from the Prefect API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {run.name.rsplit("-", 1)[0]: run.state.name for run in runs if run.state}


def nested_runs(client: MlflowClient, parent: str) -> dict[str, Any]:
    """The runs nested under `parent`, by their `lmpipe.stage` tag."""
    experiment = client.get_run(parent).info.experiment_id
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    return {run.data.tags["lmpipe.stage"]: run for run in runs}


def parent_run(client: MlflowClient, stages: dict[str, Any]) -> str:
    parents = {
        client.get_run(s["mlflow_run_id"]).data.tags["mlflow.parentRunId"]
        for s in stages.values()
        if s.get("mlflow_run_id")
    }
    assert len(parents) == 1, parents
    return parents.pop()


def where(root: Path, demo: Path) -> list[str]:
    """The overrides that put a run's workspace at `root` and read the demo data in `demo`."""
    return [
        f"workspace={root}",
        f"ingest.sources.0.path={demo / 'corpus'}",
        f"task.base_dir={demo}",
    ]


def test_pipeline_runs_every_stage_once_then_caches_and_reruns_only_what_changed(
    tmp_path: Path, ray_session: str, prefect_api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.artifacts import Artifact

    from pipelines.config import load_config
    from pipelines.flows.pipeline_flow import pipeline_flow
    from tasks.demo.synthetic import SyntheticConfig, write_corpus
    from training.tracking.local_store import local_store_uri

    write_corpus(tmp_path / "demo", SyntheticConfig(documents=300, task_examples=20))
    workspace = tmp_path / "ws"
    # No tracking URI: the workspace's own store (`<workspace>/mlflow.db`), which moves with it.
    recipe = [
        f"name=cache{tmp_path.name[-6:].replace('_', '')}",
        "train.max_steps=8",  # the whole pipeline runs; the recipe's length is not the point
        "train.checkpoint.every_steps=4",
        "train.eval.every_steps=4",
        # One worker in this process (the launcher's `auto`): the stages, caching and MLflow
        # nesting are the point, not Ray Train, whose start costs 20-30 s a run here;
        # 2-worker pretraining runs in test_progress_cli.py and test_submit.py.
        "train.scale.num_workers=1",
        "train.scale.max_failures=0",
        "finetune.epochs=1",
    ]
    overrides = [*recipe, *where(workspace, tmp_path / "demo")]
    cfg = load_config(RECIPE, overrides)
    client = MlflowClient(local_store_uri(workspace))

    first = pipeline_flow(cfg)
    assert list(first) == [*STAGES, "evaluate"]
    assert not any(s["reused"] for s in first.values())
    version = client.get_model_version(
        first["pretrain"]["model_name"], first["pretrain"]["model_version"]
    )
    assert version.status == "READY"
    assert first["finetune"]["model_name"]
    built = mtimes(workspace)
    assert len(built) > 30

    # Same recipe, same bits: a second fresh workspace, over its own copy of the inputs, gives
    # the same output directories (fingerprints), shards, tokenizer and weights byte for byte,
    # and the same records by value leaving out timings, run ids and paths (workspace_bits.py).
    write_corpus(tmp_path / "demo2", SyntheticConfig(documents=300, task_examples=20))
    twin = tmp_path / "twin"
    pipeline_flow(load_config(RECIPE, [*recipe, *where(twin, tmp_path / "demo2")]))
    inputs = (tmp_path / "demo", tmp_path / "demo2")
    problems = workspace_differences(workspace, twin, inputs)
    assert not problems, "\n".join(problems)
    shutil.rmtree(twin)
    shutil.rmtree(tmp_path / "demo2")

    # Nothing changed: every stage is a cache hit and no output file is touched; every
    # stage is a Prefect cache hit too, training and evaluation included: `Cached` in the API.
    rerun = pipeline_flow(cfg, return_state=True)
    second = rerun.result()
    assert {name: s["reused"] for name, s in second.items()} == dict.fromkeys(first, True)
    states = task_states(rerun.state_details.flow_run_id)
    cached = {name: states.get(name) for name in CACHED_TASKS}
    assert cached == dict.fromkeys(CACHED_TASKS, "Cached")
    assert mtimes(workspace) == built
    assert second["pretrain"]["model_version"] == first["pretrain"]["model_version"]
    parent = parent_run(client, second)
    runs = nested_runs(client, parent)
    assert set(runs) == set(first)
    assert all(run.data.tags["lmpipe.reused"] == "true" for run in runs.values())
    # Every run has params (#40): the evaluation's, and each cache hit's record (its section).
    for stages in (first, second):
        ids = {name: s["mlflow_run_id"] for name, s in stages.items()}
        assert [n for n, i in ids.items() if not client.get_run(i).data.params] == []
    assert client.get_run(parent).info.status == "FINISHED"
    assert client.get_run(parent).data.metrics["stages_reused"] == len(first)
    # One Markdown artifact per stage, with a pointer to its MLflow run.
    for name in first:
        artifact = Artifact.get(f"{cfg.name}-{name}")
        assert artifact is not None, name
        assert "status" in str(artifact.data)
        assert str(second[name]["mlflow_run_id"]) in str(artifact.data)

    # A new fine-tuning config reruns fine-tuning and evaluation, and nothing upstream.
    third = pipeline_flow(load_config(RECIPE, [*overrides, "finetune.lr=0.0005"]))
    assert {name: s["reused"] for name, s in third.items()} == {
        name: name not in ("finetune", "evaluate") for name in first
    }
    upstream = tuple(name for name in OUTPUT_DIRS if name not in ("finetune", "evaluate"))
    assert mtimes(workspace, upstream) == {
        k: v for k, v in built.items() if k.split("/")[0] in upstream
    }
    assert third["finetune"]["run_dir"] != first["finetune"]["run_dir"]
    assert third["evaluate"]["path"] != first["evaluate"]["path"]
    assert third["evaluate"]["finetuned"]["test"] == third["finetune"]["test"]

    # The finished workspace and its inputs copied elsewhere (`cp -a`), the originals moved
    # away: the copy reuses every stage (each `Cached`), rewrites no output, writes
    # nothing where the originals were, and loads its registered models from its own store.
    moved, gone = tmp_path / "moved", tmp_path / "gone"
    # As `cp -a` copies: links as links, every file and directory with its times.
    shutil.copytree(workspace, moved / "ws", symlinks=True)
    shutil.copytree(tmp_path / "demo", moved / "demo", symlinks=True)
    gone.mkdir()
    os.rename(workspace, gone / "ws")
    os.rename(tmp_path / "demo", gone / "demo")
    originals, copied = stamps(gone), stamps(moved / "ws")
    lr = "finetune.lr=0.0005"
    rerun = pipeline_flow(
        load_config(RECIPE, [*recipe, *where(moved / "ws", moved / "demo"), lr]),
        return_state=True,
    )
    fourth = rerun.result()
    assert {name: s["reused"] for name, s in fourth.items()} == dict.fromkeys(first, True)
    states = task_states(rerun.state_details.flow_run_id)
    cached = {name: states.get(name) for name in CACHED_TASKS}
    assert cached == dict.fromkeys(CACHED_TASKS, "Cached")
    now = stamps(moved / "ws")
    assert {k: now.get(k) for k in copied if k not in BOOKKEEPING} == {
        k: v for k, v in copied.items() if k not in BOOKKEEPING
    }
    assert stamps(gone) == originals
    assert not workspace.exists()
    assert not (tmp_path / "demo").exists()
    paths = [s[k] for s in fourth.values() for k in ("path", "run_dir", "export_dir") if k in s]
    assert len(paths) > len(fourth)
    assert all(p.startswith(str(moved / "ws") + os.sep) for p in paths), paths
    for stage in ("pretrain", "finetune"):
        assert fourth[stage]["model_version"] == third[stage]["model_version"]
    import mlflow
    from mlflow.tracking._tracking_service import utils

    monkeypatch.setattr(utils, "_tracking_uri", local_store_uri(moved / "ws"))
    for stage in ("pretrain", "finetune"):
        uri = f"models:/{fourth[stage]['model_name']}/{fourth[stage]['model_version']}"
        model = mlflow.transformers.load_model(uri, return_type="components")["model"]
        assert model.config.model_type == "bert", stage
    served_answers_and_aliases(MlflowClient(local_store_uri(moved / "ws")), first, third, fourth)


def served_answers_and_aliases(
    client: MlflowClient, first: dict[str, Any], third: dict[str, Any], fourth: dict[str, Any]
) -> None:
    """Every registered version serves through MLflow's pyfunc and answers with its task.

    The pretrained model fills a mask with a token of its vocabulary; each fine-tuned version
    (the first fine-tune and the one at another learning rate) answers a label of the task.
    `newest` is the last fine-tune; `candidate` the better of the two on the same test data.
    """
    import mlflow
    from transformers import AutoTokenizer

    vocab = AutoTokenizer.from_pretrained(fourth["pretrain"]["export_dir"]).get_vocab()
    labels = set(fourth["finetune"]["labels"])
    name = {stage: fourth[stage]["model_name"] for stage in ("pretrain", "finetune")}
    versions = {
        stage: sorted(str(v.version) for v in client.search_model_versions(f"name = '{model}'"))
        for stage, model in name.items()
    }
    assert versions == {"pretrain": ["1"], "finetune": ["1", "2"]}
    for stage, numbers in versions.items():
        for number in numbers:
            served = mlflow.pyfunc.load_model(f"models:/{name[stage]}/{number}")
            if stage == "pretrain":
                assert served.predict(["[MASK] lives in Oslo."])[0] in vocab
            else:
                assert set(served.predict(["Where does Tavor live?"])["label"]) <= labels
            assert client.get_model_version(name[stage], number).description
    metric = "f1_macro"  # the classification task's primary metric
    better = third["finetune"]["test"][metric] >= first["finetune"]["test"][metric]
    held = {a: str(client.get_model_version_by_alias(name["finetune"], a).version) for a in ALIASES}
    assert held == {"newest": "2", "candidate": "2" if better else "1"}
    decision = client.get_model_version(name["finetune"], "2").tags["candidate_decision"]
    assert decision == ("moved" if better else "kept")


def test_pipeline_flow_parameters_are_a_typed_form_that_validates() -> None:
    from prefect.exceptions import ParameterTypeError

    from pipelines.flows.pipeline_flow import pipeline_flow

    schema = pipeline_flow.parameters.model_dump()
    config = schema["definitions"]["RunConfig"]["properties"]
    assert config["seed"]["description"].startswith("Run seed")
    assert config["seed"]["default"] == 0
    assert "IngestConfig" in schema["definitions"]
    retries = schema["definitions"]["PrefectConfig"]["properties"]["retries"]
    assert retries["minimum"] == 0
    assert "cfg" not in schema.get("required", [])  # the form starts from the defaults
    with pytest.raises(ParameterTypeError, match="seed"):
        pipeline_flow.validate_parameters({"cfg": {"seed": -1}})
