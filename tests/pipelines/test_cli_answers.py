"""The `lmpipe` command line answers: version, help with config sections, keys, exit codes.

Cheap by design: the parser and the key listing run in this process, the import check in one
subprocess, and the exception mapping on stand-in classes named like the real ones (the real
ones live beside torch and Ray; `test_every_mapped_exception_class_exists` checks the names
against the source). One end-to-end case runs a real Prefect flow on a corrupt input file.
"""

from __future__ import annotations

import ast
import atexit
import builtins
import gc
import importlib.metadata as md
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.cli import failures
from pipelines.cli.failures import ExitCode, classify, report_failure, signals_raise
from pipelines.cli.keys import COMMAND_SECTIONS, describe
from pipelines.cli.main import main
from pipelines.cli.parser import join_nested
from pipelines.config import RunConfig

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
HEAVY = ("torch", "ray", "prefect", "mlflow", "transformers", "deepspeed", "peft")


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`main(argv)` in this process: exit code (help and --version exit 0), stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def fake_error(module: str, name: str, base: type[BaseException] = ValueError) -> BaseException:
    """An exception of a stand-in class with the real class's module and name."""
    cls = type(name, (base,), {"__module__": module})
    return cls("stand-in")


def test_version_is_the_installed_distribution_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_main(["--version"], capsys)
    assert code == 0
    assert out.strip() == f"lmpipe {md.version('lmpipe')}"


def test_command_help_lists_the_sections_it_reads_and_how_to_list_their_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_main(["pretrain", "--help"], capsys)
    assert code == 0
    read = " ".join(out.split()).split("config sections read: ")[1]
    assert read.startswith("ingest, decontaminate, tokenizer, encode, examples, train, name")
    assert "lmpipe config --keys SECTION (e.g. lmpipe config --keys train)" in " ".join(out.split())


@pytest.mark.parametrize("command", sorted(COMMAND_SECTIONS))
def test_every_section_a_help_names_is_a_key_of_the_recipe(command: str) -> None:
    for section in COMMAND_SECTIONS[command][0]:
        assert describe(section), section


