"""GPU throughput and MFU of lmpipe's training loop without Ray: BERT-base and GPT-2 124M.

Usage:
  python bench/pretrain_gpu.py prepare --out DIR [--wheels]      # here: the CPU machine
  python bench/pretrain_gpu.py run --data DIR --out OUT           # the GPU machine
      [--only NAME,...] [--warmup 10] [--steps 40] [--device cuda|cpu] [--size SIZE]
      [--batch N] [--work DIR]

Two steps on two machines, since the GPU machine lacks Ray, the shared data and part of the
stack (docs/benchmarks.md, "GPU"):

- `prepare` runs the real stages (ingest, tokenizer, encode, examples; Ray locally) over the
  texts of ../shared/data into BERT examples of 128 tokens (WordPiece, 30,522 tokens: the same
  set as bench/pretrain_throughput.py) and GPT-2 blocks of 1,024 tokens (byte-level BPE). It
  copies each example set and its tokenizer into DIR (about 20 MB). With `--wheels` it adds the
  wheels of the packages the GPU image lacks or has at another version (`WHEELS`: pydantic,
  DeepSpeed, transformers at this venv's versions), for Python 3.12 on x86-64.
- `run` first builds each model once, seeded, and saves its weights: every arm starts from
  them, sees the same batches and uses the same optimizer (`OPTIM`). It then trains each
  setting in its own subprocess (run directories under `--work`) and writes
  `pretrain_gpu.json` and `pretrain_gpu.md` to OUT after every setting:
  - `lmpipe-*`: lmpipe's loop itself (`training.pretrain.loop.Worker` with `LocalContext`: the
    memory-mapped example shards, the seeded global order, the DeepSpeed engine at ZeRO 0, bf16,
    one NCCL+gloo rank, no Ray), eager or with `torch.compile` (`train.compile`; `-modules`
    compiles each top-level module apart, `train.compile_scope`);
  - `plain-*`: a plain PyTorch loop on the same model, loss (`pretraining_loss`, sparse MLM) and
    batches, already on the GPU: fused AdamW, bf16 autocast, clipping, nothing else. It is the
    ceiling the loop's own work (batch building, guard, telemetry, DeepSpeed) is measured
    against;
  - `nanogpt-*`: the outside reference, a minimal nanoGPT-style GPT-2 (fused QKV,
    `scaled_dot_product_attention(is_causal=True)`, tied head, compiled with its loss) with the
    same weights, batches and optimizer;
  - `-docmask`: GPT-2 with `train.document_masking`. On a GPU `train.attention: auto` makes it
    FlexAttention block masks built from the blocks' document ids (the plain arm builds its
    model the same way); `-dense` keeps the (B, 1, L, L) mask through SDPA, the path a CPU
    takes, to compare the two.
  The arms' mean losses over the timed steps must agree within `LOSS_AGREEMENT` per model and
  masking; `run` exits non-zero when they do not (`loss_agreement` in the JSON).

Models: lmpipe's `base` size of `bert` (BertForPreTraining, MLM + NSP, 110 M parameters) at
128 tokens, batch 256; of `gpt2` (GPT2LMHeadModel, 124 M) at 1,024 tokens, batch 32, with the
published vocabulary of 50,257 tokens (`model.overrides`; the BPE trained on the shared texts is
smaller, and the vocabulary projection is a large part of GPT-2's FLOPs) and no dropout, as
nanoGPT trains it. Both vocabularies are padded to a multiple of 64 rows
(`model.pad_vocab_to_multiple_of`); MFU counts the real rows only. Counted: real input tokens
of the timed steps. Timed, for every arm alike: the CUDA-synchronised wall time of the whole
window of steps after the warm-up (an asynchronous step's own time measures only how fast it
was queued); lmpipe's window includes its logging reads at `train.log_every_steps`. After the
window, lmpipe trains `SYNC_CHECK_STEPS` more steps under
`torch.cuda.set_sync_debug_mode("error")`: `sync_free` in the report says whether a step
synchronised with the host, and `sync_error` where.
MFU = `training.models.flops.flops_per_token` x tokens/s / the GPU's dense bf16 peak: the
datasheet's (`training.pretrain.telemetry.DATASHEET_PEAKS`, 989.4 TFLOP/s for an H100 SXM or H200)
and, in a second column, the matmul peak measured there.
Targets: MFU >= 45% for GPT-2 and >= 40% for BERT-base, against the datasheet peak.

`--device cpu --size tiny` runs the same code on a CPU
(tests/training/pretrain/test_pretrain_gpu_bench.py), in fp32 where the CPU has no native bf16.

The arms' code is in bench/pretrain_gpu_arms.py (and bench/nanogpt.py), the example sets'
in bench/pretrain_data.py, the subprocess per setting in bench/harness.py. The GPU machine
gets them with the working tree (docs/benchmarks.md, "GPU"); they import only the standard
library at the top, as this script does.
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from harness import launch_child, write_json  # noqa: E402
from pretrain_data import prepare_examples, prepare_gpt2_blocks  # noqa: E402
from pretrain_gpu_arms import (  # noqa: E402
    MODELS,
    child_device,
    child_init,
    child_lmpipe,
    child_nanogpt,
    child_plain,
)

CHILD_TIMEOUT_S = 480
#: The arms' mean losses over the timed steps must agree within this (relative), in bf16.
LOSS_AGREEMENT = 0.02


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
#: loops of both models and the nanoGPT reference, module-by-module compilation, GPT-2 with
#: document masking (FlexAttention, then the dense mask), then eager.
SETTINGS: dict[str, dict[str, Any]] = dict(
    [
        _setting("lmpipe", "gpt2-124m", True),
        _setting("plain", "gpt2-124m", True),
        _setting("nanogpt", "gpt2-124m", True),
        _setting("lmpipe", "bert-base", True),
        _setting("plain", "bert-base", True),
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
        _setting("lmpipe", "gpt2-124m", False, docmask=True),
        _setting("plain", "gpt2-124m", False, docmask=True),
    ]
)
#: Packages to carry as wheels (the GPU image has none of pydantic and DeepSpeed, and an older
#: transformers); their dependencies are in the image (docs/benchmarks.md, "GPU").
WHEELS = (
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "hjson",
    "transformers",
)


# -- prepare (the CPU machine) --------------------------------------------------------------


def download_wheels(dest: Path) -> list[str]:
    """This venv's versions of `WHEELS` for CPython 3.12 on x86-64, and a DeepSpeed wheel."""
    from importlib.metadata import version

    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + [
        "--platform=manylinux2014_x86_64"
    ]
    pins = [f"{name}=={version(name)}" for name in WHEELS]
    download = ["download", "--no-deps", "--only-binary=:all:", "--python-version=3.12"]
    subprocess.run(
        [*pip, *download, "--implementation=cp", *platforms, "-d", str(dest), *pins], check=True
    )
    # DeepSpeed publishes a source archive only. Built here without its optional C++/CUDA ops
    # (lmpipe uses torch's fused AdamW), the wheel is pure Python.
    deepspeed = f"deepspeed=={version('deepspeed')}"
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), deepspeed],
        check=True,
        env=os.environ | {"DS_BUILD_OPS": "0"},
    )
    return sorted(path.name for path in dest.glob("*.whl"))


