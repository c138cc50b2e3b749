"""Loss guards: a NaN/inf loss or a spike over the running mean skips the step or stops the run.

The decision is taken on the device, so a step never waits for the host: every micro-batch's
loss is kept as a tensor (`observe`), and before the update `decide` turns the step's losses
into a skip flag (one all-reduce per step, so every rank decides alike). The flag is folded into
the update the way `torch.amp.GradScaler` skips steps: the fused AdamW kernel takes it as
`found_inf` and leaves the weights and its own state exactly as they were. The running mean of
accepted losses is a ring buffer on the device.

The host learns of the step at the next read (`replay`, at the logging interval, evaluation,
checkpoint and the end of training), judges each micro-batch as before with the values the
device used, counts the skips, and raises `TrainingDivergedError` with the same messages when
the policy is to stop. A stop therefore raises a few steps late, but nothing it would have
refused was applied in between.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Literal

import torch
import torch.distributed as dist

from training.runtime.config import GuardConfig

Verdict = Literal["ok", "skip"]


class TrainingDivergedError(RuntimeError):
    """The loss went non-finite or spiked and the guard is set to stop."""


class LossGuard:
    """Tracks the running mean of accepted losses and judges each micro-batch's loss."""

    def __init__(self, cfg: GuardConfig) -> None:
        """Start with an empty history."""
        self.cfg = cfg
        self.history: deque[float] = deque(maxlen=cfg.spike_window)
        self.skipped_in_row = 0
        self.skipped_total = 0
        self._pending = math.nan
        self._device: _DeviceGuard | None = None
        self._losses: list[torch.Tensor] = []

    # -- the host's judgement (also what `replay` runs on the device's records) -------------

    def check(self, loss: torch.Tensor, step: int) -> Verdict:
        """Judge the mean of `loss` over all ranks now (a host read); raise when it stops."""
        values, nonfinite = _rank_mean(loss.float().reshape(1))
        value, flag = torch.stack([values, nonfinite.double()])[:, 0].tolist()  # one read
        return self.judge(value, flag > 0, step, self.running_mean())

    def running_mean(self) -> float | None:
        """The mean a spike is measured against; None until enough steps are in it."""
        if self.cfg.spike_factor is None or len(self.history) < self._armed_after():
            return None
        return sum(self.history) / len(self.history)

    def judge(self, value: float, nonfinite: bool, step: int, mean: float | None) -> Verdict:
        """The verdict on one micro-batch's loss `value` (the mean over ranks) at `step`."""
        if nonfinite:
            return self._act(self.cfg.on_nonfinite, f"non-finite loss at step {step + 1}")
        factor = self.cfg.spike_factor
        if factor is not None and mean is not None and value > factor * mean:
            reason = f"loss spike at step {step + 1}: {value:.4g} > {factor} x {mean:.4g}"
            return self._act(self.cfg.on_spike, reason)
        self._pending = value
        return "ok"

    def _armed_after(self) -> int:
        return min(5, self.cfg.spike_window)

    def _act(self, policy: str, reason: str) -> Verdict:
        if policy == "stop":
            raise TrainingDivergedError(
                f"{reason}; stopping (train.guard policy 'stop'). Resume from the last "
                "checkpoint with a lower train.optim.lr, or set the guard to 'skip'."
            )
        if self.skipped_in_row + 1 > self.cfg.max_skips:
            raise TrainingDivergedError(
                f"{reason}; {self.cfg.max_skips} steps in a row skipped already "
                "(train.guard.max_skips): stopping"
            )
        return "skip"

    def step_done(self, skipped: bool) -> None:
        """Close a step: count a skip, or add its loss to the running mean."""
        if skipped:
            self.skipped_in_row += 1
            self.skipped_total += 1
        else:
            self.skipped_in_row = 0
            if math.isfinite(self._pending):
                self.history.append(self._pending)

    # -- the device's side: no host read inside a step --------------------------------------

    def observe(self, loss: torch.Tensor) -> None:
        """Keep one micro-batch's (detached) loss for this step's decision."""
        self._losses.append(loss.detach().float().reshape(()))

    def decide(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's skip flag (0-d float, 1 = skip) and its record for `replay`.

        Call once per step, after every micro-batch was observed and before the update. The
        record holds, per micro-batch, the loss (mean over ranks) and a non-finite flag, then
        the running mean used and whether the spike check was armed; on one rank without a
        spike check, only the micro-batches' losses.
        """
        # A handful of numbers every step: on a small model the guard's cost is the number of
        # its operations (each far dearer than its arithmetic), so it makes as few as it can.
        losses = torch.stack(self._losses) if len(self._losses) > 1 else self._losses[0][None]
        self._losses = []
        factor = self.cfg.spike_factor
        if factor is None and _alone():
            # One rank and no spike check (the default): nothing to average or keep. The record
            # is the losses as they are (`replay` reads their finiteness on the host), the flag
            # two operations.
            finite = torch.isfinite(losses).all() if len(losses) > 1 else torch.isfinite(losses[0])
            return torch.where(finite, 0.0, 1.0), losses
        values, nonfinite = _rank_mean(losses)  # (M,) float64, (M,) bool
        state = self._state_on(values.device)
        bad = nonfinite.any()
        if factor is None:  # no spike check: no running mean to keep, unarmed
            return bad.float(), torch.cat([values, nonfinite.double(), state.unarmed])
        mean, armed = state.mean()
        bad = bad | ((values > factor * mean).any() & armed)
        # The history takes the step's last micro-batch loss unless the step is skipped.
        state.push(values[-1:], bad)
        record = torch.cat([values, nonfinite.double(), mean[None], armed.double()[None]])
        return bad.float(), record

    def to(self, device: torch.device) -> None:
        """Put the running mean on `device` now (a copy from the host), not inside a step."""
        self._device = _DeviceGuard(self, device)

    def _state_on(self, device: torch.device) -> _DeviceGuard:
        if self._device is None or self._device.device != device:
            self.to(device)
        assert self._device is not None
        return self._device

    def replay(self, step: int, record: list[float]) -> bool:
        """Judge a decided step from its record, as `check` would have; return whether skipped.

        Raises `TrainingDivergedError` with `check`'s messages where the policy is to stop.
        """
        if self.cfg.spike_factor is None and _alone():  # `decide`'s record: the losses alone
            values, nonfinite, mean = record, [not math.isfinite(v) for v in record], None
        else:
            micro = (len(record) - 2) // 2
            values = record[:micro]
            nonfinite = [flag > 0 for flag in record[micro : 2 * micro]]
            mean = record[-2] if record[-1] > 0 else None
        skip = False
        for value, flag in zip(values, nonfinite, strict=True):
            skip = self.judge(value, flag, step, mean) == "skip" or skip
        self.step_done(skip)
        return skip

    # -- checkpoints ------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run judges losses exactly as before."""
        return {
            "history": list(self.history),
            "skipped_in_row": self.skipped_in_row,
            "skipped_total": self.skipped_total,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state` returned."""
        self.history = deque(state["history"], maxlen=self.cfg.spike_window)
        self.skipped_in_row = state["skipped_in_row"]
        self.skipped_total = state["skipped_total"]
        self._device = None  # rebuilt from the restored history at the next decision


def _alone() -> bool:
    """Whether this process is the only rank (no process group, or a group of one)."""
    return not dist.is_initialized() or dist.get_world_size() == 1


def _rank_mean(losses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M,) float64 and (M,) bool: the mean over ranks and whether any rank's was non-finite.

    A non-finite loss counts as 0 in the mean. One all-reduce, asynchronous on NCCL: nothing
    waits for the host. A one-rank world (a worker in the command's process) has no other rank
    to ask: gloo's all-reduce would still cost a fifth of a millisecond a step.
    """
    values = losses.double()
    finite = torch.isfinite(values)
    values = torch.where(finite, values, 0.0)
    if not _alone():
        probe = torch.stack([values, (~finite).double()])
        dist.all_reduce(probe)
        return probe[0] / dist.get_world_size(), probe[1] > 0
    return values, ~finite


class _DeviceGuard:
    """The running mean's window on the device: the newest `count` entries at its end.

    The entries before them are zeros (the window starts as zeros and only shifts left), so
    the window's sum is the sum of the accepted losses in it.
    """

    def __init__(self, guard: LossGuard, device: torch.device) -> None:
        window = guard.cfg.spike_window
        self.device, self.window = device, window
        self.armed_after = guard._armed_after()
        history = list(guard.history)
        values = torch.zeros(window, dtype=torch.float64)
        if history:
            values[window - len(history) :] = torch.tensor(history, dtype=torch.float64)
        self.values = values.to(device)  # (W,)
        self.count = torch.full((), len(history), dtype=torch.int64, device=device)
        self.unarmed = torch.zeros(2, dtype=torch.float64, device=device)  # a record's tail

    def mean(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The running mean (0 when empty) and whether the spike check is armed."""
        return self.values.sum() / self.count.clamp(min=1), self.count >= self.armed_after

    def push(self, value: torch.Tensor, refuse: torch.Tensor) -> None:
        """Append `value` (1,) unless `refuse`, dropping the oldest once the window is full."""
        shifted = torch.cat([self.values[1:], value])
        self.values = torch.where(refuse, self.values, shifted)
        self.count = torch.where(refuse, self.count, (self.count + 1).clamp(max=self.window))
