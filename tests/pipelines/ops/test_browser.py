"""The Prefect and MLflow UIs in headless Chromium: a deployment, its run, a registered model.

The browser acceptance test. A command runs first with nothing configured, as after
`make demo` (`lmpipe ingest`: its flow run goes to the workspace's own Prefect home, through a
temporary API), and a tiny model with an alias is registered in the workspace's own
`mlflow.db`. Then the test starts `lmpipe up`'s servers of that workspace (`start_servers`) on
free loopback ports, serves the ingest deployment with a nightly schedule from an
`lmpipe serve` subprocess, triggers a run through the API, and reads the pages a user would
open: the earlier command's flow run and registered model are there. Every page is saved as
a screenshot under `test-artifacts/browser/` (plus its text when a check fails).

Needs Debian's `chromium` and `chromium-driver` and the `selenium` package: the test skips
without them, except under CI (`CI=true`), where it fails instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from serving import stop_group, wait_for_deployment

from pipelines.config.servers import ServersConfig
from pipelines.ops.server_processes import ServerState
from pipelines.ops.servers import start_servers, stop_servers

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.yaml"
ARTIFACTS = REPO / "test-artifacts" / "browser"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROME_ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    # No internet here: without these Chromium keeps dialling out and logging refusals.
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1400,1000",
    "--lang=en-US",  # the UIs' wording (cron descriptions, dates) is locale-dependent
)
RECIPE = "browser-demo"  # the recipe's name, hence the deployment's: ingest/browser-demo
CRON = "0 2 * * *"
MODEL = "browser-demo-bert"
ALIAS = "champion"
PAGE_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 180.0


@pytest.fixture(scope="session")
def chromium() -> Path:
    """The chromedriver path; skip (fail under CI=true) when Chromium or Selenium is missing.

    Session-scoped so that it is checked before the session fixtures this test also uses
    (Ray, the tiny models) are started for nothing.
    """
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if importlib.util.find_spec("selenium") is None:
        missing.append("the selenium package (pip install selenium)")
    if missing:
        reason = (
            f"browser test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true: {reason}")
        pytest.skip(reason)
    return CHROMEDRIVER


@pytest.fixture
def browser(chromium: Path, tmp_path: Path) -> Iterator[WebDriver]:
    """Headless Chromium with an empty profile under tmp_path, in UTC; quit afterwards."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in CHROME_ARGS:
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    # The UIs show times in the browser's zone: UTC makes "02:00 AM" the cron's own hour.
    service = Service(str(chromium), env={**os.environ, "TZ": "UTC"})
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()  # stops the browser and the chromedriver this fixture started


def _free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all sockets are held open until every port is picked)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@dataclass(frozen=True)
class LocalRun:
    """What a command run before `lmpipe up` left in the workspace's own stores."""

    flow_run: str  # the name Prefect gave its flow run
    version: str  # the model version registered in the workspace's mlflow.db


def _local_run(tmp_path: Path, ray_address: str, base_dir: Path) -> LocalRun:
    """Run `lmpipe ingest` with nothing configured, and register a model in the workspace store.

    The command gets no Prefect API and no tracking URI, as after `make demo`: it records its
    flow run in `<workspace>/.prefect` through a temporary API and its MLflow run in
    `<workspace>/mlflow.db`, which is where `lmpipe up` must then serve them from.
    """
    from tasks.demo.synthetic import SyntheticConfig, write_corpus
    from training.tracking.local_store import local_store_uri

    write_corpus(tmp_path / "demo", SyntheticConfig(documents=60, parts=1, task_examples=10))
    unset = ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI")
    env = {k: v for k, v in os.environ.items() if k not in unset} | {"RAY_AUTH_MODE": "token"}
    overrides = [
        f"name={RECIPE}",
        f"workspace={tmp_path / 'ws'}",
        f"ingest.sources.0.path={tmp_path / 'demo' / 'corpus'}",
        f"ray.address={ray_address}",
        "ray.num_workers=1",
    ]
    command = [sys.executable, "-m", "pipelines.cli.main", "ingest", str(DEMO), *overrides]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    names = re.findall(r"Beginning flow run '([^']+)'", output)
    assert names, output[-4000:]
    version = _register_model(base_dir, tmp_path, local_store_uri(tmp_path / "ws"))
    return LocalRun(names[0], version)


@pytest.fixture
def servers(
    tmp_path: Path,
    ray_session: str,
    tiny_base_models: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[dict[str, ServerState], LocalRun]]:
    """A local run in a new workspace, then `lmpipe up`'s servers of that workspace.

    The servers are this test's own, stopped (exactly these) afterwards.
    """
    local = _local_run(tmp_path, ray_session, tiny_base_models["bert"])
    # As for the command before it, nothing names a Prefect home: `up` serves the workspace's
    # (this session's own Prefect harness sets one in the environment).
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    prefect_port, mlflow_port = _free_ports(2)
    cfg = ServersConfig(
        prefect_port=prefect_port, mlflow_port=mlflow_port, state_dir=tmp_path / "servers"
    )
    try:
        started = start_servers(cfg, tmp_path / "ws")
        yield {name: status.state for name, status in started.items()}, local
    finally:
        stop_servers(cfg, tmp_path / "ws")


