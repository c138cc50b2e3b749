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
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SEED = 0
GPT2_BLOCK = 1024
GPT2_VOCAB = 50_257  # GPT-2's published vocabulary
CHILD_TIMEOUT_S = 480
SYNC_CHECK_STEPS = 3  # lmpipe's steps run under CUDA's sync debug mode after the timed ones

#: model -> lmpipe family, size, objective, examples set, batch, MFU target (datasheet peak).
MODELS: dict[str, dict[str, Any]] = {
    "bert-base": {
        "family": "bert",
        "size": "base",
        "objective": "bert",
        "data": "bert",
        "batch": 256,
        "overrides": {},
        "target": 0.40,
    },
    "gpt2-124m": {
        "family": "gpt2",
        "size": "base",
        "objective": "causal",
        "data": "gpt2",
        "batch": 32,
        "overrides": {"vocab_size": GPT2_VOCAB},
        "dropout": 0.0,  # as nanoGPT and llm.c pretrain GPT-2
        "target": 0.45,
    },
}
#: The optimizer of every arm (lmpipe's `train.optim`): nanoGPT's GPT-2 settings, constant
#: rate, so the arms' losses can be compared step by step.
OPTIM: dict[str, Any] = {
    "lr": 6e-4,
    "betas": (0.9, 0.95),
    "eps": 1e-8,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "warmup_steps": 0,
    "decay": "constant",
}
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


