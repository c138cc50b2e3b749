"""CPU training throughput: lmpipe's loop against a plain PyTorch loop and transformers.Trainer.

Usage: python bench/pretrain_throughput.py [--quick] [--warmup 10] [--steps 30]
                                           [--only NAME,...] [--ab NAME] [--out bench/results]

Builds BERT examples of 128 tokens once (set-up, not measured): the real texts of
../shared/data (the four Gutenberg books and Tiny Shakespeare, one document per file, and the
1,000 IMDB reviews) through the ingest, tokenizer (WordPiece, 30,522 tokens), encode and
examples stages. Then, on the same examples, batches (the loop's seeded global order, static
masks), model (BERT, 4 layers, hidden 256, 4 heads, FFN 1024) and 2 torch threads, it runs
each setting in its own subprocess:

- `plain-*`: a plain PyTorch loop (AdamW, gradient clipping, the same warm-up/decay schedule,
  `training.pretrain.losses.pretraining_loss`), fp32 or bf16 autocast, eager or `torch.compile`;
- `hf-*`: `transformers.Trainer` on `BertForPreTraining` (its own loss: MLM logits at every
  position), the same samples as a torch Dataset in the same order, fp32 or bf16 (autocast),
  with or without its `torch_compile` option;
- `lmpipe-local-*`: lmpipe's loop (`training.pretrain.loop.run_worker`, DeepSpeed engine) in this
  process with `LocalContext` (a one-rank gloo group, no Ray);
- `lmpipe-ray-*`: the same loop on Ray Train (`training.runtime.launcher.run_training`, 1 worker,
  2 CPUs, 2 threads), with a local Ray started in the subprocess.

Counted: real input tokens, i.e. the sum of the attention mask (padding excluded) of the
batches of the timed steps; every setting sees the same batches, so the same tokens. Timed:
from the end of the last warm-up step to the end of the last step (for lmpipe the sum of the
`step_time_s` its loop logs in `steps.jsonl`, read after the run; after `optimizer.step` for
the plain loop, at `on_step_end` for the Trainer), so compilation and start-up are left out.
MFU = `flops_per_token` x tokens/s / the matmul peak measured on 2 threads in the same dtype.
Each row also gives the cores that processes outside the benchmark kept busy while it was timed
(the load average cannot tell: it counts the benchmark's own two threads).

`--only` runs the named settings, including candidate fixes that are not run by default
(`lmpipe-local-bf16[-compile]-{fused,zero1-fused,zero0-fused}`: fused AdamW and the ZeRO stage,
set through `train.deepspeed_extra` / `train.zero_stage`; `lmpipe-ray-{bf16,fp32}-nice0`: Ray
workers at nice 0; `lmpipe-ray-{bf16,fp32}-poll2`: Ray Train's own 2 s controller poll
instead of `train.scale.report_poll_s`; `lmpipe-{local,ray}-defaults-zero0`: `TrainConfig`'s
own defaults (ZeRO 0); `lmpipe-ray-defaults-zero2`: the same with ZeRO 2; `plain-bf16-raytrain`:
the plain loop inside a Ray Train worker; `*-dense`: the MLM head at every position, against
sparse MLM). Separate subprocesses see the machine's speed drift (±15% between runs here), so
`--ab NAME` compares one lmpipe-local setting with the plain loop in one subprocess, alternating
their steps, and prints forward, backward and optimizer-step ms per step of each.

The Trainer needs `accelerate`, which is not a project dependency. Without it in the venv the
`hf-*` settings fail, unless it is installed apart, for those subprocesses only:
`pip install --no-deps --target bench/results/pretrain_work/pydeps accelerate`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared" / "data"

THREADS = 2
BATCH = 32
SEQ_LEN = 128
SEED = 0
VOCAB = 30_522
OVERRIDES = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
}
LR, WARMUP_STEPS, WEIGHT_DECAY, EPS, CLIP = 1e-3, 10, 0.01, 1e-6, 1.0  # TrainConfig defaults
CHILD_TIMEOUT_S = 900
PYDEPS = ROOT / "bench" / "results" / "pretrain_work" / "pydeps"  # see the module docstring

# name -> (kind, settings). Plain and Trainer settings mirror lmpipe's precision/compile axes.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain-fp32": {"kind": "plain", "precision": "fp32", "compile": False},
    "plain-fp32-compile": {"kind": "plain", "precision": "fp32", "compile": True},
    "plain-bf16": {"kind": "plain", "precision": "bf16", "compile": False},
    "plain-bf16-compile": {"kind": "plain", "precision": "bf16", "compile": True},
    "hf-fp32": {"kind": "hf", "precision": "fp32", "compile": False},
    "hf-bf16": {"kind": "hf", "precision": "bf16", "compile": False},
    "hf-bf16-compile": {"kind": "hf", "precision": "bf16", "compile": True},
    "lmpipe-local-fp32": {"kind": "lmpipe-local", "precision": "fp32", "compile": False},
    "lmpipe-local-fp32-compile": {"kind": "lmpipe-local", "precision": "fp32", "compile": True},
    "lmpipe-local-bf16": {"kind": "lmpipe-local", "precision": "bf16", "compile": False},
    "lmpipe-local-bf16-compile": {"kind": "lmpipe-local", "precision": "bf16", "compile": True},
    "lmpipe-local-fp32-micro8": {  # lmpipe's defaults until 2026-11-25
        "kind": "lmpipe-local",
        "precision": "fp32",
        "compile": False,
        "micro_batch": 8,
    },
    "lmpipe-ray-fp32": {"kind": "lmpipe-ray", "precision": "fp32", "compile": False},
    "lmpipe-ray-fp32-compile": {"kind": "lmpipe-ray", "precision": "fp32", "compile": True},
    "lmpipe-ray-bf16": {"kind": "lmpipe-ray", "precision": "bf16", "compile": False},
    "lmpipe-ray-bf16-compile": {"kind": "lmpipe-ray", "precision": "bf16", "compile": True},
}
# Candidate fixes (config only), run only when named in --only: fused AdamW, ZeRO stage.
_FUSED = {"optimizer": {"params": {"fused": True}}}
EXTRA_VARIANTS: dict[str, dict[str, Any]] = {
    f"lmpipe-local-bf16{compiled}-{name}": {
        "kind": "lmpipe-local",
        "precision": "bf16",
        "compile": bool(compiled),
        "deepspeed_extra": _FUSED,
        "zero_stage": zero,
    }
    for compiled in ("", "-compile")
    for name, zero in (("fused", 2), ("zero1-fused", 1), ("zero0-fused", 0))
}
# Ray starts its workers at nice 15 (RAY_worker_niceness); on 2 cores its own daemons then
# preempt the training threads. nice 0 is set in the environment of the local Ray it starts.
EXTRA_VARIANTS |= {
    f"lmpipe-ray-{precision}-nice0": {
        "kind": "lmpipe-ray",
        "precision": precision,
        "compile": False,
        "ray_env": {"RAY_worker_niceness": "0"},
    }
    for precision in ("bf16", "fp32")
}
# Ray Train's own poll interval (2 s) against lmpipe's default `train.scale.report_poll_s`:
# does polling the worker 10x as often cost training throughput?
EXTRA_VARIANTS |= {
    f"lmpipe-ray-{precision}-poll2": {
        "kind": "lmpipe-ray",
        "precision": precision,
        "compile": False,
        "report_poll_s": 2.0,
    }
    for precision in ("bf16", "fp32")
}
# lmpipe's own defaults (`TrainConfig()`: precision auto, i.e. bf16 on this CPU, the whole
# global batch per micro-batch at 1 worker, ZeRO 0), and with ZeRO 2, the default stage until
# 2026-11-25 (it shards nothing on one rank). `-dense`: the vocabulary projection at every
# position (`train.sparse_mlm=false`) against sparse MLM, the same loss.
EXTRA_VARIANTS |= {
    "lmpipe-ray-defaults-zero2": {
        "kind": "lmpipe-ray",
        "precision": "auto",
        "compile": False,
        "zero_stage": 2,
    },
    "lmpipe-ray-defaults-zero0": {
        "kind": "lmpipe-ray",
        "precision": "auto",
        "compile": False,
        "zero_stage": 0,
    },
    "lmpipe-ray-defaults-zero0-dense": {
        "kind": "lmpipe-ray",
        "precision": "auto",
        "compile": False,
        "zero_stage": 0,
        "sparse_mlm": False,
    },
    "plain-bf16-raytrain": {"kind": "plain-ray", "precision": "bf16", "compile": False},
    "lmpipe-local-defaults-zero0": {
        "kind": "lmpipe-local",
        "precision": "auto",
        "compile": False,
        "zero_stage": 0,
    },
    "plain-bf16-dense": {
        "kind": "plain",
        "precision": "bf16",
        "compile": False,
        "sparse_mlm": False,
    },
}
VARIANTS |= EXTRA_VARIANTS


def resolved_precision(spec: dict[str, Any]) -> str:
    """A setting's precision, with lmpipe's `auto` resolved as `TrainConfig` resolves it."""
    if spec["precision"] != "auto":
        return str(spec["precision"])
    from training.pretrain.config import TrainConfig

    return TrainConfig().precision


# -- set-up (not measured) ------------------------------------------------------------------


def ingest_shared_texts(ws: Path, ray_cfg: Any) -> Any:
    """Ingest the real texts of ../shared/data (a book is one document) into workspace `ws`."""
    from tasks.ingest.ingest import IngestConfig
    from tasks.ingest.stage import run_ingest

    books = {"format": "txt", "txt_mode": "file"}  # a book is one document: full 128-token rows
    return run_ingest(
        IngestConfig.model_validate(
            {
                "sources": [
                    {"path": str(SHARED / "gutenberg_books"), **books},
                    {"path": str(SHARED / "tiny_shakespeare" / "input.txt"), **books},
                    {"path": str(SHARED / "imdb_sample" / "texts.csv"), "format": "csv"},
                ],
                "max_chars": 2_000_000,  # Tiny Shakespeare is 1.1 M characters
            }
        ),
        ray_cfg,
        ws,
    )


def prepare_examples(work: Path) -> dict[str, Any]:
    """Ingest the real texts, train the WordPiece tokenizer, encode, cut BERT examples.

    Every stage reuses a complete output with the same fingerprint, so a rerun is quick.
    """
    from tasks.common.ray_runtime import RayConfig
    from tasks.encode.encode import EncodeConfig
    from tasks.encode.stage import run_encode
    from tasks.examples.config import ExamplesConfig
    from tasks.examples.stage import run_examples
    from tasks.tokenizer.stage import run_tokenizer
    from tasks.tokenizer.tokenizer import TokenizerConfig

    ray_cfg, ws = RayConfig(num_workers=THREADS), work / "ws"
    ingest = ingest_shared_texts(ws, ray_cfg)
    # min_frequency 1: the corpus (4.4 M characters) reaches 28,573 tokens at the default 2.
    tok_cfg = TokenizerConfig(family="wordpiece", vocab_size=VOCAB, min_frequency=1)
    tokenizer = run_tokenizer(tok_cfg, ingest.path, ws)
    encode = run_encode(EncodeConfig(), ray_cfg, ingest.path, tokenizer.path, ws)
    cfg = ExamplesConfig(objective="bert", max_seq_length=SEQ_LEN)
    examples = run_examples(cfg, SEED, ray_cfg, encode.path, tokenizer.path, ws)
    import ray

    ray.shutdown()
    train = examples.manifest["splits"]["train"]
    return {
        "examples_dir": str(examples.path),
        "tokenizer_dir": str(tokenizer.path),
        "vocab_size": tokenizer.manifest["metrics"]["vocab_size"],
        "documents": {s: e["rows"] for s, e in ingest.manifest["splits"].items()},
        "train_examples": train["rows"],
        "train_real_tokens": train["counts"].get("real_tokens"),
        "train_padding_fraction": train["realised"].get("padding_fraction"),
    }


class BenchData:
    """The loop's batches: its seeded global order over the train split, built by its builder."""

    def __init__(self, examples_dir: Path, precision: str = "fp32") -> None:
        """Open the train split (memory-mapped) as the loop does."""
        from training.pretrain.data import BatchBuilder, ExampleShards, GlobalOrder, read_manifest

        self.manifest = read_manifest(examples_dir)
        self.train = ExampleShards(examples_dir, "train", verify=False)
        self.order = GlobalOrder(len(self.train), SEED, BATCH)
        self.build = BatchBuilder(self.manifest["objective"], None, False)

    def batches(self, steps: int) -> list[Any]:
        """The first `steps` global batches (the static masks are in the shards)."""
        from training.pretrain.data import Cursor

        out, cursor = [], Cursor()
        for _ in range(steps):
            epoch, indices, cursor = self.order.next_batch(cursor)
            out.append(self.build(self.train.take(indices), indices, epoch))
        return out

    def tokens_per_step(self, steps: int) -> list[int]:
        """Real (non-padding) input tokens of each of the first `steps` batches."""
        # A batch without padding carries no mask (training.pretrain.data.BatchBuilder).
        return [
            int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
            for b in self.batches(steps)
        ]


