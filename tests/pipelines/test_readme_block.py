"""Every line of the README's "Using it" block is right (issue 40).

Each line is parsed as the shell would split it (continuations joined, `$PWD` the repository
root) and by lmpipe's own parser; its recipe and overrides go through `load_config` (from the
repository root, as the README runs them; `submit` through the checks it makes before it
submits); the CoLA line's files are looked for in `../shared/data`. Lines marked `# long`
(training), `# server` (servers that keep running) or `# cluster` (a Ray job) stop there. Every
other line then runs in this process (`main`, as `test_cli_answers.py` runs it) on the demo
recipe shortened to the session's demo corpus (`DemoData`), whose built stages are linked into
the workspace so that what the line does not change is a cache hit.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelines.cli.main import STAGE_COMMANDS, main
from pipelines.cli.parser import build_parser, join_nested
from pipelines.config import load_config

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DEMO = "configs/demo.yaml"
LMPIPE = ".venv/bin/lmpipe"
#: The mark each command's line must carry; the others carry none and run here.
MARKS = {
    **dict.fromkeys(("pretrain", "export", "finetune", "compare", "evaluate", "run"), "long"),
    **dict.fromkeys(("up", "serve", "down"), "server"),
    "submit": "cluster",
}
#: What cannot be typed as it stands: `<run>`, `HEAD`, `...`.
PLACEHOLDER = re.compile(r"<[^>]*>|\bHEAD\b|\.\.\.")
#: A word with brackets or braces outside quotes: a glob that zsh refuses when nothing matches.
UNQUOTED_GLOB = re.compile(r"(?:^|\s)[^\s'\"]*[\[{][^\s'\"]*(?=\s|$)")
#: The stages the shortened demo links in from `DemoData` (its `examples("bert")`).
LINKED = ("ingest", "tokenizer", "encode", "examples")


@dataclass(frozen=True)
class Line:
    """One command of the block: its text, words after `lmpipe`, and its mark (or None)."""

    text: str
    words: list[str]
    mark: str | None


def block_lines(readme: str) -> list[str]:
    """The commands of the first bash block under "## Using it", continuations joined."""
    section = readme.split("\n## Using it\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    return [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def parse_line(text: str) -> Line:
    """Split a line into its words (as a shell would, `$PWD` the repository) and its mark."""
    code, _, comment = text.partition(" #")
    words = shlex.split(code.replace("$PWD", str(REPO)))
    assert words[0] == LMPIPE, f"not an lmpipe command: {text}"
    first = comment.strip().split(" ", 1)[0].rstrip(":")
    return Line(text, words[1:], first if first in ("long", "server", "cluster") else None)


LINES = [parse_line(text) for text in block_lines(README.read_text(encoding="utf-8"))]


def command_of(line: Line) -> str:
    """The subcommand a line runs (`examples inspect` as one), or its option (`--version`)."""
    return join_nested(line.words)[0]


def runs_a_stage(line: Line) -> bool:
    """Whether the line, unmarked, runs stages or reads the workspace (the shortened demo's)."""
    command = command_of(line)
    return line.mark is None and "--help" not in line.words and command in {*STAGE_COMMANDS, "gc"}


def params() -> list[Any]:
    return [
        pytest.param(
            line,
            id=f"{i:02d}-{command_of(line)}",
            marks=[pytest.mark.slow, pytest.mark.integration] if runs_a_stage(line) else [],
        )
        for i, line in enumerate(LINES)
    ]


def parse_args(words: list[str]) -> Any:
    """lmpipe's own parser on the words; None for `--help`/`--version`, which exit at parsing."""
    if {"--help", "--version"} & set(words):
        with pytest.raises(SystemExit) as stop:
            build_parser().parse_args(join_nested(words))
        assert stop.value.code == 0, f"lmpipe refused {words}"
        return None
    return build_parser().parse_args(join_nested(words))


def validate(args: Any, request: pytest.FixtureRequest) -> None:
    """The checks the command makes before any work, made here from the repository root."""
    if args.command == "submit":
        from pipelines.ops.submit import (
            project_root,
            recipe_in_project,
            resolve_address,
            validate_recipe,
        )

        root = project_root()
        validate_recipe(root, recipe_in_project(args.config, root), args.overrides)
        resolve_address(args.address, {})
        return
    if args.command == "export":
        from training.runtime.checkpoint import checkpoint_name

        demo = load_config(DEMO)
        pattern = Path(demo.workspace) / "pretrain" / "*" / checkpoint_name(demo.train.max_steps)
        assert args.checkpoint == pattern  # the demo's last checkpoint, in its run directory
        return
    if getattr(args, "config", None) is None:
        return
    cfg = load_config(Path(args.config), args.overrides)
    if cfg.task is not None and "shared/data" in cfg.task.base_dir.as_posix():
        from tasks.downstream.downstream import source_paths

        request.getfixturevalue("shared_data")  # skips, saying so, where it is missing
        missing = [p for _, p in source_paths(cfg.task.resolved(), cfg.task.base_dir)]
        assert [p for p in missing if not p.exists()] == []


@pytest.fixture(scope="module")
def short_demo(
    tmp_path_factory: pytest.TempPathFactory, demo_data: Any, ray_session: str, mlflow_uri: str
) -> Path:
    """The demo recipe on the session's demo corpus; its built stages linked in, output by output.

    The data sections are `DemoData`'s (1,500 documents, its tokenizer and examples), so the
    stages a line leaves alone are cache hits; what a line builds goes to this workspace only.
    """
    demo_data.examples("bert")
    root = tmp_path_factory.mktemp("readme-block")
    workspace = root / "ws"
    for stage in LINKED:
        (workspace / stage).mkdir(parents=True)
        for output in (demo_data.root / "ws" / stage).iterdir():
            (workspace / stage / output.name).symlink_to(output)
    recipe = yaml.safe_load((REPO / DEMO).read_text(encoding="utf-8"))
    recipe |= {
        "name": "readme",
        "workspace": str(workspace),
        "ray": {"num_workers": 2, "address": ray_session},
        "tracking": {"tracking_uri": mlflow_uri, "experiment": "readme-block"},
        "ingest": {
            "sources": [{"path": str(demo_data.root / "corpus" / "corpus"), "format": "jsonl"}],
            "split": {"validation": 0.05, "test": 0.05},
        },
        "tokenizer": {"family": "wordpiece", "vocab_size": 1024, "model_max_length": 512},
        "encode": {},
        "examples": {"objective": "bert", "max_seq_length": 64, "block_size": 64},
        "task": {
            "config": str(REPO / "configs/tasks/demo_residence.yaml"),
            "base_dir": str(demo_data.root / "corpus"),
        },
    }
    path = root / "demo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_main(words: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`main(words)` in this process: exit code (help and --version exit 0), stdout, stderr."""
    try:
        code = main(words)
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("line", params())
def test_readme_line_validates_and_runs_unless_marked(
    line: Line,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert not PLACEHOLDER.search(line.text), f"a placeholder: {line.text}"
    assert not UNQUOTED_GLOB.search(line.text.partition(" #")[0]), f"quote it: {line.text}"
    assert line.mark == MARKS.get(command_of(line)), f"mark it # {MARKS.get(command_of(line))}"
    monkeypatch.chdir(REPO)  # relative paths as the README's commands see them
    args = parse_args(line.words)
    if args is not None:
        validate(args, request)
    if line.mark is not None:
        pytest.skip(f"# {line.mark}: parsed and validated only")
    words = line.words
    if runs_a_stage(line):
        request.getfixturevalue("prefect_api")  # before `main` imports Prefect
        words = [str(request.getfixturevalue("short_demo")) if w == DEMO else w for w in words]
    exit_code, out, err = run_main(words, capsys)
    assert exit_code == 0, err[-3000:]
    assert out.strip(), err[-3000:]


def test_the_block_is_found_with_lines_of_every_kind() -> None:
    assert len(LINES) >= 20
    assert {line.mark for line in LINES} == {None, "long", "server", "cluster"}
    assert any(runs_a_stage(line) for line in LINES)