def test_config_keys_prints_every_key_of_a_section_with_type_default_and_meaning(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_main(["config", "--keys", "train.optim"], capsys)
    assert code == 0
    train = RunConfig.model_fields["train"].annotation
    optim = train.model_fields["optim"].annotation
    for name, field in optim.model_fields.items():
        assert f"train.optim.{name}  " in out
        assert " ".join(field.description.split()[:3]) in " ".join(out.split())
    assert "train.optim.lr  float (> 0)  = 0.001" in out
    assert 'train.optim.decay  one of linear, cosine, constant  = "linear"' in out


def test_config_keys_alone_lists_the_sections_and_a_misspelled_one_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_main(["config", "--keys"], capsys)
    assert code == 0
    top = [line.split()[0] for line in out.splitlines() if not line.startswith(" ")]
    assert top == list(RunConfig.model_fields)
    code, _, err = run_main(["config", "--keys", "train.optimm"], capsys)
    assert code == ExitCode.CONFIG
    assert "did you mean train.optim" in err


def test_keys_follow_lists_and_unions_of_sections() -> None:
    paths = {key.path for key in describe("compare")}
    assert "compare.entries.<i>.strategy.lora.r" in paths
    schedule = [k for k in describe("train.length_schedule") if k.path.endswith(".every")]
    assert schedule
    assert "[AlternateLengths]" in schedule[0].type


def test_examples_inspect_is_a_subcommand_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    assert join_nested(["--debug", "examples", "inspect", "c.yaml"]) == [
        "--debug",
        "examples inspect",
        "c.yaml",
    ]
    assert join_nested(["examples", "c.yaml"]) == ["examples", "c.yaml"]
    code, out, _ = run_main(["examples", "inspect", "--help"], capsys)
    assert code == 0
    assert out.startswith("usage: lmpipe examples inspect [-h] [--count COUNT] config")


def test_a_bad_config_exits_2_with_its_keys_and_a_last_line_cause(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_main(["config", str(DEMO), "train.max_steps=0"], capsys)
    assert code == ExitCode.CONFIG
    assert out == ""
    assert "  train.max_steps = 0: Input should be greater than or equal to 1" in err
    assert err.splitlines()[-1].startswith("lmpipe: config error (exit 2): ConfigError: ")


@pytest.mark.parametrize("command", ["config", "ingest"])
def test_a_refusal_prints_each_line_once(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_main([command, str(DEMO), "train.optimm.lr=1"], capsys)
    assert code == ExitCode.CONFIG
    assert err.splitlines() == [
        "  train.optimm = {'lr': 1}: unknown key (misspelled?); `lmpipe config --keys train` "
        "lists the valid keys",
        f"lmpipe: config error (exit 2): ConfigError: {DEMO}: invalid configuration (1 error(s))",
    ]


def test_a_command_turns_prefect_telemetry_off_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Offline, the temporary Prefect API's heartbeat logged "Failed to send telemetry" (#40).
    monkeypatch.delenv("PREFECT_SERVER_ANALYTICS_ENABLED", raising=False)
    assert run_main(["config", str(DEMO)], capsys)[0] == 0
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "true")
    assert run_main(["config", str(DEMO)], capsys)[0] == 0
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "true"


def test_a_command_freezes_the_collector_at_exit_once_however_often_it_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    registered: list[object] = []

    def unregister(fn: object) -> None:  # as atexit's: every registration of fn, if any
        registered[:] = [f for f in registered if f is not fn]

    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", unregister)
    for _ in range(2):
        assert run_main(["config", str(DEMO)], capsys)[0] == 0
    assert registered == [gc.freeze]


def test_cli_and_config_loading_import_none_of_the_heavy_libraries() -> None:
    # A fresh interpreter: this test process may have imported them for other tests.
    script = (
        "import sys, io, contextlib\n"
        "from pipelines.cli.main import build_parser, main\n"
        "build_parser()\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['config', {str(DEMO)!r}]) == 0\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("module", "name", "code"),
    [
        ("training.runtime.guard", "TrainingDivergedError", ExitCode.DIVERGED),
        ("tasks.ingest.sources", "InputError", ExitCode.INPUT_DATA),
        ("training.pretrain.data", "DataError", ExitCode.INPUT_DATA),
        ("tasks.common.schema", "ObjectiveMismatchError", ExitCode.CONFIG),
        ("pipelines.config", "ConfigError", ExitCode.CONFIG),
        ("somewhere.else", "OSError", ExitCode.FAILURE),
    ],
)
def test_each_failure_class_maps_to_its_exit_code(module: str, name: str, code: ExitCode) -> None:
    assert classify(fake_error(module, name))[0] == code


def test_the_original_error_decides_behind_prefect_and_ray_wrappers() -> None:
    diverged = fake_error("training.runtime.guard", "TrainingDivergedError", RuntimeError)
    # Ray Train: the launcher's RuntimeError from WorkerGroupError, whose worker failure wraps
    # the user's exception (UserExceptionWithTraceback._base_exc).
    carrier = fake_error("ray.train.v2._internal.exceptions", "UserExceptionWithTraceback")
    carrier._base_exc = diverged
    group = fake_error("ray.train.v2.api.exceptions", "WorkerGroupError")
    group.worker_failures = {1: carrier}
    wrapped = RuntimeError("training failed after 2 restart(s)")
    wrapped.__cause__ = group
    assert classify(wrapped) == (ExitCode.DIVERGED, diverged)
    # Ray tasks: RayTaskError(InputError) subclasses the remote exception's class.
    base = type(fake_error("tasks.ingest.sources", "InputError"))
    remote = type("RayTaskError(InputError)", (RuntimeError, base), {"__module__": "ray"})
    assert classify(remote("bad bytes"))[0] == ExitCode.INPUT_DATA
    assert classify(KeyboardInterrupt())[0] == ExitCode.INTERRUPTED
    assert classify(failures.Terminated())[0] == ExitCode.TERMINATED


def send_sigterm_to_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)  # interrupted at once by the handler's exception


def test_sigterm_becomes_exit_143_and_the_handler_is_restored() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(failures.Terminated) as stopped, signals_raise():
        send_sigterm_to_self()
    assert classify(stopped.value)[0] == ExitCode.TERMINATED
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_ctrl_c_that_a_library_turned_into_another_error_still_exits_130(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def crash_on_ctrl_c() -> None:
        crashed = False
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # interrupted at once by the handler's exception
        except KeyboardInterrupt:
            crashed = True
        if crashed:  # what a library may do with a run it saw crash: a new error, no chain
            raise RuntimeError("Crashed")

    # As in a terminal: Python's own SIGINT handler (a shell that started this process in the
    # background had it ignore SIGINT, which the guard leaves so).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    before = len(failures.RECEIVED)
    try:
        with pytest.raises(RuntimeError) as failed, signals_raise():
            crash_on_ctrl_c()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert classify(failed.value)[0] == ExitCode.FAILURE  # the exception alone says otherwise
    code = report_failure(failed.value, False, signal_code=failures.signalled(before))
    assert code == ExitCode.INTERRUPTED
    assert "interrupted" in capsys.readouterr().err
    assert failures.signalled(len(failures.RECEIVED)) is None  # nothing since


def test_a_stage_stopped_by_rays_sigterm_handler_exits_143(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Once Ray starts in the driver, its SIGTERM handler replaces ours with sys.exit(signum).
    import pipelines.cli.main as cli

    def stopped(cfg: RunConfig) -> dict[str, dict[str, str]]:
        sys.exit(signal.SIGTERM)

    monkeypatch.setattr(cli, "_run_ingest", stopped)
    code, _, err = run_main(["ingest", str(DEMO)], capsys)
    assert code == ExitCode.TERMINATED
    assert err.splitlines()[-1] == "lmpipe: terminated (exit 143)"


def test_a_failure_ends_with_one_line_naming_the_class_and_cause(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = fake_error("tasks.ingest.sources", "InputError")
    assert report_failure(error, debug=False) == ExitCode.INPUT_DATA
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "lmpipe: input data error (exit 3): InputError: stand-in [--debug shows the traceback]"
    ]
    try:
        raise error
    except ValueError as raised:
        report_failure(raised, debug=True)
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert err.splitlines()[-1] == "lmpipe: input data error (exit 3): InputError: stand-in"


def _class_exists(qualified: str) -> bool:
    module, _, name = qualified.rpartition(".")
    top = module.partition(".")[0]
    if top == "builtins":
        return hasattr(builtins, name)
    if top == "pydantic_core":
        from pydantic import ValidationError

        return f"{ValidationError.__module__}.{ValidationError.__qualname__}" == qualified
    if top in ("pipelines", "tasks", "training"):
        path = REPO / Path(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    else:  # read the installed source: importing prefect here would cost seconds
        spec = importlib.util.find_spec(top)
        assert spec is not None
        assert spec.origin is not None
        path = Path(spec.origin).parent / Path(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body)


def test_every_mapped_exception_class_exists() -> None:
    missing = [c for names in failures.CLASSES.values() for c in names if not _class_exists(c)]
    assert missing == []


@pytest.mark.slow
@pytest.mark.integration
def test_lmpipe_ingest_on_a_corrupt_file_exits_3_through_the_prefect_flow(
    tmp_path: Path, prefect_api: str, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "corpus.parquet"
    bad.write_bytes(b"not a parquet file")
    recipe = tmp_path / "recipe.yaml"
    body = {"workspace": str(tmp_path / "ws"), "ingest": {"sources": [{"path": str(bad)}]}}
    recipe.write_text(yaml.safe_dump(body))
    args = ["ingest", str(recipe), "prefect.retries=0", "tracking.enabled=false"]
    code, _, err = run_main(args, capsys)
    assert code == ExitCode.INPUT_DATA, err[-3000:]
    last = err.splitlines()[-1]
    assert last.startswith("lmpipe: input data error (exit 3): InputError: input file ")
    assert "cannot be read as parquet" in last


@pytest.mark.slow
def test_the_default_schedules_built_unvalidated_are_valid() -> None:
    # DeploymentsConfig builds its default schedules with model_construct (validating a cron
    # expression imports Prefect); here they go through the validator.
    from pipelines.config.deployments import DeploymentsConfig, ScheduleConfig

    for schedule in DeploymentsConfig().schedules:
        dumped = json.loads(schedule.model_dump_json())
        assert ScheduleConfig.model_validate(dumped) == schedule


def test_a_sigint_ignored_from_the_start_stays_ignored_under_the_guard() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `nohup` or `cmd &` leave it
    try:
        with signals_raise():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
