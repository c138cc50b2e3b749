"""Register exported models in the MLflow model registry, find them again and load them offline.

Here: `register_export` (log an export as an MLflow model attached to a run, register it, tag its
lineage, describe it by its model card's summary, move its aliases), `resolve_version` and
`download_model`. Not here: how each export layout is logged so that it serves
(`training/tracking/flavors.py`), which version an alias points at
(`training/tracking/aliases.py`), writing the export (`training/models/export.py`,
`training/finetune/strategies.py`) and run tracking (`training/tracking/runs.py`).

A plain export and a peft adapter export serve through `mlflow.pyfunc` and
`mlflow.transformers.load_model` (which returns the peft model with the base model from inside
the artifact); lmpipe's bottleneck adapters serve through `mlflow.pyfunc` only when registered
with their `CodeModel`, and MLflow's transformers loader refuses them (`download_model`, then
`training.finetune.adapters.load_finetuned`).

MLflow is imported inside the functions: importing it costs seconds and most callers never
register anything.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tasks.common.io import UnsafePathError, safe_join, safe_name
from training.models.cards import card_summary
from training.models.export import (
    BASE_MODEL_DIR,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    assert_safetensors_only,
)
from training.tracking.aliases import (
    NEWEST_ALIAS,
    AliasDecision,
    current_holder,
    decide_candidate,
    describe,
    model_description,
    selection_of,
)
from training.tracking.flavors import ADAPTERS_FLAVOR as ADAPTERS_FLAVOR
from training.tracking.flavors import MODEL_NAME_IN_RUN, CodeModel, log_export, set_base_path
from training.tracking.flavors import pip_requirements as pip_requirements

log = logging.getLogger(__name__)

HF_ARTIFACT_DIR = "hf_model"  # the export, verbatim, among the run's artifacts
_URI_VARIABLE = "MLFLOW_TRACKING_URI"


@dataclass(frozen=True)
class Registration:
    """Where `register_export` puts a new model version, and the tags it gives it.

    Attributes:
        model_name: Registered model name.
        alias: The gated alias, e.g. `candidate`: it moves to the new version only when that
            is no worse than the version holding it (`training.tracking.aliases`). `newest`
            always moves.
        tags: Lineage tags for the version: corpus manifest, tokenizer and example config
            hashes, DeepSpeed config JSON, git commit.
    """

    model_name: str
    alias: str
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelVersionRef:
    """One registered model version.

    Attributes:
        name: Registered model name.
        version: Version number, as MLflow spells it (a string).
        alias: The alias it was found under, or given at registration (the gated alias when
            that moved to it, else `newest`); None when looked up by number.
        model_uri: `models:/<name>/<version>`, for `mlflow.*.load_model` and `download_model`.
        source: Where the version's files live: `models:/m-<id>`, the run's LoggedModel.
    """

    name: str
    version: str
    alias: str | None
    model_uri: str
    source: str


def check_model_name(name: str) -> str:
    """Return `name` if it can name a registered model and a directory; else raise.

    A registered model's name becomes a directory name (`<workspace>/models/<name>-v<n>`), so
    it must be one safe path segment: no `/`, `..`, backslash, NUL or encoded variant of them.

    Raises:
        UnsafePathError: the name could escape the directory it is joined to.
    """
    safe_name(name, what="registered model name")
    if "/" in name or ":" in name:
        raise UnsafePathError(f"registered model name {name!r} must not contain '/' or ':'")
    return name


@contextmanager
def _tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's global tracking URI at `uri` for a block, then restore it exactly.

    `mlflow.<flavor>.log_model` has no tracking URI argument, and the registry store resolves a
    `models:/m-<id>` source through the global URI, not its client's (an MLflow TODO in
    `SqlAlchemyStore.create_model_version`). `mlflow.set_tracking_uri` also writes, and on
    `None` deletes, the `MLFLOW_TRACKING_URI` variable, so a caller's own value is put back.
    """
    import mlflow
    from mlflow.tracking._tracking_service import utils

    previous, previous_env = utils._tracking_uri, os.environ.get(_URI_VARIABLE)
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)
        if previous_env is not None:
            os.environ[_URI_VARIABLE] = previous_env


