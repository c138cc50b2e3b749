"""Deployments: built from a recipe, registered with schedules and a validated schema, served."""

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
import yaml
from pydantic import ValidationError
from serving import stop_group, wait_for_deployment

from pipelines.config import RunConfig, load_config
from pipelines.config.deployments import FAILED_EVENTS, FLOWS, DeploymentsConfig, ScheduleConfig
from pipelines.ops.deployments import (
    build_deployments,
    ensure_failure_automation,
    recipe_parameters,
)

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.yaml"


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recipes and prefect.yaml hold paths relative to the repository root."""
    monkeypatch.chdir(REPO)


def test_schedule_needs_exactly_one_of_cron_and_interval() -> None:
    with pytest.raises(ValidationError, match="exactly one of cron, interval_seconds"):
        ScheduleConfig(flow="ingest", name="both", cron="0 2 * * *", interval_seconds=60)
    with pytest.raises(ValidationError, match="exactly one of cron, interval_seconds"):
        ScheduleConfig(flow="ingest", name="neither")


def test_schedule_refuses_a_bad_cron_or_timezone_by_name() -> None:
    with pytest.raises(ValidationError, match="'nightly': cron '0 25 \\* \\* \\*'"):
        ScheduleConfig(flow="ingest", name="nightly", cron="0 25 * * *")
    with pytest.raises(ValidationError, match="timezone 'Mars/Olympus' is not an IANA name"):
        ScheduleConfig(flow="ingest", name="nightly", cron="0 2 * * *", timezone="Mars/Olympus")


def test_a_schedule_must_belong_to_a_deployed_flow() -> None:
    with pytest.raises(ValidationError, match="flow 'pretrain' is not in `flows`"):
        DeploymentsConfig(flows=["ingest", "encode"])  # the weekly pretraining has no flow


def test_default_schedules_are_nightly_encode_and_weekly_pretrain() -> None:
    schedules = {s.name: s for s in DeploymentsConfig().schedules}
    assert schedules["nightly-ingest-encode"].flow == "encode"
    assert schedules["nightly-ingest-encode"].cron == "0 2 * * *"
    assert schedules["nightly-ingest-encode"].overrides == {"ingest.incremental": True}
    assert (schedules["weekly-pretrain"].flow, schedules["weekly-pretrain"].cron) == (
        "pretrain",
        "0 3 * * 0",
    )
    assert all(s.timezone == "UTC" for s in schedules.values())


def test_recipe_parameters_round_trip_and_leave_secrets_out(in_repo: None) -> None:
    cfg = load_config(DEMO, ["tracking.password=hunter2", "prefect.api_key=pk-secret"])
    params = recipe_parameters(cfg)
    assert "hunter2" not in str(params)
    assert "pk-secret" not in str(params)
    assert "password" not in params["tracking"]
    assert "dataset" not in params["task"]  # loaded from task.config, not written in the recipe
    assert RunConfig.model_validate(params) == load_config(DEMO)


def _prefect_yaml() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((REPO / "prefect.yaml").read_text())
    return data


@pytest.mark.slow
def test_prefect_yaml_entrypoints_are_the_flows_and_parameters_are_the_demo_recipe(
    in_repo: None,
) -> None:
    from prefect.flows import load_flow_from_entrypoint

    deployments = _prefect_yaml()["deployments"]
    names = {d["entrypoint"].split(":")[1].removesuffix("_flow") for d in deployments}
    assert names == set(FLOWS)
    demo = load_config(DEMO)
    for deployment in deployments:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
        assert flow.name == deployment["entrypoint"].split(":")[1].removesuffix("_flow")
        assert deployment["work_pool"]["name"] == "lmpipe-process"
        assert "lmpipe" in deployment["tags"]
        cfg = RunConfig.model_validate(deployment["parameters"]["cfg"])
        assert cfg == demo, "prefect.yaml's cfg differs from configs/demo.yaml: update it"
        for schedule in deployment["schedules"]:
            if "parameters" in schedule:
                RunConfig.model_validate(schedule["parameters"]["cfg"])


def test_prefect_yaml_schedules_nightly_incremental_encode_and_weekly_pretrain() -> None:
    data = _prefect_yaml()
    assert data["pull"][0]["prefect.deployments.steps.set_working_directory"]
    by_flow = {d["entrypoint"].split(":")[1]: d for d in data["deployments"]}
    nightly = by_flow["encode_flow"]["schedules"][0]
    assert (nightly["cron"], nightly["timezone"]) == ("0 2 * * *", "UTC")
    assert nightly["parameters"]["cfg"]["ingest"]["incremental"] is True
    assert nightly["parameters"]["cfg"]["ingest"]["sources"]  # the merge kept the rest
    assert by_flow["pretrain_flow"]["schedules"][0]["cron"] == "0 3 * * 0"
    assert by_flow["pipeline_flow"]["schedules"] == []


@pytest.fixture
def registered(prefect_api: str, in_repo: None) -> Iterator[list[Any]]:
    """The demo recipe's deployments, registered with the session's Prefect API; then deleted."""
    from prefect.client.orchestration import get_client

    deployments = build_deployments(DEMO, [], DeploymentsConfig())
    ids = [d.apply() for d in deployments]
    yield deployments
    with get_client(sync_client=True) as client:
        for deployment_id in ids:
            client.delete_deployment(deployment_id)


@pytest.mark.slow
@pytest.mark.integration
def test_deployments_have_schedules_and_a_schema_the_server_enforces(
    registered: list[Any],
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    with get_client(sync_client=True) as client:
        found = {f: client.read_deployment_by_name(f"{f}/demo") for f in FLOWS}
        assert all("lmpipe" in d.tags for d in found.values())
        (nightly,) = found["encode"].schedules
        assert (nightly.schedule.cron, nightly.schedule.timezone) == ("0 2 * * *", "UTC")
        assert nightly.active
        assert nightly.parameters["cfg"]["ingest"]["incremental"] is True
        assert found["pretrain"].schedules[0].schedule.cron == "0 3 * * 0"
        assert found["pipeline"].schedules == []
        schema = found["pipeline"].parameter_openapi_schema
        run_config = schema["definitions"]["RunConfig"]["properties"]
        assert set(RunConfig.model_fields) <= set(run_config)
        assert run_config["seed"]["description"].startswith("Run seed")
        assert run_config["seed"]["minimum"] == 0
        bad = {"cfg": {**found["ingest"].parameters["cfg"], "seed": -1}}
        with pytest.raises(PrefectHTTPStatusError, match="409") as refused:
            client.create_flow_run_from_deployment(found["ingest"].id, parameters=bad)
        assert "cfg.seed" in refused.value.response.text


@pytest.fixture
def webhook() -> Iterator[tuple[str, list[bytes]]]:
    """A local HTTP endpoint that records the bodies POSTed to it; yields its URL and them."""
    received: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received.append(self.rfile.read(int(self.headers.get("content-length", 0))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)  # port 0: a free one
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/hook", received
    server.shutdown()
    server.server_close()


def covered_failures(trigger: Any, run_ids: list[UUID], timeout_s: float = 30) -> dict[UUID, bool]:
    """Whether the server's trigger covers each run's stored Failed event (waits until stored)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
    from prefect.server.events.schemas.automations import EventTrigger
    from prefect.server.events.schemas.events import ReceivedEvent

    ids = {f"prefect.flow-run.{run_id}": run_id for run_id in run_ids}
    wanted = EventFilter(
        event=EventNameFilter(name=["prefect.flow-run.Failed"]),
        resource=EventResourceFilter(id=list(ids)),
    )
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:  # events are stored asynchronously: poll until each run's is there
            page = client.read_events(wanted, limit=50)  # the server's maximum page
            stored = {event.resource.id: event for event in page.events}
            if len(stored) == len(ids) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    server_trigger = EventTrigger.model_validate(trigger.model_dump())
    return {
        ids[resource_id]: server_trigger.covers(ReceivedEvent.model_validate(event.model_dump()))
        for resource_id, event in stored.items()
    }


