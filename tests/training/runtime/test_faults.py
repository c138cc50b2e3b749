"""A chain of planned faults: each fires once, at its own point, step and rank."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from training.runtime.faults import FaultPlan, chain, fault_hooks
from training.runtime.hooks import Hooks

REPO = Path(__file__).resolve().parents[3]

# A fresh process reaches the points of a run in order (its hooks, as the loop calls them) and
# says which it got past.
REACH = """
import sys
from training.runtime.faults import FaultPlan, fault_hooks

hooks = fault_hooks(FaultPlan.model_validate_json(sys.argv[1]), rank=0)
for point, step in [("step", 3), ("before_meta", 6), ("during_purge", 9)]:
    hooks.run(point, step)
    print(point, step, flush=True)
"""


def reach(plan: FaultPlan) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-c", REACH, plan.model_dump_json()]
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # three fresh interpreters
def test_each_fault_of_a_chain_kills_once_then_the_next_one(tmp_path: Path) -> None:
    second = FaultPlan(point="during_purge", step=9, marker=tmp_path / "b")
    plan = FaultPlan(point="before_meta", step=6, marker=tmp_path / "a", then=second)
    assert chain(plan) == [plan, second]
    attempts = [reach(plan) for _ in range(3)]
    assert [a.returncode for a in attempts] == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert attempts[0].stdout.split("\n")[:-1] == ["step 3"]
    assert attempts[1].stdout.split("\n")[:-1] == ["step 3", "before_meta 6"]
    assert (tmp_path / "a").read_text().startswith("before_meta step=6 rank=0")
    assert (tmp_path / "b").read_text().startswith("during_purge step=9 rank=0")


def test_the_faults_of_a_chain_need_their_own_markers(tmp_path: Path) -> None:
    second = FaultPlan(point="during_purge", step=9, marker=tmp_path / "a")
    with pytest.raises(ValidationError, match="its own marker"):
        FaultPlan(point="before_meta", step=6, marker=tmp_path / "a", then=second)


def test_a_plan_hooks_only_the_rank_it_names_and_hooks_run_in_order(tmp_path: Path) -> None:
    plan = FaultPlan(point="after_shard", step=4, rank=1, marker=tmp_path / "m")
    fault_hooks(plan, rank=0).run("after_shard", 4)  # another rank: no callback, no kill
    assert not (tmp_path / "m").exists()
    seen: list[tuple[str, int]] = []
    hooks = Hooks()
    hooks.add("step", lambda step: seen.append(("first", step)))
    hooks.add("step", lambda step: seen.append(("second", step)))
    hooks.run("step", 7)
    hooks.run("before_meta", 7)  # a point with no callback
    assert seen == [("first", 7), ("second", 7)]
