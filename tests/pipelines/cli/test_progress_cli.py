"""`lmpipe finetune` (pretraining, then fine-tuning, 2 Ray workers each) shows its progress.

The CLI runs twice against the session's Ray and Prefect API: once with a pipe (one plain line
per log interval, as CI and Prefect logs see it) for both runs, then under a pseudo-terminal (a
live line redrawn in place) with another fine-tuning learning rate, so that the pretraining is
reused and only the fine-tuning runs again: each Ray Train start costs tens of seconds here, and
both kinds of run draw their line with the same driver code. Both outputs are kept under
`tmp_path` for a look.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.integration]
REPO = Path(__file__).resolve().parents[3]
ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MAX_STEPS, LOG_EVERY, EPOCHS = 4, 2, 2


def recipe(tmp_path: Path, demo: Any) -> Path:
    """A 2-layer BERT for 4 steps, then a 2-epoch fine-tuning, on the session's demo examples.

    The data stages' outputs are the session's (`demo_data`, shared with the pretraining
    tests): linked into the workspace, the CLI finds them complete and reuses them.
    """
    demo.examples("bert")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    for stage in ("ingest", "tokenizer", "encode", "examples"):
        (workspace / stage).symlink_to(demo.root / "ws" / stage)
    config: dict[str, Any] = {
        "name": "progress-cli",
        "workspace": str(workspace),
        "tracking": {"enabled": False},
        # As `DemoData` built them, so that every data stage is a cache hit.
        "ingest": {
            "sources": [{"path": str(demo.root / "corpus" / "corpus"), "format": "jsonl"}],
            "split": {"validation": 0.05, "test": 0.05},
        },
        "tokenizer": {"family": "wordpiece", "vocab_size": 1024, "model_max_length": 512},
        "examples": {"objective": "bert", "max_seq_length": 64, "block_size": 64},
        "train": {
            "model": {"family": "bert", "size": "tiny"},
            "max_steps": MAX_STEPS,
            "global_batch_size": 8,
            "precision": "fp32",
            "log_every_steps": LOG_EVERY,
            "checkpoint": {"every_steps": MAX_STEPS},
            "eval": {"every_steps": MAX_STEPS, "max_samples": 8},
            "scale": {"num_workers": 2},
        },
        "task": {
            "config": str(REPO / "configs/tasks/demo_residence.yaml"),
            "base_dir": str(demo.root / "corpus"),
            "max_examples": {"train": 32, "validation": 8, "test": 8},
        },
        "finetune": {
            "epochs": EPOCHS,
            "batch_size": 8,
            "micro_batch_size": 4,
            "early_stopping": None,
            "register_model": False,
            "features": {"max_length": 32, "stride": 8},
            "scale": {"num_workers": 2},
        },
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_in_pty(command: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """Run `command` on a new pseudo-terminal (120 columns); its exit code and screen bytes.

    Past `timeout_s` the process group this started is killed (exit code -9).
    """
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(
        command, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO, start_new_session=True
    )
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunks.append(os.read(master, 1 << 16))
            except OSError:  # EIO: the process and its children have closed the terminal
                break
    finally:
        if process.poll() is None and time.monotonic() >= deadline:
            os.killpg(process.pid, signal.SIGKILL)  # the group this test started, and only it
        process.wait()
        os.close(master)
    return process.returncode, b"".join(chunks).decode(errors="replace")


def run_in_pipe(
    command: list[str], env: dict[str, str], timeout_s: float
) -> subprocess.CompletedProcess[str]:
    """Run `command` with stdout and stderr on one pipe; kill its process group past the limit."""
    process = subprocess.Popen(
        command,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the group this test started, and only it
        out, _ = process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, out)


def progress_lines(text: str, title: str) -> list[str]:
    """The plain progress lines of a run titled `title`: `<title>: step N/M ...`."""
    return [line for line in text.splitlines() if re.search(rf"{re.escape(title)}: step \d", line)]


def test_progress_is_live_on_a_terminal_and_one_line_per_log_interval_in_a_pipe(
    tmp_path: Path, ray_session: str, prefect_api: str, demo_data: Any
) -> None:
    path = recipe(tmp_path, demo_data)
    cli = [sys.executable, "-m", "pipelines.cli.main", "finetune", str(path)]
    overrides = [f"ray.address={ray_session}"]
    env = os.environ | {"PREFECT_API_URL": prefect_api, "TERM": "xterm-256color"}
    env.pop("COLUMNS", None)
    piped = run_in_pipe([*cli, *overrides], env | {"TERM": "dumb"}, timeout_s=300)
    (tmp_path / "pipe.txt").write_text(piped.stdout)
    assert piped.returncode == 0, piped.stdout[-3000:]

    # Another fine-tuning learning rate: the pretraining is reused, the fine-tuning runs again.
    again = [*cli, *overrides, "finetune.lr=0.002"]
    code, screen = run_in_pty(again, env, timeout_s=300)
    (tmp_path / "tty.txt").write_text(screen)
    assert code == 0, screen[-3000:]

    # On the terminal: one line redrawn in place (bar, steps, rates, elapsed<left, losses),
    # with each log interval printed above it, and no log line written into it.
    plain = ESCAPE.sub("", screen)
    assert "\x1b[2K" in screen  # erase line: a redraw
    live = re.findall(r"finetune full seed 0 ━+ (\d+)/8 · [^\n]* it/s [^\n]*<", plain)
    assert live, "no live line for the fine-tuning"
    assert "8" in live
    assert "pretrain bert-tiny: step" not in plain  # reused: no training, no line
    assert "finetune full seed 0: step 4/8 (50%)" in plain
    assert not [line for line in plain.splitlines() if " it/s" in line and "INFO" in line]

    # In the pipe: no terminal codes; one line per log interval (loss), evaluation and epoch.
    log = piped.stdout
    assert not ESCAPE.search(log)
    # A quiet terminal: none of the HTTP clients' request lines (`--verbose` asks for them).
    assert not re.findall(r"^(?:DEBUG|INFO) (?:httpx|httpcore|urllib3)\b.*$", log, re.M)
    pre = progress_lines(log, "pretrain bert-tiny")
    losses = [int(m.group(1)) for line in pre if (m := re.search(r"step (\d+)/4.* loss ", line))]
    assert losses == list(range(LOG_EVERY, MAX_STEPS + 1, LOG_EVERY))
    assert sum("eval_loss" in line for line in pre) == 2  # before the first step and at the end
    assert "pretrain bert-tiny: done at step 4/4" in log
    tune = progress_lines(log, "finetune full seed 0")
    assert [line.count("train_loss") for line in tune] == [1] * EPOCHS + [0]  # + the test line
    assert "finetune full seed 0: done at step" in log
    assert_progress_artifacts_at_100(
        {"progress-cli-pretrain-progress": 1, "progress-cli-finetune-progress": 2}
    )


def assert_progress_artifacts_at_100(runs: dict[str, int]) -> None:
    """Each run (`runs[key]` of them per artifact key) left its progress artifact at 100%."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=list(runs)))
        )
    assert sorted((a.key, a.type, a.data) for a in found) == sorted(
        (key, "progress", 100.0) for key, n in runs.items() for _ in range(n)
    )
