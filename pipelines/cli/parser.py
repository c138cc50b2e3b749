"""The `lmpipe` argument parser: every subcommand, its help, and the config sections it reads.

Building the parser imports only the light modules of the operations commands (`register`),
never torch, Ray, Prefect, MLflow or transformers: `lmpipe --help` and every refusal of a bad
command line answer at once. Running a command is `pipelines/cli/main.py`.
"""

from __future__ import annotations

import argparse
import importlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pipelines.cli.keys import COMMAND_SECTIONS, sections_help

_OVERRIDES_HELP = "dotted overrides, e.g. ingest.shard_size_mb=16 ray.num_workers=4"
# Subcommands that operate the stack rather than run a stage; each module has `register(sub)`.
_OPERATIONS: tuple[str, ...] = (
    "pipelines.cli.serve",
    "pipelines.cli.gc",
    "pipelines.cli.submit",
    "pipelines.cli.servers",
    "pipelines.daemon.client",
)
#: A subcommand of a subcommand: `lmpipe examples inspect ...` is parsed as one command.
NESTED = {("examples", "inspect"): "examples inspect"}


class _Formatter(argparse.HelpFormatter):
    """Wrap each line of a description or epilog on its own, keeping the line breaks."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        fill = super()._fill_text
        return "\n".join(fill(line, width, indent) for line in text.split("\n"))


def lmpipe_version() -> str:
    """The installed distribution's version (its metadata), or a note that it is not installed."""
    try:
        return version("lmpipe")
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def join_nested(argv: list[str]) -> list[str]:
    """Turn `examples inspect` into the one argument the parser knows that subcommand by."""
    for i, word in enumerate(argv):
        if word.startswith("-"):
            continue  # a top-level option (none of them takes a value)
        pair = (word, argv[i + 1] if i + 1 < len(argv) else "")
        if pair in NESTED:
            return [*argv[:i], NESTED[pair], *argv[i + 2 :]]
        return argv
    return argv


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="YAML recipe (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)


