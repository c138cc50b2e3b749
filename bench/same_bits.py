"""Before and after a change: the same recipe at two commits gives the same bits.

Usage:
    python bench/same_bits.py run --rev <commit> --out <dir>   # one commit's runs
    python bench/same_bits.py compare <dir-a> <dir-b>          # what differs, with why

`run` checks the commit out into `<dir>/tree` (a detached `git worktree`, the compiled
extension copied in), writes the demo corpus, and runs there, with this checkout's `.venv` and
the tree first on `PYTHONPATH`:

- `one/`: the whole demo pipeline shortened to 20 pretraining steps, one worker in process, one
  fine-tuning epoch (`lmpipe run`);
- `zero2/`: the demo's pretraining with 2 Ray Train workers under DeepSpeed ZeRO-2, 20 steps
  (`lmpipe pretrain`).

`compare` applies the same-bits rules of `tests/pipelines/flows/workspace_bits.py` (shards,
tokenizer and exported weights byte for byte; `steps.jsonl`, `evals.jsonl`, `history.jsonl`,
predictions and manifests by value without timings, run ids, paths and the code's commit,
source hash and fingerprints) to each pair of
workspaces. A stage's output directory is named by its key, and the keys of the training
stages cover the code, so directories are matched by stage: the one output of each stage of one
workspace against the other's. Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "pipelines" / "flows"))
from workspace_bits import workspace_differences  # noqa: E402

SHORT = [
    "train.max_steps=20",
    "train.checkpoint.every_steps=10",
    "train.eval.every_steps=10",
    "finetune.epochs=1",
]
RUNS = {
    "one": ("run", [*SHORT, "train.scale.num_workers=1", "train.scale.max_failures=0"]),
    "zero2": ("pretrain", [*SHORT[:3], "train.scale.num_workers=2", "train.zero_stage=2"]),
}
# Directories named by a key (a fingerprint or a run id) under each stage's folder.
KEYED = (
    "ingest",
    "tokenizer",
    "encode",
    "examples",
    "pretrain",
    "downstream",
    "finetune",
    "evaluate",
)
# Training stages, and the records of a run that say where it is and what it was named.
RUN_STAGES = ("pretrain", "finetune")
RUN_RECORDS = ("record.json", "manifest.json")
# What names the code, not what it computed: two commits differ here by design (a stage's
# fingerprint hashes the source of tasks/; directories named by one are matched by stage).
CODE_KEYS = frozenset({"git_commit", "source_hash", "fingerprint"})


def checkout(rev: str, tree: Path) -> None:
    """A detached worktree of `rev` at `tree`, with this checkout's compiled extension."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev])
    for built in (REPO / "tasks" / "ingest").glob("_textscan*.so"):
        shutil.copy2(built, tree / "tasks" / "ingest" / built.name)


def run(rev: str, out: Path) -> None:
    """Both recipes of the module docstring at `rev`, their workspaces under `out`."""
    tree = out / "tree"
    checkout(rev, tree)
    env = {**os.environ, "PYTHONPATH": str(tree), "PREFECT_HOME": str(out / ".prefect")}
    python = str(REPO / ".venv" / "bin" / "python")
    demo = out / "demo_data"
    cli = [python, "-m", "pipelines.cli.main"]
    subprocess.run([*cli, "demo-corpus", "--out", str(demo)], cwd=tree, env=env, check=True)
    for name, (command, overrides) in RUNS.items():
        where = [
            f"workspace={out / name}",
            f"name=bits{name}",
            f"ingest.sources.0.path={demo / 'corpus'}",
            f"task.base_dir={demo}",
        ]
        args = [*cli, command, "configs/demo.yaml", *where, *overrides]
        subprocess.run(args, cwd=tree, env=env, check=True)
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])


def by_stage(workspace: Path, into: Path, layout_records: bool = True) -> list[str]:
    """`workspace` hard-linked into `into`, each stage's keyed entries renamed `run`.

    A training run of the layout before runs were stage outputs (`<key>/`, `<key>.export/`,
    `<key>.run.json`) is laid out as one of today's (`<key>/export/`), so that the two compare.
    `layout_records`: keep the records of where a run is and what it was named (the legacy
    `.run.json`, a run's `record.json` and `manifest.json`); a comparison across the two
    layouts leaves them out, since one layout has what the other has not.

    Returns the keys renamed, so that the records' mentions of them compare equal too, after
    the two layouts' names of a pretraining export (`<key>.export`, `<key>/export`).
    """
    keys, exports = [], []
    for entry in sorted(workspace.iterdir()):
        target = into / entry.name
        if entry.name not in KEYED or not entry.is_dir():
            copy(entry, target)
            continue
        target.mkdir(parents=True)
        for child in sorted(entry.iterdir()):
            key = child.name.split(".")[0]
            keys.append(key)
            name = child.name.replace(key, "run", 1)
            if name == "run.export":  # the legacy export, beside its run
                exports.append(child.name)
                copy(child, target / "run" / "export")
            elif name == "run" and child.is_dir() and entry.name in RUN_STAGES:
                exports.append(f"{key}/export")
                copy(child, target / "run", skip=() if layout_records else RUN_RECORDS)
            elif layout_records or name != "run.run.json":
                copy(child, target / name)
    return exports + keys


def copy(source: Path, target: Path, skip: tuple[str, ...] = ()) -> None:
    """`source` at `target` by hard links (the runs' files are read, never written).

    `skip`: names left out at the top of a copied directory.
    """
    if not source.is_dir():
        os.link(source, target)
        return
    target.mkdir(parents=True, exist_ok=True)
    for child in sorted(source.iterdir()):
        if child.name not in skip:
            if child.is_dir() and not child.is_symlink():
                shutil.copytree(child, target / child.name, copy_function=os.link, symlinks=True)
            else:
                os.link(child, target / child.name, follow_symlinks=False)


def legacy_layout(workspace: Path) -> bool:
    """Whether `workspace`'s training runs are of the layout before runs were stage outputs."""
    return any(p for stage in RUN_STAGES for p in (workspace / stage).glob("*.run.json"))


def compare(first: Path, second: Path) -> list[str]:
    """Every difference between the two commits' runs under the same-bits rules."""
    problems = []
    for name in RUNS:
        same = legacy_layout(first / name) == legacy_layout(second / name)
        if not same:
            print(f"{name}: the two run layouts differ; run records are not compared")
        with tempfile.TemporaryDirectory(dir=first) as scratch:
            a, b = Path(scratch) / "a", Path(scratch) / "b"
            aliases = (
                (str(first / name), str(first), *by_stage(first / name, a, same)),
                (str(second / name), str(second), *by_stage(second / name, b, same)),
            )
            found = workspace_differences(a, b, aliases, CODE_KEYS)
            problems += [f"{name}: {p}" for p in found]
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run")
    one.add_argument("--rev", default="HEAD")
    one.add_argument("--out", type=Path, required=True)
    two = sub.add_parser("compare")
    two.add_argument("first", type=Path)
    two.add_argument("second", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.rev, args.out.resolve())
        return
    problems = compare(args.first.resolve(), args.second.resolve())
    print("\n".join(problems) or "same bits: nothing differs")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
