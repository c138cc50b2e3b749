"""GPU throughput, MFU and time to quality of lmpipe's loop without Ray: BERT-base, GPT-2 124M.

Usage:
  python bench/pretrain_gpu.py prepare --out DIR [--wheels] [--tiny]   # here: the CPU machine
  python bench/pretrain_gpu.py run --data DIR --out OUT [--quality]    # the GPU machine
      [--only NAME,...] [--warmup 10] [--steps N] [--device cuda|cpu]
      [--size SIZE] [--batch N] [--work DIR]

Two steps on two machines, since the GPU machine lacks Ray, the shared data and part of the
stack (docs/benchmarks.md, "GPU"):

- `prepare` runs the real stages (ingest, tokenizer, encode, examples; Ray locally) over the
  texts of ../shared/data into BERT examples of 128 tokens (WordPiece, 30,522 tokens) and GPT-2
  blocks of 1,024 tokens (byte-level BPE), and copies each set and its tokenizer into DIR;
  `--wheels` adds the wheels the GPU image lacks (bench/pretrain_data.py: pydantic, DeepSpeed,
  transformers at this venv's versions, for CPython 3.12 on x86-64); `--tiny` cuts one book
  into 64-token examples over vocabularies of 1,024 (the CPU check).
- `run` builds each model once, seeded, and saves its weights: every arm starts from them, sees
  the same batches and uses the same optimizer. Each setting trains in its own subprocess (run
  directories under `--work`); `pretrain_gpu.json` and `.md` (`--quality`:
  `pretrain_gpu_quality.*`) are written to OUT after every setting. The arms
  (bench/pretrain_gpu_arms.py): `lmpipe-*`, lmpipe's loop itself without Ray; `plain-*`, a
  plain PyTorch loop on the same model, loss and batches (the ceiling); `nanogpt-*` and
  `nanobert-*`, the outside references (bench/nanogpt.py, bench/nanobert.py). `-compile`: the
  model and loss as one graph (`-modules`: each top-level module apart); `-docmask`: GPT-2
  with `train.document_masking` (FlexAttention on a GPU; `-dense`: the (B, 1, L, L) mask).
  The arms' mean losses over the timed steps must agree within `LOSS_AGREEMENT` per model and
  masking, or `run` exits non-zero (`loss_agreement` in the JSON).
- `run --quality` (issue 39): the `QUALITY` settings (per model the reference, lmpipe, the
  plain loop; compiled), `--steps` 300 by default. Each arm trains the warm-up, then `--steps`
  plus `QUALITY_SLACK` more timed steps. A step's loss is the mean training loss of the
  `LOSS_WINDOW` steps ending at it (every arm sees the same batch at the same step, so the
  batches' differences cancel between arms). The target is the reference's loss at timed step
  `--steps`; an arm's time to it runs from the start of its timed window to the end of its
  first timed step at or below it (`StepClock`: CUDA events, no host wait; the warm-up, with
  compilation, is reported apart as `warmup_s`). The report gives that time and its ratio to
  the reference's, tokens/s and MFU against the reference's, and `QUALITY_TARGETS`.

Models (bench/pretrain_gpu_arms.py, `MODELS`): BERT-base (MLM + NSP) at B256 x L128, and
GPT-2 124M at B32 x L1024 with the published vocabulary of 50,257 tokens and no dropout, as
nanoGPT trains it. Counted: real input tokens of the timed steps. Timed alike for every arm:
the CUDA-synchronised wall time of the window of steps after the warm-up (lmpipe's includes its
logging reads); then lmpipe trains `SYNC_CHECK_STEPS` more steps under CUDA's sync debug mode
(`sync_free`). MFU = `flops_per_token` x tokens/s / the dense bf16 peak: the datasheet's
(`DATASHEET_PEAKS`, 989.4 TFLOP/s for an H100 SXM or H200) and, in a second column, the matmul
peak measured there. Targets: MFU >= 45% for GPT-2 and >= 40% for BERT-base (datasheet).

`--device cpu --size tiny` runs the same code on a CPU (test_pretrain_gpu_bench.py), in fp32 where
it has no native bf16. Only the standard library is imported at the top of these modules.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import launch_child, write_json  # noqa: E402
from pretrain_data import check_prepared, prepare  # noqa: E402
from pretrain_gpu_arms import MODELS, run_child  # noqa: E402

CHILD_TIMEOUT_S = 480
#: The arms' mean losses over the timed steps must agree within this (relative), in bf16.
LOSS_AGREEMENT = 0.02
#: `--quality`: a step's loss is the mean training loss of the steps in this window ending at it.
LOSS_WINDOW = 20
#: `--quality`: timed steps past `--steps`, as a fraction of it, so that an arm a little behind
#: the reference can still reach its loss (and one that cannot is over 1.1x its time).
QUALITY_SLACK = 0.1
#: `--quality`: the issue's targets for lmpipe against the reference, in the same call.
QUALITY_TARGETS = {"tokens_ratio": 0.95, "mfu_ratio": 1.0, "time_ratio": 1.1}  # >=, >=, <=


def _setting(
    loop: str,
    model: str,
    compile_: bool,
    scope: str = "model_and_loss",
    docmask: bool = False,
    attention: str = "auto",
) -> tuple[str, dict[str, Any]]:
    name = f"{loop}-{model}" + ("-docmask" if docmask else "")
    name += "" if attention == "auto" else f"-{attention}"
    if compile_:
        name += "-compile" + ("-modules" if scope == "modules" else "")
    spec = {"loop": loop, "model": model, "compile": compile_, "scope": scope, "docmask": docmask}
    return name, spec | {"attention": attention}


#: In the order they run, the most wanted first (a device's time is short): the compiled
#: loops of both models and the references, module-by-module compilation, GPT-2 with
#: document masking (FlexAttention, then the dense mask), then eager.
SETTINGS: dict[str, dict[str, Any]] = dict(
    [
        _setting("lmpipe", "gpt2-124m", True),
        _setting("plain", "gpt2-124m", True),
        _setting("nanogpt", "gpt2-124m", True),
        _setting("lmpipe", "bert-base", True),
        _setting("plain", "bert-base", True),
        _setting("nanobert", "bert-base", True),
        _setting("lmpipe", "gpt2-124m", True, "modules"),
        _setting("lmpipe", "bert-base", True, "modules"),
        _setting("lmpipe", "gpt2-124m", True, docmask=True),
        _setting("plain", "gpt2-124m", True, docmask=True),
        _setting("lmpipe", "gpt2-124m", True, docmask=True, attention="dense"),
        _setting("lmpipe", "gpt2-124m", False),
        _setting("plain", "gpt2-124m", False),
        _setting("nanogpt", "gpt2-124m", False),
        _setting("lmpipe", "bert-base", False),
        _setting("plain", "bert-base", False),
        _setting("nanobert", "bert-base", False),
        _setting("lmpipe", "gpt2-124m", False, docmask=True),
        _setting("plain", "gpt2-124m", False, docmask=True),
    ]
)
#: `run --quality`'s settings, in order: per model the reference (whose loss is the target),
#: lmpipe, then the plain loops last, so that a run cut short keeps the issue's comparisons.
QUALITY = ["nanogpt-gpt2-124m-compile", "lmpipe-gpt2-124m-compile", "nanobert-bert-base-compile"]
QUALITY += ["lmpipe-bert-base-compile", "plain-gpt2-124m-compile", "plain-bert-base-compile"]

# -- the driver -----------------------------------------------------------------------------

#: How the driver runs a child: (spec, run directory) -> its result, or `{"error": ...}`.
Launcher = Callable[[dict[str, Any], Path], dict[str, Any]]


def launch(spec: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """Run one child in a fresh subprocess; its result, or its error with the log's tail."""
    started = time.perf_counter()
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false"}
    result = launch_child(__file__, spec, run_dir, env, CHILD_TIMEOUT_S, 25, catch_timeout=True)
    wall = {"wall_s": round(time.perf_counter() - started, 1)}
    if "error" not in result:
        for path in run_dir.iterdir():  # the checkpoint (weights, AdamW state); logs, results stay
            if path.is_dir():
                shutil.rmtree(path)
    return wall | result