def _ensure_registered_model(client: Any, name: str, alias: str) -> None:
    """Create registered model `name`, described by what its aliases mean, unless it exists.

    An existing model without a description gets one; a description someone wrote stays.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    try:
        client.create_registered_model(name, description=model_description(alias))
    except MlflowException as err:
        if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
        if not client.get_registered_model(name).description:
            client.update_registered_model(name, description=model_description(alias))


def _log_model(
    client: Any, run: Any, hf_dir: Path, family: str, task_type: str | None, code: CodeModel | None
) -> str:
    """Log `hf_dir` as an MLflow model of `run` (`flavors.log_export`); return its id.

    The LoggedModel is created first, in the run's experiment: given only `run_id`,
    `log_model` files it under the *active* experiment (Default, with artifacts under
    `./mlruns` of the cwd) instead. Nothing here starts or ends the run.
    """
    logged = client.create_logged_model(
        experiment_id=run.info.experiment_id, name=MODEL_NAME_IN_RUN, source_run_id=run.info.run_id
    )
    ids = {"name": MODEL_NAME_IN_RUN, "model_id": logged.model_id, "run_id": run.info.run_id}
    log_export(ids, hf_dir, family, task_type, code)
    return str(logged.model_id)


def _decide(
    client: Any, name: str, alias: str, hf_dir: Path
) -> tuple[AliasDecision, dict[str, str]]:
    """Whether `alias` moves to a new version of `name` made from `hf_dir`; its version tags."""
    selection = selection_of(hf_dir)
    if alias == NEWEST_ALIAS:
        decision = AliasDecision(True, f"@{NEWEST_ALIAS} always moves")
    else:
        held, current = current_holder(client, name, alias)
        decision = decide_candidate(selection, current, held)
    return decision, selection.tags() | decision.tags()


def _move_aliases(client: Any, name: str, version: str, alias: str, decision: AliasDecision) -> str:
    """Point `newest`, and `alias` when `decision` says so, at `version`; return its alias."""
    if decision.move:
        client.set_registered_model_alias(name, alias, version)
    client.set_registered_model_alias(name, NEWEST_ALIAS, version)
    verb = "moved to" if decision.move else "stayed away from"
    log.info("@%s %s %s version %s: %s", alias, verb, name, version, decision.reason)
    return alias if decision.move else NEWEST_ALIAS


def register_export(
    hf_dir: Path,
    family: str,
    tracking_uri: str,
    run_id: str,
    registration: Registration,
    task_type: str | None = None,
    code_model: CodeModel | None = None,
) -> ModelVersionRef:
    """Log an export to run `run_id`, register it as a new version of a model, tag and alias it.

    The version's description is its model card's summary, then the decision about the gated
    alias (`training.tracking.aliases`); `newest` always moves to it. The run's status is left
    as it was (a RUNNING run stays RUNNING): the run is only written to through
    `MlflowClient`, never entered with `mlflow.start_run`.

    Args:
        hf_dir: An export written by `training.models.export.export_model`, or a fine-tuned
            export in any layout (`training.finetune.strategies.StrategyPlan.save_export`).
        family: Model family; picks the Auto class and the pipeline task.
        tracking_uri: MLflow tracking URI (also the registry), e.g. `sqlite:////abs/mlflow.db`.
        run_id: The run that produced the model.
        registration: The registered model's name, the gated alias and the version's lineage
            tags.
        task_type: For a fine-tuned export, its downstream task type (picks the Auto class and
            the pipeline task); None for a pretrained export.
        code_model: For a bottleneck-adapter export, the pyfunc that serves it
            (`training.finetune.serving.adapters_code_model`); without it the version does not
            serve through `mlflow.pyfunc`. Ignored for other layouts.

    Returns:
        The new version, with the gated alias when that moved to it, else `newest`.
    """
    import mlflow

    model_name, alias = registration.model_name, registration.alias
    check_model_name(model_name)
    client = mlflow.MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    with _tracking_uri(tracking_uri):
        model_id = _log_model(client, run, hf_dir, family, task_type, code_model)
        client.log_artifacts(run_id, str(hf_dir), HF_ARTIFACT_DIR)
        _ensure_registered_model(client, model_name, alias)
        decision, decided = _decide(client, model_name, alias, hf_dir)
        mv = client.create_model_version(
            model_name,
            source=f"models:/{model_id}",
            run_id=run_id,
            tags={"family": family, **registration.tags, **decided},
            description=describe(card_summary(hf_dir), alias, decision),
            model_id=model_id,
        )
        held = _move_aliases(client, model_name, str(mv.version), alias, decision)
    log.info("registered %s version %s (run %s)", model_name, mv.version, run_id)
    return ModelVersionRef(
        model_name, str(mv.version), held, f"models:/{model_name}/{mv.version}", mv.source
    )


def resolve_version(tracking_uri: str, name: str, alias_or_version: str) -> ModelVersionRef:
    """Find a version of `name` by alias (`candidate`) or by number (`3`).

    Raises:
        UnsafePathError: `name` is not a safe path segment (see `check_model_name`).
    """
    import mlflow

    check_model_name(name)
    client = mlflow.MlflowClient(tracking_uri)
    if alias_or_version.isdigit():
        mv = client.get_model_version(name, alias_or_version)
        alias = None
    else:
        mv = client.get_model_version_by_alias(name, alias_or_version)
        alias = alias_or_version
    return ModelVersionRef(name, str(mv.version), alias, f"models:/{name}/{mv.version}", mv.source)


def _flatten_flavor(mlflow_model: Path, dst: Path, read_from: Path) -> None:
    """Copy the weights, config and tokenizer of a downloaded MLflow model into one HF dir.

    The transformers flavor keeps the model under `<model_binary>/` (`model/`) and each
    component under `components/<name>/`, as its MLmodel file records; a peft model's adapter
    is under `<peft_adaptor>/` and becomes an adapter export again (the base in `base_model/`,
    which its `base_model_name_or_path` names absolutely as `<read_from>/base_model`: `dst` is
    read from `read_from` once in place).
    A bottleneck-adapter export is under `model/` verbatim. The model card is split into
    `model_card.md` and `model_card_data.yaml`; they are joined back as README.md.
    """
    flavors = yaml.safe_load((mlflow_model / "MLmodel").read_text())["flavors"]
    # The MLmodel file comes from the registry, i.e. from whoever logged the model: the
    # directories it names must stay inside the download, and links are copied as links.
    _refuse_links(mlflow_model)
    flavor = flavors.get(ADAPTERS_FLAVOR) or flavors["transformers"]
    binary = safe_join(mlflow_model, str(flavor["model_binary"]), what="MLmodel model_binary")
    if ADAPTERS_FLAVOR in flavors:
        shutil.copytree(binary, dst, symlinks=True)
        return
    adapter = flavor.get("peft_adaptor")
    base = dst / BASE_MODEL_DIR if adapter else dst
    shutil.copytree(binary, base, symlinks=True)
    for component in flavor.get("components", []):
        source = safe_join(mlflow_model / "components", str(component), what="MLmodel component")
        for home in {dst, base}:
            shutil.copytree(source, home, dirs_exist_ok=True, symlinks=True)
    if adapter:
        source = safe_join(mlflow_model, str(adapter), what="MLmodel peft_adaptor")
        for name in (PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE):  # safetensors only, never a .bin
            shutil.copyfile(source / name, dst / name)
        set_base_path(dst, str(read_from / BASE_MODEL_DIR))
        shutil.copyfile(base / "config.json", dst / "config.json")
    text, data = mlflow_model / "model_card.md", mlflow_model / "model_card_data.yaml"
    if text.exists() and data.exists():
        readme = f"---\n{data.read_text()}---\n{text.read_text()}"
        (dst / "README.md").write_text(readme, encoding="utf-8")


def _refuse_links(root: Path) -> None:
    """Refuse a downloaded model that holds a symbolic link (it could point anywhere)."""
    links = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_symlink())
    if links:
        raise UnsafePathError(f"the downloaded model holds symbolic links: {links[:5]}")


def download_model(tracking_uri: str, ref: ModelVersionRef, dst: Path) -> Path:
    """Download a registered version as a Hugging Face directory at `dst`.

    A plain export loads offline with `AutoModelFor....from_pretrained(dst)` and
    `AutoTokenizer.from_pretrained(dst)`; an adapter export comes back in the layout it was
    written in (`base_model/` plus the adapter) and loads with
    `training.finetune.adapters.load_finetuned(dst, task_type)` or, from any working directory,
    with `AutoPeftModelFor<Task>.from_pretrained(dst)`: a peft adapter's
    `base_model_name_or_path` is the absolute path of `dst/base_model` (moving `dst` leaves it
    stale; `load_finetuned` does not read it). `dst` is replaced if it exists.

    Returns:
        `dst`.

    Raises:
        UnsafeWeightsError: the version holds pickle weight files.
        UnsafePathError: its MLmodel names directories outside the download, or it holds links.
    """
    import mlflow

    check_model_name(ref.name)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{dst.name}.tmp-", dir=dst.parent) as tmp:
        # `models:/` resolution builds clients from the global URI despite the arguments.
        with _tracking_uri(tracking_uri):
            local = mlflow.artifacts.download_artifacts(
                artifact_uri=ref.model_uri, dst_path=tmp, tracking_uri=tracking_uri
            )
        staged = Path(tmp) / "hf"
        _flatten_flavor(Path(local), staged, dst.resolve())
        for home in (staged, staged / BASE_MODEL_DIR):
            if home.is_dir():
                assert_safetensors_only(home)
        if dst.exists():
            shutil.rmtree(dst)
        staged.rename(dst)
    return dst
