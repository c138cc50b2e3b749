"""bench/pretrain_gpu.py on a CPU: the code a GPU machine runs, on tiny models.

The GPU figures can only be taken where a GPU is lent, for minutes; this keeps the script that
takes them working: lmpipe's loop without Ray, the plain loop, the nanoGPT reference, their
common initial state, the loss agreement and the report, on the demo corpus's examples and the
models' tiny size.
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


def setting(
    bench: Any, name: str, data: dict[str, Path], run_dir: Path, init: Path
) -> dict[str, Any]:
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
        "init": str(init),
    }


def test_settings_put_the_compiled_loops_and_the_reference_first(bench: Any) -> None:
    names = list(bench.SETTINGS)
    assert names[:3] == [
        "lmpipe-gpt2-124m-compile",
        "plain-gpt2-124m-compile",
        "nanogpt-gpt2-124m-compile",
    ]
    assert {bench.SETTINGS[name]["model"] for name in names} == set(bench.MODELS)
    assert {"lmpipe-gpt2-124m-docmask", "plain-gpt2-124m-docmask-compile"} <= set(names)
    assert bench.MODELS["gpt2-124m"]["overrides"] == {"vocab_size": 50_257}


def test_the_arms_start_alike_train_and_the_report_gives_mfu(
    bench: Any, demo_data: Any, single_process_dist: None, tmp_path: Path
) -> None:
    causal, bert = demo_data.examples("causal"), demo_data.examples("bert")
    inits = {"gpt2": tmp_path / "gpt2.pt", "bert": tmp_path / "bert.pt"}
    bench.child_init(setting(bench, "lmpipe-gpt2-124m", causal, tmp_path, inits["gpt2"]))
    bench.child_init(setting(bench, "plain-bert-base", bert, tmp_path, inits["bert"]))
    gpt2 = {
        name: setting(bench, name, causal, tmp_path / name, inits["gpt2"])
        for name in ("lmpipe-gpt2-124m", "plain-gpt2-124m", "nanogpt-gpt2-124m")
    }
    raws = {name: getattr(bench, f"child_{spec['loop']}")(spec) for name, spec in gpt2.items()}
    lmpipe = raws["lmpipe-gpt2-124m"]
    bert_name = "plain-bert-base"
    raws[bert_name] = bench.child_plain(
        setting(bench, bert_name, bert, tmp_path / bert_name, inits["bert"])
    )
    device = bench.child_device({"device": "cpu"})
    assert device["peak_source"] == "measured"
    assert device["deepspeed"][0].isdigit()
    # One initial state and one first batch: the same loss before any update, in every arm
    # (bf16 where the CPU has it natively, else fp32; nanoGPT does not mask the padded
    # vocabulary rows).
    first = [raw["losses"][0] for name, raw in raws.items() if "gpt2" in name]
    assert max(first) - min(first) <= 0.02 * min(first), first
    rows = {}
    for name, raw in raws.items():
        assert len(raw["step_s"]) == len(raw["tokens"]) == len(raw["losses"]) == 3, name
        target = bench.MODELS[bench.SETTINGS[name]["model"]]["target"]
        # Through JSON, as a child's result reaches the driver.
        rows[name] = bench.summarize(
            json.loads(json.dumps(raw)), 1, device["peak_flops"], device["peak_flops"], target
        )
        row = rows[name]
        assert row["timed_steps"] == 2, name
        assert 0 < row["mfu"] < 1, name
        assert row["tokens_per_s"] == pytest.approx(sum(raw["tokens"][1:]) / sum(raw["step_s"][1:]))
    agreement = bench.loss_agreement(rows)
    assert set(agreement) == {"gpt2-124m", "bert-base"}
    assert set(agreement["gpt2-124m"]["means"]) == set(gpt2)
    assert agreement["gpt2-124m"]["agree"], agreement
    # GPT-2 blocks have no padding: 8 blocks of the examples' length per step.
    assert lmpipe["tokens"][1] == pytest.approx(8 * 64)
    # The published vocabulary (50,257 rows), not the demo tokenizer's.
    assert lmpipe["parameters"] > 50_257 * 64
    assert raws["nanogpt-gpt2-124m"]["flops_per_token"] == lmpipe["flops_per_token"]
    text = bench.table(rows | {"broken": {"error": "exit 1: boom"}}, device)
    assert "| lmpipe-gpt2-124m |" in text
    assert "| broken | failed: exit 1: boom |" in text


def test_loss_agreement_flags_an_arm_that_trains_another_model(bench: Any) -> None:
    rows = {
        "lmpipe-gpt2-124m-compile": {"mean_loss": 5.00},
        "plain-gpt2-124m-compile": {"mean_loss": 5.05},
        "nanogpt-gpt2-124m-compile": {"mean_loss": 5.30},
        "lmpipe-gpt2-124m-docmask-compile": {"mean_loss": 5.5},
        "lmpipe-bert-base": {"error": "exit 1"},
    }
    agreement = bench.loss_agreement(rows)
    assert set(agreement) == {"gpt2-124m", "gpt2-124m-docmask"}
    assert not agreement["gpt2-124m"]["agree"]
    assert agreement["gpt2-124m"]["spread"] == pytest.approx(0.06)
    assert agreement["gpt2-124m-docmask"]["agree"]
