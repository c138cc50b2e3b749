"""Progress without Ray: formatting, rates and time left, terminal or log lines, coalescing."""

from __future__ import annotations

import io
import logging
import os

import pytest
from rich.console import Console

from tasks.common.progress import (
    ProgressRecord,
    ProgressState,
    ProgressView,
    format_count,
    format_duration,
)
from training.runtime.progress import (
    NullProgress,
    ProgressArtifact,
    ProgressSender,
    ProgressSpec,
    artifact_key,
    connect_progress,
    local_progress,
)


def steps(last: int, total: int = 6, loss_every: int = 2, wall0: float = 100.0) -> list:
    """Records of steps 1..last, 0.5 s apart, 8 samples of 64 tokens each; a loss every N."""
    out = []
    for step in range(1, last + 1):
        kw = dict(step=step, total=total, wall_s=wall0 + 0.5 * step, samples=8 * step)
        out.append(ProgressRecord(**kw, tokens=512 * step))
        if step % loss_every == 0:
            out.append(ProgressRecord(**kw, tokens=512 * step, metrics={"loss": 3.0 / step}))
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_counts_and_durations_read_like_a_progress_bar() -> None:
    assert [format_count(x) for x in (0.5, 12.34, 512, 1234, 12_345_678)] == [
        "0.50",
        "12.3",
        "512",
        "1.23k",
        "12.3M",
    ]
    assert [format_duration(s) for s in (5, 59.6, 3723)] == ["0:05", "1:00", "1:02:03"]


def test_rates_and_time_left_come_from_the_workers_clock() -> None:
    state = ProgressState("pretrain")
    for record in steps(5, total=100, loss_every=1000):
        state.add(record)
    rates = state.rates()
    assert rates == pytest.approx((2.0, 16.0, 1024.0))
    assert state.seconds_left() == pytest.approx(95 / 2.0)
    assert state.status() == "5/100 · 2.00 it/s · 1.02k tok/s · 0:02<0:48"
    state.add(ProgressRecord(5, 100, 102.5, 40, 2560, metrics={"loss": 2.5, "lr": 1e-3}))
    assert state.status().endswith("0:02<0:48 · loss 2.5")  # the live line: losses only
    assert "16.0 samples/s" in state.log_line(state.points[-1])


def test_a_restart_from_a_checkpoint_starts_the_rates_over() -> None:
    state = ProgressState("pretrain")
    for record in steps(10, total=20, loss_every=1000):
        state.add(record)
    state.add(ProgressRecord(step=7, total=20, wall_s=200.0, samples=8))  # a new worker
    assert state.rates() is None
    assert "<?" in state.status()


def test_without_a_terminal_one_line_per_log_interval_and_a_closing_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("lmpipe.test.progress")
    view = ProgressView("pretrain tiny", logger)
    with caplog.at_level(logging.INFO, logger=logger.name):
        view.update(steps(4))
        view.update(steps(6)[-3:])
        view.close()
    lines = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert [line.split(" · ")[0] for line in lines] == [
        "pretrain tiny: step 2/6 (33%)",
        "pretrain tiny: step 4/6 (67%)",
        "pretrain tiny: step 6/6 (100%)",
        "pretrain tiny: done at step 6/6",
    ]
    assert lines[1].endswith("loss 0.75")
    assert "2.00 it/s · 16.0 samples/s · 1.02k tok/s · 0:00 left" in lines[2]
    assert "\x1b[" not in "".join(lines)


def test_on_a_terminal_the_line_is_live_and_log_intervals_print_above_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200)
    logger = logging.getLogger("lmpipe.test.progress.tty")
    percents: list[tuple[float, bool]] = []
    view = ProgressView("pretrain", logger, console, lambda p, final: percents.append((p, final)))
    with caplog.at_level(logging.INFO, logger=logger.name):
        for record in steps(6):
            view.update([record])
        view.close()
    text = screen.getvalue()
    assert "\x1b[" in text  # redrawn in place
    assert "6/6 · 2.00 it/s · 1.02k tok/s · 0:02<0:00 · loss 0.5" in text
    assert "pretrain: step 4/6 (67%)" in text
    assert "pretrain: done at step 6/6" in text
    assert not [r for r in caplog.records if r.name == logger.name]
    assert percents[-1] == (100.0, True)


def test_step_records_are_coalesced_and_logged_metrics_are_kept_until_sent() -> None:
    sent: list[list[ProgressRecord]] = []
    answered: set[int] = set()
    clock = FakeClock()

    def send(records: list[ProgressRecord]) -> int:
        sent.append(list(records))
        return len(sent) - 1

    def unanswered(handles: list[int], _timeout_s: float) -> list[int]:
        return [h for h in handles if h not in answered]

    sender = ProgressSender(send, unanswered, 100, min_interval_s=1.0, max_in_flight=1, clock=clock)
    for step in (1, 2, 3):
        sender.step(step, samples=8)
    assert [[r.step for r in batch] for batch in sent] == [[1]]  # 2 and 3 within the interval
    sender.log(3, {"loss": 1.5})
    assert len(sent) == 1  # the driver has not answered: held, not dropped
    answered.add(0)
    sender.step(4, samples=8)
    clock.now = 1.0
    sender.step(5, samples=8)
    assert [(r.step, dict(r.metrics)) for r in sent[1]] == [(3, {}), (3, {"loss": 1.5}), (5, {})]
    assert sent[1][-1].samples == 40
    answered.add(1)
    sender.step(100)  # the last step is sent at once
    assert sent[2][-1].step == 100
    sender.close()


def test_a_loop_without_a_driver_never_starts_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("ray.init called")

    monkeypatch.setattr(ray, "init", refuse)
    assert isinstance(connect_progress(None, 0, 10), NullProgress)
    assert isinstance(connect_progress("lmpipe-progress/run-x", 1, 10), NullProgress)
    # Rank 0 with an address: a sink that is not there (or no Ray at all) is no display.
    assert isinstance(connect_progress("lmpipe-progress/run-missing", 0, 10), NullProgress)


def test_local_progress_outside_prefect_logs_its_parts_and_makes_no_artifact(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("lmpipe.test.progress.local")
    assert ProgressArtifact.for_current_run("k", "outside a run") is None
    spec = ProgressSpec("evaluate", logger, artifact_key("Demo_run evaluate"), terminal=False)
    with caplog.at_level(logging.INFO, logger=logger.name), local_progress(spec, 2) as shown:
        shown.step(0, phase="heldout")
        shown.log(1, {"heldout_loss": 2.5})
        shown.step(2, phase="fill mask")
    lines = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert lines[0].startswith("evaluate: step 1/2 (50%)")
    assert lines[0].endswith("heldout_loss 2.5")
    assert lines[-1].startswith("evaluate: done at step 2/2")
    assert artifact_key("Demo_run evaluate") == "demo-run-evaluate"


def test_log_lines_to_the_terminal_go_above_the_live_line_and_come_back_after() -> None:
    from tasks.common.progress import route_logs_through

    master, slave = os.openpty()
    terminal = open(slave, "w")  # noqa: SIM115 (closed below, after the handler is gone)
    handler = logging.StreamHandler(terminal)
    logger = logging.getLogger("lmpipe.test.progress.routed")
    logger.addHandler(handler)
    screen = io.StringIO()
    try:
        restore = route_logs_through(Console(file=screen, force_terminal=True, width=100))
        logger.warning("a warning while the line is live")
        restore()
        assert handler.stream is terminal
    finally:
        logger.removeHandler(handler)
        terminal.close()
        os.close(master)
    assert "a warning while the line is live" in screen.getvalue()
