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
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tasks.common import schema
from training.pretrain.losses import eval_metrics
from training.pretrain.losses.common import StepOutput
from training.runtime.precision import X86_MACHINES, assume_no_native_bf16, cpu_has_native_bf16
from training.tracking.runs import NullTracker, Tracker

if TYPE_CHECKING:
    from training.pretrain.config import TrainConfig
    from training.runtime.worker_context import WorkerContext

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
    """Sums over micro-batches of `StepOutput.counts` (token-weighted, exact across ranks).

    The sums stay on the device (float64) until `reduced` reads them, so adding a
    micro-batch never waits for the host.
    """

    def __init__(self) -> None:
        """Start empty."""
        self.sums: dict[str, torch.Tensor] = {}
        self.samples = 0

    def add(self, out: StepOutput, batch: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's output."""
        # The first micro-batch's counts are kept as they are (float32 sums, int64 counts) and
        # converted when read: at one micro-batch a step, no operation at all.
        if not self.sums:
            self.sums = dict(out.counts)
        else:
            for key, value in out.counts.items():
                self.sums[key] = self.sums[key].double() + value.double()
        self.samples += batch[schema.INPUT_IDS].shape[0]

    def keys(self) -> tuple[str, ...]:
        """The names of `vector`'s entries, in order."""
        return (*sorted(self.sums), "samples")

    def vector(self) -> torch.Tensor:
        """The sums in `keys` order, one float64 tensor on the device (not yet reduced)."""
        sums = [self.sums[k] for k in sorted(self.sums)]
        device = sums[0].device if sums else torch.device("cpu")
        samples = torch.full((), float(self.samples), dtype=torch.float64, device=device)
        # One stack converts every sum: with a float64 member, torch promotes them all to it
        # (int64 counts exactly). Detached: a loss may hand over a count still in its graph.
        return torch.stack([*sums, samples]).detach()

    def totals(self) -> dict[str, float]:
        """This rank's sums, read on the host (no reduction)."""
        return dict(zip(self.keys(), self.vector().tolist(), strict=True))

    def reduced(self) -> dict[str, float]:
        """The sums over every rank (same keys on every rank: one objective); a host read."""
        values = self.vector()
        if dist.is_initialized():
            dist.all_reduce(values)
        return dict(zip(self.keys(), values.tolist(), strict=True))


def metrics_from(sums: dict[str, float], prefix: str = "") -> dict[str, float]:
    """Token-weighted losses, accuracies and perplexity (`losses.eval_metrics`), prefixed."""
    return {f"{prefix}{k}": v for k, v in eval_metrics(sums).items()}


def measure_peak_flops(dtype: torch.dtype, seconds: float = 0.5) -> float:
    """This process's dense matmul FLOP/s in `dtype` (square 1024 matmuls, best of a few)."""
    if dtype in _PEAK_CACHE:
        return _PEAK_CACHE[dtype]
    n = 1024
    own = torch.Generator().manual_seed(0)  # not the global RNG, which dropout draws from
    a = torch.randn(n, n, generator=own).to(dtype)
    b = torch.randn(n, n, generator=own).to(dtype)
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
    own = torch.Generator(device=device).manual_seed(0)  # not the global RNG (dropout's)
    a = torch.randn(n, n, device=device, generator=own).to(dtype)
    b = torch.randn(n, n, device=device, generator=own).to(dtype)
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
    peak. On a CPU: the measured matmul peak of this process's threads, in `dtype` or in fp32,
    whichever is higher.
    """
    if not use_gpu:
        # A CPU without native bf16 emulates it, far below its fp32 peak (and its 1024^3 bf16
        # matmul is slower still than the smaller ones of a tiny model): the faster of the two
        # is the most this process can do, so MFU stays a fraction.
        fp32 = measure_peak_flops(torch.float32)
        if dtype == torch.float32 or (dtype == torch.bfloat16 and not _bf16_may_beat_fp32()):
            return fp32, "measured"
        return max(measure_peak_flops(dtype), fp32), "measured"
    device = torch.device("cuda", torch.cuda.current_device())
    known = datasheet_peak(torch.cuda.get_device_name(device), dtype)
    if known is not None:
        return known, "datasheet"
    return measure_cuda_peak_flops(dtype, device), "measured"


def _bf16_may_beat_fp32() -> bool:
    """Whether this CPU's 16-bit matmul peak is worth measuring next to its fp32 one.

    An x86 CPU without AVX512-BF16 or AMX-BF16 (`cpu_has_native_bf16`) emulates bf16: its
    1024^3 product took 2.6 s of CPU here against fp32's 0.035 s, so `peak_flops`' maximum is
    fp32's, and measuring bf16 would cost every bf16 worker 12-25 s at its start. Elsewhere
    (another architecture, or the test switch that hides the CPU's flags) it is measured.
    """
    if assume_no_native_bf16() or platform.machine().lower() not in X86_MACHINES:
        return True
    return cpu_has_native_bf16()


@dataclass
class _PendingStep:
    """One decided step whose values are still on the device."""

    step: int
    keys: tuple[str, ...]
    sums: torch.Tensor  # (K,) this rank's sums, float64
    local: torch.Tensor  # (2 + R,) grad norm, skip flag, then the guard's record
    lr: float
    seq_len: int


class Telemetry:
    """Rank 0's logger of step and evaluation metrics; other ranks only join the reductions.

    A step's values are recorded on the device (`record`) and read at `flush`: every
    `log_every_steps` steps, before evaluation and checkpoints, and at the end. One flush is one
    all-reduce and one host read for all of its steps. `steps.jsonl` still gets one row per step;
    its `step_time_s` is the flush window's synchronised wall time shared evenly by the window's
    steps (an asynchronous step's own time would measure only how fast it was queued).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        ctx: WorkerContext,
        tracker: Tracker,
        flops_per_token: float,
        flops_at: Callable[[int], float] | None = None,
    ) -> None:
        """Log into `tracker` (rank 0) and find the peak MFU divides by (`peak_flops`).

        `flops_per_token` is at the examples' length; `flops_at(seq_len)` at a step's shorter
        length under `train.length_schedule` (attention FLOPs per token grow with the length).
        """
        self.rank, self.every = ctx.rank, cfg.log_every_steps
        self.tracker = tracker if ctx.rank == 0 else NullTracker()
        self.flops_per_token = flops_per_token
        self.flops_at = flops_at
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        self.peak, source = peak_flops(dtype[cfg.precision], cfg.scale.use_gpu)
        if ctx.rank == 0:
            log.info("MFU against a %s peak of %.1f TFLOP/s per worker", source, self.peak / 1e12)
        self.history: list[tuple[int, float]] = []
        self.steps_file = ctx.run_dir / "steps.jsonl"
        if ctx.rank == 0:
            self.steps_file.parent.mkdir(parents=True, exist_ok=True)
        self.eval_history: list[tuple[int, float]] = []
        self.pending: list[_PendingStep] = []
        self.latest: dict[str, float] = {}  # the last step `flush` read: step, loss, lr, ...
        self.last = time.perf_counter()

    def resumed(self, step: int) -> None:
        """Drop history past `step` (those steps are trained again) and restart the clock."""
        self.history = [h for h in self.history if h[0] <= step]
        self.pending = []
        self.last = time.perf_counter()

    def record(
        self,
        step: int,
        meter: StepMeter,
        lr: float,
        grad_norm: torch.Tensor | float | None,
        skip: torch.Tensor,
        guard_record: torch.Tensor,
        seq_len: int,
    ) -> bool:
        """Keep one step's values on the device; return whether it is time to `flush`."""
        sums = meter.vector()
        if isinstance(grad_norm, torch.Tensor):
            norm = grad_norm.detach().reshape(1).to(sums.device)
        else:  # a fill on the device, not a copy from the host (which would synchronise)
            value = math.nan if grad_norm is None else float(grad_norm)
            norm = torch.full((1,), value, dtype=torch.float64, device=sums.device)
        # One cat, promoted to the record's float64: the norm, the skip flag, the record.
        local = torch.cat([norm, skip.reshape(1), guard_record])
        self.pending.append(_PendingStep(step, meter.keys(), sums, local, lr, seq_len))
        return step % self.every == 0

    def flush(self, judge: Callable[[int, list[float]], bool]) -> float:
        """Read the pending steps (one host read), log them; return their input tokens.

        `judge(step, guard_record)` replays the guard on each step before it is logged (it may
        raise `TrainingDivergedError`; the steps before that one are logged first).
        """
        if not self.pending:
            return 0.0
        pending, self.pending = self.pending, []
        sums = torch.cat([p.sums for p in pending])
        if dist.is_initialized():
            dist.all_reduce(sums)
        flat = torch.cat([sums, *(p.local for p in pending)]).tolist()  # the one read
        now = time.perf_counter()
        elapsed, self.last = (now - self.last) / len(pending), now
        rows, offset, local_at = [], 0, sum(len(p.keys) for p in pending)
        tokens = 0.0
        try:
            for item in pending:
                values = dict(zip(item.keys, flat[offset : offset + len(item.keys)], strict=True))
                local = flat[local_at : local_at + len(item.local)]
                offset, local_at = offset + len(item.keys), local_at + len(item.local)
                judge(item.step - 1, local[2:])  # the guard's step index is 0-based
                tokens += values.get("input_tokens", 0.0)
                rows.append(self._row(item, values, local, elapsed))
        finally:
            self._write(rows)
        self.latest = rows[-1]
        return tokens

    def _row(
        self, item: _PendingStep, sums: dict[str, float], local: list[float], elapsed: float
    ) -> dict[str, float]:
        metrics = metrics_from(sums)
        self.history.append((item.step, metrics["loss"]))
        tokens_s = sums["input_tokens"] / elapsed
        seq_len = item.seq_len
        metrics |= {
            "lr": item.lr,
            "grad_norm": local[0],
            "tokens_per_s": tokens_s,
            "samples_per_s": sums["samples"] / elapsed,
            "step_time_s": elapsed,
            "skipped": local[1],
            "seq_len": float(seq_len),
        }
        if self.peak:
            world = dist.get_world_size() if dist.is_initialized() else 1
            flops = self.flops_at(seq_len) if self.flops_at is not None else self.flops_per_token
            metrics["mfu"] = flops * tokens_s / (self.peak * world)
        return {"step": float(item.step), **metrics}

    def _write(self, rows: list[dict[str, float]]) -> None:
        if self.rank != 0 or not rows:
            return
        # Every step, appended (a replayed step's later line wins), with its throughput.
        with open(self.steps_file, "a") as handle:
            for row in rows:
                handle.write(json.dumps({**row, "step": int(row["step"])}) + "\n")
        for row in rows:
            step = int(row["step"])
            if step % self.every == 0 or row is rows[-1]:
                metrics = {f"train_{k}": v for k, v in row.items() if k != "step"}
                self.tracker.log_metrics(metrics, step=step)

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
