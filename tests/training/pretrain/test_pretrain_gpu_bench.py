"""bench/pretrain_gpu.py on a CPU: the code a GPU machine runs, on tiny models.

The GPU figures can only be taken where a GPU is lent, for minutes; this keeps the script that
takes them working: lmpipe's loop without Ray, the plain loop, the nanoGPT and nanoBERT
references (the latter against `BertForPreTraining`, weight for weight), their common initial
state, the loss agreement and the report, on the demo corpus's examples and the models' tiny
size; and `prepare --tiny` followed by `run --quality`, the time-to-quality mode, as the GPU
machine runs them, with each child in this process instead of a subprocess.
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
    from pretrain_gpu_arms import CHILDREN as child  # on the path once `bench` is loaded

    child["init"](setting(bench, "lmpipe-gpt2-124m", causal, tmp_path, inits["gpt2"]))
    child["init"](setting(bench, "plain-bert-base", bert, tmp_path, inits["bert"]))
    gpt2 = {
        name: setting(bench, name, causal, tmp_path / name, inits["gpt2"])
        for name in ("lmpipe-gpt2-124m", "plain-gpt2-124m", "nanogpt-gpt2-124m")
    }
    raws = {name: child[spec["loop"]](spec) for name, spec in gpt2.items()}
    lmpipe = raws["lmpipe-gpt2-124m"]
    bert_name = "plain-bert-base"
    raws[bert_name] = child["plain"](
        setting(bench, bert_name, bert, tmp_path / bert_name, inits["bert"])
    )
    device = child["device"]({"device": "cpu"})
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


def test_nanobert_gives_bert_for_pretrainings_logits_and_loss(bench: Any) -> None:
    from nanobert import nanobert_inputs, nanobert_model, nanobert_state

    from training.models.models import ModelConfig, build_model
    from training.pretrain.losses import pretraining_loss

    specials = {"cls": 2, "sep": 3, "mask": 4, "pad": 0, "vocab_size": 1000}
    section = ModelConfig.model_validate({"family": "bert", "size": "tiny"})
    torch.manual_seed(0)
    hf = build_model(section, "bert", 1000, specials, 64).eval()
    assert hf.config.vocab_size == 1024  # padded: the reference masks the same rows
    reference = nanobert_model(hf.config).eval()
    reference.load_state_dict(nanobert_state(hf.state_dict()))  # strict: every weight maps
    ids = torch.randint(5, 1000, (4, 64))
    types = (torch.arange(64) >= 30).long().expand(4, 64)
    mask = torch.ones(4, 64, dtype=torch.long)
    mask[1, 50:] = mask[3, 20:] = 0
    labels = torch.where((torch.rand(4, 64) < 0.15) & mask.bool(), ids, -100)
    batch = {
        "input_ids": ids,
        "token_type_ids": types,
        "attention_mask": mask,
        "labels": labels,
        "masked_positions": torch.nonzero(labels.flatten() != -100).flatten(),
        "next_sentence_label": torch.tensor([0, 1, 1, 0]),
    }
    with torch.no_grad():
        out = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
        mlm, nsp = reference.logits(ids, types, mask)
        loss = reference(*nanobert_inputs(batch))
        expected = pretraining_loss(hf, "bert", batch).loss
    torch.testing.assert_close(mlm, out.prediction_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(nsp, out.seq_relationship_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-5)
    with pytest.raises(KeyError):
        nanobert_state(hf.state_dict() | {"bert.encoder.extra.weight": torch.zeros(1)})


def test_time_to_loss_reads_the_smoothed_curve_against_the_reference(bench: Any) -> None:
    assert bench.smoothed([4.0, 2.0, 6.0, 0.0], window=2) == [4.0, 3.0, 4.0, 3.0]
    losses = [10.0 - step for step in range(30)]  # one warm-up step, then 29 timed ones
    raw = {"losses": losses, "elapsed_s": [0.5 * step for step in range(1, 30)]}
    # The 20-step mean first reaches -0.5 over losses 9 .. -10: the 20th timed step, at 10 s.
    reached = bench.time_to_loss(raw, 1, target=-0.5)
    assert reached == {"steps_to_target": 20, "time_to_target_s": 10.0}
    assert bench.time_to_loss(raw, 1, target=-100.0)["time_to_target_s"] is None
    arm = {"tokens_per_s": 96.0, "mfu": 0.38, "time_to_target_s": 10.8}
    ref = {"tokens_per_s": 100.0, "mfu": 0.40, "time_to_target_s": 10.0}
    verdict = bench.against(arm, ref)
    assert verdict["time_ratio"] == pytest.approx(1.08)
    assert verdict["met"] == {"tokens_ratio": True, "mfu_ratio": False, "time_ratio": True}


def in_process(bench: Any) -> Any:
    """The driver's launcher with each child run here, not in a subprocess (no start-up)."""

    def launch(spec: dict[str, Any], run_dir: Path) -> dict[str, Any]:
        run_dir.mkdir(parents=True)
        spec = spec | {"run_dir": str(run_dir), "result": str(run_dir / "result.json")}
        bench.run_child(spec)
        result: dict[str, Any] = json.loads(Path(spec["result"]).read_text())
        return result

    return launch


