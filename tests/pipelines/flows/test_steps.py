"""How a stage command's flow runs the data stages: in order, as tasks of its one flow run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelines.config import RunConfig, load_config
from pipelines.flows import steps
from pipelines.flows.steps import Stages, run_data_steps


def test_the_data_steps_run_in_order_up_to_the_last_each_on_the_ones_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: steps\nworkspace: {tmp_path / 'ws'}\n")
    cfg = load_config(recipe)
    seen: list[tuple[str, list[str]]] = []

    def fake(name: str) -> steps.Step:
        def step(_: RunConfig, stages: Stages) -> Stages:
            seen.append((name, list(stages)))
            return {} if name == "decontaminate" else {name: {"stage": name}}

        return step

    for name in steps.DATA_STEPS:
        monkeypatch.setitem(steps.DATA_STEPS, name, fake(name))
    assert list(run_data_steps(cfg, "encode")) == ["ingest", "tokenizer", "encode"]
    assert seen == [
        ("ingest", []),
        ("decontaminate", ["ingest"]),
        ("tokenizer", ["ingest"]),
        ("encode", ["ingest", "tokenizer"]),
    ]
