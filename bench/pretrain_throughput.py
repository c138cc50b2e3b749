"""CPU training throughput: lmpipe's loop against a plain PyTorch loop and transformers.Trainer.

Usage: python bench/pretrain_throughput.py [--quick] [--warmup 10] [--steps 30]
                                           [--only NAME,...] [--ab NAME] [--out bench/results]

Builds BERT examples of 128 tokens once (set-up, not measured): the real texts of
../shared/data (the four Gutenberg books and Tiny Shakespeare, one document per file, and the
1,000 IMDB reviews) through the ingest, tokenizer (WordPiece, 30,522 tokens), encode and
examples stages. Then, on the same examples, batches (the loop's seeded global order, static
masks), model (BERT, 4 layers, hidden 256, 4 heads, FFN 1024) and 2 torch threads, it runs
each setting in its own subprocess:

- `plain-*`: a plain PyTorch loop (AdamW, gradient clipping, the same warm-up/decay schedule,
  `training.pretrain.losses.pretraining_loss`), fp32 or bf16 autocast, eager or `torch.compile`;
- `hf-*`: `transformers.Trainer` on `BertForPreTraining` (its own loss: MLM logits at every
  position), the same samples as a torch Dataset in the same order, fp32 or bf16 (autocast),
  with or without its `torch_compile` option;
- `lmpipe-local-*`: lmpipe's loop (`training.pretrain.loop.run_worker`, DeepSpeed engine) in this
  process with `LocalContext` (a one-rank gloo group, no Ray);
- `lmpipe-ray-*`: the same loop on Ray Train (`training.pretrain.driver.run_training`, 1 worker,
  2 CPUs, 2 threads), with a local Ray started in the subprocess.

Counted: real input tokens, i.e. the sum of the attention mask (padding excluded) of the
batches of the timed steps; every setting sees the same batches, so the same tokens. Timed:
from the end of the last warm-up step to the end of the last step (for lmpipe the sum of the
`step_time_s` its loop logs in `steps.jsonl`, read after the run; after `optimizer.step` for
the plain loop, at `on_step_end` for the Trainer), so compilation and start-up are left out.
MFU = `flops_per_token` x tokens/s / the matmul peak measured on 2 threads in the same dtype.
Each row also gives the cores that processes outside the benchmark kept busy while it was timed
(the load average cannot tell: it counts the benchmark's own two threads).

`--only` runs the named settings, including candidate fixes that are not run by default
(`lmpipe-local-bf16[-compile]-{fused,zero1-fused,zero0-fused}`: fused AdamW and the ZeRO stage,
set through `train.deepspeed_extra` / `train.zero_stage`; `lmpipe-ray-{bf16,fp32}-nice0`: Ray
workers at nice 0; `lmpipe-ray-{bf16,fp32}-poll2`: Ray Train's own 2 s controller poll
instead of `train.scale.report_poll_s`; `lmpipe-{local,ray}-defaults-zero0`: `TrainConfig`'s
own defaults (ZeRO 0); `lmpipe-ray-defaults-zero2`: the same with ZeRO 2; `plain-bf16-raytrain`:
the plain loop inside a Ray Train worker; `*-dense`: the MLM head at every position, against
sparse MLM). Separate subprocesses see the machine's speed drift (±15% between runs here), so
`--ab NAME` compares one lmpipe-local setting with the plain loop in one subprocess, alternating
their steps, and prints forward, backward and optimizer-step ms per step of each.

The Trainer needs `accelerate`, which is not a project dependency. Without it in the venv the
`hf-*` settings fail, unless it is installed apart, for those subprocesses only:
`pip install --no-deps --target bench/results/pretrain_work/pydeps accelerate`.

The settings' code is in bench/pretrain_cpu_arms.py, the examples' set-up in
bench/pretrain_data.py, the subprocess per setting in bench/harness.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # the shared modules, when loaded from elsewhere

from harness import CpuWatch, launch_child, machine, upper_median, write_json  # noqa: E402
from pretrain_cpu_arms import (  # noqa: E402
    CHILDREN,
    THREADS,
    build_bench_model,
    model_section,
    tokens_per_step,
)
from pretrain_data import SEQ_LEN, prepare_examples  # noqa: E402

CHILD_TIMEOUT_S = 900
PYDEPS = ROOT / "bench" / "results" / "pretrain_work" / "pydeps"  # see the module docstring

# name -> (kind, settings). Plain and Trainer settings mirror lmpipe's precision/compile axes.
VARIANTS: dict[str, dict[str, Any]] = {
    "plain-fp32": {"kind": "plain", "precision": "fp32", "compile": False},
    "plain-fp32-compile": {"kind": "plain", "precision": "fp32", "compile": True},
    "plain-bf16": {"kind": "plain", "precision": "bf16", "compile": False},
    "plain-bf16-compile": {"kind": "plain", "precision": "bf16", "compile": True},
    "hf-fp32": {"kind": "hf", "precision": "fp32", "compile": False},
    "hf-bf16": {"kind": "hf", "precision": "bf16", "compile": False},
    "hf-bf16-compile": {"kind": "hf", "precision": "bf16", "compile": True},
    "lmpipe-local-fp32": {"kind": "lmpipe-local", "precision": "fp32", "compile": False},
    "lmpipe-local-fp32-compile": {"kind": "lmpipe-local", "precision": "fp32", "compile": True},
    "lmpipe-local-bf16": {"kind": "lmpipe-local", "precision": "bf16", "compile": False},
    "lmpipe-local-bf16-compile": {"kind": "lmpipe-local", "precision": "bf16", "compile": True},
    "lmpipe-local-fp32-micro8": {  # lmpipe's defaults until 2026-11-25
        "kind": "lmpipe-local",
        "precision": "fp32",
        "compile": False,
        "micro_batch": 8,
    },
    "lmpipe-ray-fp32": {"kind": "lmpipe-ray", "precision": "fp32", "compile": False},
    "lmpipe-ray-fp32-compile": {"kind": "lmpipe-ray", "precision": "fp32", "compile": True},
    "lmpipe-ray-bf16": {"kind": "lmpipe-ray", "precision": "bf16", "compile": False},
    "lmpipe-ray-bf16-compile": {"kind": "lmpipe-ray", "precision": "bf16", "compile": True},
}
# Candidate fixes (config only), run only when named in --only: fused AdamW, ZeRO stage.
_FUSED = {"optimizer": {"params": {"fused": True}}}
EXTRA_VARIANTS: dict[str, dict[str, Any]] = {
    f"lmpipe-local-bf16{compiled}-{name}": {
        "kind": "lmpipe-local",
        "precision": "bf16",
        "compile": bool(compiled),
        "deepspeed_extra": _FUSED,
        "zero_stage": zero,
    }
    for compiled in ("", "-compile")
    for name, zero in (("fused", 2), ("zero1-fused", 1), ("zero0-fused", 0))
}
# Ray starts its workers at nice 15 (RAY_worker_niceness); on 2 cores its own daemons then
# preempt the training threads. nice 0 is set in the environment of the local Ray it starts.
EXTRA_VARIANTS |= {
    f"lmpipe-ray-{precision}-nice0": {
        "kind": "lmpipe-ray",
        "precision": precision,
        "compile": False,
        "ray_env": {"RAY_worker_niceness": "0"},
    }
    for precision in ("bf16", "fp32")
}
# Ray Train's own poll interval (2 s) against lmpipe's default `train.scale.report_poll_s`:
# does polling the worker 10x as often cost training throughput?
EXTRA_VARIANTS |= {
    f"lmpipe-ray-{precision}-poll2": {
        "kind": "lmpipe-ray",
        "precision": precision,
        "compile": False,
        "report_poll_s": 2.0,
    }
    for precision in ("bf16", "fp32")
}
# lmpipe's own defaults (`TrainConfig()`: precision auto, i.e. bf16 on this CPU, the whole
# global batch per micro-batch at 1 worker, ZeRO 0), and with ZeRO 2, the default stage until
# 2026-11-25 (it shards nothing on one rank). `-dense`: the vocabulary projection at every
# position (`train.sparse_mlm=false`) against sparse MLM, the same loss.
EXTRA_VARIANTS |= {
    "lmpipe-ray-defaults-zero2": {
        "kind": "lmpipe-ray",
        "precision": "auto",
        "compile": False,
        "zero_stage": 2,
    },
    "lmpipe-ray-defaults-zero0": {
        "kind": "lmpipe-ray",
        "precision": "auto",
        "compile": False,
        "zero_stage": 0,
    },
    "lmpipe-ray-defaults-zero0-dense": {
        "kind": "lmpipe-ray",
        "precision": "auto",
        "compile": False,
        "zero_stage": 0,
        "sparse_mlm": False,
    },
    "plain-bf16-raytrain": {"kind": "plain-ray", "precision": "bf16", "compile": False},
    "lmpipe-local-fp32-zero0": {
        "kind": "lmpipe-local",
        "precision": "fp32",
        "compile": False,
        "zero_stage": 0,
    },
    "lmpipe-local-defaults-zero0": {
        "kind": "lmpipe-local",
        "precision": "auto",
        "compile": False,
        "zero_stage": 0,
    },
    "plain-bf16-dense": {
        "kind": "plain",
        "precision": "bf16",
        "compile": False,
        "sparse_mlm": False,
    },
}
VARIANTS |= EXTRA_VARIANTS


def resolved_precision(spec: dict[str, Any]) -> str:
    """A setting's precision, with lmpipe's `auto` resolved as `TrainConfig` resolves it."""
    if spec["precision"] != "auto":
        return str(spec["precision"])
    from training.pretrain.config import TrainConfig

    return TrainConfig().precision


def run_child(spec: dict[str, Any]) -> None:
    """Subprocess entry: run one setting with 2 torch threads and write its result JSON."""
    import torch

    torch.set_num_threads(THREADS)
    result = CHILDREN[spec["kind"]](spec)
    Path(spec["result"]).write_text(json.dumps(result))


# -- the driver -----------------------------------------------------------------------------


def child_env(kind: str) -> dict[str, str]:
    """The environment of a setting's subprocess: 2 threads, and the Trainer's extra path."""
    env = os.environ | {
        "OMP_NUM_THREADS": str(THREADS),
        "MKL_NUM_THREADS": str(THREADS),
        "TOKENIZERS_PARALLELISM": "false",
    }
    extra = PYDEPS  # accelerate for the Trainer, kept out of the project's venv
    if kind == "hf" and extra.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra), env.get("PYTHONPATH")]))
    return env


def launch(name: str, base: dict[str, Any], work: Path) -> dict[str, Any]:
    """Run one setting in a fresh subprocess; return its raw result (or its error)."""
    spec = {**base, **VARIANTS.get(name, {})}
    env = child_env(spec["kind"])
    load, watch = os.getloadavg()[0], CpuWatch()
    started = time.perf_counter()
    watch.start()
    outcome = launch_child(__file__, spec, work / "runs" / name, env, CHILD_TIMEOUT_S)
    watch.finish()
    meta = {
        "wall_s": round(time.perf_counter() - started, 1),
        "load_1min": [load, os.getloadavg()[0]],
        "cpu_samples": watch.samples,
    }
    return meta | outcome


def summarize(raw: dict[str, Any], tokens: list[int], warmup: int, steps: int) -> dict[str, Any]:
    """tokens/s over the timed steps (after `warmup`), the median step time, the mean loss."""
    ends = raw.get("ends", [])
    if "error" in raw or len(ends) < warmup + steps:
        return {"error": raw.get("error", f"{len(ends)} step ends, expected {warmup + steps}")}
    window = ends[warmup - 1 : warmup + steps]  # the end of the last warm-up step, then steps
    elapsed = window[-1] - window[0]
    step_s = [b - a for a, b in itertools.pairwise(window)]
    losses = raw.get("losses")
    samples = [v for t, v in raw.get("cpu_samples", []) if window[0] <= t <= window[-1] + 1.0]
    samples = samples or [0.0]
    return {
        "others_cores_mean": sum(samples) / len(samples),
        "others_cores_max": max(samples),
        "tokens_per_s": sum(tokens[warmup : warmup + steps]) / elapsed,
        "timed_s": elapsed,
        "median_step_s": upper_median(step_s),
        "max_step_s": max(step_s),
        "mean_loss": sum(losses) / len(losses) if losses else raw.get("mean_loss"),
    }


def flops(examples_dir: Path) -> dict[str, float]:
    """Training FLOPs per input token: sparse MLM (lmpipe, plain) and dense (Trainer's loss)."""
    from training.models.flops import flops_per_token
    from training.models.models import model_config_for
    from training.pretrain.data import read_manifest

    manifest = read_manifest(examples_dir)
    specials = manifest["specials"]
    config = model_config_for(model_section(), specials["vocab_size"], specials, SEQ_LEN)
    rate = manifest["config"]["mask"]["masked_lm_prob"]
    return {
        "sparse": flops_per_token(config, SEQ_LEN, "bert", mlm_probability=rate),
        "dense": flops_per_token(config, SEQ_LEN, "bert", sparse_mlm=False),
    }


def run_order(only: list[str] | None) -> list[str]:
    """Settings grouped by (precision, compile), so that a drift in load hits every loop alike."""
    names = [n for n in VARIANTS if (n in only if only else n not in EXTRA_VARIANTS)]
    unknown = sorted(set(only or []) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {list(VARIANTS)}")

    def key(name: str) -> tuple[str, bool, int]:
        spec = VARIANTS[name]
        kinds = ["plain", "plain-ray", "lmpipe-local", "lmpipe-ray", "hf"]
        return spec["precision"], spec["compile"], kinds.index(spec["kind"])

    return sorted(names, key=key)


def add_ratios(
    rows: dict[str, dict[str, Any]], peak: dict[str, float], fpt: dict[str, float]
) -> str:
    """Add MFU and the ratios to the best baseline; return the best baseline's name."""
    ok = {n: r for n, r in rows.items() if "tokens_per_s" in r}
    baselines = {n: r for n, r in ok.items() if VARIANTS[n]["kind"] in ("plain", "hf")}
    best = max(baselines, key=lambda n: baselines[n]["tokens_per_s"]) if baselines else ""
    for name, row in ok.items():
        spec = VARIANTS[name]
        dense = spec["kind"] == "hf" or not spec.get("sparse_mlm", True)
        per_token = fpt["dense" if dense else "sparse"]
        row["mfu"] = per_token * row["tokens_per_s"] / peak[resolved_precision(spec)]
        if best:
            row["vs_best_baseline"] = row["tokens_per_s"] / rows[best]["tokens_per_s"]
        plain = f"plain-{resolved_precision(spec)}{'-compile' if spec['compile'] else ''}"
        plain += "" if spec.get("sparse_mlm", True) else "-dense"
        if spec["kind"].startswith("lmpipe") and "tokens_per_s" in rows.get(plain, {}):
            row["vs_plain_same_setting"] = row["tokens_per_s"] / rows[plain]["tokens_per_s"]
    return best


def table(rows: dict[str, dict[str, Any]], best: str) -> str:
    """The results as a Markdown table."""
    head = (
        "| setting | tokens/s | median step (s) | vs best baseline | vs plain, same setting "
        "| MFU | mean loss | other jobs' cores (mean / max) |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, row in rows.items():
        if "tokens_per_s" not in row:
            lines.append(f"| {name} | failed: {row['error'].splitlines()[-1][:80]} |||||||")
            continue
        others = f"{row['others_cores_mean']:.2f} / {row['others_cores_max']:.2f}"
        mark = " (best baseline)" if name == best else ""
        best_ratio, ratio = row.get("vs_best_baseline"), row.get("vs_plain_same_setting")
        lines.append(
            f"| {name}{mark} | {row['tokens_per_s']:,.0f} | {row['median_step_s']:.3f} "
            f"| {f'{best_ratio:.2f}x' if best_ratio else '-'} "
            f"| {f'{ratio:.2f}x' if ratio else '-'} | {row['mfu']:.1%} "
            f"| {row['mean_loss']:.3f} | {others} |"
        )
    return "\n".join(lines)


def run_ab(setting: str, base: dict[str, Any], work: Path) -> dict[str, Any]:
    """`--ab`: plain and lmpipe steps interleaved in one subprocess, per-phase ms per step."""
    spec = VARIANTS.get(setting, {})
    if spec.get("kind") != "lmpipe-local":
        raise SystemExit(f"--ab takes an lmpipe-local-* setting, not {setting!r}")
    raw = launch(f"ab-{setting}", base | spec | {"kind": "ab"}, work)
    if "error" in raw:
        raise SystemExit(raw["error"])
    plain, lm = raw["plain"], raw["lmpipe"]
    print(
        f"{setting} against the plain loop ({spec['precision']}, compile {spec['compile']}), "
        f"interleaved, ms per step:"
    )
    for phase in ("forward", "backward", "step", "total"):
        # A one-rank ZeRO-0 step calls neither the engine's backward nor its step (the loop
        # runs them itself): such phases show as "-", inside lmpipe's total.
        times = [f"{t[phase] * 1e3:7.1f}" if phase in t else "      -" for t in (plain, lm)]
        print(f"  {phase:9s} plain {times[0]}   lmpipe {times[1]}")
    ratio = plain["total"] / lm["total"]
    print(f"  lmpipe throughput / plain: {ratio:.3f}")
    return {"setting": setting, "plain": plain, "lmpipe": lm, "ratio": ratio}


def run_settings(
    names: list[str], base: dict[str, Any], work: Path, tokens: list[int], peak_s: float
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """Each setting in its own subprocess, between two measurements of the matmul peak."""
    peaks = [launch("peak", base | {"kind": "peak", "seconds": peak_s}, work)]
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        raw = launch(name, base, work)
        rows[name] = {**VARIANTS[name], **summarize(raw, tokens, base["warmup"], base["steps"])}
        rows[name] |= {k: raw[k] for k in ("wall_s", "load_1min")}
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    peaks.append(launch("peak", base | {"kind": "peak", "seconds": peak_s}, work))
    return rows, peaks


def measure(names: list[str], base: dict[str, Any], work: Path, peak_s: float) -> dict[str, Any]:
    """Run the settings between two measurements of the peak; return the report's figures."""
    examples = Path(base["examples_dir"])
    warmup, steps = base["warmup"], base["steps"]
    tokens = tokens_per_step(examples, warmup + steps)
    fpt = flops(examples)
    params = sum(p.numel() for p in build_bench_model(examples).parameters())
    rows, peaks = run_settings(names, base, work, tokens, peak_s)
    peak = {p: max(run.get(p, 0.0) for run in peaks) for p in ("fp32", "bf16")}
    best = add_ratios(rows, peak, fpt)
    return {
        "parameters": params,
        "flops_per_token": fpt,
        "peak_flops": peak,
        "peak_runs": peaks,
        "warmup_steps": warmup,
        "timed_steps": steps,
        "timed_tokens": sum(tokens[warmup:]),
        "best_baseline": best,
        "results": rows,
    }


def print_report(report: dict[str, Any]) -> None:
    """Print the results' table and the model's size, FLOPs, the peaks and the load."""
    fpt, peak = report["flops_per_token"], report["peak_flops"]
    print(table(report["results"], report["best_baseline"]))
    print(
        f"params {report['parameters']:,}; vocab {report['data']['vocab_size']}; flops/token "
        f"{fpt['sparse']:.3e} (sparse MLM), {fpt['dense']:.3e} (dense); peak fp32 "
        f"{peak['fp32'] / 1e9:.0f}, bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s; "
        f"load {report['load_avg_start']} -> {os.getloadavg()}"
    )


def parse_args() -> argparse.Namespace:
    """Parse the command line (a child's `--child SPEC` included)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Smoke run: 2 + 3 steps.")
    parser.add_argument("--warmup", type=int, default=10, help="Untimed steps first.")
    parser.add_argument("--steps", type=int, default=30, help="Timed steps.")
    parser.add_argument("--only", default=None, help="Comma-separated settings to run.")
    parser.add_argument("--ab", default=None, help="Diagnose one lmpipe-local-* setting.")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    """Set up the examples once, run every setting in its own subprocess, report."""
    args = parse_args()
    if args.child:
        run_child(json.loads(args.child))
        return
    warmup, steps = (2, 3) if args.quick else (args.warmup, args.steps)
    if warmup < 1 or steps < 1:
        raise SystemExit("--warmup and --steps must be at least 1")
    names = run_order(args.only.split(",") if args.only else None)
    work = args.out / "pretrain_work"
    started, load_start = time.time(), os.getloadavg()
    data = prepare_examples(work)
    base = {**data, "warmup": warmup, "steps": steps}
    args.out.mkdir(parents=True, exist_ok=True)
    if args.ab:
        write_json(args.out / "pretrain_ab.json", run_ab(args.ab, base, work))
        return
    figures = measure(names, base, work, 0.5 if args.quick else 2.0)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "elapsed_s": round(time.time() - started, 1),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "machine": machine("torch", "transformers", "deepspeed", "ray"),
        "data": data,
        **figures,
    }
    write_json(args.out / "pretrain_throughput.json", report)
    print_report(report)


if __name__ == "__main__":
    main()