def _stage(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str, text: str
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help, description=text)
    _add_config_args(parser)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every subcommand, its help and its config sections."""
    parser = argparse.ArgumentParser(
        prog="lmpipe",
        description="Pretrain and fine-tune BERT-, GPT- and T5-style models from a raw corpus. "
        "Exit codes: 0 ok, 1 other failure, 2 config error, 3 input data error, 4 training "
        "diverged, 130/143 interrupted (docs/cli.md).",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"lmpipe {lmpipe_version()}")
    parser.add_argument("--debug", action="store_true", help="print a failure's full traceback")
    parser.add_argument(
        "--verbose", action="store_true", help="also log every HTTP request to Prefect and MLflow"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _data_commands(sub)
    _model_commands(sub)
    show = sub.add_parser(
        "config",
        help="print the resolved config (secrets left out), or list a section's keys",
        description="Validate a recipe with its overrides and print it; or, with --keys "
        "SECTION, print every key under SECTION (e.g. train.optim) with its type, constraints, "
        "default and meaning, read from the config models. --keys alone lists the top-level "
        "keys and sections.",
    )
    show.add_argument("config", type=Path, nargs="?", help="YAML recipe (see configs/)")
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=_OVERRIDES_HELP)
    show.add_argument(
        "--keys",
        metavar="SECTION",
        nargs="?",
        const="",
        default=None,
        help="list every key under SECTION (e.g. train.optim); alone: the sections",
    )
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
    for name, command in sub.choices.items():
        command.formatter_class = _Formatter
        for flag in ("--debug", "--verbose"):  # accepted after the command too
            command.add_argument(
                flag, action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
            )
        if name in COMMAND_SECTIONS:  # the others (export, notify, demo-corpus) read no recipe
            command.epilog = sections_help(name)
    return parser


def _data_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _stage(
        sub,
        "ingest",
        "corpus files → cleaned, deduplicated, split Arrow shards",
        "Read the configured sources (txt, jsonl, json, csv/tsv, parquet, saved "
        "datasets; gz/bz2/xz/zst), clean and filter each document, split it into sentences, "
        "remove duplicates corpus-wide, assign train/validation/test by content hash and write "
        "Arrow shards plus manifest.json under <workspace>/ingest/<fingerprint>/. Bad records "
        "are counted and written to quarantine.jsonl. A rerun with identical inputs and config "
        "reuses the output.",
    )
    _stage(
        sub,
        "tokenizer",
        "ingest and decontaminate (reused when done), then train or load the tokenizer",
        "Train a WordPiece (BERT), byte-level BPE (GPT-2/RoBERTa) or Unigram (T5) "
        "tokenizer on the train split of the ingested shards, or load your own files "
        "(tokenizer.pretrained.*), and save it under <workspace>/tokenizer/<fingerprint>/ so "
        "that transformers.AutoTokenizer.from_pretrained loads it offline.",
    )
    _stage(
        sub,
        "encode",
        "ingest and tokenizer (reused when done), then encode the corpus to token shards",
        "Encode every ingested shard with the tokenizer on Ray: ids per sentence "
        "and per document (uint16 when the vocabulary fits), with token statistics and a "
        "tokens-per-document histogram, under <workspace>/encode/<fingerprint>/.",
    )
    _stage(
        sub,
        "examples",
        "the stages before (reused when done), then pretraining examples",
        "Cut the encoded train and validation splits into examples of "
        "examples.objective (bert, sop, roberta, causal, span_corruption, denoising) on Ray, "
        "under <workspace>/examples/<fingerprint>/. `lmpipe examples inspect CONFIG` prints a "
        "few of them (see `lmpipe examples inspect --help`).",
    )
    inspect = _stage(
        sub,
        "examples inspect",
        "the examples stage (reused when done), then print a few decoded examples",
        "Run (or reuse) the stages up to the examples, then print --count decoded training "
        "examples with masks, segments, spans and sentinels made visible.",
    )
    inspect.add_argument("--count", type=int, default=3, help="examples to print (default 3)")


def _model_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pretrain = _stage(
        sub,
        "pretrain",
        "the data stages (reused when done), then DeepSpeed pretraining on Ray Train",
        "Pretrain train.model on the examples with DeepSpeed inside Ray Train, "
        "checkpointing every train.checkpoint.every_steps under <workspace>/pretrain/<run>/; "
        "then export to Hugging Face format, check the reload and register the model in MLflow. "
        "A finished run with the same inputs and config is reused; --resume continues a "
        "stopped one from its newest valid checkpoint.",
    )
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
    _stage(
        sub,
        "finetune",
        "prepare the task, then fine-tune the base model on Ray Train",
        "Read the `task` dataset (CSV, TSV, JSON, JSONL, Parquet, CoNLL or a saved "
        "datasets directory) into <workspace>/downstream/<name>/, take the base model "
        "(finetune.base: a local HF directory or a registry version; default the model the "
        "pretrain flow exports), fine-tune it with finetune.strategy on Ray Train (DeepSpeed "
        "optional), stop early on the validation metric, evaluate the test split, export and "
        "register the model with lineage to its base, and log a report to MLflow and Prefect.",
    )
    _stage(
        sub,
        "compare",
        "fine-tune several strategies x seeds on the task; one comparison table",
        "Run every compare.entries strategy once per compare.seeds seed on the "
        "task, all in one MLflow experiment, and write one table (test metric mean and spread "
        "over seeds, trainable parameters, time) with a bar chart.",
    )
    _stage(
        sub,
        "evaluate",
        "intrinsic evaluation of the base model; prompting on the task",
        "Held-out perplexity / masked-LM accuracy (when lmpipe pretrained the "
        "model), fill-mask probes or generation samples (greedy, temperature, top-k, top-p), "
        "and with evaluate.prompting zero- or few-shot classification of the task's split.",
    )
    _stage(
        sub,
        "run",
        "the whole pipeline, every stage that exists, on one config",
        "Run the `pipeline` Prefect flow: ingest → decontaminate (when enabled) "
        "→ tokenizer → encode → examples "
        "→ pretrain → finetune (when a task is set) → evaluate. Stages whose inputs, config "
        "and code are unchanged are reused.",
    )
