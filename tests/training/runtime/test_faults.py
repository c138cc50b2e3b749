"""A chain of planned faults: each fires once, at its own point, step and rank."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from training.runtime.faults import FaultPlan, chain

REPO = Path(__file__).resolve().parents[3]

# A fresh process reaches the points of a run in order and says which it got past.
REACH = """
import sys
from training.runtime.faults import FaultPlan, hit

plan = FaultPlan.model_validate_json(sys.argv[1])
for point, step in [("step", 3), ("before_meta", 6), ("during_purge", 9)]:
    hit(plan, point, step, 0)
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
