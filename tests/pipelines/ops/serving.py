"""Helpers of the tests that run `lmpipe serve` in a subprocess (deployments, browser)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any


def wait_for_deployment(name: str, process: subprocess.Popen[bytes], log: Path) -> Any:
    """Wait until `lmpipe serve` has registered deployment `name`; return it.

    Fails with the serve log's tail when the process exits or two minutes pass.
    """
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    deadline = time.monotonic() + 120
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            tail = log.read_text(errors="replace")[-3000:]
            assert process.poll() is None, f"lmpipe serve exited:\n{tail}"
            try:
                return client.read_deployment_by_name(name)
            except ObjectNotFound:
                time.sleep(0.5)
    raise AssertionError(f"{name} never registered:\n{log.read_text(errors='replace')[-3000:]}")


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group the test started (`start_new_session`); SIGKILL if it lingers."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
