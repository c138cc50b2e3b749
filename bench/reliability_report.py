"""Render the reliability suite's figures (test-artifacts/reliability/full/*.json) as Markdown.

Usage: `.venv/bin/python bench/reliability_report.py [DIR]` after `make test-reliability`
(DIR defaults to the full run's folder; `make test` writes its quick figures to `quick/`);
the output is what docs/reliability.md quotes. Each JSON file becomes a section: its scalar
figures as a list, each list of records as a table, plus N/N summaries where a record says
whether it held (`weights_equal`, `identical`, `outcome`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def table(rows: list[dict[str, Any]]) -> list[str]:
    """A Markdown table over the union of the rows' keys, in first-seen order."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k)) for k in keys) + " |")
    return lines


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True).replace("|", "\\|")
    return "" if value is None else str(value).replace("|", "\\|")


def section(path: Path) -> list[str]:
    """One figures file as a Markdown section."""
    data: dict[str, Any] = json.loads(path.read_text())
    out = [f"### {path.stem} ({data.get('mode', '?')} counts)", ""]
    for key, value in sorted(data.items()):
        if key == "mode":
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out += [f"{key}: {len(value)} records", "", *table(value), ""]
        else:
            out.append(f"- {key}: {_cell(value)}")
    return [*out, ""]


def main(folder: Path) -> int:
    files = sorted(folder.glob("*.json"))
    if not files:
        print(f"no figures under {folder}: run `make test-reliability` first", file=sys.stderr)
        return 1
    for path in files:
        print("\n".join(section(path)))
    return 0


if __name__ == "__main__":
    default = ROOT / "test-artifacts" / "reliability" / "full"
    raise SystemExit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else default))
