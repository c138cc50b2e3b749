"""Training under SIGKILL: random worker kills, kills at each phase of a checkpoint save, and
more faults than `max_failures` allows.

Real Ray Train (2 workers on the session's Ray), real DeepSpeed (ZeRO-2, fp32, CPU). Every
faulty run is compared with one uninterrupted run of the same config: the committed history of
consumed sample ids (a replayed step's later line wins) and the final weights must be equal.
Kills come from `training/runtime/faults.py` (the worker SIGKILLs itself at an exact point) or from
this test (an external SIGKILL of the rank's PID once the run has reached a step).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import training_runs as runs
from figures import record, record_row, trials
from training_runs import tiny_bert_config

from training.models.export import gather_state_dict
from training.pretrain.config import TrainConfig
from training.pretrain.driver import TrainingRun
from training.runtime import checkpoint as ckpt
from training.runtime.faults import SAVE_POINTS, FaultPlan, FaultPoint, chain

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.reliability]

MAX_STEPS, EVERY = 12, 3
SAVE_STEPS = list(range(2 * EVERY, MAX_STEPS, EVERY))  # a previous checkpoint exists before each
# A purge deletes the checkpoints beyond keep_last=2: the first one happens at the third save.
PURGE_STEPS = [s for s in SAVE_STEPS if s >= 3 * EVERY]


def chaos_config(storage: Path, max_failures: int = 3) -> TrainConfig:
    return tiny_bert_config(
        storage,
        max_steps=MAX_STEPS,
        every=EVERY,
        keep_last=2,
        max_failures=max_failures,
        optim={"lr": 3e-3, "warmup_steps": 2},
        log_sample_ids=True,
    )


def train(
    data: dict[str, Path], storage: Path, fault: FaultPlan | None = None, **kw: Any
) -> TrainingRun:
    return runs.train(chaos_config(storage, **kw), data, fault=fault)


def history(run_dir: Path) -> dict[str, Any]:
    """The committed history of the sample logs and what the faults cost."""
    lines: list[dict[str, Any]] = []
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        lines += [json.loads(x) | {"rank": rank} for x in path.read_text().splitlines()]
    committed: dict[tuple[int, int], list[int]] = {}
    for line in lines:  # in file order: a replayed step's later line replaces the earlier one
        committed[(line["step"], line["rank"])] = line["ids"]
    steps: dict[int, list[int]] = {}
    for (step, _), ids in sorted(committed.items()):
        steps.setdefault(step, []).extend(ids)
    rank0 = [x for x in lines if x["rank"] == 0]
    return {
        "steps": steps,
        "recomputed": len(rank0) - len({x["step"] for x in rank0}),
        "times": sorted(x["time"] for x in lines),
    }


def resumes(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "resumes.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(scope="module")
def clean(demo_data: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted run: its committed history and final weights."""
    data = demo_data.examples("bert")
    run = train(data, tmp_path_factory.mktemp("chaos-clean"))
    return {
        "data": data,
        "history": history(run.run_dir),
        "weights": gather_state_dict(run.checkpoint, ckpt.TAG),
    }


def check_against_clean(
    run: TrainingRun, clean: dict[str, Any], killed_at: float
) -> dict[str, Any]:
    """Assert no sample lost or repeated and equal final weights; return the trial's figures."""
    assert run.finished
    assert run.meta["step"] == MAX_STEPS
    got, want = history(run.run_dir), clean["history"]
    consumed = [i for ids in got["steps"].values() for i in ids]
    expected = [i for ids in want["steps"].values() for i in ids]
    lost = len(set(expected) - set(consumed))
    repeated = len(consumed) - len(set(consumed)) - (len(expected) - len(set(expected)))
    assert sorted(got["steps"]) == list(range(1, MAX_STEPS + 1))
    assert got["steps"] == want["steps"], "the committed sample history differs from the clean run"
    weights = gather_state_dict(run.checkpoint, ckpt.TAG)
    assert weights.keys() == clean["weights"].keys()
    differing = [k for k in weights if not torch.equal(weights[k], clean["weights"][k])]
    assert not differing, f"final weights differ from the clean run's: {differing[:5]}"
    dirs = ckpt.checkpoint_dirs(run.run_dir)
    leftovers = [p.name for _, p in dirs if not (p / ckpt.META).exists()]
    assert not leftovers, f"incomplete checkpoint directories left: {leftovers}"
    return {
        "samples_lost": lost,
        "samples_repeated": repeated,
        "steps_recomputed": got["recomputed"],
        "recover_s": recover_s(got["times"], killed_at),
        "weights_equal": True,
    }


def recover_s(times: list[float], killed_at: float) -> float | None:
    """Seconds from a kill to the next sample logged by any rank (None: none after it)."""
    after = [t for t in times if t > killed_at]
    return round(after[0] - killed_at, 1) if after else None


class ExternalKiller(threading.Thread):
    """SIGKILL rank `rank`'s process (its PID file) once rank 0 has logged `step` steps."""

    def __init__(self, run_dir: Path, step: int, rank: int) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.step, self.rank = run_dir, step, rank
        self.killed_at: float | None = None

    def run(self) -> None:
        samples = self.run_dir / "samples" / "rank-00000.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if samples.is_file() and len(samples.read_text().splitlines()) >= self.step:
                pid = int((self.run_dir / "pids" / f"rank-{self.rank:05d}.pid").read_text())
                self.killed_at = time.time()
                os.kill(pid, signal.SIGKILL)  # the worker this run started, by its PID
                return
            time.sleep(0.02)


