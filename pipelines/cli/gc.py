"""`lmpipe gc CONFIG [--delete]`: list (and remove) workspace outputs nothing needs any more.

The references come from the recipe's MLflow store (`pipelines.ops.gc.collect_references`); the
decision is `pipelines.ops.gc.plan_gc`. A dry run is the default.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipelines.config import ConfigError, load_config
from pipelines.ops.gc import GcPlan, Reference, apply_plan, collect_references, plan_gc

console = Console(stderr=False)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `gc` subcommand."""
    gc = sub.add_parser(
        "gc",
        help="list (--delete: remove) workspace outputs no model or recent run needs",
        description="List the outputs under the recipe's workspace (stage outputs, pretraining "
        "and fine-tuning runs, prepared tasks, evaluation reports, temp leftovers) that no "
        "registered model version and no MLflow run of the last --keep-days names, directly "
        "or as an input of something kept, and were not modified within --keep-days. "
        "Prints what would go and why; removes it only with --delete.",
    )
    gc.add_argument("config", type=Path, help="YAML recipe (its workspace and MLflow store)")
    gc.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides")
    gc.add_argument("--delete", action="store_true", help="remove (default: only list)")
    gc.add_argument(
        "--keep-days",
        type=float,
        default=7.0,
        help="runs started and outputs modified within this many days are kept (default 7)",
    )
    gc.add_argument("--all", action="store_true", help="list kept outputs too")
    gc.set_defaults(func=run_gc)


def run_gc(args: argparse.Namespace) -> int:
    """Plan, print and (with --delete) apply the clean-up; return the exit code."""
    from pipelines.ops.runtime import resolve_environment

    if args.keep_days < 0:
        console.print(f"[red]error:[/red] --keep-days {args.keep_days}: must be >= 0")
        return 2
    try:
        cfg = resolve_environment(load_config(args.config, args.overrides))
    except ConfigError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    now = time.time()
    references: list[Reference] = []
    uri = cfg.tracking.tracking_uri
    local_db = Path(cfg.workspace) / "mlflow.db"
    if not cfg.tracking.enabled or uri is None:
        console.print("tracking is off: only recently modified outputs are kept")
    elif uri.startswith("sqlite:") and uri.endswith(str(local_db)) and not local_db.exists():
        console.print(f"no MLflow store at {local_db}: only recently modified outputs are kept")
    else:
        references = collect_references(uri, keep_days=args.keep_days, now=now)
    plan = plan_gc(Path(cfg.workspace), references, now=now, keep_recent_s=args.keep_days * 86400)
    print_plan(plan, show_kept=args.all)
    if not args.delete:
        if plan.removals:
            console.print("dry run: nothing removed; run again with --delete to remove these")
        return 0
    freed = apply_plan(plan)
    console.print(f"removed {len(plan.removals)} outputs, {_size(freed)} freed")
    return 0


def print_plan(plan: GcPlan, show_kept: bool = False) -> None:
    """Print the plan as a table: output, size, action and why."""
    table = Table(title=f"lmpipe gc: {plan.workspace}")
    table.add_column("output")
    table.add_column("size", justify="right")
    table.add_column("action")
    table.add_column("why")
    for decision in plan.decisions:
        if decision.keep and not show_kept:
            continue
        out = decision.output
        where = ", ".join(str(p.relative_to(plan.workspace)) for p in out.paths)
        action = "keep" if decision.keep else "[red]remove[/red]"
        table.add_row(where, _size(out.bytes), action, decision.why)
    console.print(table)
    kept = len(plan.decisions) - len(plan.removals)
    console.print(
        f"{len(plan.removals)} to remove ({_size(plan.bytes_to_free)}), {kept} kept",
        highlight=False,
    )


def _size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} B"
