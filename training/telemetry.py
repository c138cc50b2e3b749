"""Training telemetry: per-step and evaluation metrics, throughput, MFU, the loss-curve PNG.

Every rank measures; the sums are all-reduced; only rank 0 logs (to MLflow through the
`Tracker` protocol). MFU = achieved model FLOP/s (`flops_per_token` x tokens/s) over the peak
of one worker's device in the training precision (`peak_flops`): a CPU's measured matmul peak,
a known GPU's datasheet peak, another GPU's measured one.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tasks import schema
from training.forward import StepOutput, eval_metrics
from training.tracking import MlflowTracker, NullTracker, Tracker

if TYPE_CHECKING:
    from training.context import WorkerContext
    from training.loop import WorkerJob

log = logging.getLogger(__name__)
_PEAK_CACHE: dict[torch.dtype, float] = {}

#: Dense 16-bit tensor-core peaks (FLOP/s, no structured sparsity) of NVIDIA's datasheets, by a
#: substring of `torch.cuda.get_device_name()`, first match wins. None: the variant's clocks
#: differ (NVL), so its peak is measured. MFU is conventionally quoted against these figures
#: (PaLM, Megatron), not against what a matmul reaches (about 80% of them on an H200).
DATASHEET_PEAKS: tuple[tuple[str, float | None], ...] = (
    ("NVL", None),
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),
    ("H200", 989.4e12),
    ("A100", 312e12),
)


class StepMeter:
    """Sums over micro-batches of `StepOutput.counts` (token-weighted, exact across ranks)."""

    def __init__(self) -> None:
        """Start empty."""
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, out: StepOutput, batch: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's output."""
        for key, value in out.counts.items():
            self.sums[key] += float(value)
        self.sums["samples"] += batch[schema.INPUT_IDS].shape[0]

    def reduced(self) -> dict[str, float]:
        """The sums over every rank (same keys on every rank: one objective)."""
        keys = sorted(self.sums)
        if not dist.is_initialized():
            return {k: self.sums[k] for k in keys}
        values = torch.tensor([self.sums[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(values)
        return dict(zip(keys, values.tolist(), strict=True))


def metrics_from(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Token-weighted losses, accuracies and perplexity (`forward.eval_metrics`), prefixed."""
    return {f"{prefix}{k}": v for k, v in eval_metrics(sums).items()}


def measure_peak_flops(dtype: torch.dtype, seconds: float = 0.5) -> float:
    """This process's dense matmul FLOP/s in `dtype` (square 1024 matmuls, best of a few)."""
    if dtype in _PEAK_CACHE:
        return _PEAK_CACHE[dtype]
    n = 1024
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - start))
    _PEAK_CACHE[dtype] = best
    return best


def datasheet_peak(device_name: str, dtype: torch.dtype) -> float | None:
    """The datasheet's dense peak of the named GPU in `dtype` (bf16, fp16), None if not known."""
    if dtype not in (torch.bfloat16, torch.float16):
        return None  # fp32 matmuls run as fp32 or TF32 depending on torch's settings
    for key, peak in DATASHEET_PEAKS:
        if key in device_name:
            return peak
    return None


def measure_cuda_peak_flops(dtype: torch.dtype, device: torch.device, n: int = 8192) -> float:
    """The current GPU's dense matmul FLOP/s in `dtype`: n x n x n products, best of five."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):  # warm-up: clocks and cuBLAS's kernel choice
        torch.mm(a, b)
    best = 0.0
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(4):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        best = max(best, 4 * 2 * n**3 / (start.elapsed_time(end) / 1e3))
    return best


def peak_flops(dtype: torch.dtype, use_gpu: bool) -> tuple[float, str]:
    """MFU's denominator for one worker, and where it comes from (`datasheet` or `measured`).

    On a GPU: the datasheet peak of a known model (`DATASHEET_PEAKS`), else a measured matmul
    peak. On a CPU: the measured matmul peak of this process's threads.
    """
    if not use_gpu:
        return measure_peak_flops(dtype), "measured"
    device = torch.device("cuda", torch.cuda.current_device())
    known = datasheet_peak(torch.cuda.get_device_name(device), dtype)
    if known is not None:
        return known, "datasheet"
    return measure_cuda_peak_flops(dtype, device), "measured"


class Telemetry:
    """Rank 0's logger of step and evaluation metrics; other ranks only join the reductions."""

    def __init__(
        self,
        job: WorkerJob,
        ctx: WorkerContext,
        flops_per_token: float,
        flops_at: Callable[[int], float] | None = None,
    ) -> None:
        """Attach to the run's tracker (rank 0) and find the peak MFU divides by (`peak_flops`).

        `flops_per_token` is at the examples' length; `flops_at(seq_len)` at a step's shorter
        length under `train.length_schedule` (attention FLOPs per token grow with the length).
        """
        cfg = job.train
        self.rank, self.every = ctx.rank, cfg.log_every_steps
        self.tracker: Tracker = NullTracker()
        if ctx.rank == 0 and job.tracking_uri and job.run_id:
            self.tracker = MlflowTracker(job.tracking_uri, job.run_id)
        self.flops_per_token = flops_per_token
        self.flops_at = flops_at
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        self.peak, source = peak_flops(dtype[cfg.precision], cfg.scale.use_gpu)
        if ctx.rank == 0:
            log.info("MFU against a %s peak of %.1f TFLOP/s per worker", source, self.peak / 1e12)
        self.history: list[tuple[int, float]] = []
        self.steps_file = ctx.run_dir / "steps.jsonl"
        self.eval_history: list[tuple[int, float]] = []
        self.last = time.perf_counter()

    def resumed(self, step: int) -> None:
        """Drop history past `step` (those steps are trained again) and restart the clock."""
        self.history = [h for h in self.history if h[0] <= step]
        self.last = time.perf_counter()

    def step(
        self,
        step: int,
        meter: StepMeter,
        lr: float,
        grad_norm: Any,
        skipped: bool,
        seq_len: int | None = None,
    ) -> float:
        """Reduce one step's sums, log them every `log_every_steps`; return its input tokens.

        `seq_len` is the step's sequence length (`train.length_schedule`), logged as `seq_len`.
        """
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        sums = meter.reduced()
        metrics = metrics_from(sums)
        self.history.append((step, metrics["loss"]))
        tokens = sums.get("input_tokens", 0.0)
        if self.rank != 0:
            return tokens
        tokens_s = sums["input_tokens"] / elapsed
        metrics |= {
            "lr": lr,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "tokens_per_s": tokens_s,
            "samples_per_s": sums["samples"] / elapsed,
            "step_time_s": elapsed,
            "skipped": float(skipped),
        }
        if seq_len is not None:
            metrics["seq_len"] = float(seq_len)
        if self.peak:
            world = dist.get_world_size() if dist.is_initialized() else 1
            flops = self.flops_per_token
            if seq_len is not None and self.flops_at is not None:
                flops = self.flops_at(seq_len)
            metrics["mfu"] = flops * tokens_s / (self.peak * world)
        # Every step, appended (a replayed step's later line wins), with its throughput.
        with open(self.steps_file, "a") as handle:
            handle.write(json.dumps({"step": step, **metrics}) + "\n")
        if step % self.every == 0:
            self.tracker.log_metrics({f"train_{k}": v for k, v in metrics.items()}, step=step)
        return tokens

    def evaluation(self, step: int, meter: StepMeter) -> dict[str, float]:
        """Reduce and log held-out metrics; return them (the same on every rank)."""
        metrics = metrics_from(meter.reduced(), prefix="eval_")
        self.eval_history.append((step, metrics["eval_loss"]))
        if self.rank == 0:
            self.tracker.log_metrics(metrics, step=step)
            with open(self.steps_file.with_name("evals.jsonl"), "a") as handle:
                handle.write(json.dumps({"step": step, **metrics}) + "\n")
            log.info("step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
        self.last = time.perf_counter()  # evaluation time is not training throughput
        return metrics
