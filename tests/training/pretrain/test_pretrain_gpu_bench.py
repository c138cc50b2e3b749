"""bench/pretrain_gpu.py on a CPU: the code a GPU machine runs, on tiny models (issue 5).

The GPU figures can only be taken where a GPU is lent, for minutes; this keeps the script that
takes them working: lmpipe's loop without Ray, the plain loop, and the report, on the demo
corpus's examples and the models' tiny size.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.slow]
BENCH = Path(__file__).resolve().parents[3] / "bench" / "pretrain_gpu.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    spec = importlib.util.spec_from_file_location("pretrain_gpu", BENCH)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def setting(bench: Any, name: str, data: dict[str, Path], run_dir: Path) -> dict[str, Any]:
    return {
        **bench.SETTINGS[name],
        "name": name,
        "device": "cpu",
        "size": "tiny",
        "batch": 8,
        "warmup": 1,
        "steps": 2,
        "threads": torch.get_num_threads(),
        "examples_dir": str(data["examples"]),
        "tokenizer_dir": str(data["tokenizer"]),
        "run_dir": str(run_dir),
    }


def test_settings_put_the_compiled_loops_first(bench: Any) -> None:
    names = list(bench.SETTINGS)
    assert names[:2] == ["lmpipe-bert-base-compile", "lmpipe-gpt2-124m-compile"]
    assert len(names) == 8
    assert bench.MODELS["gpt2-124m"]["overrides"] == {"vocab_size": 50_257}


def test_both_loops_train_and_the_report_gives_mfu(
    bench: Any, demo_data: Any, single_process_dist: None, tmp_path: Path
) -> None:
    causal, bert = demo_data.examples("causal"), demo_data.examples("bert")
    lmpipe = bench.child_lmpipe(setting(bench, "lmpipe-gpt2-124m", causal, tmp_path / "lmpipe"))
    plain = bench.child_plain(setting(bench, "plain-bert-base", bert, tmp_path / "plain"))
    device = bench.child_device({"device": "cpu"})
    assert device["peak_source"] == "measured"
    assert device["deepspeed"][0].isdigit()
    rows = {}
    for name, raw, model in (
        ("lmpipe-gpt2-124m", lmpipe, "gpt2-124m"),
        ("plain-bert-base", plain, "bert-base"),
    ):
        assert len(raw["step_s"]) == len(raw["tokens"]) == len(raw["losses"]) == 3, name
        target = bench.MODELS[model]["target"]
        # Through JSON, as a child's result reaches the driver.
        rows[name] = bench.summarize(
            json.loads(json.dumps(raw)), 1, device["peak_flops"], device["peak_flops"], target
        )
        row = rows[name]
        assert row["timed_steps"] == 2, name
        assert 0 < row["mfu"] < 1, name
        assert row["tokens_per_s"] == pytest.approx(sum(raw["tokens"][1:]) / sum(raw["step_s"][1:]))
    # GPT-2 blocks have no padding: 8 blocks of the examples' length per step.
    assert lmpipe["tokens"][1] == pytest.approx(8 * 64)
    # The published vocabulary (50,257 rows), not the demo tokenizer's.
    assert lmpipe["parameters"] > 50_257 * 64
    text = bench.table(rows | {"broken": {"error": "exit 1: boom"}}, device)
    assert "| lmpipe-gpt2-124m |" in text
    assert "| broken | failed: exit 1: boom |" in text
