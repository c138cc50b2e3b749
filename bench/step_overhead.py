"""lmpipe's training step against a plain AdamW loop over the same transformers module.

Usage: python bench/step_overhead.py [--shape nanogpt,bert-mini] [--warmup 10] [--steps 60]
                                     [--precision fp32] [--work DIR] [--json OUT]

For each shape, in one subprocess of its own, lmpipe's `Worker.train_step`
(training/pretrain/loop.py, the step `lmpipe pretrain` takes by default: one worker, ZeRO 0,
in this process, the recipe's precision) and a plain loop take their steps interleaved, in
alternating order, so that drift in the machine's load falls on both alike. Both get the same
module's weights (the plain loop's module is transformers' own class, `GPT2LMHeadModel` or
`BertForPreTraining`, with the worker's initial weights, whether or not the worker trains
lmpipe's fast subclass of it, `model.implementation`), the same
threads (the usable cores: what `threads_per_worker: auto` gives the one worker) and the same
batches, in the same order. The plain loop is what a user writes: the loss of the module's
objective (`training.pretrain.losses.pretraining_loss`), `backward`, `clip_grad_norm_`, torch's
fused AdamW, `zero_grad`; its batches are built before it is timed, while lmpipe's step builds
its own (its data path is inside its time).

Shapes:
- `nanogpt`: `GPT2LMHeadModel` at nanoGPT's CPU recipe (configs/shakespeare_char.yaml: 4 layers,
  4 heads, 128 dims, blocks of 64, batch 12), on its Tiny Shakespeare examples;
- `bert-mini`: `BertForPreTraining` at BERT-mini's shape (4 layers, 256 dims, 4 heads, FFN
  1024), batch 32 x 128 tokens, on bench/pretrain_data.py's BERT examples (static masks).

A third arm takes its steps in the same rotation: the nanoGPT-style reference (`Reference`:
bench/char_reference.py's GPT for GPT-2, bench/nanobert.py's BERT for BERT) at the module's
shape: issue 39's yardstick for the module itself. BERT's trains on the same batches. GPT-2's
cuts random windows of the examples' text in each step, as nanoGPT's `get_batch` and
bench/char_reference.py do inside their loops; a fourth arm (`reference_given`, GPT-2 only)
is the same reference handed the built batches, as this bench measured it until 2026-11-29.
A fifth (`lmpipe_no_bias`, GPT-2 only) is lmpipe's step on the recipe with `model.bias: false`:
nanoGPT's model itself (bias=False, as the reference), where the recipe keeps GPT-2's biases
for its time to quality.

Reported per shape: the median ms per step of each, lmpipe's tokens/s over the plain loop's
and over the reference's (the inverse ratios of the medians). docs/benchmarks.md, "Step
overhead" and "The module", has figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
SHAKESPEARE = ROOT / "configs" / "shakespeare_char.yaml"


def shakespeare_examples(work: Path) -> dict[str, Any]:
    """The recipe's examples and tokenizer, cut by lmpipe's stages (reused when complete)."""
    from pretrain_data import WORKERS

    from pipelines.config import load_config
    from tasks.common.ray_runtime import RayConfig
    from tasks.encode.stage import run_encode
    from tasks.examples.stage import run_examples
    from tasks.ingest.stage import run_ingest
    from tasks.tokenizer.stage import run_tokenizer

    cfg = load_config(SHAKESPEARE, [])
    source = cfg.ingest.sources[0].model_copy(
        update={"path": str(ROOT / cfg.ingest.sources[0].path)}
    )
    ingest_cfg = cfg.ingest.model_copy(update={"sources": [source]})
    ray_cfg, ws = RayConfig(num_workers=WORKERS), work / "shakespeare"
    ingest = run_ingest(ingest_cfg, ray_cfg, ws)
    tokenizer = run_tokenizer(cfg.tokenizer, ingest.path, ws)
    encode = run_encode(cfg.encode, ray_cfg, ingest.path, tokenizer.path, ws)
    examples = run_examples(cfg.examples, cfg.seed, ray_cfg, encode.path, tokenizer.path, ws)
    import ray

    ray.shutdown()
    return {
        "examples_dir": str(examples.path),
        "tokenizer_dir": str(tokenizer.path),
        "train": cfg.train.model_dump(mode="json"),
    }


def bert_examples(work: Path) -> dict[str, Any]:
    """bench/pretrain_throughput.py's BERT examples and its model section, ZeRO 0."""
    from pretrain_cpu_arms import BATCH, model_section
    from pretrain_data import prepare_examples

    data = prepare_examples(work / "bert")
    train = {"model": model_section().model_dump(mode="json"), "global_batch_size": BATCH}
    return {**data, "train": train}


SHAPES = {"nanogpt": shakespeare_examples, "bert-mini": bert_examples}


def stock_copy(module: Any) -> Any:
    """A copy of `module` as transformers' own class (`module` may be lmpipe's fast subclass)."""
    from training.models.fast import as_stock

    stock = as_stock(module)
    return copy.deepcopy(module) if stock is module else stock


