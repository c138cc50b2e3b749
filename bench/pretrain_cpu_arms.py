"""The training arms of bench/pretrain_throughput.py, each run in its own subprocess.

On the same BERT examples (bench/pretrain_data.py), batches (the loop's seeded global order,
static masks), model (BERT, 4 layers, hidden 256, 4 heads, FFN 1024) and 2 torch threads:

- `plain`: a plain PyTorch loop (`PlainLoop`: fused AdamW, clipping, lmpipe's warm-up/decay
  schedule, `training.pretrain.losses.pretraining_loss`); `plain-ray`: the same inside a Ray
  Train worker;
- `hf`: `transformers.Trainer` on `BertForPreTraining` (its own dense-MLM loss);
- `lmpipe-local`: lmpipe's loop (`run_worker`) in the subprocess with `LocalContext`;
  `lmpipe-ray`: the same loop on Ray Train (`run_training`);
- `peak`: the matmul peak of 2 threads; `ab`: plain and lmpipe steps interleaved in one
  process, with the time of each phase of a step.

Each returns the timestamps of its step ends (or its phase times), which the driver turns into
tokens/s (`CHILDREN`, keyed by the setting's `kind`).
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from harness import add_time, timed_calls
from pretrain_arms import SEED, loop_batches, real_tokens, seeded_model, worker_job
from pretrain_data import SEQ_LEN

THREADS = 2
BATCH = 32
OVERRIDES = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
}
LR, WARMUP_STEPS, WEIGHT_DECAY, EPS, CLIP = 1e-3, 10, 0.01, 1e-6, 1.0  # TrainConfig defaults


def bench_batches(examples_dir: Path, steps: int) -> list[Any]:
    """The loop's first `steps` global batches of `BATCH` (the static masks are in the shards)."""
    return list(loop_batches(examples_dir, BATCH, steps))


def tokens_per_step(examples_dir: Path, steps: int) -> list[int]:
    """Real (non-padding) input tokens of each of the first `steps` batches."""
    return [int(real_tokens(batch)) for batch in bench_batches(examples_dir, steps)]


def model_section() -> Any:
    """The benchmark's model section: BERT, 4 layers x 256, 4 heads, FFN 1024."""
    from training.models.models import ModelConfig

    return ModelConfig(family="bert", size="mini", overrides=OVERRIDES)


def build_bench_model(examples_dir: Path) -> Any:
    """A fresh `BertForPreTraining` (seeded) with the initial weights the loop's model gets.

    transformers' own class: the plain loop and the Trainer arm run its stock forward, as a
    user's loop would, while lmpipe trains its fast subclass (`model.implementation`).
    """
    from training.pretrain.data import read_manifest

    manifest = read_manifest(examples_dir)
    return seeded_model(model_section(), "bert", manifest, SEQ_LEN, stock=True)


def lr_factor(step: int, total: int) -> float:
    """DeepSpeed's WarmupDecayLR (lmpipe's default schedule) as a multiple of the peak rate."""
    if step < WARMUP_STEPS:
        return step / WARMUP_STEPS
    return max(0.0, (total - step) / max(1, total - WARMUP_STEPS))


def step_ends(path: Path) -> dict[str, list[float]]:
    """Step-end times and losses of a finished lmpipe run, from its `steps.jsonl`.

    The loop logs each step's `step_time_s`, the time from the end of the step before (or of
    the last evaluation) to the end of this one, measured in the loop itself; their running sum
    gives the step ends. Reading the file afterwards keeps the measurement out of the timed
    process: an earlier version polled the file from a thread every 10 ms, and on 2 cores that
    thread's wake-ups took time from the 2 training threads of the lmpipe settings only.
    """
    rows: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row  # a replayed step's later line wins
    ordered = [rows[step] for step in sorted(rows)]
    ends = list(itertools.accumulate(row["step_time_s"] for row in ordered))
    return {"ends": ends, "losses": [row["loss"] for row in ordered]}


# -- the settings, each run in its own subprocess -------------------------------------------