def model_section() -> Any:
    """The benchmark's model section: BERT, 4 layers x 256, 4 heads, FFN 1024."""
    from training.models.models import ModelConfig

    return ModelConfig(family="bert", size="mini", overrides=OVERRIDES)


def build_bench_model(examples_dir: Path) -> Any:
    """A fresh model (seeded), exactly as `training.pretrain.loop.Worker` builds it."""
    import torch

    from training.models.models import build_model
    from training.pretrain.data import read_manifest

    manifest = read_manifest(examples_dir)
    specials = manifest["specials"]
    torch.manual_seed(SEED)
    return build_model(model_section(), "bert", specials["vocab_size"], specials, SEQ_LEN)


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
                phases[name] = phases.get(name, 0.0) + span
        return loss


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the plain loop over the same batches; the end of each step is timestamped."""
    steps = spec["warmup"] + spec["steps"]
    batches = BenchData(Path(spec["examples_dir"])).batches(steps)
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
        for batch in BenchData(examples).batches(steps)
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
    from training.pretrain.loop import WorkerJob, run_worker
    from training.runtime.worker_context import LocalContext, init_single_process

    run_dir = Path(spec["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    job = WorkerJob(
        train=train_config(spec, run_dir),
        seed=SEED,
        examples_dir=Path(spec["examples_dir"]),
        tokenizer_dir=Path(spec["tokenizer_dir"]),
        config_hash="bench",
    )
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


def _timed(fn: Any, phases: dict[str, float], name: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return result

    return timed


def child_ab(spec: dict[str, Any]) -> dict[str, Any]:
    """Interleave plain steps and lmpipe `Worker.train_step`s in one process, with phase times.

    A diagnostic (`--ab`): drift in the machine's load hits both loops alike, so the ratio is
    steadier than between two subprocesses. lmpipe's phases are timed by wrapping its engine's
    `backward` and `step` and the loop's `pretraining_loss` (forward, including the loss).
    """
    import training.pretrain.loop as lmpipe_loop
    from training.runtime.worker_context import LocalContext, init_single_process

    run_dir, steps = Path(spec["run_dir"]), spec["warmup"] + spec["steps"]
    job = lmpipe_loop.WorkerJob(
        train=train_config(spec, run_dir),
        seed=SEED,
        examples_dir=Path(spec["examples_dir"]),
        tokenizer_dir=Path(spec["tokenizer_dir"]),
        config_hash="bench",
    )
    init_single_process()
    worker = lmpipe_loop.Worker(job, LocalContext(run_dir))
    plain = PlainLoop(spec, steps)
    batches = BenchData(Path(spec["examples_dir"])).batches(steps)
    phases: dict[str, dict[str, float]] = {"plain": {}, "lmpipe": {}}
    lm = phases["lmpipe"]
    worker.engine.backward = _timed(worker.engine.backward, lm, "backward")
    worker.engine.step = _timed(worker.engine.step, lm, "step")
    from training.pretrain.losses import pretraining_loss

    # The loop calls the name it imported into its module: wrap that one.
    setattr(lmpipe_loop, "pretraining_loss", _timed(pretraining_loss, lm, "forward"))  # noqa: B010
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
            phases[name]["total"] = phases[name].get("total", 0.0) + time.perf_counter() - start
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


def run_child(spec: dict[str, Any]) -> None:
    """Subprocess entry: run one setting with 2 torch threads and write its result JSON."""
    import torch

    torch.set_num_threads(THREADS)
    result = CHILDREN[spec["kind"]](spec)
    Path(spec["result"]).write_text(json.dumps(result))


# -- the driver -----------------------------------------------------------------------------


class CpuWatch(threading.Thread):
    """Samples, every second, how many cores processes outside this benchmark keep busy.

    Others = the machine's busy cores minus this process tree's (live processes plus reaped
    children). The load average cannot tell: it counts the benchmark's own two threads.
    Timestamps are `time.perf_counter` (CLOCK_MONOTONIC), comparable with the children's.
    """

    def __init__(self) -> None:
        """Start empty; `start()` begins sampling."""
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []  # (time, others' busy cores)
        self._stop_flag = threading.Event()

    @staticmethod
    def _busy_and_own() -> tuple[float, float]:
        import psutil

        cpu = psutil.cpu_times()
        busy = cpu.user + cpu.nice + cpu.system + cpu.irq + cpu.softirq + cpu.steal
        me = psutil.Process()
        times = me.cpu_times()
        own = times.user + times.system + times.children_user + times.children_system
        for child in me.children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.Error:
                continue
            own += times.user + times.system
        return busy, own

    def run(self) -> None:
        """Sample until stopped."""
        last, then = self._busy_and_own(), time.perf_counter()
        while not self._stop_flag.wait(1.0):
            now, (busy, own) = time.perf_counter(), self._busy_and_own()
            others = max(0.0, (busy - last[0]) - (own - last[1])) / (now - then)
            self.samples.append((now, others))
            last, then = (busy, own), now

    def finish(self) -> None:
        """Stop sampling."""
        self._stop_flag.set()
        self.join()


def launch(name: str, base: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one setting in a fresh subprocess; return its raw result (or its error)."""
    import shutil

    run_dir = work / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {**base, **VARIANTS.get(name, {}), "run_dir": str(run_dir)}
    spec["result"] = str(run_dir / "result.json")
    env = os.environ | {
        "OMP_NUM_THREADS": str(THREADS),
        "MKL_NUM_THREADS": str(THREADS),
        "TOKENIZERS_PARALLELISM": "false",
    }
    extra = PYDEPS  # accelerate for the Trainer, kept out of the project's venv
    if spec["kind"] == "hf" and extra.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra), env.get("PYTHONPATH")]))
    load, watch = os.getloadavg()[0], CpuWatch()
    started = time.perf_counter()
    watch.start()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=CHILD_TIMEOUT_S,
            check=False,
        )
    watch.finish()
    meta = {
        "wall_s": round(time.perf_counter() - started, 1),
        "load_1min": [load, os.getloadavg()[0]],
        "cpu_samples": watch.samples,
    }
    if proc.returncode != 0:
        tail = (run_dir / "log.txt").read_text().splitlines()[-15:]
        return meta | {"error": f"exit {proc.returncode}: " + "\n".join(tail)}
    result: dict[str, Any] = json.loads(Path(spec["result"]).read_text())
    return meta | result


