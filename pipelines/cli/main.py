"""The `lmpipe` command line: one subcommand per stage, plus the whole pipeline.

Usage: `lmpipe ingest configs/demo.yaml ingest.shard_size_mb=16`. Every command takes a YAML
recipe and dotted `key=value` overrides; an invalid key or value stops it before any work.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from pipelines.config import ConfigError, RunConfig, load_config

console = Console(stderr=False)

_OVERRIDES_HELP = "dotted overrides, e.g. ingest.shard_size_mb=16 ray.num_workers=4"


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="YAML recipe (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every subcommand and its help."""
    parser = argparse.ArgumentParser(
        prog="lmpipe",
        description="Pretrain and fine-tune BERT-, GPT- and T5-style models from a raw corpus.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ingest = sub.add_parser(
        "ingest",
        help="corpus files → cleaned, deduplicated, split Arrow shards",
        description="Read the configured sources (txt, jsonl, json, csv/tsv, parquet, saved "
        "datasets; gz/bz2/xz/zst), clean and filter each document, split it into sentences, "
        "remove duplicates corpus-wide, assign train/validation/test by content hash and write "
        "Arrow shards plus manifest.json under <workspace>/ingest/<fingerprint>/. Bad records "
        "are counted and written to quarantine.jsonl. A rerun with identical inputs and config "
        "reuses the output.",
    )
    _add_config_args(ingest)
    tokenizer = sub.add_parser(
        "tokenizer",
        help="ingest and decontaminate (reused when done), then train or load the tokenizer",
        description="Train a WordPiece (BERT), byte-level BPE (GPT-2/RoBERTa) or Unigram (T5) "
        "tokenizer on the train split of the ingested shards, or load your own files "
        "(tokenizer.pretrained.*), and save it under <workspace>/tokenizer/<fingerprint>/ so "
        "that transformers.AutoTokenizer.from_pretrained loads it offline.",
    )
    _add_config_args(tokenizer)
    encode = sub.add_parser(
        "encode",
        help="ingest and tokenizer (reused when done), then encode the corpus to token shards",
        description="Encode every ingested shard with the tokenizer on Ray: ids per sentence "
        "and per document (uint16 when the vocabulary fits), with token statistics and a "
        "tokens-per-document histogram, under <workspace>/encode/<fingerprint>/.",
    )
    _add_config_args(encode)
    examples = sub.add_parser(
        "examples",
        help="the stages before (reused when done), then pretraining examples; "
        "`examples inspect CONFIG` prints a few",
        description="Cut the encoded train and validation splits into examples of "
        "examples.objective (bert, sop, roberta, causal, span_corruption, denoising) on Ray, under "
        "<workspace>/examples/<fingerprint>/. `lmpipe examples inspect CONFIG [--count N]` "
        "prints N decoded examples with masks, segments, spans and sentinels made visible.",
    )
    examples.add_argument(
        "config", type=Path, help="YAML recipe, or the word 'inspect' followed by the recipe"
    )
    examples.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)
    examples.add_argument("--count", type=int, default=3, help="inspect: examples to print")
    pretrain = sub.add_parser(
        "pretrain",
        help="the data stages (reused when done), then DeepSpeed pretraining on Ray Train",
        description="Pretrain train.model on the examples with DeepSpeed inside Ray Train, "
        "checkpointing every train.checkpoint.every_steps under <workspace>/pretrain/<run>/; "
        "then export to Hugging Face format, check the reload and register the model in MLflow. "
        "A finished run with the same inputs and config is reused; --resume continues a "
        "stopped one from its newest valid checkpoint.",
    )
    _add_config_args(pretrain)
    pretrain.add_argument(
        "--resume", action="store_true", help="continue a stopped run of this config"
    )
    export = sub.add_parser(
        "export",
        help="export a training checkpoint to a Hugging Face directory",
        description="Validate CHECKPOINT (a checkpoint_step-* directory) against its meta.json, "
        "gather its full weights (any ZeRO stage), save them as safetensors with the tokenizer "
        "and a model card, and check that the reload reproduces the training-time loss.",
    )
    export.add_argument("checkpoint", type=Path, help="a checkpoint_step-NNNNNNNNN directory")
    export.add_argument("--out", type=Path, default=None, help="default: CHECKPOINT.export")
    finetune = sub.add_parser(
        "finetune",
        help="prepare the task, then fine-tune the base model on Ray Train",
        description="Read the `task` dataset (CSV, TSV, JSON, JSONL, Parquet, CoNLL or a saved "
        "datasets directory) into <workspace>/downstream/<name>/, take the base model "
        "(finetune.base: a local HF directory or a registry version; default the model the "
        "pretrain flow exports), fine-tune it with finetune.strategy on Ray Train (DeepSpeed "
        "optional), stop early on the validation metric, evaluate the test split, export and "
        "register the model with lineage to its base, and log a report to MLflow and Prefect.",
    )
    _add_config_args(finetune)
    compare = sub.add_parser(
        "compare",
        help="fine-tune several strategies x seeds on the task; one comparison table",
        description="Run every compare.entries strategy once per compare.seeds seed on the "
        "task, all in one MLflow experiment, and write one table (test metric mean and spread "
        "over seeds, trainable parameters, time) with a bar chart.",
    )
    _add_config_args(compare)
    evaluate = sub.add_parser(
        "evaluate",
        help="intrinsic evaluation of the base model; prompting on the task",
        description="Held-out perplexity / masked-LM accuracy (when lmpipe pretrained the "
        "model), fill-mask probes or generation samples (greedy, temperature, top-k, top-p), "
        "and with evaluate.prompting zero- or few-shot classification of the task's split.",
    )
    _add_config_args(evaluate)
    run = sub.add_parser(
        "run",
        help="the whole pipeline, every stage that exists, on one config",
        description="Run the `pipeline` Prefect flow: ingest → decontaminate (when enabled) "
        "→ tokenizer → encode → examples "
        "→ pretrain → finetune (when a task is set) → evaluate. Stages whose inputs, config "
        "and code are unchanged are reused.",
    )
    _add_config_args(run)
    show = sub.add_parser(
        "config",
        help="print the resolved config (secrets left out)",
        description="Validate a recipe with its overrides and print it.",
    )
    _add_config_args(show)
    demo = sub.add_parser(
        "demo-corpus",
        help="write the synthetic demo corpus and its labelled tasks",
        description="Generate, deterministically from a seed, a corpus with learnable structure "
        "(facts that recur across documents, agreement grammar) plus fact-verification and "
        "acceptability tasks. Needs no download.",
    )
    demo.add_argument("--out", type=Path, default=Path("workspace/demo_data"))
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--documents", type=int, default=3000)
    for module in _OPERATIONS:
        # Each operations module adds its subcommands with a `func(args) -> int` default.
        importlib.import_module(module).register(sub)
    return parser