class Plain:
    """A plain loop over `model`: the objective's loss, backward, clip, fused AdamW."""

    def __init__(self, model: Any, objective: str, lr: float, clip: float) -> None:
        """Train `model` (a copy of the worker's) with AdamW at `lr`, clipping at `clip`."""
        import torch

        self.model, self.objective, self.clip = model.train(), objective, clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)

    def step(self, batch: dict[str, Any], autocast: Any) -> None:
        """One optimizer step on `batch`."""
        import torch

        from training.pretrain.losses import pretraining_loss

        with autocast():
            out = pretraining_loss(self.model, self.objective, batch, True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Reference:
    """The nanoGPT-style reference at the module's shape: issue 39's yardstick for the module.

    GPT-2: bench/char_reference.py's `CharGPT` (pre-LN blocks without biases, exact GELU,
    `scaled_dot_product_attention`, tied head), seeded, on the batch's token ids. BERT:
    bench/nanobert.py's nanoBERT (fused QKV, SDPA, sparse MLM head, NSP), from the module's own
    weights by its exact name map, on the same batch. Trained like the plain loop.
    """

    def __init__(self, module: Any, lr: float, clip: float, stream: Any = None) -> None:
        """Build the reference of `module`'s family and shape.

        GPT-2: `stream` (a 1-D tensor of token ids) is the training text its steps cut their
        random windows from, as nanoGPT's `get_batch` and bench/char_reference.py do inside
        their timed loop; without one it trains on the batch it is given.
        """
        import torch

        config = module.config
        if config.model_type == "gpt2":
            from char_reference import CharGPT

            torch.manual_seed(0)
            self.model = CharGPT(
                config.vocab_size, config.n_positions, config.n_layer, config.n_head, config.n_embd
            )
            self.stream = stream
            self.loss = self._next_token_loss
        else:
            from nanobert import nanobert_inputs, nanobert_model, nanobert_state

            self.model = nanobert_model(config)
            self.model.load_state_dict(nanobert_state(module.state_dict()))
            self.loss = lambda batch: self.model(*nanobert_inputs(batch))
        self.model.train()
        self.clip = clip
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=True)

    def _next_token_loss(self, batch: dict[str, Any]) -> Any:
        import torch
        import torch.nn.functional as F

        ids = batch["input_ids"]
        if self.stream is None:
            logits = self.model(ids)
            return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
        rows, block = ids.shape  # bench/char_reference.py's batch, from the stream, each step
        starts = torch.randint(len(self.stream) - block - 1, (rows,)).tolist()
        x = torch.stack([self.stream[i : i + block] for i in starts])  # (B, T)
        y = torch.stack([self.stream[i + 1 : i + 1 + block] for i in starts])
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def step(self, batch: dict[str, Any], autocast: Any) -> None:
        """One optimizer step on `batch`."""
        import torch

        with autocast():
            loss = self.loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _worker(spec: dict[str, Any], run_dir: Path, model: dict[str, Any] | None = None) -> Any:
    """Lmpipe's one-rank worker for the spec's shape (its model section updated by `model`)."""
    from training.pretrain.config import TrainConfig
    from training.pretrain.job import WorkerJob
    from training.pretrain.loop import Worker
    from training.runtime.worker_context import LocalContext

    run_dir.mkdir(parents=True, exist_ok=True)
    steps = spec["warmup"] + spec["steps"]
    section = spec["train"] | {"model": spec["train"]["model"] | (model or {})}
    train = TrainConfig.model_validate(
        section
        | {
            "max_steps": steps + 1,
            "precision": spec["precision"],
            "zero_stage": 0,
            "eval": {"every_steps": 1 << 20},
            "checkpoint": {"every_steps": 1 << 20, "storage_path": str(run_dir)},
        }
    )
    examples, tokenizer = Path(spec["examples_dir"]), Path(spec["tokenizer_dir"])
    job = WorkerJob(
        train=train, seed=0, examples_dir=examples, tokenizer_dir=tokenizer, config_hash="bench"
    )
    return Worker(job, LocalContext(run_dir))


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Interleave lmpipe's steps and the plain loop's on one shape; return their step times."""
    import torch

    from tasks.common.ray_runtime import usable_cores
    from training.runtime.worker_context import init_single_process

    threads = usable_cores()
    torch.set_num_threads(threads)
    run_dir = Path(spec["run_dir"])
    steps = spec["warmup"] + spec["steps"]
    init_single_process()
    worker = _worker(spec, run_dir)
    train = worker.cfg
    plain = Plain(stock_copy(worker.engine.module), worker.objective, train.optim.lr, worker.clip)
    # The plain loop's batches: the worker's own plans, built before any step is timed.
    batches = [b for s in range(steps) for b in worker._plan(s + 1, _cursor_at(worker, s)).batches]
    loops: dict[str, Any] = {"plain": plain}
    workers = {"lmpipe": worker}
    if worker.engine.module.config.model_type in {"gpt2", "bert"}:
        stream = None
        if worker.engine.module.config.model_type == "gpt2":  # the text its windows come from
            import numpy as np

            rows = worker.train_data.take(np.arange(len(worker.train_data)), doc_starts=False)
            stream = torch.from_numpy(rows["input_ids"]).long().flatten()
            # nanoGPT's model itself: the recipe's GPT-2 without biases (`model.bias: false`)
            workers["lmpipe_no_bias"] = _worker(spec, run_dir / "no-bias", {"bias": False})
        loops["reference"] = Reference(worker.engine.module, train.optim.lr, worker.clip, stream)
        if stream is not None:  # and as it was measured before: handed the built batches
            loops["reference_given"] = Reference(worker.engine.module, train.optim.lr, worker.clip)
    times: dict[str, list[float]] = {**{arm: [] for arm in workers}, **{arm: [] for arm in loops}}
    for i in range(steps):
        for arm in list(times) if i % 2 == 0 else reversed(times):
            start = time.perf_counter()
            if arm in workers:
                workers[arm].train_step()
            else:
                loops[arm].step(batches[i], worker.precision)
            if i >= spec["warmup"]:
                times[arm].append(time.perf_counter() - start)
    for each in workers.values():
        each.flush()
        each.batches.close()
    tokens = train.global_batch_size * worker.train_data.width
    return {"threads": threads, "tokens_per_step": tokens, "times": times}


def _cursor_at(worker: Any, step: int) -> Any:
    """The data cursor before step `step + 1` (the worker's order, walked from the start)."""
    from training.pretrain.data import Cursor

    cursor = Cursor()
    for _ in range(step):
        cursor = worker.order.next_batch(cursor)[2]
    return cursor


def run_shape(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Set up the shape's examples (untimed), then run its child; summarise its step times."""
    data = SHAPES[name](args.work)
    spec = data | {
        "warmup": args.warmup,
        "steps": args.steps,
        "precision": args.precision,
        "run_dir": str(args.work / f"run-{name}"),
    }
    log = args.work / f"{name}.log"
    argv = [sys.executable, __file__, "--child", json.dumps(spec)]
    with open(log, "w") as out:
        code = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if code != 0:
        raise SystemExit(f"{name}: exit {code}; see {log}")
    raw = json.loads((args.work / f"run-{name}" / "result.json").read_text())
    ms = {arm: statistics.median(t) * 1e3 for arm, t in raw["times"].items()}
    result = {
        "threads": raw["threads"],
        "tokens_per_step": raw["tokens_per_step"],
        **{f"{arm}_ms": value for arm, value in ms.items()},
        "lmpipe_over_plain_tokens_per_s": ms["plain"] / ms["lmpipe"],
    }
    if "reference" in ms:
        result["lmpipe_over_reference_tokens_per_s"] = ms["reference"] / ms["lmpipe"]
    if "reference_given" in ms:
        result["lmpipe_over_reference_given_tokens_per_s"] = ms["reference_given"] / ms["lmpipe"]
    if "lmpipe_no_bias" in ms:
        no_bias = ms["reference"] / ms["lmpipe_no_bias"]
        result["lmpipe_no_bias_over_reference_tokens_per_s"] = no_bias
    return result | {"times": raw["times"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="nanogpt,bert-mini", help="Comma-separated shapes.")
    parser.add_argument("--warmup", type=int, default=10, help="Untimed steps of each first.")
    parser.add_argument("--steps", type=int, default=60, help="Timed steps of each.")
    parser.add_argument("--precision", default="fp32", help="Both arms' precision.")
    parser.add_argument("--work", type=Path, default=Path("/tmp/lmpipe-step-overhead"))
    parser.add_argument("--json", type=Path, default=None, help="Write the results here too.")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        spec = json.loads(args.child)
        result = child(spec)
        (Path(spec["run_dir"]) / "result.json").write_text(json.dumps(result))
        return
    args.work.mkdir(parents=True, exist_ok=True)
    results = {name: run_shape(name, args) for name in args.shape.split(",")}
    for name, r in results.items():
        print(
            f"{name}: lmpipe {r['lmpipe_ms']:.1f} ms, plain {r['plain_ms']:.1f} ms a step "
            f"({r['threads']} threads, {r['tokens_per_step']} tokens): lmpipe's tokens/s "
            f"{r['lmpipe_over_plain_tokens_per_s']:.3f}x the plain loop's"
            + (
                f"; reference {r['reference_ms']:.1f} ms: lmpipe's tokens/s "
                f"{r['lmpipe_over_reference_tokens_per_s']:.3f}x the reference's"
                if "reference_ms" in r
                else ""
            )
            + (
                f"; reference handed the built batches {r['reference_given_ms']:.1f} ms: "
                f"{r['lmpipe_over_reference_given_tokens_per_s']:.3f}x"
                if "reference_given_ms" in r
                else ""
            )
            + (
                f"; lmpipe without biases (nanoGPT's model) {r['lmpipe_no_bias_ms']:.1f} ms: "
                f"{r['lmpipe_no_bias_over_reference_tokens_per_s']:.3f}x the reference's"
                if "lmpipe_no_bias_ms" in r
                else ""
            )
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