def summarize(
    raw: dict[str, Any], warmup: int, peak: float, measured_peak: float, target: float
) -> dict[str, Any]:
    """tokens/s and MFU over the steps after `warmup`; the median step; the loss."""
    if "error" in raw:
        return {"error": raw["error"]}
    step_s, tokens = raw["step_s"][warmup:], raw["tokens"][warmup:]
    if not step_s:
        return {"error": f"{len(raw['step_s'])} steps, none after {warmup} of warm-up"}
    tokens_s = sum(tokens) / sum(step_s)
    achieved = raw["flops_per_token"] * tokens_s
    return {
        "tokens_per_s": tokens_s,
        "median_step_s": statistics.median(step_s),
        "max_step_s": max(step_s),
        "mfu": achieved / peak,
        "mfu_of_measured_peak": achieved / measured_peak,
        "target": target,
        "met": achieved / peak >= target,
        "flops_per_token": raw["flops_per_token"],
        "parameters": raw["parameters"],
        "max_memory_gib": raw.get("max_memory_gib"),
        "first_loss": raw["losses"][0],
        "last_loss": raw["losses"][-1],
        "mean_loss": statistics.fmean(raw["losses"][warmup:]),
        "timed_steps": len(step_s),
        "warmup_s": sum(raw["step_s"][:warmup]),  # compilation included
        "wall_s": raw.get("wall_s"),
        "attention": raw.get("attention"),  # dense or flex: how document masks ran
    }


