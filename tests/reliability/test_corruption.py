"""Damaged files are detected by their manifest hashes and refused; nothing loads silently.

Each case flips a byte in, truncates, or deletes one file: of a committed training checkpoint
(real DeepSpeed ZeRO-2 files from a real run) and of each stage's data shards (ingest, encode,
examples). A damaged checkpoint is never loaded: resume takes the previous complete one, with a
warning, and the damaged one is moved aside; export refuses it. A damaged data shard stops the
stage that reads it, with a message naming the file.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import training_runs as runs
from figures import FULL, record, record_row
from training_runs import tiny_bert_config

from tasks.common.ray_runtime import RayConfig
from tasks.common.stage import StageInputError, read_upstream, shards_of
from tasks.encode.encode import EncodeConfig
from tasks.encode.stage import run_encode
from tasks.examples.config import ExamplesConfig
from tasks.examples.stage import run_examples
from tasks.tokenizer.stage import run_tokenizer
from tasks.tokenizer.tokenizer import TokenizerConfig
from training.pretrain.data import DataError, ExampleShards
from training.pretrain.driver import TrainingRun
from training.pretrain.stage import export_checkpoint
from training.runtime import checkpoint as ckpt

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.reliability]


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def delete(path: Path) -> None:
    path.unlink()


DAMAGE: dict[str, Callable[[Path], None]] = {"flip": flip, "truncate": truncate, "delete": delete}


def note(target: str, damage: str, file: str, outcome: str) -> None:
    row = {"target": target, "damage": damage, "file": file, "outcome": outcome}
    path = record_row("corruption", "cases", row, ("target", "damage", "file"))
    cases = json.loads(path.read_text())["cases"]
    record("corruption", {"silent_loads": sum(c["outcome"] == "loaded" for c in cases)})


# -- checkpoints ---------------------------------------------------------------------------

MAX_STEPS, EVERY = 9, 3


def train(data: dict[str, Path], storage: Path, workers: int, **kw: Any) -> TrainingRun:
    """The tiny run on `workers` workers: 1 trains in this process, more on Ray Train."""
    scale = {"num_workers": workers, "max_failures": 0}
    cfg = tiny_bert_config(
        storage, max_steps=MAX_STEPS, every=EVERY, keep_last=3, max_failures=0, scale=scale
    )
    return runs.train(cfg, data, **kw)


@pytest.fixture(scope="module")
def stopped(demo_data: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A run stopped at step 6: committed checkpoints at steps 3 and 6.

    One worker, in this process: the damaged files are DeepSpeed's own either way, and Ray
    Train's start (most of a 2-worker run of 6 tiny steps) buys these checks nothing.
    """
    data = demo_data.examples("bert")
    storage = tmp_path_factory.mktemp("corrupt-ckpt") / "run"
    run = train(data, storage, workers=1, stop_at_step=2 * EVERY)
    assert [s for s, _ in ckpt.checkpoint_dirs(run.run_dir)] == [2 * EVERY, EVERY]
    return {"data": data, "storage": storage, "run": run}


def checkpoint_files(path: Path) -> dict[str, Path]:
    """One file of each kind a checkpoint holds: model states, an optimizer shard, RNG, meta."""
    ds = path / ckpt.TAG
    return {
        "model_states": ds / "mp_rank_00_model_states.pt",
        "optim_shard": sorted(ds.glob("*optim_states.pt"))[-1],
        "rng": path / ckpt.rng_file(0),  # the one worker's
        "meta": path / ckpt.META,
    }


CKPT_CASES = [(d, f) for d in DAMAGE for f in ("model_states", "optim_shard", "rng", "meta")]
QUICK_CKPT = [("flip", "optim_shard"), ("truncate", "model_states"), ("delete", "rng")]


@pytest.mark.parametrize(("damage", "file"), CKPT_CASES if FULL else QUICK_CKPT)
def test_a_damaged_checkpoint_is_never_loaded_and_the_previous_one_is_used(
    damage: str, file: str, stopped: dict[str, Any], tmp_path: Path, caplog: Any
) -> None:
    run_dir = tmp_path / stopped["run"].run_dir.name
    shutil.copytree(stopped["run"].run_dir, run_dir)
    newest = run_dir / ckpt.checkpoint_name(2 * EVERY)
    DAMAGE[damage](checkpoint_files(newest)[file])
    config_hash = json.loads(
        (newest.with_name(ckpt.checkpoint_name(EVERY)) / ckpt.META).read_text()
    )["config_hash"]

    with caplog.at_level(logging.WARNING, logger="training.runtime.checkpoint"):
        found = ckpt.find_resumable(run_dir, newest, config_hash)
    assert found is not None
    assert found.path.name == ckpt.checkpoint_name(EVERY), "resume must take the previous one"
    assert any(newest.name in r.getMessage() for r in caplog.records), "no warning was logged"

    with pytest.raises(ckpt.CheckpointError, match=newest.name):
        export_checkpoint(newest, tmp_path / "export")
    assert not (tmp_path / "export").exists()

    ckpt.remove_incomplete(run_dir, found.path)
    assert [s for s, _ in ckpt.checkpoint_dirs(run_dir)] == [EVERY]
    if file != "meta":  # with meta.json gone it is a partial save, deleted, not quarantined
        assert (run_dir / "corrupt" / newest.name).is_dir(), "the damaged one must be kept aside"
    note("checkpoint", damage, file, "refused")


