"""Time to quality: lmpipe's whole command against a reference loop, to the same held-out loss.

Usage: python bench/time_to_quality.py [--family gpt2|bert|t5] [--rounds 3] [--work DIR]
[--steps N] [--target LOSS] [--json OUT]

`--family gpt2` (the default) is described first; bert and t5 at the end.

The recipe is `configs/shakespeare_char.yaml` (nanoGPT's CPU recipe for Tiny Shakespeare:
4 layers, 4 heads, 128 dims, block 64, batch 12, 2000 steps, AdamW lr 1e-3 with 100 warm-up
steps and cosine decay to 1e-4, weight decay 0.1, beta2 0.99, no dropout, fp32). Two arms, each
in its own process, interleaved round after round (the order alternates), on the same text:

- `lmpipe`: `lmpipe pretrain configs/shakespeare_char.yaml` from a fresh workspace and a fresh
  `PREFECT_HOME`, and no command daemon (stopped before and after: the command pays the
  daemon's start, as the first command on a machine does): ingest, tokenizer, encode,
  examples, start-up and training, all timed, from the spawn of the command to its exit. The
  bench adds the evaluation cadence of both arms
  (`train.eval.every_steps=100`, every held-out block) and a checkpoint every 100 steps, kept,
  which it evaluates afterwards (untimed); the checkpoints' own cost stays in lmpipe's time.
- `reference`: bench/char_reference.py, nanoGPT's model and loop written in this repository,
  its data preparation and its evaluations timed from its spawn.

Loss: nats per character on all of the held-out text: the speeches lmpipe's split holds out
(10%), one after another with a separator after each, cut into blocks of 64, the loss of every
next character in a block, separators excluded (`heldout_loss`, the same function for both
arms; one token is one character for both). The bench reports, per arm, the wall time until
the loss first reaches `--target` (1.88, nanoGPT's figure), the final loss and the whole time,
as medians over the rounds, and the reference's honesty check (its ms per step against a
plain loop over transformers' `GPT2LMHeadModel` of the same shape, measured in its process:
it must be at most 0.85x). docs/benchmarks.md, "Time to quality", has the figures.

`--family bert` (configs/gutenberg_bert.yaml: BERT-tiny, MLM + next sentence, 128-token pairs,
dynamic masking) and `--family t5` (configs/gutenberg_t5.yaml: tiny T5, span corruption at
density 0.15 and mean span 3, 128 encoder tokens) run on the four Gutenberg books. The untimed
set-up runs `lmpipe examples` once and writes what both arms share: the model config lmpipe
builds for the recipe (`config.json`), the recipe's optimiser, schedule, batch and steps, and
the fixed validation batch (`validation.npz`: lmpipe's validation examples, with the masks
lmpipe's own evaluation draws for BERT and the spans its example stage wrote for T5). The
`lmpipe` arm is as above (its whole command from nothing, a checkpoint every `eval_every` steps,
evaluated afterwards); the `reference` arm is bench/mlm_reference.py or bench/span_reference.py,
a plain transformers loop (bench/plain_reference.py) on the same token stream with lmpipe's
tokenizer. Loss, one function per family for both arms (bench/plain_reference.py): nats per
masked token (BERT, `masked_lm_loss`; the next-sentence loss is recorded beside it) or per
target token (T5, `span_loss`). The load average after each arm is recorded with its run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RECIPE = ROOT / "configs" / "shakespeare_char.yaml"
TEXT = ROOT.parent / "shared" / "data" / "tiny_shakespeare" / "input.txt"
LMPIPE = ROOT / ".venv" / "bin" / "lmpipe"
EVAL_EVERY = 100
# nanoGPT's recipe as the reference reads it (configs/shakespeare_char.yaml says the same).
NANOGPT = {
    "layers": 4,
    "heads": 4,
    "d": 128,
    "block": 64,
    "batch": 12,
    "steps": 2000,
    "lr": 1e-3,
    "min_lr": 1e-4,
    "warmup": 100,
    "weight_decay": 0.1,
}


@dataclass(frozen=True)
class Family:
    """One compared model family: lmpipe's recipe, the reference script, the bench's defaults."""

    recipe: Path
    reference: Path
    steps: int  # the recipe's max_steps
    eval_every: int  # steps between evaluations (and kept checkpoints), both arms
    target: float  # the held-out loss whose time to reach is reported
    work: Path


FAMILIES = {
    "gpt2": Family(
        RECIPE,
        BENCH / "char_reference.py",
        2000,
        EVAL_EVERY,
        1.88,
        Path("/tmp/lmpipe-time-to-quality"),
    ),
    "bert": Family(
        ROOT / "configs" / "gutenberg_bert.yaml",
        BENCH / "mlm_reference.py",
        400,
        50,
        6.5,
        Path("/tmp/lmpipe-time-to-quality-bert"),
    ),
    "t5": Family(
        ROOT / "configs" / "gutenberg_t5.yaml",
        BENCH / "span_reference.py",
        400,
        50,
        6.2,
        Path("/tmp/lmpipe-time-to-quality-t5"),
    ),
}


def blocks_of(docs: Sequence[str], encode: Callable[[str], list[int]], sep: int, block: int) -> Any:
    """(N, block) ids: `docs` encoded one after another, `sep` after each, cut into blocks.

    The cut is lmpipe's causal packing's (a stream of documents and separators, the tail
    shorter than a block dropped), so for lmpipe it gives exactly its validation examples.
    """
    import torch

    ids: list[int] = []
    for doc in docs:
        ids.extend(encode(doc))
        ids.append(sep)
    n = len(ids) // block
    return torch.tensor(ids[: n * block], dtype=torch.long).view(n, block)


def heldout_loss(model: Callable[[Any], Any], blocks: Any, sep: int, batch: int = 256) -> float:
    """Mean next-token loss (nats) over `blocks`, targets equal to `sep` left out.

    `model` maps (B, T) ids to (B, T, V) logits.
    """
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(blocks), batch):
            ids = blocks[start : start + batch]  # (B, T)
            logits = model(ids)[:, :-1].float()  # (B, T-1, V): the next character's
            targets = ids[:, 1:].clone()
            targets[targets == sep] = -100
            nll += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            count += int((targets != -100).sum())
    return nll / count


def lmpipe_overrides(workspace: Path, steps: int, eval_every: int = EVAL_EVERY) -> list[str]:
    """The bench's additions to the recipe: where, the evaluation cadence, kept checkpoints."""
    return [
        f"workspace={workspace}",
        f"train.max_steps={steps}",
        f"train.eval.every_steps={eval_every}",
        "train.eval.max_samples=1000000",  # every held-out example, as the reference evaluates
        f"train.checkpoint.every_steps={eval_every}",
        "train.checkpoint.keep_last=1000",
    ]