@pytest.mark.slow
@pytest.mark.integration
def test_failure_automation_notifies_once_per_failed_lmpipe_run(
    prefect_api: str, webhook: tuple[str, list[bytes]]
) -> None:
    from prefect import flow, tags
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    url, received = webhook
    block = CustomWebhookNotificationBlock(name="lmpipe", url=url, json_data={"text": "{{body}}"})
    block_id = block.save("lmpipe-test-alerts", overwrite=True)
    first = ensure_failure_automation("custom-webhook/lmpipe-test-alerts")
    assert ensure_failure_automation("custom-webhook/lmpipe-test-alerts").id == first.id

    @flow(name="lmpipe-test-failing")
    def failing() -> None:
        raise RuntimeError("disk full")

    untagged_id = failing(return_state=True).state_details.flow_run_id  # no notification
    with tags("lmpipe"):
        state = failing(return_state=True)
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        time.sleep(0.2)
    with get_client(sync_client=True) as client:
        (automation,) = client.read_automations_by_name(first.name)
        tagged = client.read_flow_run(state.state_details.flow_run_id)
        # No waiting for a notification that should never come: ask the server's own trigger
        # whether it fires for each run's recorded Failed event.
        covered = covered_failures(automation.trigger, [untagged_id, tagged.id])
        client.delete_automation(automation.id)
        client.delete_block_document(block_id)
    assert covered == {untagged_id: False, tagged.id: True}
    assert automation.trigger.expect == set(FAILED_EVENTS)
    assert automation.trigger.match_related["prefect.resource.id"] == ["prefect.tag.lmpipe"]
    assert automation.actions[0].block_document_id == block_id
    assert len(received) == 1
    assert f"lmpipe-test-failing/{tagged.name} entered Failed" in received[0].decode()
    assert "disk full" in received[0].decode()
    with pytest.raises(ValueError, match="notification block 'custom-webhook/missing'"):
        ensure_failure_automation("custom-webhook/missing")