def table(rows: dict[str, dict[str, Any]], device: dict[str, Any]) -> str:
    """The Markdown table of docs/benchmarks.md."""
    out = [
        "| setting | tokens/s | median step (s) | MFU (datasheet) | MFU (measured peak) "
        "| target | peak memory (GiB) | loss first → last |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in rows.items():
        if "error" in row:
            first = row["error"].splitlines()[0]
            out.append(f"| {name} | failed: {first} | | | | | | |")
            continue
        memory = row["max_memory_gib"]
        out.append(
            f"| {name} | {row['tokens_per_s']:,.0f} | {row['median_step_s']:.4f} "
            f"| {row['mfu']:.1%} | {row['mfu_of_measured_peak']:.1%} | {row['target']:.0%} "
            f"| {'' if memory is None else f'{memory:.1f}'} "
            f"| {row['first_loss']:.3f} → {row['last_loss']:.3f} |"
        )
    out.append("")
    out.append(
        f"Device: {device.get('gpu', 'CPU')}; peak {device['peak_flops'] / 1e12:.1f} TFLOP/s "
        f"({device['peak_source']}), measured {device['measured_peak_flops'] / 1e12:.1f}; "
        f"Python {device['python']}, torch {device['torch']}, transformers "
        f"{device['transformers']}, deepspeed {device['deepspeed']}."
    )
    return "\n".join(out)


# -- time to quality (`run --quality`) ------------------------------------------------------


def smoothed(losses: list[float], window: int = LOSS_WINDOW) -> list[float]:
    """Each step's mean loss over the `window` steps ending at it (fewer before the window)."""
    return [statistics.fmean(losses[max(0, i + 1 - window) : i + 1]) for i in range(len(losses))]


def _group(name: str) -> str:
    """The comparison group of a setting: its model, and `-docmask` with document masking."""
    setting = SETTINGS.get(name, {})
    return str(setting.get("model", name)) + ("-docmask" if setting.get("docmask") else "")


def time_to_loss(raw: dict[str, Any], warmup: int, target: float) -> dict[str, Any]:
    """The first timed step whose smoothed loss is at most `target`, and its time (s).

    The time runs from the start of the timed window to the end of that step.
    """
    curve = smoothed(raw["losses"])[warmup:]
    for step, (loss, end_s) in enumerate(zip(curve, raw["elapsed_s"], strict=False), 1):
        if loss <= target:
            return {"steps_to_target": step, "time_to_target_s": end_s}
    return {"steps_to_target": None, "time_to_target_s": None}


def against(arm: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """An arm's time, tokens/s and MFU as ratios to the reference's, and the issue's targets."""
    time_s, ref_s = arm["time_to_target_s"], ref["time_to_target_s"]
    ratios = {
        "tokens_ratio": arm["tokens_per_s"] / ref["tokens_per_s"],
        "mfu_ratio": arm["mfu"] / ref["mfu"],
        "time_ratio": None if time_s is None or not ref_s else time_s / ref_s,  # None: not reached
    }
    low, high = QUALITY_TARGETS["tokens_ratio"], QUALITY_TARGETS["time_ratio"]
    met = {"tokens_ratio": ratios["tokens_ratio"] >= low}
    met["mfu_ratio"] = ratios["mfu_ratio"] >= QUALITY_TARGETS["mfu_ratio"]
    met["time_ratio"] = ratios["time_ratio"] is not None and ratios["time_ratio"] <= high
    return ratios | {"met": met}


def quality(
    rows: dict[str, dict[str, Any]], raw: dict[str, Any], warmup: int, steps: int
) -> dict[str, Any]:
    """Per model: the reference's smoothed loss at timed step `steps`, each arm's time to it."""
    report: dict[str, Any] = {}
    for name, row in rows.items():
        if "error" in row:
            continue
        curve = smoothed(raw[name]["losses"])
        group = report.setdefault(_group(name), {"reference": None, "arms": {}})
        group["arms"][name] = {
            "tokens_per_s": row["tokens_per_s"],
            "mfu": row["mfu"],
            "warmup_s": row["warmup_s"],
            "loss_at_steps": curve[warmup + steps - 1] if len(curve) >= warmup + steps else None,
        }
        is_reference = SETTINGS[name]["loop"] == MODELS[SETTINGS[name]["model"]]["reference"]
        if is_reference and group["reference"] is None:
            group["reference"] = name
    for group in report.values():
        ref = group["reference"]
        target = None if ref is None else group["arms"][ref]["loss_at_steps"]
        group |= {"target_loss": target, "target_step": steps, "window": LOSS_WINDOW}
        for name, arm in group["arms"].items():
            if target is not None:
                arm |= time_to_loss(raw[name], warmup, target)
        for arm in group["arms"].values():
            if target is not None:  # the reference's own row: every ratio 1
                arm["against_reference"] = against(arm, group["arms"][ref])
    return report


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "not reached" if value is None else f"{value:{spec}}{suffix}"


def quality_table(report: dict[str, Any]) -> str:
    """The Markdown table of time to the reference's loss, per model."""
    out = [
        "| setting | time to target (s) | steps | x reference | tokens/s | x reference "
        "| MFU (datasheet) | x reference | loss at the target step | warm-up (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for model, group in report.items():
        for name, arm in group["arms"].items():
            ratio = arm.get("against_reference", {})
            out.append(
                f"| {name} | {_cell(arm.get('time_to_target_s'), '.2f')} "
                f"| {_cell(arm.get('steps_to_target'), 'd')} "
                f"| {_cell(ratio.get('time_ratio'), '.3f', 'x')} | {arm['tokens_per_s']:,.0f} "
                f"| {_cell(ratio.get('tokens_ratio'), '.3f', 'x')} | {arm['mfu']:.1%} "
                f"| {_cell(ratio.get('mfu_ratio'), '.3f', 'x')} "
                f"| {_cell(arm['loss_at_steps'], '.4f')} | {arm['warmup_s']:.1f} |"
            )
        target = group["target_loss"]
        notes.append(
            f"{model}: target {_cell(target, '.4f')}, {group['reference']}'s mean training loss "
            f"over the {group['window']} steps ending at timed step {group['target_step']}."
        )
    return "\n".join([*out, "", *notes])


# -- the run --------------------------------------------------------------------------------


def chosen_settings(only: str | None, quality_mode: bool = False) -> list[str]:
    """The settings `--only` names (all, or `QUALITY` with `--quality`), in the order given."""
    names = only.split(",") if only else list(QUALITY if quality_mode else SETTINGS)
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; known: {sorted(SETTINGS)}")
    return names


def setting_spec(base: dict[str, Any], name: str, data: Path, batch: int | None) -> dict[str, Any]:
    """The spec of one setting's child: the run's options, the setting, its examples."""
    setting = SETTINGS[name]
    model = MODELS[setting["model"]]
    folder = data / model["data"]
    spec = base | setting | {"name": name, "batch": batch or model["batch"]}
    return spec | {
        "examples_dir": str(folder / "examples"),
        "tokenizer_dir": str(folder / "tokenizer"),
    }


def write_report(
    out: Path, rows: dict[str, Any], raw: dict[str, Any], device: dict[str, Any], args: Any
) -> dict[str, Any]:
    """Write OUT/pretrain_gpu[_quality].json (with the loss agreement) and its Markdown."""
    report: dict[str, Any] = {"command": sys.argv, "device": device, "rows": rows, "raw": raw}
    report["loss_agreement"] = loss_agreement(rows)
    text = table(rows, device)
    stem = "pretrain_gpu"
    if args.quality:
        report["quality"] = quality(rows, raw, args.warmup, args.steps)
        text += "\n\nTime to quality:\n\n" + quality_table(report["quality"])
        stem += "_quality"
    write_json(out / f"{stem}.json", report, newline=True)
    (out / f"{stem}.md").write_text(text + "\n")
    return report


def run(args: argparse.Namespace, launcher: Launcher = launch) -> dict[str, Any]:
    """Run the chosen settings one after the other; write and print the results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = chosen_settings(args.only, args.quality)
    data = Path(args.data).resolve()
    check_prepared(data, {MODELS[SETTINGS[name]["model"]]["data"] for name in names}, args.data)
    if args.steps is None:
        args.steps = 300 if args.quality else 40
    slack = math.ceil(QUALITY_SLACK * args.steps) if args.quality else 0
    base = {"device": args.device, "warmup": args.warmup, "steps": args.steps + slack}
    base |= {"threads": args.threads, "size": args.size}
    work = Path(args.work)  # not under OUT: the device tool brings back a few files only
    # Each model's initial weights, built once (with the device check) for all its arms.
    inits = {SETTINGS[name]["model"]: setting_spec(base, name, data, args.batch) for name in names}
    for model, spec in inits.items():
        spec["init"] = str(work / f"init-{model}.pt")
    check = base | {"loop": "device", "name": "device", "inits": list(inits.values())}
    device = launcher(check, work / "device")
    if "error" in device:
        raise SystemExit(f"the device check or the initial weights failed:\n{device['error']}")
    raw: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        spec = setting_spec(base, name, data, args.batch)
        spec["init"] = inits[spec["model"]]["init"]
        raw[name] = launcher(spec, work / name)
        peaks = device["peak_flops"], device["measured_peak_flops"]
        target = MODELS[spec["model"]]["target"]
        rows[name] = summarize(raw[name], args.warmup, *peaks, target)
        print(name, json.dumps(rows[name]), flush=True)
        # After every setting: a run stopped at the device's time limit keeps what it measured.
        report = write_report(out, rows, raw, device, args)
    print(table(rows, device))
    if args.quality:
        print(quality_table(report["quality"]))
    apart = {
        group: check for group, check in report["loss_agreement"].items() if not check["agree"]
    }
    if apart:
        raise SystemExit(f"the arms' mean losses differ by more than {LOSS_AGREEMENT:.0%}: {apart}")
    return report


def loss_agreement(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model and masking, the arms' mean losses over the timed steps, and whether they agree.

    Every arm starts from the same weights and sees the same batches with the same optimizer,
    so in bf16 their mean losses must agree within `LOSS_AGREEMENT` (relative to the lowest);
    a faster arm that trains a different model would not.
    """
    groups: dict[str, dict[str, float]] = {}
    for name, row in rows.items():
        if "mean_loss" in row:
            groups.setdefault(_group(name), {})[name] = row["mean_loss"]
    result = {}
    for group, means in groups.items():
        low, high = min(means.values()), max(means.values())
        spread = (high - low) / low if low > 0 else float("inf")
        result[group] = {"means": means, "spread": spread, "agree": spread <= LOSS_AGREEMENT}
    return result


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line of `prepare` and `run`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="Build the example sets (and wheels) to carry.")
    prep.add_argument("--out", required=True)
    prep.add_argument("--work", default=str(ROOT / "bench" / "results" / "pretrain_gpu_work"))
    prep.add_argument("--wheels", action="store_true", help="Also fetch the wheels to carry.")
    prep.add_argument("--tiny", action="store_true", help="One book, 64 tokens (a CPU check).")
    go = sub.add_parser("run", help="Train every setting and report tokens/s and MFU.")
    go.add_argument("--data", required=True, help="What `prepare --out` wrote.")
    go.add_argument("--out", required=True, help="Where the JSON and Markdown reports go.")
    go.add_argument(
        "--work",
        default=str(ROOT / "bench" / "results" / "pretrain_gpu_runs"),
        help="The settings' run directories (logs, steps; checkpoints are removed).",
    )
    go.add_argument("--quality", action="store_true", help="Time to the reference's loss.")
    go.add_argument("--only", help=f"Comma-separated settings of {sorted(SETTINGS)}.")
    go.add_argument("--warmup", type=int, default=10, help="Untimed steps first.")
    go.add_argument("--steps", type=int, help="Timed steps (40; --quality: 300, plus slack).")
    go.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    go.add_argument("--size", help="Another lmpipe size for both models (tiny: a CPU check).")
    go.add_argument("--batch", type=int, help="Global batch instead of each model's own.")
    go.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Command line: `prepare`, `run`, or a child's `--child SPEC`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_child(json.loads(argv[1]))
        return
    args = parse_args(argv)
    if args.command == "prepare":
        summary = prepare(Path(args.out), Path(args.work), args.wheels, args.tiny)
        print(json.dumps(summary, indent=1))
    else:
        run(args)


if __name__ == "__main__":
    main()