def prepare_gpt2_blocks(work: Path) -> dict[str, Any]:
    """Byte-level BPE on the shared texts, then causal blocks of 1,024 tokens."""
    import pretrain_throughput as cpu_bench

    from tasks.common.ray_runtime import RayConfig
    from tasks.encode.encode import EncodeConfig
    from tasks.encode.stage import run_encode
    from tasks.examples.config import ExamplesConfig
    from tasks.examples.stage import run_examples
    from tasks.tokenizer.stage import run_tokenizer
    from tasks.tokenizer.tokenizer import TokenizerConfig

    ray_cfg, ws = RayConfig(num_workers=cpu_bench.THREADS), work / "ws"
    ingest = cpu_bench.ingest_shared_texts(ws, ray_cfg)
    tok_cfg = TokenizerConfig(family="bpe", bpe_style="gpt2", vocab_size=GPT2_VOCAB)
    tokenizer = run_tokenizer(tok_cfg, ingest.path, ws)
    encode = run_encode(EncodeConfig(), ray_cfg, ingest.path, tokenizer.path, ws)
    cfg = ExamplesConfig(objective="causal", block_size=GPT2_BLOCK)
    examples = run_examples(cfg, SEED, ray_cfg, encode.path, tokenizer.path, ws)
    import ray

    ray.shutdown()
    return {
        "examples_dir": str(examples.path),
        "tokenizer_dir": str(tokenizer.path),
        "vocab_size": tokenizer.manifest["metrics"]["vocab_size"],
        "train_examples": examples.manifest["splits"]["train"]["rows"],
    }


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
    import pretrain_throughput as cpu_bench

    built = {"bert": cpu_bench.prepare_examples(work), "gpt2": prepare_gpt2_blocks(work)}
    for name, info in built.items():
        for part in ("examples", "tokenizer"):
            target = out / name / part
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(info[f"{part}_dir"], target)
    summary: dict[str, Any] = {"sets": built}
    if wheels:
        summary["wheels"] = download_wheels(out / "wheels")
    (out / "prepared.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


# -- the settings, each in its own subprocess -----------------------------------------------


def model_section(spec: dict[str, Any]) -> dict[str, Any]:
    """The `train.model` section of a setting (`--size` replaces the model's own size)."""
    model = MODELS[spec["model"]]
    section = {
        "family": model["family"],
        "size": spec.get("size") or model["size"],
        "overrides": model["overrides"],
    }
    return section | ({"dropout": model["dropout"]} if "dropout" in model else {})


def child_init(spec: dict[str, Any]) -> dict[str, Any]:
    """Build each model once, seeded, and save its weights: every arm starts from them."""
    import torch

    from training.models.models import ModelConfig, build_model
    from training.pretrain.data import read_manifest, sequence_length

    manifest = read_manifest(Path(spec["examples_dir"]))
    objective = manifest["objective"]
    length = sequence_length(manifest)
    torch.manual_seed(SEED)
    section = ModelConfig.model_validate(model_section(spec))
    specials = manifest["specials"]
    model = build_model(section, objective, specials["vocab_size"], specials, length)
    torch.save(model.state_dict(), spec["init"])
    return {"parameters": sum(p.numel() for p in model.parameters())}


def child_lmpipe(spec: dict[str, Any]) -> dict[str, Any]:
    """Run lmpipe's loop (`Worker.run`) here, on one rank without Ray; its logged steps."""
    import torch

    from training.pretrain.config import TrainConfig
    from training.pretrain.loop import Worker, WorkerJob
    from training.runtime.worker_context import LocalContext, init_single_process
    from training.scoring.plots import step_history

    run_dir, batch = Path(spec["run_dir"]), spec["batch"]
    gpu = spec["device"] == "cuda"
    threads = spec["threads"]
    cfg = TrainConfig.model_validate(
        {
            "model": model_section(spec),
            "max_steps": spec["warmup"] + spec["steps"] + SYNC_CHECK_STEPS,
            "global_batch_size": batch,
            "precision": "bf16" if _bf16(spec) else "fp32",
            "zero_stage": 0,
            "compile": spec["compile"],
            "compile_scope": spec["scope"],
            "document_masking": spec["docmask"],
            "attention": spec.get("attention", "auto"),
            "optim": OPTIM,
            # Evaluation at the start and end, one checkpoint at the end: outside the window.
            "eval": {"every_steps": 1 << 20, "max_samples": batch},
            "checkpoint": {"every_steps": 1 << 20, "keep_last": 1, "storage_path": str(run_dir)},
            "scale": {
                "num_workers": 1,
                "use_gpu": gpu,
                "cpus_per_worker": threads,
                "threads_per_worker": threads,
            },
        }
    )
    job = WorkerJob(
        train=cfg,
        seed=SEED,
        examples_dir=Path(spec["examples_dir"]),
        tokenizer_dir=Path(spec["tokenizer_dir"]),
        config_hash=f"bench-gpu-{spec['name']}",
    )
    init_single_process()
    torch.set_num_threads(threads)
    worker = Worker(job, LocalContext(run_dir))
    worker.engine.module.load_state_dict(torch.load(spec["init"]))  # the arms' common start
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    warmup, steps = spec["warmup"], spec["steps"]
    for _ in range(warmup):
        worker.train_step()
    worker.flush()  # the loop's own reads at its logging interval stay inside the window
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        worker.train_step()
    worker.flush()
    sync()
    window_s = time.perf_counter() - start
    check = sync_check(worker, gpu)
    ordered = list(step_history(run_dir / "steps.jsonl").values())[: warmup + steps]
    return {
        # Warm-up steps as the loop logged them; the timed ones share the synchronised window.
        "step_s": [row["step_time_s"] for row in ordered[:warmup]] + [window_s / steps] * steps,
        "tokens": [row["tokens_per_s"] * row["step_time_s"] for row in ordered],
        "losses": [row["loss"] for row in ordered],
        "flops_per_token": worker.telemetry.flops_per_token,
        "parameters": sum(p.numel() for p in worker.engine.module.parameters()),
        "attention": cfg.document_attention(),
        **check,
        **_memory(gpu),
    }


def sync_check(worker: Any, gpu: bool, steps: int = SYNC_CHECK_STEPS) -> dict[str, Any]:
    """Train `steps` more steps under `torch.cuda.set_sync_debug_mode("error")` (GPU only).

    No flush falls inside them, so any synchronisation is one the step itself makes; the first
    one raises, and its traceback names the call.
    """
    if not gpu:
        return {}
    import torch

    worker.telemetry.every = 1 << 30  # no logging read inside the checked steps
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            worker.train_step()
        result: dict[str, Any] = {"sync_free": True}
    except RuntimeError:
        result = {"sync_free": False, "sync_error": traceback.format_exc()[-3000:]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    worker.flush()
    return result


def _device_batches(spec: dict[str, Any], device: Any) -> tuple[dict[str, Any], list[Any]]:
    """The examples' manifest, and every step's batch (the loop's order) already on `device`."""
    from training.pretrain.data import (
        BatchBuilder,
        Cursor,
        ExampleShards,
        GlobalOrder,
        read_manifest,
    )

    examples = Path(spec["examples_dir"])
    manifest = read_manifest(examples)
    train = ExampleShards(examples, "train", verify=False)
    order = GlobalOrder(len(train), SEED, spec["batch"])
    build = BatchBuilder(manifest["objective"], None, spec["docmask"])
    batches, cursor = [], Cursor()
    for _ in range(spec["warmup"] + spec["steps"]):
        epoch, indices, cursor = order.next_batch(cursor)
        batch = build(train.take(indices), indices, epoch)
        batches.append({k: v.to(device) for k, v in batch.items()})
    return manifest, batches


def _bf16(spec: dict[str, Any]) -> bool:
    """Whether the arms train in bf16: on a GPU, and on a CPU that multiplies it natively.

    A CPU run is a check of the code path (`--device cpu`); emulated bf16 would only slow it.
    """
    from training.runtime.precision import cpu_has_native_bf16

    return spec["device"] == "cuda" or cpu_has_native_bf16()


def _adamw(params: Any) -> Any:
    """Fused AdamW with `OPTIM`, as lmpipe's engine builds it."""
    import torch

    betas, eps = OPTIM["betas"], OPTIM["eps"]
    return torch.optim.AdamW(params, lr=OPTIM["lr"], betas=betas, eps=eps, fused=True)


def _timed(step: Any, batches: list[Any], warmup: int, device: Any) -> list[float]:
    """Run `step` over `batches`: the warm-up timed one by one, then one synchronised window."""
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    step_s = []
    for batch in batches[:warmup]:  # reported, not counted
        sync()
        start = time.perf_counter()
        step(batch)
        sync()
        step_s.append(time.perf_counter() - start)
    timed = batches[warmup:]
    sync()
    start = time.perf_counter()
    for batch in timed:
        step(batch)
    sync()
    return step_s + [(time.perf_counter() - start) / max(len(timed), 1)] * len(timed)


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """A plain loop over the same model, loss and batches, all on the device beforehand."""
    import torch

    from training.models.config import document_attention
    from training.models.flops import flops_per_token
    from training.models.models import ModelConfig, build_model
    from training.pretrain.data import sequence_length
    from training.pretrain.losses import pretraining_loss
    from training.runtime.deepspeed import param_groups

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    manifest, batches = _device_batches(spec, device)
    objective = manifest["objective"]
    length = sequence_length(manifest)
    section = ModelConfig.model_validate(model_section(spec))
    specials = manifest["specials"]
    # The attention lmpipe's `train.attention: auto` picks for this model and device.
    attention = document_attention("auto", section, spec["docmask"], device.type == "cuda")
    vocab = specials["vocab_size"]
    model = build_model(section, objective, vocab, specials, length, attention)
    model.load_state_dict(torch.load(spec["init"]))  # the arms' common start
    model = model.to(device).train()
    opt = _adamw(param_groups(model.named_parameters(), OPTIM["weight_decay"]))
    loss_fn = functools.partial(pretraining_loss, model, objective)
    if spec["compile"] and spec["scope"] == "modules":
        for child in model.children():
            child.compile()
    elif spec["compile"]:  # the model and the loss as one graph, as the loop compiles them
        loss_fn = torch.compile(loss_fn)
    losses = []

    def step(batch: dict[str, Any]) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_bf16(spec)):
            out = loss_fn(batch, True)
        out.loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.detach())  # read after the window

    step_s = _timed(step, batches, spec["warmup"], device)
    mlm = manifest["config"]["mask"]["masked_lm_prob"]
    return {
        "step_s": step_s,
        "tokens": [float(_tokens(batch)) for batch in batches],
        "losses": [float(loss) for loss in losses],
        "flops_per_token": flops_per_token(model.config, length, objective, mlm_probability=mlm),
        "parameters": sum(p.numel() for p in model.parameters()),
        "attention": attention,
        **_memory(device.type == "cuda"),
    }