@pytest.mark.slow
@pytest.mark.integration
def test_lmpipe_serve_runs_a_triggered_deployment_and_leaves_it_scheduled(
    tmp_path: Path, prefect_api: str, ray_session: str
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from tasks.demo.synthetic import SyntheticConfig, write_corpus

    write_corpus(tmp_path / "demo", SyntheticConfig(documents=200, parts=1, task_examples=10))
    recipe = tmp_path / "recipe.yaml"
    source = {"path": str(tmp_path / "demo" / "corpus"), "format": "jsonl"}
    recipe.write_text(
        yaml.safe_dump(
            {
                "name": "served",
                "workspace": str(tmp_path / "ws"),
                "ray": {"address": ray_session, "num_workers": 1},
                "tracking": {"enabled": False},
                "ingest": {"sources": [source]},
            }
        )
    )
    log = tmp_path / "serve.log"
    # The runner polls for runs every 10 s by default; a second keeps the test short.
    env = os.environ | {"PREFECT_API_URL": prefect_api, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "pipelines.cli.main", "serve", str(recipe)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: we stop exactly it
        )
    try:
        deployment = wait_for_deployment("ingest/served", process, log)
        run = run_deployment("ingest/served", timeout=240, poll_interval=1)
        assert run.state is not None
        assert run.state.is_completed(), f"{run.state}:\n{log.read_text()[-3000:]}"
        assert list((tmp_path / "ws" / "ingest").glob("*/manifest.json"))
    finally:
        stop_group(process)
    with get_client(sync_client=True) as client:
        after = client.read_deployment_by_name("encode/served")
        assert not after.paused  # pause_on_shutdown is off: the nightly schedule stays on
        assert after.schedules[0].active
        for flow in FLOWS:
            client.delete_deployment(client.read_deployment_by_name(f"{flow}/served").id)
    assert deployment.entrypoint == "pipelines.flows.ingest_flow.ingest_flow"