def prepare(out: Path, work: Path, wheels: bool) -> dict[str, Any]:
    """Build both example sets into `work` and copy what the GPU run reads into `out`."""
    built = {"bert": prepare_examples(work), "gpt2": prepare_gpt2_blocks(work)}
    for name, info in built.items():
        for part in ("examples", "tokenizer"):
            target = out / name / part
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(info[f"{part}_dir"], target)
    summary: dict[str, Any] = {"sets": built}
    if wheels:
        summary["wheels"] = download_wheels(out / "wheels")
    write_json(out / "prepared.json", summary, newline=True)
    return summary


# -- the settings, each in its own subprocess -----------------------------------------------

CHILDREN = {
    "lmpipe": child_lmpipe,
    "plain": child_plain,
    "nanogpt": child_nanogpt,
    "init": child_init,
    "device": child_device,
}


def run_child(spec: dict[str, Any]) -> None:
    """Subprocess entry: run one setting and write its result JSON."""
    result = CHILDREN[spec["loop"]](spec)
    Path(spec["result"]).write_text(json.dumps(result))


# -- the driver -----------------------------------------------------------------------------


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


def chosen_settings(only: str | None) -> list[str]:
    """The settings `--only` names (all by default), in the order given."""
    names = only.split(",") if only else list(SETTINGS)
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; known: {sorted(SETTINGS)}")
    return names


def check_data(data: Path, names: list[str], given: str) -> None:
    """Exit unless `prepare --out GIVEN` wrote each chosen model's examples, for its objective."""
    for model in {SETTINGS[name]["model"] for name in names}:
        manifest = data / MODELS[model]["data"] / "examples" / "manifest.json"
        if not manifest.is_file():
            raise SystemExit(f"{manifest}: missing; run `prepare --out {given}` first")
        objective = json.loads(manifest.read_text())["objective"]
        if objective != MODELS[model]["objective"]:
            wanted = MODELS[model]["objective"]
            raise SystemExit(f"{manifest}: objective {objective!r}; {model} trains on {wanted!r}")


