"""The workspace's own MLflow store after a copy: re-rooted, so the copy writes and loads its own.

A real SQLite store and a tiny BERT registered through `register_export`, as the pipeline
registers its models; no training.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from training.tracking.local_store import (
    ROOT_TABLE,
    STORE_FILE,
    local_store_uri,
    open_local_store,
    reroot_store,
)
from training.tracking.runs import TrackingConfig, experiment_id, tracked_run

pytestmark = pytest.mark.slow  # MLflow

SENTENCES = [f"the {a} saw the {b} near the {c}." for a in "abcd" for b in "efgh" for c in "ijk"]


def tiny_bert_export(out: Path) -> Path:
    """A seeded two-layer BERT with its tokenizer and card, exported as the pipeline does."""
    import torch
    import transformers as tf

    from tasks.tokenizer.tokenizer import TokenizerConfig, to_transformers, train_tokenizer
    from training.models.export import DataRef, ModelCard, TokenizerRef, export_model

    tok_cfg = TokenizerConfig(family="wordpiece", vocab_size=120, min_frequency=1)
    tok = to_transformers(train_tokenizer(SENTENCES, tok_cfg), tok_cfg)
    tok.save_pretrained(out / "tok")
    torch.manual_seed(0)
    width = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2}
    config = tf.BertConfig(
        vocab_size=128, intermediate_size=64, max_position_embeddings=64, **width
    )
    config.pad_token_id = tok.pad_token_id
    model = tf.BertForPreTraining(config).eval()
    card = ModelCard(
        family="bert",
        size="tiny",
        parameters=model.num_parameters(),
        objective="mlm+nsp",
        steps=1,
        tokens_seen=64,
        data=DataRef(path="examples", fingerprint="ex"),
        tokenizer=TokenizerRef(fingerprint="tok", family="wordpiece", vocab_size=len(tok)),
        metrics={},
        deepspeed={"zero_stage": 0},
        git_commit="unknown",
    )
    return export_model(model, out / "tok", out / "export", card)


def tracking(workspace: Path) -> TrackingConfig:
    return TrackingConfig(tracking_uri=local_store_uri(workspace), experiment="moves")


def locations(db: Path) -> list[str]:
    """The artifact locations of the store's experiment, runs, logged models and versions.

    MLflow's Default experiment (id 0, unused) is left out: it names `mlruns/` of the working
    directory the store was created from, no place of the workspace's.
    """
    con = sqlite3.connect(db)
    try:
        rows = [
            *con.execute("SELECT artifact_location FROM experiments WHERE experiment_id != 0"),
            *con.execute("SELECT artifact_uri FROM runs"),
            *con.execute("SELECT artifact_location FROM logged_models"),
            *con.execute("SELECT storage_location FROM model_versions"),
        ]
    finally:
        con.close()
    return [str(value) for (value,) in rows if value]


def test_a_copied_store_writes_new_runs_and_loads_its_models_under_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow
    from mlflow.tracking._tracking_service import utils

    from training.tracking.registry import Registration, register_export

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    uri_a = open_local_store(a)  # no store yet: nothing to re-root
    with tracked_run(tracking(a), a, "build", {}) as tracker:
        assert tracker.run_id is not None
        hf_dir = tiny_bert_export(tmp_path / "model")
        ref = register_export(hf_dir, "bert", uri_a, tracker.run_id, Registration("moved", "c"))
    assert open_local_store(a) == uri_a  # the store records where it is
    assert len(locations(a / STORE_FILE)) == 4
    assert all(location.startswith(a.as_uri()) for location in locations(a / STORE_FILE))

    shutil.copytree(a, b, symlinks=True)
    a.rename(tmp_path / "a-gone")  # whatever still points at `a` now fails
    uri_b = open_local_store(b)
    assert uri_b == f"sqlite:///{b / STORE_FILE}"
    assert all(location.startswith(b.as_uri()) for location in locations(b / STORE_FILE))
    stamp = (b / STORE_FILE).stat().st_mtime_ns
    assert open_local_store(b) == uri_b
    assert (b / STORE_FILE).stat().st_mtime_ns == stamp  # opened where it is: nothing written

    note = tmp_path / "note.txt"
    note.write_text("written in the copy\n")
    with tracked_run(tracking(b), b, "after", {}) as tracker:
        assert tracker.run_id is not None
        tracker.log_artifact(note, "notes")
        new_run = tracker.run_id
    assert experiment_id(tracking(b), uri_b, b) == experiment_id(tracking(a), uri_b, b)
    assert list(b.glob(f"mlartifacts/{new_run}/artifacts/notes/note.txt"))
    assert not a.exists()

    monkeypatch.setattr(utils, "_tracking_uri", uri_b)  # load_model reads the global URI
    components = mlflow.transformers.load_model(ref.model_uri, return_type="components")
    assert components["model"].config.model_type == "bert"


def test_a_store_from_before_the_root_record_is_re_rooted_from_its_experiments(
    tmp_path: Path,
) -> None:
    from mlflow.tracking import MlflowClient

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    client = MlflowClient(local_store_uri(a))
    exp = experiment_id(tracking(a), local_store_uri(a), a)
    run = client.create_run(exp).info.run_id
    shutil.copytree(a, b)
    assert reroot_store(b / STORE_FILE, b) == str(a)  # inferred: no root recorded at `a`
    assert MlflowClient(local_store_uri(b)).get_run(run).info.artifact_uri == (
        f"{(b / 'mlartifacts').as_uri()}/{run}/artifacts"
    )
    con = sqlite3.connect(b / STORE_FILE)
    assert con.execute(f"SELECT root FROM {ROOT_TABLE}").fetchall() == [(str(b),)]
    con.close()
    assert reroot_store(b / STORE_FILE, b) is None
    assert reroot_store(tmp_path / "empty.db", b) is None  # not an MLflow store: left alone
