"""The training arms of bench/pretrain_gpu.py, each run in its own subprocess.

Every arm starts from the same saved weights (`child_init`), sees the same batches (the loop's
order) and uses the same optimizer (`OPTIM`), in bf16 on a GPU:

- `child_lmpipe`: lmpipe's loop itself (`training.pretrain.loop.Worker` with `LocalContext`,
  the DeepSpeed engine at ZeRO 0, one rank, no Ray), then `SYNC_CHECK_STEPS` steps under
  CUDA's sync debug mode (`sync_check`);
- `child_plain`: a plain PyTorch loop on the same model, loss and batches, already on the
  device: fused AdamW, bf16 autocast, clipping, nothing else;
- `child_reference`: the outside reference with its loss in its forward, compiled as one
  graph: nanoGPT's GPT-2 (bench/nanogpt.py) or the nanoGPT-style BERT (bench/nanobert.py);
- `child_device`: the device, its peaks and the versions in use (and `child_init`'s weights).

`run_child` runs the one a spec names (`CHILDREN`) and writes its result.

The timed steps of every arm are one CUDA-synchronised window after the warm-up; within it,
`StepClock` marks each step's end on the device's timeline (CUDA events, no host wait), which
the time-to-quality report reads (`elapsed_s`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import version_of
from nanobert import nanobert_inputs, nanobert_model, nanobert_state
from nanogpt import nanogpt_model, nanogpt_state
from pretrain_arms import loop_batches, real_tokens, seeded_model, worker_job
from pretrain_data import GPT2_VOCAB

SYNC_CHECK_STEPS = 3  # lmpipe's steps run under CUDA's sync debug mode after the timed ones

#: model -> lmpipe family, size, example set (bench/pretrain_data.py), batch, MFU target
#: (datasheet peak), the outside reference's arm.
MODELS: dict[str, dict[str, Any]] = {
    "bert-base": {
        "family": "bert",
        "size": "base",
        "data": "bert",
        "batch": 256,
        "overrides": {},
        "target": 0.40,
        "reference": "nanobert",
    },
    "gpt2-124m": {
        "family": "gpt2",
        "size": "base",
        "data": "gpt2",
        "batch": 32,
        "overrides": {"vocab_size": GPT2_VOCAB},
        "dropout": 0.0,  # as nanoGPT and llm.c pretrain GPT-2
        "target": 0.45,
        "reference": "nanogpt",
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

    from training.models.models import ModelConfig
    from training.pretrain.data import read_manifest, sequence_length

    manifest = read_manifest(Path(spec["examples_dir"]))
    section = ModelConfig.model_validate(model_section(spec))
    model = seeded_model(section, manifest["objective"], manifest, sequence_length(manifest))
    torch.save(model.state_dict(), spec["init"])
    return {"parameters": sum(p.numel() for p in model.parameters())}


def lmpipe_config(spec: dict[str, Any]) -> Any:
    """Build the loop's `TrainConfig` of a setting: ZeRO 0, `OPTIM`, no work in the window."""
    from training.pretrain.config import TrainConfig

    batch, threads = spec["batch"], spec["threads"]
    return TrainConfig.model_validate(
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
            "checkpoint": {
                "every_steps": 1 << 20,
                "keep_last": 1,
                "storage_path": str(Path(spec["run_dir"])),
            },
            "scale": {
                "num_workers": 1,
                "use_gpu": spec["device"] == "cuda",
                "cpus_per_worker": threads,
                "threads_per_worker": threads,
            },
        }
    )


class StepClock:
    """Each step's end, in seconds from the window's start, on the device's own timeline.

    On a GPU a CUDA event is recorded after each step (no host wait, so the host runs ahead as
    it would untimed) and read once the window is over; on a CPU, whose steps are synchronous,
    the host clock is read.
    """

    def __init__(self, gpu: bool) -> None:
        """Start the window now (after waiting for the work queued before it)."""
        import torch

        self.gpu, self.marks = gpu, list[Any]()
        if gpu:
            torch.cuda.synchronize()
            self.start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            self.start.record()
        self.host_start = time.perf_counter()

    def mark(self) -> None:
        """Mark the end of a step."""
        import torch

        if self.gpu:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def stop(self) -> tuple[float, list[float]]:
        """Wait for the device; the window's wall seconds and each step's end (s from start)."""
        import torch

        if self.gpu:
            torch.cuda.synchronize()
            ends = [self.start.elapsed_time(event) / 1000 for event in self.marks]  # ms -> s
        else:
            ends = [mark - self.host_start for mark in self.marks]
        return time.perf_counter() - self.host_start, ends