def nanogpt_model(config: Any) -> Any:
    """A minimal nanoGPT-style GPT-2 of `config`'s shape: fused QKV, SDPA with is_causal."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    d, heads = config.n_embd, config.n_head

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
            q, k, v = (z.view(b, t, heads, d // heads).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
            return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(config.vocab_size, d)
            self.wpe = nn.Embedding(config.n_positions, d)
            self.h = nn.ModuleList(Block() for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
            self.lm_head.weight = self.wte.weight  # tied

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.wte(ids) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            logits = self.lm_head(self.ln_f(x))  # (B, T, V)
            targets = F.pad(ids[:, 1:], (0, 1), value=-1)  # the next token; none after the last
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)

    return GPT()


def nanogpt_state(hf_state: dict[str, Any]) -> dict[str, Any]:
    """The transformers GPT-2 weights under nanoGPT's names (its Conv1D weights transposed)."""
    names = {
        "attn.c_attn": "c_attn",
        "attn.c_proj": "attn_proj",
        "mlp.c_fc": "c_fc",
        "mlp.c_proj": "mlp_proj",
        "ln_1": "ln_1",
        "ln_2": "ln_2",
    }
    out = {}
    for key, value in hf_state.items():
        key = key.removeprefix("transformer.")  # lm_head.weight (tied to wte) keeps its name
        parts = key.split(".")
        if parts[0] == "h":
            inner = ".".join(parts[2:-1])
            key = f"h.{parts[1]}.{names[inner]}.{parts[-1]}"
            if parts[-1] == "weight" and inner.startswith(("attn.", "mlp.")):
                value = value.t()  # Conv1D keeps (in, out), nn.Linear (out, in)
        out[key] = value
    return out