def summarize(raw: dict[str, Any], tokens: list[int], warmup: int, steps: int) -> dict[str, Any]:
    """tokens/s over the timed steps (after `warmup`), the median step time, the mean loss."""
    ends = raw.get("ends", [])
    if "error" in raw or len(ends) < warmup + steps:
        return {"error": raw.get("error", f"{len(ends)} step ends, expected {warmup + steps}")}
    window = ends[warmup - 1 : warmup + steps]  # the end of the last warm-up step, then steps
    elapsed = window[-1] - window[0]
    step_s = sorted(b - a for a, b in itertools.pairwise(window))
    losses = raw.get("losses")
    samples = [v for t, v in raw.get("cpu_samples", []) if window[0] <= t <= window[-1] + 1.0]
    samples = samples or [0.0]
    return {
        "others_cores_mean": sum(samples) / len(samples),
        "others_cores_max": max(samples),
        "tokens_per_s": sum(tokens[warmup : warmup + steps]) / elapsed,
        "timed_s": elapsed,
        "median_step_s": step_s[len(step_s) // 2],
        "max_step_s": step_s[-1],
        "mean_loss": sum(losses) / len(losses) if losses else raw.get("mean_loss"),
    }


def flops(examples_dir: Path) -> dict[str, float]:
    """Training FLOPs per input token: sparse MLM (lmpipe, plain) and dense (Trainer's loss)."""
    from training.models.flops import flops_per_token
    from training.models.models import model_config_for
    from training.pretrain.data import read_manifest

    manifest = read_manifest(examples_dir)
    specials = manifest["specials"]
    config = model_config_for(model_section(), specials["vocab_size"], specials, SEQ_LEN)
    rate = manifest["config"]["mask"]["masked_lm_prob"]
    return {
        "sparse": flops_per_token(config, SEQ_LEN, "bert", mlm_probability=rate),
        "dense": flops_per_token(config, SEQ_LEN, "bert", sparse_mlm=False),
    }


def machine() -> dict[str, Any]:
    """CPU, cores, memory, Python and library versions."""
    import deepspeed
    import ray
    import torch
    import transformers

    info = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in info if line.startswith("model name")]
    cpu = names[0] if names else platform.processor()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "deepspeed": deepspeed.__version__,
        "ray": ray.__version__,
    }


