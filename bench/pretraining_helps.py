"""Does pretraining help? lmpipe's pretrained model against random initialisation, on the demo.

Usage: python bench/pretraining_helps.py [--fresh] [--seeds 0,1,2] [--task residence]
                                         [--work bench/results/pretraining_helps] [--json FILE]
                                         [recipe options: see --help; defaults = the recipe]

Acceptance: "pretraining must visibly help". Writes the synthetic demo corpus
(`tasks/demo/synthetic.py`), runs the real data stages on it (ingest, WordPiece tokenizer, encode,
BERT examples with dynamic masking, on a local Ray) and pretrains once with lmpipe
(`training.pretrain.stage.pretrain_stage`: Ray Train with 2 workers, DeepSpeed ZeRO-2 on CPU,
precision auto, i.e. bf16 where the CPU multiplies it natively; MLflow off), which exports a Hugging
Face directory. It then probes what the export knows (fill-mask "Tavor lives in [MASK]." over every
person) and, per seed, fine-tunes `AutoModelForSequenceClassification` on the residence task ("Where
does Tavor live?" -> one of 12 cities; the validation and test people never occur in the train
split) twice: from the export, and from the same config randomly initialised. The fine-tuning
harness is a plain PyTorch loop (full fine-tuning, AdamW, linear warm-up and decay, gradient
clipping), not lmpipe's fine-tuning stage. It prints a Markdown table: test accuracy per seed and
the mean, chance (the most frequent test label's share), and wall times.

A finished pretraining run of the same inputs and recipe is reused (its id hashes them);
`--fresh` deletes the work directory first, so that every stage is timed again.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from tasks.common.ray_runtime import RayConfig, ensure_ray  # noqa: E402
from tasks.demo.synthetic import SyntheticConfig, make_world, write_corpus  # noqa: E402
from tasks.encode.encode import EncodeConfig  # noqa: E402
from tasks.encode.stage import run_encode  # noqa: E402
from tasks.examples.config import ExamplesConfig  # noqa: E402
from tasks.examples.stage import run_examples  # noqa: E402
from tasks.ingest.ingest import IngestConfig  # noqa: E402
from tasks.ingest.stage import run_ingest  # noqa: E402
from tasks.tokenizer.stage import run_tokenizer  # noqa: E402
from tasks.tokenizer.tokenizer import TokenizerConfig  # noqa: E402
from training.pretrain.config import TrainConfig  # noqa: E402
from training.pretrain.stage import pretrain_stage  # noqa: E402
from training.runtime.run_context import RunContext  # noqa: E402
from training.tracking.runs import TrackingConfig  # noqa: E402

RAY = RayConfig(num_workers=2, num_cpus=4)
Split = tuple[list[str], list[int]]


@dataclass(frozen=True)
class FinetuneRecipe:
    """Hyperparameters of the plain fine-tuning harness (the same for both initialisations)."""

    lr: float = 1e-3
    epochs: int = 10
    batch_size: int = 16
    max_length: int = 32
    warmup_ratio: float = 0.1
    weight_decay: float = 0.01


@dataclass(frozen=True)
class TaskData:
    """A `sentence,label,split` task: texts and label indexes per split, and the label list."""

    splits: dict[str, Split]
    labels: list[str]


def build_inputs(
    work: Path, synth: SyntheticConfig, args: argparse.Namespace
) -> tuple[Path, Path, Path]:
    """Write the corpus and run ingest, tokenizer, encode and examples on it.

    Returns:
        The examples directory, the tokenizer directory and the directory of the task CSVs.
    """
    corpus = work / "demo_data"
    write_corpus(corpus, synth)
    ws = work / "ws"
    source = {"path": str(corpus / "corpus"), "format": "jsonl"}
    ingest_cfg = {"sources": [source], "split": {"validation": 0.02, "test": 0.02}}
    ingest = run_ingest(IngestConfig.model_validate(ingest_cfg), RAY, ws).path
    tok_cfg = TokenizerConfig(family="wordpiece", vocab_size=args.vocab, model_max_length=512)
    tokenizer = run_tokenizer(tok_cfg, ingest, ws).path
    encode = run_encode(EncodeConfig(), RAY, ingest, tokenizer, ws).path
    examples_cfg = ExamplesConfig.model_validate(
        {
            "objective": "bert",
            "max_seq_length": args.seq_len,
            "masking": "dynamic",
            "mask": {"masked_lm_prob": args.mask_prob},
        }
    )
    examples = run_examples(examples_cfg, args.pretrain_seed, RAY, encode, tokenizer, ws).path
    return examples, tokenizer, corpus / "tasks"


def train_config(args: argparse.Namespace, storage: Path) -> TrainConfig:
    """The pretraining (`train`) section of the recipe."""
    return TrainConfig.model_validate(
        {
            "model": {
                "family": "bert",
                "size": args.size,
                "dropout": args.dropout,
                "overrides": args.overrides,
            },
            "max_steps": args.steps,
            "global_batch_size": args.batch,
            "micro_batch_size": args.batch // 2,
            "precision": args.precision,
            "zero_stage": 2,
            "optim": {"lr": args.lr, "warmup_steps": max(1, args.steps // 20)},
            "checkpoint": {"every_steps": args.steps, "storage_path": str(storage)},
            "eval": {"every_steps": args.steps, "max_samples": 64},
            "scale": {"num_workers": 2},
        }
    )


def pretrain(cfg: TrainConfig, seed: int, examples: Path, tokenizer: Path, work: Path) -> Path:
    """Pretrain with lmpipe (or reuse the finished run); return the export directory."""
    off = TrackingConfig(enabled=False)
    run = RunContext(work / "ws", seed=seed, ray=RAY, tracking=off, name="pretraining-helps")
    summary = pretrain_stage(cfg, examples, tokenizer, run=run)
    return Path(summary["export_dir"])


@torch.no_grad()
def probe_knowledge(export: Path, synth: SyntheticConfig) -> float:
    """Share of all people whose city the export fills in: "Tavor lives in [MASK]."."""
    tokenizer = tf.AutoTokenizer.from_pretrained(export, local_files_only=True)
    model = tf.AutoModelForMaskedLM.from_pretrained(export, local_files_only=True).eval()
    world = make_world(synth)
    cities = sorted({p.city for p in world})
    city_ids = tokenizer.convert_tokens_to_ids([c.lower() for c in cities])
    texts = [f"{p.name} lives in {tokenizer.mask_token}." for p in world]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    logits = model(**batch).logits  # (N, T, V)
    rows, cols = (batch["input_ids"] == tokenizer.mask_token_id).nonzero(as_tuple=True)
    guesses: list[int] = logits[rows, cols][:, city_ids].argmax(-1).tolist()  # (N,) city index
    right = sum(cities[g] == p.city for g, p in zip(guesses, world, strict=True))
    return right / len(world)


def read_task(path: Path) -> TaskData:
    """Read a demo task CSV; labels are indexed in sorted order."""
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    labels = sorted({row["label"] for row in rows})
    splits: dict[str, Split] = {}
    for row in rows:
        texts, ids = splits.setdefault(row["split"], ([], []))
        texts.append(row["sentence"])
        ids.append(labels.index(row["label"]))
    return TaskData(splits, labels)


def new_classifier(export: Path, pretrained: bool, num_labels: int, seed: int) -> Any:
    """The export's architecture with a new classification head, pretrained or random."""
    torch.manual_seed(seed)  # the head (and, for random init, every weight) from the seed
    if pretrained:
        return tf.AutoModelForSequenceClassification.from_pretrained(
            export, num_labels=num_labels, local_files_only=True
        )
    config = tf.AutoConfig.from_pretrained(export, num_labels=num_labels, local_files_only=True)
    return tf.AutoModelForSequenceClassification.from_config(config)  # type: ignore[no-untyped-call]


