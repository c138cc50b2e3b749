"""DistilBERT distillation: a half-depth student against its BERT teacher, on the demo corpus.

Usage: python bench/distillation.py [--fresh] [--seeds 0,1,2] [--steps 1500] [--student-steps N]
                                    [--reps 20] [--work bench/results/distillation] [--json FILE]
                                    [every other option of bench/pretraining_helps.py]

Acceptance of distillation. The data stages, the recipe's knobs and the fine-tuning harness are
bench/pretraining_helps.py's, imported from it: the synthetic demo corpus, ingest, WordPiece,
encode, BERT examples with dynamic masking, and lmpipe's `pretrain_stage` (Ray Train with 2
workers, DeepSpeed ZeRO-2 on CPU, precision auto, MLflow off). It pretrains a BERT teacher (`mini`,
4 layers by default), cuts single-segment MLM examples (`examples.objective: roberta`) from the
same encoded corpus and WordPiece vocabulary, and distils the DistilBERT student (half the
teacher's layers, initialised from every other teacher layer) with `pretrain_stage` and
`train.distillation.teacher.path` = the teacher's export. It then measures, for both exports:
layers and parameters; the forward pass (eval mode, no grad, fp32, random token ids, full
attention) at batch 32 x 128 tokens and at the demo's length, on 1 thread and on torch's
default thread count, of the encoder alone and with the MLM head, as the median of `--reps`
repetitions after `--warmup-reps`, the teacher and the student interleaved; the fill-mask probe;
and the test accuracy of the plain fine-tuning harness on the residence task per seed. It
prints a Markdown table ("kept" = student score / teacher score) and writes `--json FILE`.

Finished runs of the same inputs and recipe are reused (their ids hash them); `--fresh`
deletes the work directory first, so that every stage is timed again.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers as tf  # noqa: E402

from bench import pretraining_helps as helps  # noqa: E402  (also sets the env it needs)
from tasks.common.ray_runtime import ensure_ray  # noqa: E402
from tasks.demo.synthetic import SyntheticConfig  # noqa: E402
from tasks.examples.config import ExamplesConfig  # noqa: E402
from tasks.examples.stage import run_examples  # noqa: E402
from training.pretrain.config import TrainConfig  # noqa: E402
from training.scoring.plots import step_history  # noqa: E402

#: torch's thread count before anything sets it: what a user's process gets.
DEFAULT_THREADS = torch.get_num_threads()
#: The teacher's recipe where it differs from pretraining_helps' defaults (the user's argv wins).
TEACHER_DEFAULTS = [
    "--work",
    str(ROOT / "bench/results/distillation"),
    "--overrides",
    '{"num_hidden_layers": 4}',
    "--steps",
    "1500",
]
MODELS = ("teacher", "student")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Our options; every other one is pretraining_helps' (the teacher's recipe and the data)."""
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        allow_abbrev=False,
        epilog="Every other option is bench/pretraining_helps.py's; defaults differ in "
        f"{' '.join(TEACHER_DEFAULTS)}.",
    )
    p.add_argument("--student-steps", type=int, default=None, help="default: --steps")
    p.add_argument("--student-lr", type=float, default=None, help="default: --lr")
    p.add_argument("--reps", type=int, default=20, help="timed forward passes per setting")
    p.add_argument("--warmup-reps", type=int, default=3, help="untimed passes first")
    p.add_argument("--timing-batch", type=int, default=32)
    p.add_argument("--timing-seq-lens", default="128", help="besides the demo's --seq-len")
    ours, rest = p.parse_known_args(argv)
    recipe = helps.parse_args([*TEACHER_DEFAULTS, *rest])
    args = argparse.Namespace(**vars(recipe), **vars(ours))
    args.student_steps = args.student_steps or args.steps
    args.student_lr = args.student_lr or args.lr
    return args


def roberta_examples(args: argparse.Namespace, bert_examples: Path, tokenizer: Path) -> Path:
    """Single-segment MLM examples of the teacher's encoded corpus and WordPiece vocabulary."""
    # The BERT examples' manifest names its encode output by fingerprint, and run_encode
    # writes that output to <workspace>/encode/<fingerprint>: the same ids, not re-encoded.
    manifest = json.loads((bert_examples / "manifest.json").read_text())
    encode = args.work / "ws" / "encode" / manifest["inputs"]["encode"]
    cfg = ExamplesConfig.model_validate(
        {
            "objective": "roberta",
            "max_seq_length": args.seq_len,
            "masking": "dynamic",
            "mask": {"masked_lm_prob": args.mask_prob},
        }
    )
    ws = args.work / "ws"
    return run_examples(cfg, args.pretrain_seed, helps.RAY, encode, tokenizer, ws).path