def chaos_trial(n: int) -> tuple[str, int, int]:
    """Trial `n`'s fault, from a seeded RNG: (point, step, rank); every other one in a save."""
    rng = random.Random(1000 + n)
    rank = rng.randrange(2)
    if n % 2 == 1:
        point = rng.choice(SAVE_POINTS)
        return point, rng.choice(PURGE_STEPS if point == "during_purge" else SAVE_STEPS), rank
    point = "external" if n % 4 == 0 else "step"
    return point, rng.randrange(2, MAX_STEPS), rank


# `make test` runs trial 0 (an external SIGKILL of a worker at a random step); the kills
# inside a save are the next test's, and `make test-reliability` runs all 20 trials.
@pytest.mark.parametrize("n", range(trials(quick=1, full=20)))
def test_random_worker_kill_loses_and_repeats_no_sample(
    n: int, clean: dict[str, Any], tmp_path: Path
) -> None:
    point, step, rank = chaos_trial(n)
    if point in ("before_meta", "before_latest", "after_latest", "during_purge"):
        rank = 0  # only rank 0 reaches these points
    storage = tmp_path / "run"
    marker = tmp_path / "fired"
    started = time.time()
    if point == "external":
        from training.pretrain.driver import run_id_for

        cfg = chaos_config(storage)
        data = clean["data"]
        run_dir = storage / run_id_for(cfg, 0, data["examples"], data["tokenizer"])
        killer = ExternalKiller(run_dir, step, rank)
        killer.start()
        run = train(clean["data"], storage)
        killer.join()
        assert killer.killed_at is not None, "the worker was never killed"
        killed_at = killer.killed_at
    else:
        plan = FaultPlan(point=point, step=step, rank=rank, marker=marker)
        run = train(clean["data"], storage, plan)
        assert marker.is_file(), "the fault never fired"
        killed_at = marker.stat().st_mtime
    # A kill before the first checkpoint restarts from step 0, with nothing to resume from.
    resumed = resumes(run.run_dir)
    assert len(resumed) <= 1
    if point != "external" and step > EVERY:
        assert resumed, "the run was not restarted from its checkpoint"
    figures = check_against_clean(run, clean, killed_at)
    figures |= {"trial": n, "point": point, "step": step, "rank": rank}
    figures["resumed_from"] = resumed[0]["step"] if resumed else 0
    figures["wall_s"] = round(time.time() - started, 1)
    record_row("training_chaos", "trials", figures, ("trial",))


def _save_faults() -> list[tuple[FaultPoint, ...]]:
    """The kills of each run: one run per save point (`make test-reliability`), or one run.

    `make test`'s one run is killed before the commit (meta.json) of the step-6 save and again
    during the purge at step 9, and resumes after each: a Ray Train start fewer than a run per
    point, with the same checks on each resume.
    """
    if trials(0, 1):
        return [(point,) for point in SAVE_POINTS]
    return [("before_meta", "during_purge")]


@pytest.mark.parametrize("points", _save_faults(), ids="+".join)
def test_kill_during_save_resumes_from_the_newest_complete_checkpoint(
    points: tuple[FaultPoint, ...], clean: dict[str, Any], tmp_path: Path
) -> None:
    # The last save steps, one each, in order: a lone point at the last save.
    steps = SAVE_STEPS[len(SAVE_STEPS) - len(points) :]
    plan: FaultPlan | None = None
    for i in reversed(range(len(points))):
        point, step = points[i], steps[i]
        assert point != "during_purge" or step in PURGE_STEPS, "no purge at that step"
        rank = 1 if point == "after_shard" else 0
        marker = tmp_path / f"fired-{i}"
        plan = FaultPlan(point=point, step=step, rank=rank, marker=marker, then=plan)
    assert plan is not None
    run = train(clean["data"], tmp_path / "run", plan)
    kills = chain(plan)
    for fault in kills:
        assert fault.marker.is_file(), f"the fault {fault.point} never fired"
    # meta.json is the commit: before it the save at `step` is partial, after it complete.
    committed = ("before_latest", "after_latest", "during_purge")
    expected = [f.step if f.point in committed else f.step - EVERY for f in kills]
    resumed = resumes(run.run_dir)
    assert [r["checkpoint"] for r in resumed] == [ckpt.checkpoint_name(s) for s in expected]
    assert [r["step"] for r in resumed] == expected
    figures = check_against_clean(run, clean, kills[0].marker.stat().st_mtime)
    times = history(run.run_dir)["times"]
    for fault, resumed_from in zip(kills, expected, strict=True):
        killed_at = fault.marker.stat().st_mtime
        figures |= {"recover_s": recover_s(times, killed_at), "point": fault.point}
        figures |= {"step": fault.step, "rank": fault.rank, "resumed_from": resumed_from}
        record_row("kill_during_save", "points", dict(figures), ("point",))


def test_more_faults_than_max_failures_end_the_run_with_the_error(
    clean: dict[str, Any], tmp_path: Path
) -> None:
    plan = FaultPlan(point="step", step=4, rank=1, marker=tmp_path / "fired")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="training failed") as failure:
        train(clean["data"], tmp_path / "run", plan, max_failures=0)
    elapsed = time.monotonic() - started
    message = str(failure.value)
    assert "after 0 restart(s)" in message
    assert "The actor died" in message, message  # Ray's account of the dead worker is shown
    assert elapsed < 240, f"the failing run took {elapsed:.0f} s to give up"
    record("over_budget", {"max_failures": 0, "faults": 1, "raised_after_s": round(elapsed, 1)})