def run_order(only: list[str] | None) -> list[str]:
    """Settings grouped by (precision, compile), so that a drift in load hits every loop alike."""
    names = [n for n in VARIANTS if (n in only if only else n not in EXTRA_VARIANTS)]
    unknown = sorted(set(only or []) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {list(VARIANTS)}")

    def key(name: str) -> tuple[str, bool, int]:
        spec = VARIANTS[name]
        kinds = ["plain", "plain-ray", "lmpipe-local", "lmpipe-ray", "hf"]
        return spec["precision"], spec["compile"], kinds.index(spec["kind"])

    return sorted(names, key=key)


def add_ratios(
    rows: dict[str, dict[str, Any]], peak: dict[str, float], fpt: dict[str, float]
) -> str:
    """Add MFU and the ratios to the best baseline; return the best baseline's name."""
    ok = {n: r for n, r in rows.items() if "tokens_per_s" in r}
    baselines = {n: r for n, r in ok.items() if VARIANTS[n]["kind"] in ("plain", "hf")}
    best = max(baselines, key=lambda n: baselines[n]["tokens_per_s"]) if baselines else ""
    for name, row in ok.items():
        spec = VARIANTS[name]
        dense = spec["kind"] == "hf" or not spec.get("sparse_mlm", True)
        per_token = fpt["dense" if dense else "sparse"]
        row["mfu"] = per_token * row["tokens_per_s"] / peak[resolved_precision(spec)]
        if best:
            row["vs_best_baseline"] = row["tokens_per_s"] / rows[best]["tokens_per_s"]
        plain = f"plain-{resolved_precision(spec)}{'-compile' if spec['compile'] else ''}"
        plain += "" if spec.get("sparse_mlm", True) else "-dense"
        if spec["kind"].startswith("lmpipe") and "tokens_per_s" in rows.get(plain, {}):
            row["vs_plain_same_setting"] = row["tokens_per_s"] / rows[plain]["tokens_per_s"]
    return best


def table(rows: dict[str, dict[str, Any]], best: str) -> str:
    """The results as a Markdown table."""
    head = (
        "| setting | tokens/s | median step (s) | vs best baseline | vs plain, same setting "
        "| MFU | mean loss | other jobs' cores (mean / max) |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, row in rows.items():
        if "tokens_per_s" not in row:
            lines.append(f"| {name} | failed: {row['error'].splitlines()[-1][:80]} |||||||")
            continue
        others = f"{row['others_cores_mean']:.2f} / {row['others_cores_max']:.2f}"
        mark = " (best baseline)" if name == best else ""
        best_ratio, ratio = row.get("vs_best_baseline"), row.get("vs_plain_same_setting")
        lines.append(
            f"| {name}{mark} | {row['tokens_per_s']:,.0f} | {row['median_step_s']:.3f} "
            f"| {f'{best_ratio:.2f}x' if best_ratio else '-'} "
            f"| {f'{ratio:.2f}x' if ratio else '-'} | {row['mfu']:.1%} "
            f"| {row['mean_loss']:.3f} | {others} |"
        )
    return "\n".join(lines)


def run_ab(setting: str, base: dict[str, Any], work: Path) -> dict[str, Any]:
    """`--ab`: plain and lmpipe steps interleaved in one subprocess, per-phase ms per step."""
    spec = VARIANTS.get(setting, {})
    if spec.get("kind") != "lmpipe-local":
        raise SystemExit(f"--ab takes an lmpipe-local-* setting, not {setting!r}")
    raw = launch(f"ab-{setting}", base | spec | {"kind": "ab"}, work)
    if "error" in raw:
        raise SystemExit(raw["error"])
    plain, lm = raw["plain"], raw["lmpipe"]
    print(
        f"{setting} against the plain loop ({spec['precision']}, compile {spec['compile']}), "
        f"interleaved, ms per step:"
    )
    for phase in ("forward", "backward", "step", "total"):
        print(f"  {phase:9s} plain {plain[phase] * 1e3:7.1f}   lmpipe {lm[phase] * 1e3:7.1f}")
    ratio = plain["total"] / lm["total"]
    print(f"  lmpipe throughput / plain: {ratio:.3f}")
    return {"setting": setting, "plain": plain, "lmpipe": lm, "ratio": ratio}


def run_settings(
    names: list[str], base: dict[str, Any], work: Path, tokens: list[int], peak_s: float
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each setting in its own subprocess, between two measurements of the matmul peak."""
    peaks = [launch("peak", base | {"kind": "peak", "seconds": peak_s}, work)]
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        raw = launch(name, base, work)
        rows[name] = {**VARIANTS[name], **summarize(raw, tokens, base["warmup"], base["steps"])}
        rows[name] |= {k: raw[k] for k in ("wall_s", "load_1min")}
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    peaks.append(launch("peak", base | {"kind": "peak", "seconds": peak_s}, work))
    return rows, peaks


def main() -> None:
    """Set up the examples once, run every setting in its own subprocess, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smoke run: 2 + 3 steps.")
    parser.add_argument("--warmup", type=int, default=10, help="Untimed steps first.")
    parser.add_argument("--steps", type=int, default=30, help="Timed steps.")
    parser.add_argument("--only", default=None, help="Comma-separated settings to run.")
    parser.add_argument("--ab", default=None, help="Diagnose one lmpipe-local-* setting.")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    warmup, steps = (2, 3) if args.quick else (args.warmup, args.steps)
    if warmup < 1 or steps < 1:
        raise SystemExit("--warmup and --steps must be at least 1")
    names = run_order(args.only.split(",") if args.only else None)
    work = args.out / "pretrain_work"
    started, load_start = time.time(), os.getloadavg()
    data = prepare_examples(work)
    base = {**data, "warmup": warmup, "steps": steps}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ab:
        ab = run_ab(args.ab, base, work)
        (args.out / "pretrain_ab.json").write_text(json.dumps(ab, indent=1))
        return
    examples = Path(data["examples_dir"])
    tokens = BenchData(examples).tokens_per_step(warmup + steps)
    fpt = flops(examples)
    params = sum(p.numel() for p in build_bench_model(examples).parameters())
    rows, peaks = run_settings(names, base, work, tokens, 0.5 if args.quick else 2.0)
    peak = {p: max(run.get(p, 0.0) for run in peaks) for p in ("fp32", "bf16")}
    best = add_ratios(rows, peak, fpt)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "elapsed_s": round(time.time() - started, 1),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "machine": machine(),
        "data": data,
        "parameters": params,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_runs": peaks,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "timed_tokens": sum(tokens[warmup:]),
        "best_baseline": best,
        "results": rows,
    }
    (args.out / "pretrain_throughput.json").write_text(json.dumps(report, indent=1))
    print(table(rows, best))
    print(
        f"params {params:,}; vocab {data['vocab_size']}; flops/token {fpt['sparse']:.3e} "
        f"(sparse MLM), {fpt['dense']:.3e} (dense); peak fp32 {peak['fp32'] / 1e9:.0f}, "
        f"bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s; load {load_start} -> {os.getloadavg()}"
    )


if __name__ == "__main__":
    main()