def student_train_config(
    args: argparse.Namespace, teacher_cfg: TrainConfig, teacher: Path
) -> TrainConfig:
    """The teacher's train section for a DistilBERT student distilled from `teacher`."""
    spec = teacher_cfg.model_dump(mode="json")
    steps = args.student_steps
    spec["model"] = {"family": "distilbert", "size": args.size, "dropout": args.dropout}
    spec["max_steps"] = steps
    spec["optim"] |= {"lr": args.student_lr, "warmup_steps": max(1, steps // 20)}
    spec["checkpoint"]["every_steps"] = steps
    spec["eval"]["every_steps"] = max(1, steps // 4)
    spec["distillation"] = {"teacher": {"path": str(teacher)}}
    return TrainConfig.model_validate(spec)


def train_both(
    args: argparse.Namespace, examples: Path, tokenizer: Path
) -> tuple[dict[str, Path], dict[str, float], dict[str, Any]]:
    """Pretrain the teacher, then distil the student from its export.

    Returns:
        Each model's export, each run's wall seconds, and both train sections.
    """
    teacher_cfg = helps.train_config(args, args.work / "runs")
    started = time.perf_counter()
    teacher = helps.pretrain(teacher_cfg, args.pretrain_seed, examples, tokenizer, args.work)
    trained = time.perf_counter()
    student_examples = roberta_examples(args, examples, tokenizer)
    cut = time.perf_counter()
    student_cfg = student_train_config(args, teacher_cfg, teacher)
    student = helps.pretrain(
        student_cfg, args.pretrain_seed, student_examples, tokenizer, args.work
    )
    seconds = {
        "teacher": trained - started,
        "student_examples": cut - trained,
        "student": time.perf_counter() - cut,
    }
    cfgs = {"teacher": teacher_cfg.model_dump(mode="json")}
    cfgs["student"] = student_cfg.model_dump(mode="json")
    return {"teacher": teacher, "student": student}, seconds, cfgs


def final_evals(export: Path) -> dict[str, float]:
    """The last held-out evaluation of the run that wrote `export` (the run's `export/`)."""
    evals = step_history(export.parent / "evals.jsonl")
    return evals[max(evals)] if evals else {}


def load_mlm(export: Path) -> Any:
    """The export's masked-LM model in eval mode, fp32."""
    model = tf.AutoModelForMaskedLM.from_pretrained(export, local_files_only=True)
    return model.float().eval()


def describe(model: Any) -> dict[str, Any]:
    """Layers, parameters (encoder alone and with the MLM head) and attention kernel."""
    config = model.config
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,  # DistilBertConfig maps it to n_layers
        "params_encoder": sum(p.numel() for p in model.base_model.parameters()),
        "params_total": sum(p.numel() for p in model.parameters()),
        "attn_implementation": config._attn_implementation,
    }


@torch.no_grad()
def median_forward_s(
    models: dict[str, Any], batch: int, seq_len: int, vocab: int, reps: int, warmup: int
) -> dict[str, float]:
    """Median seconds of one forward pass of each model, the models interleaved per rep.

    Interleaving spreads any load change on a shared machine over both models alike.
    """
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "input_ids": torch.randint(5, vocab, (batch, seq_len), generator=gen),  # (B, T)
        "attention_mask": torch.ones(batch, seq_len, dtype=torch.long),  # (B, T)
    }
    times: dict[str, list[float]] = {name: [] for name in models}
    for rep in range(warmup + reps):
        for name, model in models.items():
            started = time.perf_counter()
            model(**inputs)
            if rep >= warmup:
                times[name].append(time.perf_counter() - started)
    return {name: statistics.median(ts) for name, ts in times.items()}


def measure_speed(exports: dict[str, Path], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Forward-pass medians per thread count, length and part (encoder, with MLM head)."""
    mlm = {name: load_mlm(path) for name, path in exports.items()}
    vocab = int(mlm["teacher"].config.vocab_size)
    seq_lens = [int(s) for s in args.timing_seq_lens.split(",")] + [args.seq_len]
    rows = []
    for threads in sorted({1, DEFAULT_THREADS}):
        torch.set_num_threads(threads)
        for seq_len in seq_lens:
            for part in ("encoder", "mlm"):
                models = {n: m.base_model if part == "encoder" else m for n, m in mlm.items()}
                medians = median_forward_s(
                    models, args.timing_batch, seq_len, vocab, args.reps, args.warmup_reps
                )
                rows.append(
                    {"threads": threads, "batch": args.timing_batch, "seq_len": seq_len}
                    | {"part": part, "teacher_s": medians["teacher"]}
                    | {"student_s": medians["student"]}
                    | {"speedup": medians["teacher"] / medians["student"]}
                )
    return rows


def finetune_both(
    exports: dict[str, Path], args: argparse.Namespace, tasks: Path
) -> tuple[list[dict[str, Any]], helps.TaskData, helps.FinetuneRecipe]:
    """Fine-tune each export per seed with pretraining_helps' harness (2 threads)."""
    torch.set_num_threads(2)
    task = helps.read_task(tasks / f"{args.task}.csv")
    recipe = helps.FinetuneRecipe(lr=args.ft_lr, epochs=args.ft_epochs, batch_size=args.ft_batch)
    runs = [
        {"seed": seed, "model": name} | helps.finetune(exports[name], True, task, seed, recipe)
        for seed in [int(s) for s in args.seeds.split(",")]
        for name in MODELS
    ]
    return runs, task, recipe


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build the data, train teacher and student, time and fine-tune both; return every number."""
    if args.fresh and args.work.exists():
        shutil.rmtree(args.work)
    synth = SyntheticConfig(
        seed=args.corpus_seed,
        people=args.people,
        documents=args.documents,
        register_share=args.register_share,
    )
    ensure_ray(helps.RAY)
    t0 = time.perf_counter()
    examples, tokenizer, tasks = helps.build_inputs(args.work, synth, args)
    data_s = time.perf_counter() - t0
    exports, train_s, cfgs = train_both(args, examples, tokenizer)
    tf.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    models = {name: describe(load_mlm(path)) for name, path in exports.items()}
    speed = measure_speed(exports, args)
    runs, task, recipe = finetune_both(exports, args, tasks)
    return {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"cpu_count": os.cpu_count(), "default_threads": DEFAULT_THREADS},
        "synthetic": synth.model_dump(),
        "train": cfgs,
        "finetune": asdict(recipe),
        "sizes": {split: len(v[0]) for split, v in task.splits.items()},
        "chance": helps.chance(task),
        "models": models,
        "probe": {name: helps.probe_knowledge(path, synth) for name, path in exports.items()},
        "final_evals": {name: final_evals(path) for name, path in exports.items()},
        "data_s": data_s,
        "train_s": train_s,
        "speed": speed,
        "runs": runs,
    }


def speed_lines(result: dict[str, Any]) -> list[str]:
    """One table row per timed setting: milliseconds and the student's speed-up."""
    lines = []
    for row in result["speed"]:
        part = "encoder" if row["part"] == "encoder" else "encoder + MLM head"
        lines.append(
            f"| forward ms, {part}, {row['batch']} x {row['seq_len']}, {row['threads']} "
            f"thread{'s' if row['threads'] > 1 else ''} | {row['teacher_s'] * 1e3:.1f} | "
            f"{row['student_s'] * 1e3:.1f} | **{row['speedup']:.2f}x faster** |"
        )
    return lines


def score_lines(result: dict[str, Any]) -> list[str]:
    """Per-seed and mean test accuracy, and the share of the teacher's score the student kept."""
    by = {(r["seed"], r["model"]): r for r in result["runs"]}
    seeds = sorted({r["seed"] for r in result["runs"]})
    mean = {m: statistics.mean(by[(s, m)]["test_acc"] for s in seeds) for m in MODELS}
    per_seed = {m: " / ".join(f"{by[(s, m)]['test_acc']:.3f}" for s in seeds) for m in MODELS}
    kept = mean["student"] / mean["teacher"] if mean["teacher"] else float("nan")
    probe = result["probe"]
    seeds_txt = "/".join(str(s) for s in seeds)
    return [
        f"| residence test acc, seeds {seeds_txt} | {per_seed['teacher']} | "
        f"{per_seed['student']} | |",
        f"| residence test acc, mean | {mean['teacher']:.3f} | {mean['student']:.3f} | "
        f"**kept {kept:.3f}** |",
        f"| fill-mask probe | {probe['teacher']:.3f} | {probe['student']:.3f} | "
        f"{probe['student'] - probe['teacher']:+.3f} |",
    ]


def report(result: dict[str, Any]) -> str:
    """The results as a Markdown table and a summary line."""
    t, s = result["models"]["teacher"], result["models"]["student"]
    lines = [
        "| | teacher (BERT) | student (DistilBERT) | student vs teacher |",
        "|---|---|---|---|",
        f"| layers | {t['layers']} | {s['layers']} | {s['layers'] / t['layers']:.2f} |",
        f"| parameters, encoder | {t['params_encoder']:,} | {s['params_encoder']:,} | "
        f"{s['params_encoder'] / t['params_encoder']:.3f} |",
        f"| parameters, with MLM head | {t['params_total']:,} | {s['params_total']:,} | "
        f"{s['params_total'] / t['params_total']:.3f} |",
        *speed_lines(result),
        *score_lines(result),
    ]
    nan = float("nan")
    ev, t_ev = result["final_evals"]["student"], result["final_evals"]["teacher"]
    train_s, runs = result["train_s"], result["runs"]
    lines.append(
        f"\nchance {result['chance']:.3f}; splits {result['sizes']}; the student's last eval: "
        f"loss {ev.get('eval_loss', nan):.3f}, kd {ev.get('eval_kd_loss', nan):.3f}, "
        f"mlm {ev.get('eval_mlm_loss', nan):.3f} (the teacher's mlm "
        f"{t_ev.get('eval_mlm_loss', nan):.3f}); data stages {result['data_s']:.0f} s, teacher "
        f"pretraining {train_s['teacher']:.0f} s, student examples "
        f"{train_s['student_examples']:.0f} s, distillation {train_s['student']:.0f} s, "
        f"{len(runs)} fine-tunes {sum(r['seconds'] for r in runs):.0f} s; torch default "
        f"threads {result['machine']['default_threads']} on {result['machine']['cpu_count']} CPUs"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["total_s"] = time.perf_counter() - started
    print(report(result))
    print(f"total {result['total_s']:.0f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