def finetune(
    export: Path, pretrained: bool, task: TaskData, seed: int, recipe: FinetuneRecipe
) -> dict[str, float]:
    """Fine-tune every weight on the train split; return train and test accuracy and seconds."""
    started = time.perf_counter()
    tokenizer = tf.AutoTokenizer.from_pretrained(export, local_files_only=True)
    model = new_classifier(export, pretrained, len(task.labels), seed)
    texts, labels = task.splits["train"]
    batch = encode(tokenizer, texts, recipe.max_length)
    targets = torch.tensor(labels)
    total = -(-len(texts) // recipe.batch_size) * recipe.epochs
    warmup = max(1, int(recipe.warmup_ratio * total))
    optim = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / (total - warmup)))
    )
    order = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(recipe.epochs):
        for idx in torch.split(torch.randperm(len(texts), generator=order), recipe.batch_size):
            inputs = {k: v[idx] for k, v in batch.items()}
            model(**inputs, labels=targets[idx]).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad()
    return {
        "train_acc": accuracy(model, tokenizer, task.splits["train"], recipe.max_length),
        "test_acc": accuracy(model, tokenizer, task.splits["test"], recipe.max_length),
        "seconds": time.perf_counter() - started,
    }


def encode(tokenizer: Any, texts: list[str], max_length: int) -> dict[str, torch.Tensor]:
    """Token ids and attention mask of `texts`, padded to the longest."""
    batch = tokenizer(
        texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
    )
    return {k: batch[k] for k in ("input_ids", "attention_mask")}


