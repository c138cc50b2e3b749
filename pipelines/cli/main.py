"""The `lmpipe` command line: one subcommand per stage, plus the whole pipeline.

Usage: `lmpipe ingest configs/demo.yaml ingest.shard_size_mb=16`. Every command takes a YAML
recipe and dotted `key=value` overrides; an invalid key or value stops it before any work.
The parser is `pipelines/cli/parser.py`; the exit codes and the one-line cause of a failure are
`pipelines/cli/failures.py` (docs/cli.md). torch, Ray, Prefect, MLflow and transformers are
imported only by the command that runs, so help, `config` and every refusal answer at once.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from pipelines.cli.failures import (
    RECEIVED,
    ExitCode,
    Terminated,
    report_failure,
    signalled,
    signals_raise,
)
from pipelines.cli.keys import UnknownSectionError, describe, format_keys
from pipelines.cli.parser import build_parser, join_nested
from pipelines.config import RunConfig, load_config
from pipelines.ops.runtime import no_prefect_telemetry, patient_temporary_api

console = Console(stderr=False)
log = logging.getLogger(__name__)

__all__ = ["build_parser", "main"]

#: Commands that run stages (Prefect flows, Ray): SIGTERM interrupts them cleanly.
STAGE_COMMANDS = frozenset(
    {"ingest", "tokenizer", "encode", "examples", "examples inspect", "pretrain"}
    | {"finetune", "compare", "evaluate", "run"}
)


def main(argv: list[str] | None = None) -> int:
    """Run the `lmpipe` command line; return the process exit code (docs/cli.md).

    A failure ends with one line on stderr naming its class and cause; `--debug` prints the
    traceback before it (flows also log theirs).
    """
    words = join_nested(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(words)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    log_http_requests(bool(getattr(args, "verbose", False)))
    debug = bool(getattr(args, "debug", False))
    guard = signals_raise() if args.command in STAGE_COMMANDS else contextlib.nullcontext()
    signals_before = len(RECEIVED)
    patient_temporary_api()
    no_prefect_telemetry()
    skip_final_collections()
    try:
        with guard:
            return int(_dispatch(args))
    except SystemExit as exc:
        # Ray replaces the SIGTERM handler with `sys.exit(signum)` once it starts here (and
        # its native core may then abort the process: docs/cli.md, "Exit codes").
        if args.command not in STAGE_COMMANDS or exc.code != signal.SIGTERM:
            raise
        return int(report_failure(Terminated(f"signal {exc.code}"), debug))
    except GeneratorExit:
        raise
    except BaseException as exc:  # reported as an exit code; the traceback with --debug
        log.debug("lmpipe %s failed", args.command, exc_info=exc)
        return int(report_failure(exc, debug, signal_code=signalled(signals_before)))


def process_main(argv: list[str] | None = None) -> int:
    """`main` in a process that ends with the command (the entry point, a daemon's child).

    Ray is left here, not by its exit hook, which first sleeps 0.5 s so that the workers' log
    lines can reach the terminal; lmpipe does not forward them (`log_to_driver=False`). A
    driver only disconnects (the daemon's node stays); a node this process started stops, as
    it would at exit. Tests call `main` instead, and keep their session's Ray.
    """
    try:
        return main(argv)
    finally:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


#: The HTTP clients under Prefect's and MLflow's API calls: each logs every request at INFO.
HTTP_LOGGERS = ("httpx", "httpcore", "urllib3")


def log_http_requests(verbose: bool) -> None:
    """Keep the HTTP clients' request lines off the terminal unless `--verbose` asks for them.

    A command makes dozens of API calls (a fine-tune printed 45 request lines of its 111), none
    of which a user can act on; their warnings and errors still print. Prefect's and MLflow's
    own records are untouched, so their UIs show what they did.
    """
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def skip_final_collections() -> None:
    """Freeze the garbage collector at exit, so that the interpreter's last collections are quick.

    After the atexit handlers (Prefect's drain of its logs and events among them) the
    interpreter collects garbage over every object still alive: Prefect's and pydantic's
    models and schemas, 0.5-1.1 s of a command on a 2-core machine. Frozen objects are skipped;
    the process is ending, so the memory goes back with it. Registered once however often
    `main` runs (tests call it in one process; it runs there only when that process exits).
    """
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def _dispatch(args: argparse.Namespace) -> int:
    if getattr(args, "func", None) is not None:
        return int(args.func(args))
    if args.command == "demo-corpus":
        return _demo_corpus(args.out, args.seed, args.documents)
    if args.command == "export":
        return _export(args.checkpoint, args.out)
    if args.command == "config" and args.keys is not None:
        return _list_keys(args.keys, args.config)
    if args.config is None:
        print("error: lmpipe config needs a recipe, or --keys [SECTION]", file=sys.stderr)
        return ExitCode.CONFIG
    cfg = load_config(args.config, args.overrides)
    if args.command == "config":
        from tasks.common.io import public_dump

        if console.is_terminal:
            console.print_json(json.dumps(public_dump(cfg)))
        else:
            _print_piped(json.dumps(public_dump(cfg), indent=2))
        return 0
    from pipelines.ops.prefect_api import open_prefect_api
    from pipelines.ops.warm_imports import warm_imports
    from tasks.common.ray_runtime import prepare_local_node
    from tasks.ingest.sources import local_corpus_bytes

    if args.command in TRAINING_COMMANDS:  # torch, DeepSpeed, MLflow load meanwhile
        warm_imports()
    open_prefect_api(cfg)  # before Prefect is imported: its home and API (docs/cli.md)
    # The command daemon's Ray node starts meanwhile, if none runs and the corpus is not so
    # small that the stages stay in this process.
    limit = int(cfg.ray.local_max_mb * (1 << 20))
    sources = cfg.ingest.sources if cfg.ingest is not None else []
    prepare_local_node(cfg.ray, local_corpus_bytes(sources, limit))
    commands: dict[str, Callable[[RunConfig], dict[str, dict[str, Any]]]] = {
        "ingest": _run_ingest,
        "tokenizer": _run_tokenizer,
        "encode": _run_encode,
        "examples": _run_examples,
        "examples inspect": _run_examples,
        "run": _run_pipeline,
        "pretrain": lambda c: _run_pretrain(c, args.resume),
        "finetune": _run_finetune,
        "compare": _run_compare,
        "evaluate": _run_evaluate,
    }
    stages = commands[args.command](cfg)
    if args.command == "examples inspect":
        return _inspect(stages, args.count)
    return _summarise(cfg, stages)


#: The commands that train or evaluate a model: they import torch at their training stage.
TRAINING_COMMANDS = frozenset({"run", "pretrain", "finetune", "compare", "evaluate"})


def _list_keys(section: str, stray: Path | None) -> int:
    """Print every key under `section`; `stray` is a recipe given too (refused: ambiguous)."""
    if stray is not None:
        print(f"error: --keys lists the keys of every recipe; drop {stray}", file=sys.stderr)
        return ExitCode.CONFIG
    try:
        keys = describe(section)
    except UnknownSectionError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return ExitCode.CONFIG
    _print_piped(format_keys(keys, width=max(60, console.width)))
    return 0


def _print_piped(text: str) -> None:
    """Print to stdout; a reader that stops early (`| head`) is no failure."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would raise again when it flushes stdout at exit: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


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
    from pipelines.ops.warm_imports import await_warm_imports

    await_warm_imports()  # the compare flow imports torch as it loads
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
    except CheckpointError as exc:  # the argument names no valid checkpoint: a usage error
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
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
    from rich.table import Table

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
    sys.exit(process_main())