def test_prepare_tiny_then_quality_mode_times_every_arm_to_the_references_loss(
    bench: Any, shared_data: Path, ray_session: str, single_process_dist: None, tmp_path: Path
) -> None:
    # `prepare` reads the Gutenberg books of ../shared/data: `shared_data` skips without them.
    data = tmp_path / "prepared"
    prepared = bench.prepare(data, tmp_path / "prepare-work", wheels=False, tiny=True)
    assert prepared["tiny"]
    assert prepared["sets"]["gpt2"]["train_examples"] > 100
    # Per model the reference (its loss is the target) and lmpipe first, the plain loops last.
    assert bench.QUALITY == [
        "nanogpt-gpt2-124m-compile",
        "lmpipe-gpt2-124m-compile",
        "nanobert-bert-base-compile",
        "lmpipe-bert-base-compile",
        "plain-gpt2-124m-compile",
        "plain-bert-base-compile",
    ]
    eager = [name.removesuffix("-compile") for name in bench.QUALITY]  # compiling takes minutes
    out = tmp_path / "out"
    where = ["--data", str(data), "--out", str(out), "--work", str(tmp_path / "w")]
    tiny = ["--device", "cpu", "--size", "tiny", "--batch", "2", "--warmup", "2", "--steps", "8"]
    threads = ["--threads", str(torch.get_num_threads())]
    args = bench.parse_args(
        ["run", "--quality", *where, "--only", ",".join(eager), *tiny, *threads]
    )
    report = bench.run(args, launcher=in_process(bench))
    saved = json.loads((out / "pretrain_gpu_quality.json").read_text())
    assert saved["quality"] == json.loads(json.dumps(report["quality"]))
    text = (out / "pretrain_gpu_quality.md").read_text()
    assert "Time to quality" in text
    assert all(f"| {name} |" in text for name in eager)
    assert all(check["agree"] for check in report["loss_agreement"].values())
    for model, reference in (("gpt2-124m", "nanogpt"), ("bert-base", "nanobert")):
        group = report["quality"][model]
        assert group["reference"] == f"{reference}-{model}"
        assert (group["target_step"], group["window"]) == (8, bench.LOSS_WINDOW)
        assert set(group["arms"]) == {name for name in eager if model in name}
        for name, arm in group["arms"].items():
            raw = report["raw"][name]
            assert len(raw["elapsed_s"]) == 9  # 8 steps and 10% of slack, after the warm-up
            assert raw["elapsed_s"] == sorted(raw["elapsed_s"])
            # Same weights, batches and optimizer: the curves agree at the target step.
            assert arm["loss_at_steps"] == pytest.approx(group["target_loss"], rel=0.01), name
            versus = arm["against_reference"]
            assert set(versus) == {"tokens_ratio", "mfu_ratio", "time_ratio", "met"}
            assert arm["mfu"] > 0
            assert arm["tokens_per_s"] > 0
        ref = group["arms"][group["reference"]]
        assert ref["steps_to_target"] <= 8  # the reference reaches its own loss
        assert ref["against_reference"]["time_ratio"] == 1.0