def lmpipe_window(worker: Any, warmup: int, steps: int, gpu: bool) -> tuple[float, list[float]]:
    """Train `warmup` steps, then `steps` as one synchronised window; its seconds, step ends."""
    for _ in range(warmup):
        worker.train_step()
    worker.flush()  # the loop's own reads at its logging interval stay inside the window
    clock = StepClock(gpu)
    for _ in range(steps):
        worker.train_step()
        clock.mark()
    worker.flush()
    return clock.stop()


def child_lmpipe(spec: dict[str, Any]) -> dict[str, Any]:
    """Run lmpipe's loop (`Worker.run`) here, on one rank without Ray; its logged steps."""
    import torch

    from training.pretrain.loop import Worker
    from training.runtime.worker_context import LocalContext, init_single_process
    from training.scoring.plots import step_history

    run_dir, gpu = Path(spec["run_dir"]), spec["device"] == "cuda"
    cfg = lmpipe_config(spec)
    job = worker_job(cfg, spec, f"bench-gpu-{spec['name']}")
    init_single_process()
    torch.set_num_threads(spec["threads"])
    worker = Worker(job, LocalContext(run_dir))
    worker.engine.module.load_state_dict(torch.load(spec["init"]))  # the arms' common start
    warmup, steps = spec["warmup"], spec["steps"]
    window_s, elapsed = lmpipe_window(worker, warmup, steps, gpu)
    check = sync_check(worker, gpu)
    ordered = list(step_history(run_dir / "steps.jsonl").values())[: warmup + steps]
    return {
        # Warm-up steps as the loop logged them; the timed ones share the synchronised window.
        "step_s": [row["step_time_s"] for row in ordered[:warmup]] + [window_s / steps] * steps,
        "tokens": [row["tokens_per_s"] * row["step_time_s"] for row in ordered],
        "losses": [row["loss"] for row in ordered],
        "elapsed_s": elapsed,
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
    from training.pretrain.data import read_manifest

    examples = Path(spec["examples_dir"])
    steps = spec["warmup"] + spec["steps"]
    batches = [
        {k: v.to(device) for k, v in batch.items()}
        for batch in loop_batches(examples, spec["batch"], steps, spec["docmask"])
    ]
    return read_manifest(examples), batches


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


def _timed_steps(
    step: Any, batches: list[Any], warmup: int, device: Any
) -> tuple[list[float], list[float]]:
    """Run `step` over `batches`: the warm-up timed one by one, then one synchronised window.

    Returns each step's seconds (the window's mean for the timed ones) and, for the timed
    steps, each one's end in seconds from the window's start (`StepClock`).
    """
    import torch

    gpu = device.type == "cuda"
    sync: Callable[[], None] = torch.cuda.synchronize if gpu else (lambda: None)
    step_s = []
    for batch in batches[:warmup]:  # reported, not counted
        sync()
        start = time.perf_counter()
        step(batch)
        sync()
        step_s.append(time.perf_counter() - start)
    timed = batches[warmup:]
    clock = StepClock(gpu)
    for batch in timed:
        step(batch)
        clock.mark()
    window_s, elapsed = clock.stop()
    return step_s + [window_s / max(len(timed), 1)] * len(timed), elapsed


def _train(
    spec: dict[str, Any], model: Any, loss_of: Any, batches: list[Any], device: Any
) -> dict[str, Any]:
    """Train `model` over `batches` with `OPTIM`; `loss_of(batch)` is a step's loss tensor.

    The plain and the reference arms' step: bf16 autocast (where `_bf16`), backward, clipping,
    the fused AdamW; each loss stays on the device until the window is over.
    """
    import torch

    from training.runtime.deepspeed import param_groups

    opt = _adamw(param_groups(model.named_parameters(), OPTIM["weight_decay"]))
    losses = []

    def step(batch: dict[str, Any]) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=_bf16(spec)):
            loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM["grad_clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # read after the window

    step_s, elapsed = _timed_steps(step, batches, spec["warmup"], device)
    return {
        "step_s": step_s,
        "elapsed_s": elapsed,
        "tokens": [float(real_tokens(batch)) for batch in batches],
        "losses": [float(loss) for loss in losses],
        "parameters": sum(p.numel() for p in model.parameters()),
        **_memory(device.type == "cuda"),
    }


def _flops(manifest: dict[str, Any], config: Any) -> float:
    """Model FLOPs per input token of `config` on these examples, as lmpipe's telemetry counts."""
    from training.models.flops import flops_per_token
    from training.pretrain.data import sequence_length

    mlm = manifest["config"]["mask"]["masked_lm_prob"]
    objective = manifest["objective"]
    return flops_per_token(config, sequence_length(manifest), objective, mlm_probability=mlm)


def child_plain(spec: dict[str, Any]) -> dict[str, Any]:
    """A plain loop over the same model, loss and batches, all on the device beforehand."""
    import torch

    from training.models.config import document_attention
    from training.models.models import ModelConfig, build_model
    from training.pretrain.data import sequence_length
    from training.pretrain.losses import pretraining_loss, varying_masked_positions

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    manifest, batches = _device_batches(spec, device)
    objective = manifest["objective"]
    section = ModelConfig.model_validate(model_section(spec))
    specials = manifest["specials"]
    # The attention lmpipe's `train.attention: auto` picks for this model and device.
    attention = document_attention("auto", section, spec["docmask"], device.type == "cuda")
    vocab, length = specials["vocab_size"], sequence_length(manifest)
    # transformers' own class, as a user's loop trains it (lmpipe's arm: its fast subclass).
    model = build_model(section, objective, vocab, specials, length, attention, stock=True)
    model.load_state_dict(torch.load(spec["init"]))  # the arms' common start
    model = model.to(device).train()
    loss_fn: Callable[..., Any] = functools.partial(pretraining_loss, model, objective)
    if spec["compile"] and spec["scope"] == "modules":
        for child in model.children():
            child.compile()
    elif spec["compile"]:  # the model and the loss as one graph, as the loop compiles them
        loss_fn = varying_masked_positions(torch.compile(loss_fn))
    result = _train(spec, model, lambda batch: loss_fn(batch, True).loss, batches, device)
    return result | {"flops_per_token": _flops(manifest, model.config), "attention": attention}


#: The outside references by objective: the module, its map of transformers' weights, and
#: the arguments of its forward (which returns the loss) from a batch.
REFERENCES: dict[str, tuple[Callable[..., Any], ...]] = {
    "causal": (nanogpt_model, nanogpt_state, lambda batch: (batch["input_ids"],)),
    "bert": (nanobert_model, nanobert_state, nanobert_inputs),
}


def child_reference(spec: dict[str, Any]) -> dict[str, Any]:
    """The outside reference: nanoGPT's GPT-2 or the nanoGPT-style BERT, compiled with its loss.

    Built from the transformers config lmpipe builds, loaded from the arms' common initial
    weights (`strict`: every weight maps), trained by the plain arms' step (`_train`).
    """
    import torch

    from training.models.models import ModelConfig, model_config_for
    from training.pretrain.data import sequence_length

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    manifest, batches = _device_batches(spec, device)
    build, rename, inputs = REFERENCES[manifest["objective"]]
    section = ModelConfig.model_validate(model_section(spec))
    specials = manifest["specials"]
    config = model_config_for(section, specials["vocab_size"], specials, sequence_length(manifest))
    model = build(config)
    model.load_state_dict(rename(torch.load(spec["init"])))  # the arms' common start
    model = model.to(device).train()
    forward = torch.compile(model) if spec["compile"] else model
    result = _train(spec, model, lambda batch: forward(*inputs(batch)), batches, device)
    return result | {"flops_per_token": _flops(manifest, config)}


def _memory(gpu: bool) -> dict[str, Any]:
    if not gpu:
        return {}
    import torch

    return {"max_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def child_device(spec: dict[str, Any]) -> dict[str, Any]:
    """The device, its datasheet and measured bf16 peaks, and the versions in use.

    It also builds the initial weights of each spec in `inits` (`child_init`): one process
    start-up for all of them, out of a GPU machine's few minutes.
    """
    import torch

    for init in spec.get("inits", []):
        child_init(init)
    from training.pretrain.telemetry import measure_cuda_peak_flops, measure_peak_flops, peak_flops

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "transformers": version_of("transformers"),
        "cpu_count": os.cpu_count(),
        "deepspeed": version_of("deepspeed", optional=True),
    }
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


#: Each child's function, by the `loop` of its spec.
CHILDREN = {
    "lmpipe": child_lmpipe,
    "plain": child_plain,
    "nanogpt": child_reference,
    "nanobert": child_reference,
    "init": child_init,
    "device": child_device,
}


def run_child(spec: dict[str, Any]) -> None:
    """A child's entry (`pretrain_gpu.py --child SPEC`): run it, write its result JSON."""
    result = CHILDREN[spec["loop"]](spec)
    Path(spec["result"]).write_text(json.dumps(result))
