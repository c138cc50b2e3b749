"""The Prefect home and API a command settles before importing Prefect; `lmpipe up` on them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipelines.config import load_config
from pipelines.ops.prefect_api import prefect_home, seed_prefect_home
from pipelines.ops.servers import start_servers, stop_servers
from training.tracking.local_store import local_store_uri, seed_local_store

REPO = Path(__file__).resolve().parents[3]

# In a fresh interpreter: settle Prefect as the CLI does, then run a tiny flow of ours.
_TINY_RUN = """
import os, sys
from pipelines.config import load_config
from pipelines.ops.prefect_api import open_prefect_api
url = open_prefect_api(load_config(sys.argv[1], []))
from pipelines.flows.recipe_flow import recipe_flow
from prefect.settings import PREFECT_HOME

@recipe_flow(name="tiny")
def tiny(x: int) -> int:
    return x + 1

assert tiny(1) == 2
print(f"home={PREFECT_HOME.value()} url={url}")  # a temporary API: no server was up
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fresh_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.pop("PREFECT_HOME", None)
    return env | {"LMPIPE_CACHE_DIR": str(cache), **extra}


def _call(url: str, body: dict[str, object] | None = None) -> object:
    """GET `url`, or POST `body` to it as JSON; the JSON answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with opener.open(request, timeout=30) as response:
        return json.loads(response.read())


def _tiny_run(recipe: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    """`_TINY_RUN` on `recipe` in a fresh interpreter with no API configured; it must pass."""
    done = subprocess.run(
        [sys.executable, "-c", _TINY_RUN, str(recipe)],
        cwd=REPO,
        env=_fresh_env(cache),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _recipe(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"name": "t", "workspace": str(tmp_path / "ws"), **extra}))
    return path


def test_the_prefect_home_defaults_to_the_workspace_unless_set(tmp_path: Path) -> None:
    recipe = _recipe(tmp_path)
    script = (
        "import sys; from pipelines.config import load_config; "
        "from pipelines.ops.prefect_api import open_prefect_api; "
        "print(open_prefect_api(load_config(sys.argv[1], []))); "
        "from prefect.settings import PREFECT_HOME; print(PREFECT_HOME.value())"
    )
    # No temporary API here: the environment forbids one, so only the home is settled.
    env = _fresh_env(tmp_path / "cache", PREFECT_SERVER_ALLOW_EPHEMERAL_MODE="false")
    cases = [(None, tmp_path / "ws" / ".prefect"), ("/elsewhere", Path("/elsewhere"))]
    for home, expected in cases:
        done = subprocess.run(
            [sys.executable, "-c", script, str(recipe)],
            cwd=REPO,
            env=env | ({"PREFECT_HOME": home} if home else {}),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.split() == ["None", str(expected)]


def test_a_new_home_is_seeded_from_the_template_and_an_old_one_kept(tmp_path: Path) -> None:
    templates = tmp_path / "cache"
    assert not seed_prefect_home(tmp_path / "a", templates)  # no template yet: Prefect migrates
    assert not (tmp_path / "a" / "prefect.db").exists()
    templates.mkdir()
    from importlib.metadata import version

    template = templates / f"prefect-{version('prefect')}.db"
    template.write_bytes(b"db")
    template.with_suffix(".memo.toml").write_text("memo")
    assert seed_prefect_home(tmp_path / "a", templates)
    assert (tmp_path / "a" / "prefect.db").read_bytes() == b"db"
    assert (tmp_path / "a" / "memo_store.toml").read_text() == "memo"
    template.write_bytes(b"newer")
    assert seed_prefect_home(tmp_path / "a", templates)  # has one: kept as it is
    assert (tmp_path / "a" / "prefect.db").read_bytes() == b"db"


@pytest.mark.slow
@pytest.mark.integration
def test_up_serves_the_flow_runs_and_models_the_workspace_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with no API configured, then `lmpipe up`: both servers show what it recorded."""
    ports = {"prefect_port": _free_port(), "mlflow_port": _free_port()}
    recipe = _recipe(tmp_path, servers=ports)
    cache, workspace = tmp_path / "cache", tmp_path / "ws"
    done = _tiny_run(recipe, cache)
    assert f"home={workspace / '.prefect'} url=http://127.0.0.1:" in done.stdout
    assert list(cache.glob("prefect-*.db")), "the first new home saves the template"
    from mlflow.tracking import MlflowClient

    seed_local_store(workspace, cache)
    client = MlflowClient(local_store_uri(workspace))
    run = client.create_run(client.create_experiment("lmpipe"), run_name="t-tiny")
    client.set_terminated(run.info.run_id)
    client.create_registered_model("t-model")
    client.create_model_version("t-model", f"runs:/{run.info.run_id}/m", run.info.run_id)

    monkeypatch.delenv("PREFECT_HOME")  # as a user's shell: the workspace's home
    monkeypatch.setenv("LMPIPE_CACHE_DIR", str(cache))
    cfg = load_config(recipe, [])
    assert prefect_home(workspace) == workspace / ".prefect"
    try:
        states = start_servers(cfg.servers, workspace)
        prefect, mlflow = (states[name].state for name in ("prefect", "mlflow"))
        flow_runs = _call(f"{prefect.api_url}/flow_runs/filter", {})
        assert isinstance(flow_runs, list)
        assert [(r["state_type"], r["parameters"]) for r in flow_runs] == [("COMPLETED", {"x": 1})]
        models = _call(f"{mlflow.api_url}/api/2.0/mlflow/registered-models/search")
        assert isinstance(models, dict)
        assert [m["name"] for m in models["registered_models"]] == ["t-model"]
        runs = _call(f"{mlflow.api_url}/api/2.0/mlflow/runs/search", {"experiment_ids": ["1"]})
        assert isinstance(runs, dict)
        assert [r["info"]["run_name"] for r in runs["runs"]] == ["t-tiny"]
    finally:
        stop_servers(cfg.servers, workspace)


def test_a_seeded_home_holds_the_block_types_its_server_did_not_register_again(
    tmp_path: Path,
) -> None:
    """The first home's server registers Prefect's blocks and becomes the template; a home
    seeded from it starts its server without registering them (PREFECT_API_BLOCKS_REGISTER_ON_
    START=false), and holds the same block types and schemas."""
    import sqlite3

    cache = tmp_path / "cache"
    homes = []
    for name in ("first", "seeded"):
        (tmp_path / name).mkdir()
        _tiny_run(_recipe(tmp_path / name), cache)
        homes.append(tmp_path / name / "ws" / ".prefect")
    tables = []
    for home in homes:
        with sqlite3.connect(home / "prefect.db") as db:
            types = db.execute("SELECT slug FROM block_type ORDER BY slug").fetchall()
            schemas = db.execute("SELECT checksum FROM block_schema ORDER BY checksum").fetchall()
            runs = db.execute("SELECT state_type FROM flow_run").fetchall()
        tables.append((types, schemas, runs))
    assert tables[0][0], "the first server registered the block types"
    assert tables[1] == tables[0]  # the same blocks, and one completed run each