def setting_spec(base: dict[str, Any], name: str, data: Path, batch: int | None) -> dict[str, Any]:
    """The spec of one setting's child: the run's options, the setting, its examples."""
    setting = SETTINGS[name]
    model = MODELS[setting["model"]]
    return (
        base
        | setting
        | {
            "name": name,
            "batch": batch or model["batch"],
            "examples_dir": str(data / model["data"] / "examples"),
            "tokenizer_dir": str(data / model["data"] / "tokenizer"),
        }
    )


def initial_state(spec: dict[str, Any], work: Path, inits: dict[str, str]) -> str:
    """The saved initial weights of the setting's model: built once per model, for every arm."""
    model = spec["model"]
    if model not in inits:
        state = str(work / f"init-{model}.pt")
        built = launch(spec | {"loop": "init", "init": state}, work / f"init-{model}")
        if "error" in built:
            raise SystemExit(f"building {model} failed:\n{built['error']}")
        inits[model] = state
    return inits[model]


def write_report(
    out: Path, rows: dict[str, Any], raw: dict[str, Any], device: dict[str, Any]
) -> dict[str, Any]:
    """Write OUT/pretrain_gpu.json (with the loss agreement) and OUT/pretrain_gpu.md."""
    report = {"command": sys.argv, "device": device, "rows": rows, "raw": raw}
    report["loss_agreement"] = loss_agreement(rows)
    write_json(out / "pretrain_gpu.json", report, newline=True)
    (out / "pretrain_gpu.md").write_text(table(rows, device) + "\n")
    return report


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen settings one after the other; write and print the results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = chosen_settings(args.only)
    data = Path(args.data).resolve()
    check_data(data, names, args.data)
    base = {
        "device": args.device,
        "warmup": args.warmup,
        "steps": args.steps,
        "threads": args.threads,
        "size": args.size,
    }
    work = Path(args.work)  # not under OUT: the device tool brings back a few files only
    device = launch(base | {"loop": "device", "name": "device"}, work / "device")
    if "error" in device:
        raise SystemExit(f"the device check failed:\n{device['error']}")
    raw: dict[str, Any] = {}
    rows: dict[str, dict[str, Any]] = {}
    inits: dict[str, str] = {}
    for name in names:
        spec = setting_spec(base, name, data, args.batch)
        spec["init"] = initial_state(spec, work, inits)
        raw[name] = launch(spec, work / name)
        peaks = device["peak_flops"], device["measured_peak_flops"]
        target = MODELS[spec["model"]]["target"]
        rows[name] = summarize(raw[name], args.warmup, *peaks, target)
        print(name, json.dumps(rows[name]), flush=True)
        # After every setting: a run stopped at the device's time limit keeps what it measured.
        report = write_report(out, rows, raw, device)
    print(table(rows, device))
    agreement = report["loss_agreement"]
    apart = {group: check for group, check in agreement.items() if not check["agree"]}
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
        if "mean_loss" not in row:
            continue
        setting = SETTINGS.get(name, {})
        group = setting.get("model", name) + ("-docmask" if setting.get("docmask") else "")
        groups.setdefault(group, {})[name] = row["mean_loss"]
    result = {}
    for group, means in groups.items():
        low, high = min(means.values()), max(means.values())
        spread = (high - low) / low if low > 0 else float("inf")
        result[group] = {"means": means, "spread": spread, "agree": spread <= LOSS_AGREEMENT}
    return result


def main(argv: list[str] | None = None) -> None:
    """Command line: `prepare`, `run`, or a child's `--child SPEC`."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        run_child(json.loads(argv[1]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="Build the example sets (and wheels) to carry.")
    prep.add_argument("--out", required=True)
    prep.add_argument("--work", default=str(ROOT / "bench" / "results" / "pretrain_gpu_work"))
    prep.add_argument("--wheels", action="store_true", help="Also fetch the wheels to carry.")
    go = sub.add_parser("run", help="Train every setting and report tokens/s and MFU.")
    go.add_argument("--data", required=True, help="What `prepare --out` wrote.")
    go.add_argument("--out", required=True, help="Where the JSON and Markdown reports go.")
    go.add_argument(
        "--work",
        default=str(ROOT / "bench" / "results" / "pretrain_gpu_runs"),
        help="The settings' run directories (logs, steps; checkpoints are removed).",
    )
    go.add_argument("--only", help=f"Comma-separated settings of {sorted(SETTINGS)}.")
    go.add_argument("--warmup", type=int, default=10, help="Untimed steps first.")
    go.add_argument("--steps", type=int, default=40, help="Timed steps.")
    go.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    go.add_argument("--size", help="Another lmpipe size for both models (tiny: a CPU check).")
    go.add_argument("--batch", type=int, help="Global batch instead of each model's own.")
    go.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    if args.command == "prepare":
        summary = prepare(Path(args.out), Path(args.work), args.wheels)
        print(json.dumps(summary, indent=1))
    else:
        run(args)


if __name__ == "__main__":
    main()
