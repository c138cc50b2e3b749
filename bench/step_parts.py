"""What lmpipe's training step adds to the model's own work, piece by piece (nanoGPT shape).

Usage: python bench/step_parts.py [--steps 500] [--work DIR] [--json OUT]

One process builds lmpipe's worker for configs/shakespeare_char.yaml (bench/step_overhead.py's
examples, one worker, ZeRO 0, fp32, the usable cores' threads) and times five arms over the
worker's own module and optimizer, interleaved in rotating order, on the worker's batches:

- `bare`: the fast module's logits, `F.cross_entropy`, backward, clipping, fused AdamW;
- `loss`: the same with lmpipe's loss (`pretraining_loss`: padded targets, token counts and
  accuracy kept on the device) in place of `F.cross_entropy`;
- `guard`: and the loss guard's decision, given to AdamW as its skip flag;
- `telemetry`: and the step's statistics and telemetry record (flushed at its interval);
- `step`: lmpipe's whole `Worker.train_step` (its own batch, schedule, progress, hooks).

Reported: each arm's median ms per step and its extra time over `bare`, from the median of the
per-step ratios (drift in the machine's load falls on the arms of one rotation alike).
docs/benchmarks.md, "The module" (session 39), has figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def build_worker(work: Path, steps: int) -> tuple[Any, list[dict[str, Any]]]:
    """Lmpipe's worker for the recipe, and its batches for `steps` steps (built untimed)."""
    import torch
    from step_overhead import _cursor_at, shakespeare_examples

    from tasks.common.ray_runtime import usable_cores
    from training.pretrain.config import TrainConfig
    from training.pretrain.job import WorkerJob
    from training.pretrain.loop import Worker
    from training.runtime.worker_context import LocalContext, init_single_process

    data = shakespeare_examples(work)
    torch.set_num_threads(usable_cores())
    run_dir = work / "run-parts"
    run_dir.mkdir(parents=True, exist_ok=True)
    never = 1 << 30
    train = TrainConfig.model_validate(
        data["train"]
        | {
            "max_steps": never,
            "precision": "fp32",
            "zero_stage": 0,
            "eval": {"every_steps": never},
            "checkpoint": {"every_steps": never, "storage_path": str(run_dir)},
        }
    )
    job = WorkerJob(
        train=train,
        seed=0,
        examples_dir=Path(data["examples_dir"]),
        tokenizer_dir=Path(data["tokenizer_dir"]),
        config_hash="bench",
    )
    init_single_process()
    worker = Worker(job, LocalContext(run_dir))
    batches = [b for s in range(steps) for b in worker._plan(s + 1, _cursor_at(worker, s)).batches]
    return worker, batches


def arms(worker: Any, batches: list[dict[str, Any]]) -> dict[str, Callable[[int], None]]:
    """The five arms, each one step at index i."""
    import torch
    import torch.nn.functional as F

    from training.models.fast.gpt2 import causal_lm_logits
    from training.pretrain.losses import pretraining_loss
    from training.pretrain.telemetry import StepMeter

    module, optimizer, guard = worker.engine.module, worker.optimizer, worker.guard
    params = list(worker.trainable)
    steps = [0]

    def update(skip: Any = None) -> Any:
        optimizer.found_inf = skip
        norm = torch.nn.utils.clip_grad_norm_(params, worker.clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        optimizer.found_inf = None
        return norm

    def bare(i: int) -> None:
        ids = batches[i]["input_ids"]
        logits = causal_lm_logits(module, ids, None, None)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        update()

    def loss(i: int) -> None:
        pretraining_loss(module, worker.objective, batches[i], True).loss.backward()
        update()

    def guarded(i: int, record: bool = False) -> None:
        out = pretraining_loss(module, worker.objective, batches[i], True)
        guard.observe(out.loss)
        out.loss.backward()
        skip, decision = guard.decide()
        norm = update(skip)
        if record:
            meter = StepMeter()
            meter.add(out, batches[i])
            steps[0] += 1
            length = batches[i]["input_ids"].shape[1]
            if worker.telemetry.record(steps[0], meter, 1e-3, norm, skip, decision, length):
                worker.flush()

    return {
        "bare": bare,
        "loss": loss,
        "guard": guarded,
        "telemetry": lambda i: guarded(i, record=True),
        "step": lambda i: worker.train_step(),
    }


def measure(loops: dict[str, Callable[[int], None]], steps: int, warmup: int) -> dict[str, Any]:
    """Interleave the arms for `steps` steps; times of the steps after `warmup`."""
    times: dict[str, list[float]] = {name: [] for name in loops}
    for i in range(steps):
        for name in list(loops) if i % 2 == 0 else list(reversed(loops)):
            start = time.perf_counter()
            loops[name](i)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    bare = times["bare"]
    result: dict[str, Any] = {}
    for name, values in times.items():
        ratio = statistics.median(a / b for a, b in zip(values, bare, strict=True))
        result[name] = {
            "median_ms": statistics.median(values) * 1e3,
            "extra_ms": (ratio - 1) * statistics.median(bare) * 1e3,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500, help="Steps of each arm.")
    parser.add_argument("--warmup", type=int, default=10, help="Untimed steps of each first.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmpipe-step-parts"))
    parser.add_argument("--json", type=Path, default=None, help="Write the results here too.")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    worker, batches = build_worker(args.work, args.steps)
    result = measure(arms(worker, batches), args.steps, args.warmup)
    worker.batches.close()
    for name, row in result.items():
        print(f"{name:10s} {row['median_ms']:7.2f} ms a step, {row['extra_ms']:+.3f} ms over bare")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
