"""The training step never waits for the host, and the loss guard keeps its guarantees.

Real loop (`training.pretrain.loop.Worker`), real DeepSpeed on one gloo rank, the demo corpus's
examples. A GPU proves the same with `torch.cuda.set_sync_debug_mode("error")`
(bench/pretrain_gpu.py); on a CPU the reads are counted (tests/training/pretrain/host_reads.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from host_reads import count_host_reads

from training.pretrain import loop
from training.pretrain.config import TrainConfig
from training.pretrain.losses.common import StepOutput
from training.runtime.guard import TrainingDivergedError
from training.runtime.precision import cpu_has_native_bf16
from training.runtime.worker_context import LocalContext

pytestmark = [pytest.mark.slow]

# transformers' own eager GPT-2 forward (`model.implementation: transformers`) makes two reads
# per forward (both skipped under torch.compile): the "padding without a mask" warning's look at
# the first and last ids, and the packed-sequence check of the position ids. lmpipe's fast GPT-2
# (training/models/fast/gpt2.py) makes neither.
TRANSFORMERS_CAUSAL_READS = (
    "warn_if_padding_and_no_attention_mask",
    "find_packed_sequence_indices",
)


def worker(data: dict[str, Path], run_dir: Path, **train: Any) -> loop.Worker:
    """A one-rank worker: 8 samples a step in micro-batches of 4 (two accumulate), clipping on."""
    family = train.pop("family", "bert")
    implementation = train.pop("implementation", "fast")
    cfg = TrainConfig.model_validate(
        {
            "model": {"family": family, "size": "tiny", "implementation": implementation},
            "max_steps": 20,
            "global_batch_size": 8,
            "micro_batch_size": 4,
            "precision": "bf16" if cpu_has_native_bf16() else "fp32",
            "optim": {"grad_clip": 1.0, "warmup_steps": 1},
            "eval": {"every_steps": 1000, "max_samples": 8},
            "checkpoint": {"every_steps": 1000, "storage_path": str(run_dir)},
            "scale": {"num_workers": 1, "threads_per_worker": 1},
            **train,
        }
    )
    job = loop.WorkerJob(
        train=cfg,
        seed=0,
        examples_dir=data["examples"],
        tokenizer_dir=data["tokenizer"],
        config_hash="sync-free",
    )
    return loop.Worker(job, LocalContext(run_dir))


def test_a_step_reads_nothing_on_the_host(
    demo_data: Any, single_process_dist: None, tmp_path: Path
) -> None:
    bert = worker(demo_data.examples("bert"), tmp_path / "bert", log_every_steps=1000)
    assert bert.accum == 2
    bert.train_step()  # the first step builds what later steps reuse
    with count_host_reads() as reads:
        bert.train_step()
        bert.train_step()
    assert reads == []
    bert.flush()  # the logging read: both steps' rows at once
    rows = (tmp_path / "bert" / "steps.jsonl").read_text().splitlines()
    assert len(rows) == 3

    # lmpipe's fast GPT-2 (the default) reads nothing either; transformers' own forward makes
    # its two checks.
    causal = worker(
        demo_data.examples("causal"), tmp_path / "gpt2", family="gpt2", log_every_steps=1000
    )
    causal.train_step()
    with count_host_reads() as reads:
        causal.train_step()
    assert reads == []
    stock = worker(
        demo_data.examples("causal"),
        tmp_path / "gpt2-stock",
        family="gpt2",
        implementation="transformers",
        log_every_steps=1000,
    )
    stock.train_step()
    with count_host_reads() as reads:
        stock.train_step()
    assert reads, "transformers' own checks were expected: has transformers dropped them?"
    assert {read.owner for read in reads} == {"transformers"}, reads
    assert {read.where.split("(")[-1].rstrip(")") for read in reads} <= set(
        TRANSFORMERS_CAUSAL_READS
    ), reads


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_read_only_inside_deepspeed(
    demo_data: Any, single_process_dist: None, tmp_path: Path, stage: int
) -> None:
    bert = worker(
        demo_data.examples("bert"),
        tmp_path,
        zero_stage=stage,
        precision="fp32",
        log_every_steps=1000,
    )
    bert.train_step()
    with count_host_reads() as reads:
        bert.train_step()
    # DeepSpeed's ZeRO optimizers check the gradients for overflow on the host (a handful of
    # reads a step, docs/pretraining.md); lmpipe's own part of the step adds none.
    assert {read.owner for read in reads} <= {"deepspeed"}, reads


def _weights(w: loop.Worker) -> list[torch.Tensor]:
    return [p.detach().clone() for p in w.engine.module.parameters()]


def _same(before: list[torch.Tensor], after: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("stage", [0, 2])
def test_guard_skips_a_nan_and_a_spike_mid_accumulation_and_stops_after_too_many(
    demo_data: Any,
    single_process_dist: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    stage: int,
) -> None:
    w = worker(
        demo_data.examples("bert"),
        tmp_path,
        zero_stage=stage,
        precision="fp32",
        guard={"on_nonfinite": "skip", "spike_factor": 3.0, "on_spike": "skip", "max_skips": 1},
        log_every_steps=1,
    )
    # step -> (micro-batch, factor): the loss backpropagated there is multiplied by the factor.
    faults = {7: (1, float("nan")), 9: (0, 50.0), 10: (1, 50.0)}
    calls: dict[int, int] = {}
    real_loss = loop.pretraining_loss

    def faulty_loss(*args: Any, **kwargs: Any) -> StepOutput:
        out = real_loss(*args, **kwargs)
        step = w.step + 1
        micro = calls[step] = calls.get(step, -1) + 1
        if faults.get(step, (None, None))[0] == micro:
            return StepOutput(out.loss * faults[step][1], out.parts, out.counts)
        return out

    monkeypatch.setattr(loop, "pretraining_loss", faulty_loss)
    for _ in range(6):  # the spike check arms after 5 accepted steps
        w.train_step()
    for step, applied in ((7, False), (8, True), (9, False)):
        before = _weights(w)
        w.train_step()
        assert _same(before, _weights(w)) is not applied, step
        assert w.guard.skipped_total == (1 if step < 9 else 2), step
    before = _weights(w)
    with pytest.raises(TrainingDivergedError) as stopped:
        w.train_step()
    assert _same(before, _weights(w))  # the step that stops the run was not applied either
    assert re.fullmatch(
        r"loss spike at step 10: [0-9.e+]+ > 3\.0 x [0-9.e+]+; 1 steps in a row skipped already "
        r"\(train\.guard\.max_skips\): stopping",
        str(stopped.value),
    ), str(stopped.value)
    rows = (tmp_path / "steps.jsonl").read_text().splitlines()
    skipped = [json.loads(row)["skipped"] for row in rows]
    assert skipped == [0, 0, 0, 0, 0, 0, 1, 0, 1]  # step 10 raised before its row


def test_guard_stops_at_the_next_read_with_its_message(
    demo_data: Any,
    single_process_dist: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = worker(demo_data.examples("bert"), tmp_path, precision="fp32", log_every_steps=4)
    real_loss = loop.pretraining_loss

    def nan_at_step_2(*args: Any, **kwargs: Any) -> StepOutput:
        out = real_loss(*args, **kwargs)
        factor = float("nan") if w.step + 1 == 2 else 1.0
        return StepOutput(out.loss * factor, out.parts, out.counts)

    monkeypatch.setattr(loop, "pretraining_loss", nan_at_step_2)
    w.train_step()
    after_first = _weights(w)
    w.train_step()  # the NaN: not applied, nothing raised yet (no read until step 4)
    assert _same(after_first, _weights(w))
    w.train_step()
    with pytest.raises(TrainingDivergedError) as stopped:
        w.train_step()
    assert str(stopped.value) == (
        "non-finite loss at step 2; stopping (train.guard policy 'stop'). Resume from the last "
        "checkpoint with a lower train.optim.lr, or set the guard to 'skip'."
    )