# Subcommands that operate the stack rather than run a stage; each module has `register(sub)`.
_OPERATIONS: tuple[str, ...] = (
    "pipelines.cli.serve",
    "pipelines.cli.gc",
    "pipelines.cli.submit",
    "pipelines.cli.servers",
)


def main(argv: list[str] | None = None) -> int:
    """Run the `lmpipe` command line; return the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "func", None) is not None:
        return int(args.func(args))
    if args.command == "demo-corpus":
        return _demo_corpus(args.out, args.seed, args.documents)
    if args.command == "export":
        return _export(args.checkpoint, args.out)
    inspect = args.command == "examples" and str(args.config) == "inspect"
    if inspect:
        if not args.overrides:
            console.print("[red]error:[/red] usage: lmpipe examples inspect CONFIG [KEY=VALUE]")
            return 2
        args.config, args.overrides = Path(args.overrides[0]), args.overrides[1:]
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}", markup=True, highlight=False)
        return 2
    if args.command == "config":
        from tasks.common.io import public_dump

        console.print_json(json.dumps(public_dump(cfg)))
        return 0
    commands: dict[str, Callable[[RunConfig], dict[str, dict[str, Any]]]] = {
        "ingest": _run_ingest,
        "tokenizer": _run_tokenizer,
        "encode": _run_encode,
        "examples": _run_examples,
        "run": _run_pipeline,
        "pretrain": lambda c: _run_pretrain(c, args.resume),
        "finetune": _run_finetune,
        "compare": _run_compare,
        "evaluate": _run_evaluate,
    }
    stages = commands[args.command](cfg)
    if inspect:
        return _inspect(stages, args.count)
    return _summarise(cfg, stages)


def _run_ingest(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.ingest_flow import ingest_flow

    return ingest_flow(cfg)


def _run_tokenizer(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.tokenizer_flow import tokenizer_flow

    return tokenizer_flow(cfg)


def _run_encode(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.encode_flow import encode_flow

    return encode_flow(cfg)


def _run_examples(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.examples_flow import examples_flow

    return examples_flow(cfg)


def _run_pretrain(cfg: RunConfig, resume: bool) -> dict[str, dict[str, Any]]:
    from pipelines.flows.pretrain_flow import pretrain_flow

    return pretrain_flow(cfg, resume)


def _run_finetune(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.finetune_flow import finetune_flow

    return finetune_flow(cfg)


def _run_compare(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.compare_flow import compare_flow

    return compare_flow(cfg)


def _run_evaluate(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.evaluate_flow import evaluate_flow

    return evaluate_flow(cfg)


def _export(checkpoint: Path, out: Path | None) -> int:
    from training.pretrain.stage import export_checkpoint
    from training.runtime.checkpoint import CheckpointError

    target = out or checkpoint.with_name(checkpoint.name + ".export")
    try:
        path, card = export_checkpoint(checkpoint, target)
    except CheckpointError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    console.print(f"exported {card.family}-{card.size} (step {card.steps}) to {path}")
    return 0


def _inspect(stages: dict[str, dict[str, Any]], count: int) -> int:
    from tokenizers import Tokenizer

    from tasks.common.io import read_ipc_stream
    from tasks.examples.inspect import render_examples

    out = Path(stages["examples"]["path"])
    manifest = json.loads((out / "manifest.json").read_text())
    tok = Tokenizer.from_file(str(Path(stages["tokenizer"]["path"]) / "tokenizer.json"))
    shards = manifest["splits"]["train"]["shards"]
    if not shards:
        console.print("no training examples")
        return 1
    table = read_ipc_stream(out / shards[0]["name"])
    for block in render_examples(table, manifest["objective"], tok, count):
        console.print(block, markup=False, highlight=False)
        console.print()
    return 0


def _run_pipeline(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    from pipelines.flows.pipeline_flow import pipeline_flow

    return pipeline_flow(cfg)


def _summarise(cfg: RunConfig, stages: dict[str, dict[str, Any]]) -> int:
    from pipelines.flows.summary import stage_rows, where_to_look
    from pipelines.ops.runtime import resolve_environment

    table = Table(title="lmpipe stages")
    table.add_column("stage")
    table.add_column("what")
    table.add_column("value", justify="right")
    for name, result in stages.items():
        rows = stage_rows(name, result)
        for i, (what, value) in enumerate(rows):
            table.add_row(name if i == 0 else "", what, value, end_section=i == len(rows) - 1)
    console.print(table)
    for line in where_to_look(resolve_environment(cfg), stages):
        console.print(line, highlight=False, markup=False)
    return 0


def _demo_corpus(out: Path, seed: int, documents: int) -> int:
    from tasks.demo.synthetic import SyntheticConfig, write_corpus

    files = write_corpus(out, SyntheticConfig(seed=seed, documents=documents))
    for path in files:
        console.print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