def _ui_api_url(prefect: ServerState) -> str:
    """The API address the Prefect UI served by `prefect` calls (from its `/ui-settings`)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{prefect.url}/ui-settings", timeout=10) as response:
        return str(json.load(response)["api_url"])


def _serve(tmp_path: Path, overrides: list[str], prefect_api: str) -> subprocess.Popen[bytes]:
    """Start `lmpipe serve` on the demo recipe in its own process group, logging to serve.log."""
    env = {
        **os.environ,  # a copy: this process's environment is left as it is
        "PREFECT_API_URL": prefect_api,
        "PREFECT_HOME": str(tmp_path / "prefect-home"),
        "PREFECT_RUNNER_POLL_FREQUENCY": "1",  # default 10 s: the triggered run starts sooner
        "RAY_AUTH_MODE": "token",
    }
    with open(tmp_path / "serve.log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli.main", "serve", str(DEMO), *overrides],
            cwd=REPO,  # the recipe's relative paths (task.config) start at the repository root
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _serve_log(tmp_path: Path) -> str:
    return (tmp_path / "serve.log").read_text(errors="replace")[-4000:]


def _wait_for_finished_run(flow_run_id: Any, tmp_path: Path) -> Any:
    """Wait until the flow run is final and its last log line reached the API; return the run.

    The flow-run process sends its logs in batches; "Finished in state ..." is the last one.
    Waiting for it keeps the page check deterministic and lets the process exit on its own
    before `serve` is stopped (a SIGTERM to the group would drop unsent logs).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    logs = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    with get_client(sync_client=True) as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            final = run.state is not None and run.state.is_final()
            if final and any(
                log.message.startswith("Finished in state") and log.task_run_id is None
                for log in client.read_logs(log_filter=logs)
            ):
                return run
            time.sleep(1)
    raise AssertionError(f"flow run {flow_run_id} not finished:\n{_serve_log(tmp_path)}")


def _register_model(base_dir: Path, tmp_path: Path, tracking_uri: str) -> str:
    """Export the tiny BERT with a card and register it the lmpipe way; return the version."""
    from mlflow import MlflowClient

    from training.models.export import AUTO_CLASSES, DataRef, ModelCard, TokenizerRef, export_model
    from training.tracking.registry import Registration, register_export

    model = AUTO_CLASSES["bert"].from_pretrained(base_dir, local_files_only=True)
    card = ModelCard(
        family="bert",
        size="tiny",
        parameters=model.num_parameters(),
        objective="mlm+nsp",
        steps=0,
        tokens_seen=0,
        data=DataRef(path="tests/pipelines/ops/test_browser.py", fingerprint="browser"),
        tokenizer=TokenizerRef(fingerprint="browser", family="wordpiece", vocab_size=300),
        git_commit="browser-test",
    )
    hf_dir = export_model(model, base_dir, tmp_path / "export", card)
    client = MlflowClient(tracking_uri)
    # The artifacts go where lmpipe's own runs put them: the workspace's `mlartifacts/`, which
    # `lmpipe up` serves (MLflow's default, `./mlruns`, would be the current directory).
    artifacts = (tmp_path / "ws" / "mlartifacts").as_uri()
    experiment = client.create_experiment("browser-test", artifact_location=artifacts)
    run = client.create_run(experiment, run_name="browser-export")
    registration = Registration(MODEL, ALIAS, {"git_commit": "browser-test"})
    ref = register_export(hf_dir, "bert", tracking_uri, run.info.run_id, registration)
    client.set_terminated(run.info.run_id)
    return ref.version


def _body_text(driver: WebDriver) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.TAG_NAME, "body").text)


def _check_page(
    driver: WebDriver, page: str, url: str, expected: list[str | re.Pattern[str]]
) -> str:
    """Open `url`, wait until its text shows everything `expected`, save a screenshot as `page`.

    The single-page apps render after load and fetch their data afterwards, so the check
    polls the rendered text. On a timeout the page text is saved beside the screenshot.
    """
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
        TimeoutException,
    )
    from selenium.webdriver.support.ui import WebDriverWait

    def missing(text: str) -> list[str]:
        return [
            str(e.pattern if isinstance(e, re.Pattern) else e)
            for e in expected
            if not (e.search(text) if isinstance(e, re.Pattern) else e in text)
        ]

    driver.get(url)
    wait = WebDriverWait(
        driver,
        PAGE_TIMEOUT_S,
        poll_frequency=0.5,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    )
    try:
        wait.until(lambda d: not missing(_body_text(d)))
    except TimeoutException:
        text = _body_text(driver)
        driver.save_screenshot(str(ARTIFACTS / f"{page}.png"))
        (ARTIFACTS / f"{page}.txt").write_text(f"{driver.current_url}\n\n{text}\n")
        raise AssertionError(
            f"{page} ({url}) does not show {missing(text)} after {PAGE_TIMEOUT_S:g} s; "
            f"screenshot and text in {ARTIFACTS}; text:\n{text[:3000]}"
        ) from None
    time.sleep(0.25)  # let late images and fonts settle before the screenshot
    assert driver.save_screenshot(str(ARTIFACTS / f"{page}.png")), f"no screenshot of {page}"
    return _body_text(driver)


