"""Reports people look at: Markdown and self-contained HTML with tables and PNG plots.

`finetune_report` renders one fine-tuning run (epoch table, test metrics, loss/metric curves, a
confusion matrix for classification); `comparison_report` renders a strategy comparison (mean
and spread over seeds, trainable parameters, time, a bar chart). Both write their files next
to the run and return their paths; the flows log them to MLflow and publish the Markdown as a
Prefect artifact. Nothing here trains or evaluates.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; floats are shown with 4 significant digits."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _figure(width: float, height: float) -> Figure:
    """A Figure of `width` x `height` inches, outside pyplot (no global state to close)."""
    # Imported here: matplotlib costs every `lmpipe` command's start, and only reports draw.
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


def curves_png(history: Sequence[Mapping[str, Any]], metric: str, out: Path) -> Path:
    """Train loss and the validation `metric` per epoch, side by side."""
    epochs = [int(r["epoch"]) + 1 for r in history]
    fig = _figure(9, 3.4)
    left, right = fig.subplots(1, 2)
    left.plot(epochs, [r["train_loss"] for r in history], marker="o", label="train loss")
    if history and "loss" in history[0]:
        left.plot(epochs, [r["loss"] for r in history], marker="o", label="validation loss")
    left.set_xlabel("epoch")
    left.set_title("loss")
    left.legend()
    right.plot(epochs, [r.get(metric, float("nan")) for r in history], marker="o", color="C2")
    right.set_xlabel("epoch")
    right.set_title(f"validation {metric}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def confusion_png(matrix: Sequence[Sequence[int]], labels: Sequence[str], out: Path) -> Path:
    """A confusion matrix heat map (rows: true label, columns: predicted), counts annotated."""
    size = max(3.0, 0.6 * len(labels) + 1.5)
    fig = _figure(size, size)
    ax = fig.subplots()
    ax.imshow(matrix, cmap="Blues")
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    for i, row in enumerate(matrix):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def bar_chart_png(
    names: Sequence[str], means: Sequence[float], spreads: Sequence[float], metric: str, out: Path
) -> Path:
    """Mean ± standard deviation of `metric` per strategy."""
    fig = _figure(max(4.0, 1.1 * len(names) + 1.5), 3.4)
    ax = fig.subplots()
    ax.bar(names, means, yerr=spreads, capsize=4, color="C0")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} by strategy (mean ± std over seeds)")
    ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def html_page(
    title: str, markdown_sections: Sequence[tuple[str, str]], images: Sequence[Path]
) -> str:
    """A self-contained HTML page: each section's table as preformatted text, images inline."""
    parts = [f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"]
    parts.append(f"<body style='font-family:sans-serif'><h1>{html.escape(title)}</h1>")
    for heading, body in markdown_sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>{_html_table(body)}")
    for image in images:
        data = base64.b64encode(image.read_bytes()).decode()
        parts.append(f"<p><img alt='{html.escape(image.stem)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _html_table(markdown: str) -> str:
    rows = [line.strip().strip("|").split("|") for line in markdown.splitlines() if line.strip()]
    if len(rows) < 2 or not set(markdown.splitlines()[1]) <= set("|-: "):
        return f"<pre>{html.escape(markdown)}</pre>"
    head = "".join(f"<th>{html.escape(c.strip())}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c.strip())}</td>" for c in row) + "</tr>"
        for row in rows[2:]
    )
    style = "border='1' cellpadding='4' style='border-collapse:collapse'"
    return f"<table {style}><tr>{head}</tr>{body}</table>"


def finetune_report(
    run_dir: Path, result: Mapping[str, Any], task: Mapping[str, Any]
) -> list[Path]:
    """Write `report.md`, `report.html` and plots for one fine-tuning run; return the files."""
    out = run_dir / "report"
    history = result["history"]
    metric = str(result["metric"])
    images = [curves_png(history, metric, out / "curves.png")]
    keys = sorted({k for row in history for k in row if k not in ("epoch", "step")})
    sections = [
        ("Run", markdown_table(["field", "value"], _run_rows(result, task))),
        ("Test metrics", markdown_table(["metric", "value"], sorted(result["test"].items()))),
        (
            "Epochs",
            markdown_table(
                ["epoch", *keys], [[r["epoch"] + 1, *(r.get(k, "") for k in keys)] for r in history]
            ),
        ),
    ]
    matrix = result.get("confusion_matrix")
    if matrix:
        images.append(confusion_png(matrix, result["labels"], out / "confusion_matrix.png"))
    title = f"Fine-tuning: {task.get('name', task['task_type'])}"
    md = [f"# {title}"] + [f"## {h}\n\n{body}" for h, body in sections]
    md += [f"![{p.stem}]({p.name})" for p in images]
    (out / "report.md").write_text("\n\n".join(md) + "\n", encoding="utf-8")
    (out / "report.html").write_text(html_page(title, sections, images), encoding="utf-8")
    return [out / "report.md", out / "report.html", *images]


def _run_rows(result: Mapping[str, Any], task: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [
        ("task type", task["task_type"]),
        ("strategy", result["strategy"]),
        ("initialisation", "random" if result["random_init"] else "pretrained"),
        ("epochs run", result["epochs_run"]),
        ("best epoch", int(result["best_epoch"]) + 1),
        (f"best validation {result['metric']}", result["best_value"]),
        ("trainable parameters", f"{result['trainable_parameters']:,}"),
        ("total parameters", f"{result['total_parameters']:,}"),
        ("train time (s)", result["train_time_s"]),
    ]


def comparison_report(
    rows: Sequence[Mapping[str, Any]], metric: str, out: Path, title: str
) -> tuple[list[Path], str]:
    """Write the strategy comparison (one row per strategy) as Markdown, HTML and a bar chart.

    Each row has `strategy`, `mean`, `std`, `seeds`, `values`, `trainable_parameters` and
    `train_time_s` (mean over seeds). Returns the files and the Markdown text.
    """
    header = ["strategy", f"{metric} mean", "std", "seeds", "trainable params", "time (s)"]
    table = markdown_table(
        header,
        [
            [
                r["strategy"],
                r["mean"],
                r["std"],
                len(r["values"]),
                f"{r['trainable_parameters']:,}",
                r["train_time_s"],
            ]
            for r in rows
        ],
    )
    chart = bar_chart_png(
        [r["strategy"] for r in rows],
        [r["mean"] for r in rows],
        [r["std"] for r in rows],
        metric,
        out / "comparison.png",
    )
    text = f"# {title}\n\n{table}\n\n![comparison](comparison.png)\n"
    (out / "comparison.md").write_text(text, encoding="utf-8")
    (out / "comparison.html").write_text(html_page(title, [("Strategies", table)], [chart]))
    return [out / "comparison.md", out / "comparison.html", chart], text