def child_nanogpt(spec: dict[str, Any]) -> dict[str, Any]:
    """The outside reference: a minimal nanoGPT-style loop (fused AdamW, compile) on GPT-2."""
    import torch

    from training.models.flops import flops_per_token
    from training.models.models import ModelConfig, model_config_for
    from training.runtime.deepspeed import param_groups

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    manifest, batches = _device_batches(spec, device)
    length = manifest["config"]["block_size"]
    section = ModelConfig.model_validate(model_section(spec))
    specials = manifest["specials"]
    config = model_config_for(section, specials["vocab_size"], specials, length)
    model = nanogpt_model(config)
    model.load_state_dict(nanogpt_state(torch.load(spec["init"])))  # the arms' common start
    model = model.to(device).train()
    opt = _adamw(param_groups(model.named_parameters(), OPTIM["weight_decay"]))
    forward = torch.compile(model) if spec["compile"] else model
    losses = []

    def step(batch: dict[str, Any]) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_bf16(spec)):
            loss = forward(batch["input_ids"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    step_s = _timed(step, batches, spec["warmup"], device)
    return {
        "step_s": step_s,
        "tokens": [float(_tokens(batch)) for batch in batches],
        "losses": [float(loss) for loss in losses],
        "flops_per_token": flops_per_token(config, length, "causal"),
        "parameters": sum(p.numel() for p in model.parameters()),
        **_memory(device.type == "cuda"),
    }


def _tokens(batch: dict[str, Any]) -> Any:
    """Real input tokens of a batch: its 2-D padding mask's sum, else every position."""
    if "attention_mask" in batch and batch["attention_mask"].dim() == 2:
        return batch["attention_mask"].sum().item()
    return batch["input_ids"].numel()


def _memory(gpu: bool) -> dict[str, Any]:
    if not gpu:
        return {}
    import torch

    return {"max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def child_device(spec: dict[str, Any]) -> dict[str, Any]:
    """The device, its datasheet and measured bf16 peaks, and the versions in use."""
    import torch
    import transformers

    from training.pretrain.telemetry import measure_cuda_peak_flops, measure_peak_flops, peak_flops

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_count": os.cpu_count(),
    }
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError as err:
        info["deepspeed"] = f"missing ({err})"
    gpu = spec["device"] == "cuda"
    dtype = torch.bfloat16 if _bf16(spec) else torch.float32  # the arms' compute dtype
    peak, source = peak_flops(dtype, gpu)
    info |= {"peak_flops": peak, "peak_source": source}
    if gpu:
        device = torch.device("cuda", 0)
        info |= {
            "gpu": torch.cuda.get_device_name(device),
            "cuda": torch.version.cuda,
            "measured_peak_flops": measure_cuda_peak_flops(torch.bfloat16, device),
        }
    else:
        info["measured_peak_flops"] = measure_peak_flops(dtype)
    return info


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
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = spec | {"run_dir": str(run_dir), "result": str(run_dir / "result.json")}
    started = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                env=os.environ | {"TOKENIZERS_PARALLELISM": "false"},
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=CHILD_TIMEOUT_S,
                check=False,
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = -1
    wall = {"wall_s": round(time.perf_counter() - started, 1)}
    if code != 0:
        tail = (run_dir / "log.txt").read_text(errors="replace").splitlines()[-25:]
        return wall | {"error": f"exit {code}: " + "\n".join(tail)}
    result = json.loads(Path(spec["result"]).read_text())
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen settings one after the other; write and print the results."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(SETTINGS)
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown setting(s) {unknown}; known: {sorted(SETTINGS)}")
    data = Path(args.data).resolve()
    for model in {SETTINGS[name]["model"] for name in names}:
        manifest = data / MODELS[model]["data"] / "examples" / "manifest.json"
        if not manifest.is_file():
            raise SystemExit(f"{manifest}: missing; run `prepare --out {args.data}` first")
        objective = json.loads(manifest.read_text())["objective"]
        if objective != MODELS[model]["objective"]:
            wanted = MODELS[model]["objective"]
            raise SystemExit(f"{manifest}: objective {objective!r}; {model} trains on {wanted!r}")
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
        setting = SETTINGS[name]
        model = MODELS[setting["model"]]
        spec = (
            base
            | setting
            | {
                "name": name,
                "batch": args.batch or model["batch"],
                "examples_dir": str(data / model["data"] / "examples"),
                "tokenizer_dir": str(data / model["data"] / "tokenizer"),
            }
        )
        if setting["model"] not in inits:  # one initial state per model, for every arm
            init_dir = work / f"init-{setting['model']}"
            state = str(work / f"init-{setting['model']}.pt")
            built = launch(spec | {"loop": "init", "init": state}, init_dir)
            if "error" in built:
                raise SystemExit(f"building {setting['model']} failed:\n{built['error']}")
            inits[setting["model"]] = state
        spec["init"] = inits[setting["model"]]
        raw[name] = launch(spec, work / name)
        rows[name] = summarize(
            raw[name],
            args.warmup,
            device["peak_flops"],
            device["measured_peak_flops"],
            model["target"],
        )
        print(name, json.dumps(rows[name]), flush=True)
        # After every setting: a run stopped at the device's time limit keeps what it measured.
        agreement = loss_agreement(rows)
        report = {"command": sys.argv, "device": device, "rows": rows, "raw": raw}
        report["loss_agreement"] = agreement
        (out / "pretrain_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
        (out / "pretrain_gpu.md").write_text(table(rows, device) + "\n")
    print(table(rows, device))
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
