"""Entry-point plumbing: what a command sets in its environment before Prefect is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.ops.runtime import TEMPORARY_API_STARTUP_S, patient_temporary_api

KEY = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
REPO = Path(__file__).resolve().parents[3]


def test_the_temporary_api_gets_time_to_start_unless_the_user_set_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KEY, raising=False)
    patient_temporary_api()
    assert TEMPORARY_API_STARTUP_S > 20  # Prefect's own wait, too short on a busy machine
    assert os.environ[KEY] == str(TEMPORARY_API_STARTUP_S)
    monkeypatch.setenv(KEY, "45")
    patient_temporary_api()
    assert os.environ[KEY] == "45"


@pytest.mark.slow
def test_the_cli_sets_the_wait_before_prefect_reads_its_settings() -> None:
    """In a fresh process: `lmpipe config` runs, then Prefect's setting holds the CLI's wait."""
    script = (
        "import os, sys; os.environ.pop(sys.argv[1], None); "
        "from pipelines.cli.main import main; "
        "assert 'prefect' not in sys.modules; "
        "assert main(['config', 'configs/demo.yaml']) == 0; "
        "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as S; "
        "print('wait', S.value())"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, KEY], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wait {TEMPORARY_API_STARTUP_S}" in done.stdout