class PlainLoop:
    """A plain PyTorch loop: AdamW (fused), clipping, the schedule, `pretraining_loss`."""

    def __init__(self, spec: dict[str, Any], steps: int) -> None:
        """Build the model (seeded as the loop builds it), the optimizer and the schedule."""
        import torch

        from training.runtime.deepspeed import param_groups

        self.model = build_bench_model(Path(spec["examples_dir"])).train()
        groups = param_groups(self.model.named_parameters(), WEIGHT_DECAY)
        self.opt = torch.optim.AdamW(groups, lr=LR, eps=EPS, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, steps))
        if spec["compile"]:
            # The base model and both heads: the loss indexes the masked rows in between.
            for name in ("bert", "cls.predictions", "cls.seq_relationship"):
                self.model.get_submodule(name).compile()
        self.bf16 = spec["precision"] == "bf16"
        self.sparse_mlm = spec.get("sparse_mlm", True)

    def step(self, batch: dict[str, Any], phases: dict[str, float] | None = None) -> float:
        """One optimizer step; add forward/backward/step seconds to `phases`; return the loss."""
        import torch

        from training.pretrain.losses import pretraining_loss

        marks = [time.perf_counter()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            out = pretraining_loss(self.model, "bert", batch, self.sparse_mlm)
        marks.append(time.perf_counter())
        out.loss.backward()  # type: ignore[no-untyped-call]
        marks.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        loss = float(out.loss)
        marks.append(time.perf_counter())
        if phases is not None:
            spans = (b - a for a, b in itertools.pairwise(marks))
            for name, span in zip(("forward", "backward", "step"), spans, strict=True):
                add_time(phases, name, span)
        return loss


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the plain loop over the same batches; the end of each step is timestamped."""
    steps = spec["warmup"] + spec["steps"]
    batches = bench_batches(Path(spec["examples_dir"]), steps)
    loop = PlainLoop(spec, steps)
    ends, losses = [], []
    for batch in batches:
        losses.append(loop.step(batch))
        ends.append(time.perf_counter())
    return {"ends": ends, "losses": losses}


def child_hf(spec: dict[str, Any]) -> dict[str, Any]:
    """`transformers.Trainer` on BertForPreTraining (its own dense-MLM loss), same samples."""
    import transformers as tf

    examples = Path(spec["examples_dir"])
    steps = spec["warmup"] + spec["steps"]
    # One item per sample, in the loop's order; the sequential sampler keeps the batches.
    items = [
        {k: v[i] for k, v in batch.items()}
        for batch in bench_batches(examples, steps)
        for i in range(BATCH)
    ]
    ends: list[float] = []

    class Clock(tf.TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            ends.append(time.perf_counter())

    args = tf.TrainingArguments(
        output_dir=spec["run_dir"],
        per_device_train_batch_size=BATCH,
        max_steps=steps,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        adam_epsilon=EPS,
        max_grad_norm=CLIP,
        warmup_steps=WARMUP_STEPS,
        lr_scheduler_type="linear",
        optim="adamw_torch_fused",
        bf16=spec["precision"] == "bf16",
        torch_compile=spec["compile"],
        use_cpu=True,
        train_sampling_strategy="sequential",
        dataloader_drop_last=True,
        dataloader_pin_memory=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=SEED,
    )
    model = build_bench_model(examples)
    trainer = tf.Trainer(model=model, args=args, train_dataset=items, callbacks=[Clock()])
    result = trainer.train()
    return {"ends": ends, "mean_loss": result.training_loss}


def train_config(spec: dict[str, Any], storage: Path) -> Any:
    """The train section of a setting: `TrainConfig` defaults but for what is benchmarked.

    Evaluation and checkpoints happen only after the last step (outside the timed window).
    """
    from training.pretrain.config import EvalConfig, TrainConfig
    from training.runtime.config import CheckpointConfig, ScaleConfig

    return TrainConfig(
        model=model_section(),
        max_steps=spec["warmup"] + spec["steps"],
        global_batch_size=BATCH,
        micro_batch_size=spec.get("micro_batch"),  # None: the whole batch at 1 worker
        precision=spec["precision"],
        allow_emulated_bf16=True,  # compares bf16 with fp32 on purpose
        zero_stage=spec.get("zero_stage", 2),
        compile=spec["compile"],
        sparse_mlm=spec.get("sparse_mlm", True),
        deepspeed_extra=spec.get("deepspeed_extra", {}),
        scale=ScaleConfig(
            num_workers=1,
            cpus_per_worker=THREADS,
            threads_per_worker=THREADS,
            max_failures=0,
            report_poll_s=spec.get("report_poll_s", ScaleConfig().report_poll_s),
        ),
        checkpoint=CheckpointConfig(every_steps=1 << 20, keep_last=1, storage_path=storage),
        eval=EvalConfig(every_steps=1 << 20, max_samples=BATCH),
    )


def child_lmpipe_local(spec: dict[str, Any]) -> dict[str, Any]:
    """Run lmpipe's loop (`run_worker`) here: `LocalContext`, one gloo rank, no Ray."""
    from training.pretrain.loop import run_worker
    from training.runtime.worker_context import LocalContext, init_single_process

    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    job = worker_job(train_config(spec, run_dir), spec, "bench")
    init_single_process()
    run_worker(job, LocalContext(run_dir))
    return step_ends(run_dir / "steps.jsonl")


def child_lmpipe_ray(spec: dict[str, Any]) -> dict[str, Any]:
    """Run lmpipe's loop on Ray Train (`run_training`): 1 worker, 2 CPUs, a local Ray."""
    from tasks.common.ray_runtime import RayConfig
    from training.pretrain.driver import run_id_for, run_training, storage_root
    from training.runtime.run_context import RunContext
    from training.tracking.runs import TrackingConfig

    workspace = Path(spec["run_dir"])
    examples, tokenizer = Path(spec["examples_dir"]), Path(spec["tokenizer_dir"])
    cfg = train_config(spec, workspace / "pretrain")
    os.environ.update(spec.get("ray_env", {}))  # read by the local Ray that run_training starts
    run_dir = storage_root(cfg, workspace) / run_id_for(cfg, SEED, examples, tokenizer)
    ray_cfg, off = RayConfig(num_workers=1, num_cpus=THREADS), TrackingConfig(enabled=False)
    run = RunContext(workspace, seed=SEED, ray=ray_cfg, tracking=off, name="throughput")
    run_training(cfg, examples, tokenizer, run=run, mlflow_run_id=None)
    import ray

    ray.shutdown()
    return step_ends(run_dir / "steps.jsonl")


def child_peak(spec: dict[str, Any]) -> dict[str, Any]:
    """The matmul peak of 2 threads in fp32 and bf16 (`telemetry.measure_peak_flops`)."""
    import torch

    from training.pretrain.telemetry import measure_peak_flops

    seconds = spec.get("seconds", 2.0)
    return {
        "fp32": measure_peak_flops(torch.float32, seconds),
        "bf16": measure_peak_flops(torch.bfloat16, seconds),
    }


def child_ab(spec: dict[str, Any]) -> dict[str, Any]:
    """Interleave plain steps and lmpipe `Worker.train_step`s in one process, with phase times.

    A diagnostic (`--ab`): drift in the machine's load hits both loops alike, so the ratio is
    steadier than between two subprocesses. lmpipe's phases are timed by wrapping its engine's
    `backward` and `step` and the loop's `pretraining_loss` (forward, including the loss).
    """
    import training.pretrain.loop as lmpipe_loop
    from training.runtime.worker_context import LocalContext, init_single_process

    run_dir, steps = Path(spec["run_dir"]), spec["warmup"] + spec["steps"]
    job = worker_job(train_config(spec, run_dir), spec, "bench")
    init_single_process()
    worker = lmpipe_loop.Worker(job, LocalContext(run_dir))
    plain = PlainLoop(spec, steps)
    batches = bench_batches(Path(spec["examples_dir"]), steps)
    phases: dict[str, dict[str, float]] = {"plain": {}, "lmpipe": {}}
    lm = phases["lmpipe"]
    worker.engine.backward = timed_calls(worker.engine.backward, lm, "backward")
    worker.engine.step = timed_calls(worker.engine.step, lm, "step")
    from training.pretrain.losses import pretraining_loss

    # The loop calls the name it imported into its module: wrap that one.
    setattr(lmpipe_loop, "pretraining_loss", timed_calls(pretraining_loss, lm, "forward"))  # noqa: B010
    for i, batch in enumerate(batches):
        if i == spec["warmup"]:
            phases = {"plain": {}, "lmpipe": lm}
            lm.clear()
        first, second = ("plain", "lmpipe") if i % 2 == 0 else ("lmpipe", "plain")
        for name in (first, second):
            start = time.perf_counter()
            if name == "plain":
                plain.step(batch, phases["plain"])
            else:
                worker.train_step()
            add_time(phases[name], "total", time.perf_counter() - start)
    return {k: {p: v / spec["steps"] for p, v in d.items()} for k, d in phases.items()}


def child_plain_ray(spec: dict[str, Any]) -> dict[str, Any]:
    """The plain loop inside a Ray Train worker (1 worker, 2 CPUs, lmpipe's local Ray).

    A diagnostic: what Ray Train's processes cost a loop that is not lmpipe's, on this machine.
    """
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from tasks.common.ray_runtime import RayConfig, ensure_ray

    ensure_ray(RayConfig(num_workers=1, num_cpus=THREADS))
    out = Path(spec["run_dir"]) / "plain_ray.json"

    def train_fn() -> None:
        import torch

        torch.set_num_threads(THREADS)
        out.write_text(json.dumps(child_plain(spec)))

    TorchTrainer(
        train_fn,
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": THREADS}),
        run_config=RunConfig(storage_path=str(Path(spec["run_dir"]) / "ray"), name="plain"),
    ).fit()
    ray.shutdown()
    result: dict[str, Any] = json.loads(out.read_text())
    return result


CHILDREN = {
    "plain": child_plain,
    "plain-ray": child_plain_ray,
    "hf": child_hf,
    "lmpipe-local": child_lmpipe_local,
    "lmpipe-ray": child_lmpipe_ray,
    "peak": child_peak,
    "ab": child_ab,
}