def run_command(argv: list[str], log: Path, env: dict[str, str]) -> tuple[float, float]:
    """Run `argv` in the repository with its output in `log`; return its start and end times."""
    start = time.time()
    with open(log, "w") as out:
        done = subprocess.run(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    code = done.returncode
    end = time.time()
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{argv[:3]} exited {code}:\n{tail}")
    return start, end


def stop_daemon(env: dict[str, str]) -> None:
    """Stop the command daemon serving `env` (docs/cli.md), if one runs; wait until it is gone."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        said = subprocess.run(
            [str(LMPIPE), "daemon", "stop"], env=env, capture_output=True, text=True, check=True
        ).stdout
        if said.startswith("no lmpipe daemon"):
            return
        time.sleep(0.5)  # it exits once its running commands end
    raise RuntimeError("the lmpipe daemon did not stop within 60 s")


def fresh_env(workspace: Path) -> dict[str, str]:
    """The environment of one arm: a fresh Prefect home beside its workspace."""
    home = workspace.parent / f"{workspace.name}.prefect"
    shutil.rmtree(home, ignore_errors=True)
    return os.environ | {"PREFECT_HOME": str(home), "HF_HUB_OFFLINE": "1"}


def read_arrow(path: Path) -> Any:
    """A whole Arrow shard, in the IPC file or stream format (the stages write both)."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        return ipc.open_file(pa.memory_map(str(path))).read_all()
    except pa.ArrowInvalid:
        return ipc.open_stream(pa.memory_map(str(path))).read_all()


def set_up(work: Path, steps: int) -> dict[str, Any]:
    """Build the held-out set once (untimed): lmpipe's validation speeches and blocks."""
    workspace = work / "setup"
    if not (workspace / "examples").is_dir():
        shutil.rmtree(workspace, ignore_errors=True)
        argv = [str(LMPIPE), "examples", str(RECIPE), *lmpipe_overrides(workspace, steps)[:1]]
        run_command(argv, work / "setup.log", fresh_env(workspace))
    ingest = next((workspace / "ingest").iterdir())
    docs: list[str] = []
    for shard in sorted(ingest.glob("validation-*.arrow")):
        docs.extend(read_arrow(shard).column("text").to_pylist())
    heldout = work / "heldout.json"
    heldout.write_text(json.dumps(docs))
    examples = next((workspace / "examples").iterdir())
    rows: list[list[int]] = []
    for shard in sorted(examples.glob("validation-*.arrow")):
        rows.extend(read_arrow(shard).column("input_ids").to_pylist())
    return {
        "docs": docs,
        "heldout": heldout,
        "examples": rows,
        "tokenizer": next((workspace / "tokenizer").iterdir()),
    }


def plain_reference() -> Any:
    """bench/plain_reference.py, imported on first use (it imports torch and NumPy)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    import plain_reference

    return plain_reference


def set_up_family(work: Path, family: str, steps: int) -> dict[str, Any]:
    """Run lmpipe's data stages once (untimed); write and return what both arms share."""
    from pipelines.config import load_config

    recipe = FAMILIES[family].recipe
    workspace = work / "setup"
    if not (workspace / "examples").is_dir():
        shutil.rmtree(workspace, ignore_errors=True)
        argv = [str(LMPIPE), "examples", str(recipe), f"workspace={workspace}"]
        run_command(argv, work / "setup.log", fresh_env(workspace))
    cfg = load_config(recipe, [f"workspace={workspace}", f"train.max_steps={steps}"])
    paths = {stage: next((workspace / stage).iterdir()) for stage in ("tokenizer", "encode")}
    examples = next((workspace / "examples").iterdir())
    plain_reference().write_shared(cfg, examples, paths["tokenizer"], work)
    return {
        "family": family,
        "seed": cfg.seed,
        "recipe": plain_reference().reference_recipe(cfg),
        "tokenizer": str(paths["tokenizer"]),
        "encode": str(paths["encode"]),
        "examples": str(examples),
        "validation": str(work / "validation.npz"),
        "config": str(work / "config.json"),
    }


Evaluator = Callable[[Path], dict[str, float]]


def char_evaluator(held: dict[str, Any]) -> Evaluator:
    """The GPT arm's losses of an export: `heldout_loss` on lmpipe's validation blocks."""
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(held["tokenizer"])
    sep = int(tokenizer.eos_token_id)
    blocks = blocks_of(held["docs"], lambda s: tokenizer(s)["input_ids"], sep, 64)
    if blocks.tolist() != held["examples"]:
        raise RuntimeError("the held-out blocks differ from lmpipe's validation examples")

    def losses(export: Path) -> dict[str, float]:
        model: Any = tf.AutoModelForCausalLM.from_pretrained(export)
        model.eval()
        return {"loss": heldout_loss(lambda ids: model(input_ids=ids).logits, blocks, sep)}

    return losses


def family_evaluator(held: dict[str, Any]) -> Evaluator:
    """The BERT or T5 arm's losses of an export: bench/plain_reference.py's `evaluate`."""
    import transformers as tf

    plain = plain_reference()
    family, val = held["family"], plain.load_validation(held["validation"])
    auto = tf.AutoModelForPreTraining if family == "bert" else tf.AutoModelForSeq2SeqLM
    return lambda export: plain.evaluate(family, auto.from_pretrained(export), val)


def lmpipe_curve(run_dir: Path, start: float, losses: Evaluator, out: Path) -> list[dict[str, Any]]:
    """Evaluate each kept checkpoint's export with `losses`; its time is its meta.json's."""
    from training.pretrain.stage import export_checkpoint

    curve = []
    for checkpoint in sorted(run_dir.glob("checkpoint_step-*")):
        export = out / checkpoint.name
        shutil.rmtree(export, ignore_errors=True)
        export_checkpoint(checkpoint, export)
        point = losses(export)
        step = int(checkpoint.name.rsplit("-", 1)[1])
        done = (checkpoint / "meta.json").stat().st_mtime  # meta.json is written last
        curve.append({"step": step, **point, "s": done - start})
        shutil.rmtree(export)
    return curve


def run_lmpipe(
    work: Path, tag: str, held: dict[str, Any], steps: int, family: str = "gpt2"
) -> dict[str, Any]:
    """One timed `lmpipe pretrain` from nothing, then its curve from the kept checkpoints."""
    workspace = work / f"lmpipe-{tag}"
    shutil.rmtree(workspace, ignore_errors=True)
    spec = FAMILIES[family]
    overrides = lmpipe_overrides(workspace, steps, spec.eval_every)
    argv = [str(LMPIPE), "pretrain", str(spec.recipe), *overrides]
    env = fresh_env(workspace)
    stop_daemon(env)  # from nothing: the command pays the daemon's start, as a first one does
    try:
        start, end = run_command(argv, work / f"lmpipe-{tag}.log", env)
    finally:
        stop_daemon(env)  # what the bench started
    run_dir = next(p for p in (workspace / "pretrain").iterdir() if p.is_dir())
    losses = char_evaluator(held) if family == "gpt2" else family_evaluator(held)
    curve = lmpipe_curve(run_dir, start, losses, work / "exports")
    shutil.rmtree(workspace)  # the checkpoints are many; the curve is what is kept
    return {"wall_s": end - start, "curve": curve}


def reference_spec(held: dict[str, Any], steps: int, family: str) -> dict[str, Any]:
    """The reference arm's spec, less where its result goes and its threads."""
    if family == "gpt2":
        return {
            "recipe": NANOGPT | {"steps": steps},
            "seed": 0,
            "heldout": str(held["heldout"]),
            "text": str(TEXT),
            "eval_every": EVAL_EVERY,
        }
    return held | {"eval_every": FAMILIES[family].eval_every}  # held: built for these steps


def run_reference(
    work: Path, tag: str, held: dict[str, Any], steps: int, threads: int, family: str = "gpt2"
) -> dict[str, Any]:
    """One timed run of the family's reference script (preparation and evaluations included)."""
    result = work / f"reference-{tag}.json"
    spec = reference_spec(held, steps, family) | {"threads": threads, "result": str(result)}
    argv = [sys.executable, str(FAMILIES[family].reference), "--child", json.dumps(spec)]
    start, end = run_command(argv, work / f"reference-{tag}.log", os.environ.copy())
    data = json.loads(result.read_text())
    curve = [
        {k: v for k, v in e.items() if k != "time"} | {"s": e["time"] - start}
        for e in data["evals"]
    ]
    run = {"wall_s": end - start, "curve": curve}
    return run | ({"honesty": data["honesty"]} if "honesty" in data else {})


def first_at(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds until the curve's loss is first at or below `target` (None: never)."""
    return next((point["s"] for point in curve if point["loss"] <= target), None)


def summary(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Medians over the rounds of one arm: time to `target`, final loss, whole time."""
    times = [first_at(r["curve"], target) for r in runs]
    reached = [t for t in times if t is not None]
    return {
        "time_to_target_s": statistics.median(reached) if len(reached) == len(runs) else None,
        "times_to_target_s": times,
        "final_loss": statistics.median(r["curve"][-1]["loss"] for r in runs),
        "wall_s": statistics.median(r["wall_s"] for r in runs),
    }


def interleaved_rounds(
    rounds: int, arms: dict[str, Callable[[str], dict[str, Any]]]
) -> dict[str, list[dict[str, Any]]]:
    """Run each arm once per round, the order alternating; each run gets the load after it."""
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for i in range(rounds):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        for arm in order:
            run = arms[arm](str(i))
            run["load_average"] = list(os.getloadavg())  # 1, 5, 15 min: others' jobs included
            runs[arm].append(run)
            print(f"round {i} {arm}: {json.dumps(run)}", flush=True)
    return runs


def parse_args() -> argparse.Namespace:
    """The command line; a family's defaults fill `--steps`, `--target` and `--work`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gpt2")
    parser.add_argument("--rounds", type=int, default=3, help="Interleaved runs of each arm.")
    parser.add_argument("--steps", type=int, default=None, help="Training steps.")
    parser.add_argument("--target", type=float, default=None, help="The held-out loss to reach.")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="Write the results here too.")
    args = parser.parse_args()
    family = FAMILIES[args.family]
    args.steps = args.steps or family.steps
    args.target = family.target if args.target is None else args.target
    args.work = args.work or family.work
    return args


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))
    from tasks.common.ray_runtime import usable_cores

    args.work.mkdir(parents=True, exist_ok=True)
    family, steps, work = args.family, args.steps, args.work
    held = set_up(work, steps) if family == "gpt2" else set_up_family(work, family, steps)
    threads = usable_cores()  # lmpipe's auto threads for one in-process worker
    runs = interleaved_rounds(
        args.rounds,
        {
            "lmpipe": lambda tag: run_lmpipe(work, tag, held, steps, family),
            "reference": lambda tag: run_reference(work, tag, held, steps, threads, family),
        },
    )
    result: dict[str, Any] = {arm: summary(r, args.target) for arm, r in runs.items()}
    ref, lm = result["reference"], result["lmpipe"]
    if ref["time_to_target_s"] and lm["time_to_target_s"]:
        result["lmpipe_over_reference"] = lm["time_to_target_s"] / ref["time_to_target_s"]
    if family == "gpt2":
        result["honesty"] = [r["honesty"] for r in runs["reference"]]
    result |= {"family": family, "steps": steps, "target": args.target, "runs": runs}
    result["load_average"] = [r["load_average"] for arm in runs.values() for r in arm]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