@torch.no_grad()
def accuracy(model: Any, tokenizer: Any, split: Split, max_length: int) -> float:
    """Share of `split` the model labels right."""
    model.eval()
    texts, labels = split
    predictions = model(**encode(tokenizer, texts, max_length)).logits.argmax(-1)
    model.train()
    return float((predictions == torch.tensor(labels)).float().mean())


def chance(task: TaskData) -> float:
    """Accuracy of always answering the test split's most frequent label."""
    counts = Counter(task.splits["test"][1])
    return max(counts.values()) / sum(counts.values())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line: the recipe's knobs, with the tuned recipe as defaults."""
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--work", type=Path, default=ROOT / "bench/results/pretraining_helps")
    p.add_argument("--fresh", action="store_true", help="delete --work first")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--task", default="residence", choices=["residence", "facts"])
    p.add_argument("--seeds", default="0,1,2", help="fine-tuning seeds")
    p.add_argument("--corpus-seed", type=int, default=0)
    p.add_argument("--pretrain-seed", type=int, default=0)
    p.add_argument("--people", type=int, default=120)
    p.add_argument("--documents", type=int, default=3000)
    p.add_argument("--register-share", type=float, default=0.6)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--mask-prob", type=float, default=0.45)
    p.add_argument("--size", default="mini")
    p.add_argument("--overrides", type=json.loads, default={"num_hidden_layers": 2})
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--precision", default="auto")  # bf16 where the CPU has it natively
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ft-lr", type=float, default=FinetuneRecipe.lr)
    p.add_argument("--ft-epochs", type=int, default=FinetuneRecipe.epochs)
    p.add_argument("--ft-batch", type=int, default=FinetuneRecipe.batch_size)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the data, pretrain once, fine-tune per seed both ways; return every number."""
    if args.fresh and args.work.exists():
        shutil.rmtree(args.work)
    synth = SyntheticConfig(
        seed=args.corpus_seed,
        people=args.people,
        documents=args.documents,
        register_share=args.register_share,
    )
    ensure_ray(RAY)
    t0 = time.perf_counter()
    examples, tokenizer, tasks = build_inputs(args.work, synth, args)
    t1 = time.perf_counter()
    cfg = train_config(args, args.work / "runs")
    export = pretrain(cfg, args.pretrain_seed, examples, tokenizer, args.work)
    t2 = time.perf_counter()
    torch.set_num_threads(2)
    tf.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    task = read_task(tasks / f"{args.task}.csv")
    recipe = FinetuneRecipe(lr=args.ft_lr, epochs=args.ft_epochs, batch_size=args.ft_batch)
    runs = [
        {"seed": seed, "init": init} | finetune(export, init == "pretrained", task, seed, recipe)
        for seed in [int(s) for s in args.seeds.split(",")]
        for init in ("pretrained", "random")
    ]
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "synthetic": synth.model_dump(),
        "train": cfg.model_dump(mode="json"),
        "finetune": asdict(recipe),
        "sizes": {split: len(v[0]) for split, v in task.splits.items()},
        "chance": chance(task),
        "probe": probe_knowledge(export, synth),
        "data_s": t1 - t0,
        "pretrain_s": t2 - t1,
        "runs": runs,
    }


def report(result: dict[str, Any]) -> str:
    """The results as a Markdown table and a summary line."""
    lines = [
        "| fine-tuning seed | pretrained: test acc | random init: test acc | gap | "
        "train acc (pre / rand) | fine-tune s (pre / rand) |",
        "|---|---|---|---|---|---|",
    ]
    by = {(r["seed"], r["init"]): r for r in result["runs"]}
    seeds = sorted({r["seed"] for r in result["runs"]})
    for s in seeds:
        pre, rnd = by[(s, "pretrained")], by[(s, "random")]
        lines.append(
            f"| {s} | {pre['test_acc']:.3f} | {rnd['test_acc']:.3f} | "
            f"{pre['test_acc'] - rnd['test_acc']:+.3f} | {pre['train_acc']:.3f} / "
            f"{rnd['train_acc']:.3f} | {pre['seconds']:.1f} / {rnd['seconds']:.1f} |"
        )
    pre_mean = statistics.mean(by[(s, "pretrained")]["test_acc"] for s in seeds)
    rnd_mean = statistics.mean(by[(s, "random")]["test_acc"] for s in seeds)
    lines.append(f"| mean | {pre_mean:.3f} | {rnd_mean:.3f} | {pre_mean - rnd_mean:+.3f} | | |")
    finetune_s = sum(r["seconds"] for r in result["runs"])
    lines.append(
        f"\nchance {result['chance']:.3f}; fill-mask probe {result['probe']:.3f}; splits "
        f"{result['sizes']}; data stages {result['data_s']:.0f} s, pretraining "
        f"{result['pretrain_s']:.0f} s, {len(result['runs'])} fine-tunes {finetune_s:.0f} s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    args = parse_args(argv)
    result = run(args)
    print(report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
