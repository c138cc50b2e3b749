"""Every lmpipe flow is a `RecipeFlow`: Prefect's flow, recording its parameters without FastAPI."""

from __future__ import annotations

import ast
import logging
import threading
import time
from pathlib import Path

import pytest
from prefect import Flow

from pipelines.config import RunConfig, load_config
from pipelines.config.deployments import FLOWS
from pipelines.flows.recipe_flow import RecipeFlow

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_every_deployable_flow_is_declared_a_recipe_flow(name: str) -> None:
    # Read from the source: importing every flow would import torch (compare, finetune).
    module, attr = FLOWS[name]
    tree = ast.parse((REPO / (module.replace(".", "/") + ".py")).read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == attr]
    assert [ast.unparse(d) for d in fn.decorator_list] == [f"recipe_flow(name={name!r})"]


def test_recipe_flow_makes_a_prefect_flow_of_that_name() -> None:
    from pipelines.flows.ingest_flow import ingest_flow

    assert isinstance(ingest_flow, RecipeFlow)
    assert isinstance(ingest_flow, Flow)
    assert ingest_flow.name == "ingest"


def test_recorded_parameters_are_what_prefect_records_without_its_encoder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipelines.flows.pretrain_flow import pretrain_flow

    cfg = load_config(
        REPO / "configs" / "demo.yaml",
        [f"workspace={tmp_path}", "prefect.api_key=canary-key", "tracking.password=canary-pw"],
    )
    parameters = {"cfg": cfg, "resume": True}
    expected = Flow.serialize_parameters(pretrain_flow, parameters)

    def no_encoder(self: Flow[..., object], values: dict[str, object]) -> dict[str, object]:
        raise AssertionError(f"Prefect's encoder called for {sorted(values)}")

    monkeypatch.setattr(Flow, "serialize_parameters", no_encoder)
    recorded = pretrain_flow.serialize_parameters(parameters)
    assert recorded == expected
    assert list(recorded) == ["cfg", "resume"]
    assert "canary" not in str(recorded)  # secrets masked, as Prefect masks them


def test_the_parameter_schema_is_built_on_first_use_as_prefect_builds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import prefect.flows
    import prefect.utilities.callables as callables

    def run(cfg: RunConfig) -> None:
        """Run nothing.

        Args:
            cfg: The run's recipe.
        """

    built: list[object] = []
    generate = callables.generate_parameter_schema
    monkeypatch.setattr(
        callables, "generate_parameter_schema", lambda *a: built.append(a) or generate(*a)
    )
    flow = RecipeFlow(run, name="lazy")
    assert built == []  # nothing built when the flow is defined
    schema = flow.parameters.model_dump()
    assert flow.parameters.model_dump() == schema
    assert len(built) == 1  # on first use, once
    assert schema == Flow(run, name="eager").parameters.model_dump()
    assert schema["properties"]["cfg"]["description"] == "The run's recipe."
    assert "RunConfig" in schema["definitions"]
    assert prefect.flows.parameter_schema is callables.parameter_schema  # restored


class _Engine:
    """What Prefect's heartbeat thread reads of a flow run engine: no flow run, so no event."""

    heartbeat_seconds = 30
    flow_run = None
    logger = logging.getLogger("test-heartbeats")

    def __init__(self, flow: Flow[..., object]) -> None:
        self.flow = flow
        self.beats = 0

    def _build_heartbeat_event_template(self) -> tuple[dict[str, str], list[object]]:
        return {}, []

    def _emit_flow_run_heartbeat(self, *_: object) -> None:
        self.beats += 1


def _stopped_after_s(engine: _Engine) -> tuple[float, list[threading.Thread]]:
    """Seconds the heartbeats took to stop, and the heartbeat threads they started."""
    import prefect.flow_engine

    before = set(threading.enumerate())
    with prefect.flow_engine._send_heartbeats(engine):
        deadline = time.monotonic() + 10
        while not engine.beats and time.monotonic() < deadline:  # its first beat, then a sleep
            time.sleep(0.01)
        # Prefect runs the heartbeat loop through `Context.run`, which names the thread.
        started = [t for t in threading.enumerate() if t not in before and t.name.endswith("(run)")]
        stop = time.perf_counter()
    return time.perf_counter() - stop, started


@pytest.mark.slow  # a heartbeat thread sleeps in steps of 1 s
def test_a_recipe_flow_run_does_not_wait_for_its_heartbeat_thread_to_stop() -> None:
    def run() -> None:
        pass

    # The thread beats at once, then sleeps in steps of 1 s: Prefect's own flow waits for the
    # step to end, a recipe flow does not.
    recipe, plain = _Engine(RecipeFlow(run, name="recipe")), _Engine(Flow(run, name="plain"))
    recipe_s, recipe_threads = _stopped_after_s(recipe)
    plain_s, _ = _stopped_after_s(plain)
    assert recipe_s < 0.5 < plain_s
    assert recipe.beats == plain.beats == 1
    assert len(recipe_threads) == 1  # the heartbeat thread, still sleeping
    # Only the threads this run started are followed: others of the session come and go.
    recipe_threads[0].join(timeout=1.5)  # it stops at its next step, beating no more
    assert not recipe_threads[0].is_alive()
    assert recipe.beats == 1
