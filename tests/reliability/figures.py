"""The reliability suite: trial counts and the figures each module records.

`make test` runs every module at its quick count (a few trials, inside the suite's time budget);
`make test-reliability` sets `LMPIPE_RELIABILITY=full` and runs the full counts. Each module
writes its figures to `test-artifacts/reliability/<quick|full>/<name>.json` (one folder per
mode, so a `make test` never overwrites a full run's figures); `bench/reliability_report.py`
renders a folder as the tables of `docs/reliability.md`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FULL = os.environ.get("LMPIPE_RELIABILITY", "") == "full"
FIGURES = REPO / "test-artifacts" / "reliability" / ("full" if FULL else "quick")


def trials(quick: int, full: int) -> int:
    """How many trials to run: `full` under `make test-reliability`, else `quick`."""
    return full if FULL else quick


def record(name: str, figures: dict[str, Any]) -> Path:
    """Merge `figures` into `<FIGURES>/<name>.json` (tagged quick or full)."""
    FIGURES.mkdir(parents=True, exist_ok=True)
    path = FIGURES / f"{name}.json"
    current: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    current.update(figures)
    current["mode"] = "full" if FULL else "quick"
    path.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    return path


def record_row(name: str, key: str, row: dict[str, Any], ident: tuple[str, ...]) -> Path:
    """Put `row` into the list `key` of `<name>.json`, replacing a row with the same `ident`.

    A rerun of one trial (`pytest -k`) then updates its own row and keeps the others'.
    """
    path = FIGURES / f"{name}.json"
    current: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    same = tuple(row[k] for k in ident)
    rows = [r for r in current.get(key, []) if tuple(r.get(k) for k in ident) != same]
    rows.append(row)
    rows.sort(key=lambda r: tuple(str(r.get(k)) for k in ident))
    return record(name, {key: rows})