# -- data shards ---------------------------------------------------------------------------


def damaged_copy(src: Path, tmp_path: Path, damage: str) -> tuple[Path, Path]:
    """Copy a stage output under `tmp_path`, damage its first train shard; return (copy, shard)."""
    out = tmp_path / src.parent.name / src.name
    shutil.copytree(src, out)
    entry = shards_of(read_upstream(out, src.parent.name), "train")[0][1]
    shard = out / entry["name"]
    DAMAGE[damage](shard)
    return out, shard


DATA_CASES = [(s, d) for s in ("ingest", "encode", "examples") for d in DAMAGE]
QUICK_DATA = [
    ("ingest", "flip"),
    ("encode", "truncate"),
    ("examples", "delete"),
    ("examples", "flip"),
]


@pytest.mark.parametrize(("stage", "damage"), DATA_CASES if FULL else QUICK_DATA)
def test_a_damaged_data_shard_is_refused_by_the_stage_that_reads_it(
    stage: str, damage: str, demo_data: Any, tmp_path: Path
) -> None:
    built = demo_data.examples("bert")
    ray_cfg = RayConfig(num_workers=2, num_cpus=4)
    ws = tmp_path / "ws"  # a fresh workspace: nothing downstream can be reused
    if stage == "ingest":
        out, shard = damaged_copy(demo_data.ingest, tmp_path, damage)
        tok_cfg = TokenizerConfig(family="wordpiece", vocab_size=1024, model_max_length=512)
        with pytest.raises(StageInputError, match=str(shard)):
            run_tokenizer(tok_cfg, out, ws)
        with pytest.raises(StageInputError, match=str(shard)):
            run_encode(EncodeConfig(), ray_cfg, out, built["tokenizer"], ws)
    elif stage == "encode":
        out, shard = damaged_copy(built["encode"], tmp_path, damage)
        cfg = ExamplesConfig.model_validate({"objective": "bert", "max_seq_length": 64})
        with pytest.raises(StageInputError, match=str(shard)):
            run_examples(cfg, 0, ray_cfg, out, built["tokenizer"], ws)
    else:
        out, shard = damaged_copy(built["examples"], tmp_path, damage)
        with pytest.raises(DataError, match=str(shard)):
            ExampleShards(out, "train")
    assert not any(ws.rglob("*.arrow")), "a stage wrote output from a damaged input"
    note(f"{stage} shard", damage, shard.name, "refused")


# -- last: it damages the module's stopped run -----------------------------------------------


@pytest.mark.skipif(not FULL, reason="make test-reliability only (a further training run)")
def test_resume_over_a_damaged_newest_checkpoint_finishes_from_the_previous_one(
    stopped: dict[str, Any],
) -> None:
    """End to end: DeepSpeed on 2 Ray workers resumes a run (stopped on one in-process worker)
    whose newest checkpoint has a flipped byte.

    It damages the module's stopped run itself (Ray's run state records absolute paths, so a
    copy would resume from the original), so it comes last in the module.
    """
    storage = stopped["storage"]
    run_dir = stopped["run"].run_dir
    newest = run_dir / ckpt.checkpoint_name(2 * EVERY)
    flip(checkpoint_files(newest)["optim_shard"])
    resumed = train(stopped["data"], storage, workers=2, resume=True)
    assert resumed.finished
    assert resumed.meta["step"] == MAX_STEPS
    rows = [json.loads(x) for x in (run_dir / "resumes.jsonl").read_text().splitlines()]
    assert [(r["checkpoint"], r["step"]) for r in rows] == [(ckpt.checkpoint_name(EVERY), EVERY)]
    assert (run_dir / "corrupt" / newest.name).is_dir()
    ckpt.validate(resumed.checkpoint)  # the rewritten step-6 and the final one are complete
    note("checkpoint (resume on Ray)", "flip", "optim_shard", "refused")