def _check_mlflow_pages(browser: WebDriver, mlflow: ServerState, version: str) -> None:
    """The registered model's page and its version's page show the version and its alias."""
    model_url = f"{mlflow.url}/#/models/{MODEL}"
    _check_page(browser, "mlflow-model", model_url, [MODEL, f"Version {version}", f"@ {ALIAS}"])
    _check_page(
        browser,
        "mlflow-model-version",
        f"{model_url}/versions/{version}",
        [MODEL, f"Version {version}", re.compile(rf"Aliases\s*:?\s*@ {ALIAS}")],
    )


def _check_prefect_pages(
    browser: WebDriver, prefect: ServerState, deployment: Any, run: Any, local: LocalRun
) -> None:
    """The deployments list, the deployment, its flow run and the runs list, as a user sees them.

    The runs list shows the run of the command run before `lmpipe up` too.
    """
    pages = {
        # The list words the cron; the deployment's page names the schedule and its next run.
        "prefect-deployments": (
            "/deployments",
            [RECIPE, "ingest", "lmpipe", "stage:ingest", "At 02:00 AM every day"],
        ),
        "prefect-deployment": (
            f"/deployments/deployment/{deployment.id}",
            [RECIPE, "nightly-ingest", re.compile(r"Scheduled for \S+ 02:00:00 AM"), run.name],
        ),
        "prefect-flow-run": (
            f"/runs/flow-run/{run.id}",
            [run.name, "Completed", RECIPE, "Finished in state Completed()"],
        ),
        "prefect-runs": ("/runs", [run.name, local.flow_run, "Completed", RECIPE]),
    }
    for page, (path, expected) in pages.items():
        text = _check_page(browser, page, f"{prefect.url}{path}", expected)
        assert "Can't connect to Server API" not in text, f"{page}: {text[:2000]}"


@pytest.mark.slow
@pytest.mark.integration
def test_prefect_and_mlflow_uis_show_the_deployment_its_run_and_the_registered_model(
    chromium: Path,
    ray_session: str,
    browser: WebDriver,
    servers: tuple[dict[str, ServerState], LocalRun],
    tmp_path: Path,
) -> None:
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    shutil.rmtree(ARTIFACTS, ignore_errors=True)  # only this run's pages
    ARTIFACTS.mkdir(parents=True)
    (prefect, mlflow), local = (servers[0]["prefect"], servers[0]["mlflow"]), servers[1]
    # On a port other than the default 4200 the UI must still call its own server.
    assert _ui_api_url(prefect) == prefect.api_url, (
        f"the Prefect UI at {prefect.url} calls {_ui_api_url(prefect)}, not its own server's "
        f"API {prefect.api_url}: pipelines/ops/servers.py must give the server its port "
        "(PREFECT_SERVER_API_PORT/HOST) or PREFECT_UI_API_URL"
    )
    schedule = {"flow": "ingest", "name": "nightly-ingest", "cron": CRON}
    overrides = [
        f"name={RECIPE}",
        f"workspace={tmp_path / 'ws'}",
        f"ingest.sources.0.path={tmp_path / 'demo' / 'corpus'}",
        f"ray.address={ray_session}",
        "ray.num_workers=1",
        f"tracking.tracking_uri={mlflow.api_url}",
        "deployments.flows=[ingest]",
        f"deployments.schedules={json.dumps([schedule])}",  # JSON is YAML
    ]
    process = _serve(tmp_path, overrides, prefect.api_url)
    try:
        # The model the local run registered, served from the workspace's own store.
        _check_mlflow_pages(browser, mlflow, local.version)  # while `lmpipe serve` starts
        with temporary_settings(updates={PREFECT_API_URL: prefect.api_url}):
            deployment = wait_for_deployment(f"ingest/{RECIPE}", process, tmp_path / "serve.log")
            triggered = run_deployment(f"ingest/{RECIPE}", timeout=0)  # 0: return at once
            assert isinstance(triggered, FlowRun)  # the sync variant, outside an event loop
            run = _wait_for_finished_run(triggered.id, tmp_path)
        assert run.state.is_completed(), f"{run.state}:\n{_serve_log(tmp_path)}"
        _check_prefect_pages(browser, prefect, deployment, run, local)
    finally:
        stop_group(process)
    assert sorted(p.name for p in ARTIFACTS.iterdir()) == sorted(
        f"{page}.png"
        for page in (
            "mlflow-model",
            "mlflow-model-version",
            "prefect-deployments",
            "prefect-deployment",
            "prefect-flow-run",
            "prefect-runs",
        )
    )
