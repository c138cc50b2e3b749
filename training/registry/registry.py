"""Register exported models in the MLflow model registry, find them again and load them offline.

Here: `register_export` (log an export as an MLflow transformers model attached to a run, register
it, alias it, tag its lineage), `resolve_version` and `download_model`. Not here: writing the
export (`training/models/export.py`) and run tracking (`training/registry/tracking.py`).

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
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard as HubModelCard

from tasks.common.io import UnsafePathError, safe_join, safe_name
from training.models.export import (
    PIPELINE_TASKS,
    TASK_PIPELINES,
    assert_safetensors_only,
    load_export,
)

log = logging.getLogger(__name__)

MODEL_NAME_IN_RUN = "model"  # the LoggedModel's name
HF_ARTIFACT_DIR = "hf_model"  # the export, verbatim, among the run's artifacts
# Explicit, because inferring them imports torchvision, which we do not install (docs/stack.md,
# "MLflow's transformers flavor").
_PIP_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
_URI_VARIABLE = "MLFLOW_TRACKING_URI"


@dataclass(frozen=True)
class ModelVersionRef:
    """One registered model version.

    Attributes:
        name: Registered model name.
        version: Version number, as MLflow spells it (a string).
        alias: The alias it was found or registered under; None when looked up by number.
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


def pip_requirements() -> list[str]:
    """Pin the packages a logged model needs to the installed versions (no local labels)."""
    return [f"{name}=={version(name).split('+')[0]}" for name in _PIP_PACKAGES]


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


def _log_flavor(
    client: Any, run: Any, hf_dir: Path, family: str, task_type: str | None = None
) -> str:
    """Log `hf_dir` as an MLflow transformers model of `run`; return its LoggedModel id.

    The LoggedModel is created first, in the run's experiment: given only `run_id`,
    `log_model` files it under the *active* experiment (Default, with artifacts under
    `./mlruns` of the cwd) instead. Nothing here starts or ends the run.
    """
    import mlflow

    model, tok = load_export(hf_dir, family, task_type)
    logged = client.create_logged_model(
        experiment_id=run.info.experiment_id, name=MODEL_NAME_IN_RUN, source_run_id=run.info.run_id
    )
    mlflow.transformers.log_model(
        {"model": model, "tokenizer": tok},
        name=MODEL_NAME_IN_RUN,
        task=PIPELINE_TASKS[family] if task_type is None else TASK_PIPELINES[task_type],
        model_card=HubModelCard.load(hf_dir / "README.md"),
        pip_requirements=pip_requirements(),
        model_id=logged.model_id,
        run_id=run.info.run_id,
    )
    return str(logged.model_id)


def _ensure_registered_model(client: Any, name: str) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode

    try:
        client.create_registered_model(name)
    except MlflowException as err:
        if err.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise


def register_export(
    hf_dir: Path,
    family: str,
    tracking_uri: str,
    run_id: str,
    model_name: str,
    alias: str,
    tags: Mapping[str, str],
    task_type: str | None = None,
) -> ModelVersionRef:
    """Log an export to run `run_id`, register it as a new version of `model_name`, alias it.

    The run's status is left as it was (a RUNNING run stays RUNNING): the run is only
    written to through `MlflowClient`, never entered with `mlflow.start_run`.

    Args:
        hf_dir: An export written by `training.models.export.export_model`.
        family: Model family; picks the Auto class and the pipeline task.
        tracking_uri: MLflow tracking URI (also the registry), e.g. `sqlite:////abs/mlflow.db`.
        run_id: The run that produced the model.
        model_name: Registered model name.
        alias: Alias to point at the new version, e.g. `candidate`.
        tags: Lineage tags for the version: corpus manifest, tokenizer and example config
            hashes, DeepSpeed config JSON, git commit.
        task_type: For a fine-tuned export, its downstream task type (picks the Auto class and
            the pipeline task); None for a pretrained export.

    Returns:
        The new version.
    """
    import mlflow

    check_model_name(model_name)
    client = mlflow.MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    with _tracking_uri(tracking_uri):
        model_id = _log_flavor(client, run, hf_dir, family, task_type)
        client.log_artifacts(run_id, str(hf_dir), HF_ARTIFACT_DIR)
        _ensure_registered_model(client, model_name)
        mv = client.create_model_version(
            model_name,
            source=f"models:/{model_id}",
            run_id=run_id,
            tags={"family": family, **tags},
            model_id=model_id,
        )
        client.set_registered_model_alias(model_name, alias, mv.version)
    log.info("registered %s version %s as @%s (run %s)", model_name, mv.version, alias, run_id)
    return ModelVersionRef(
        model_name, str(mv.version), alias, f"models:/{model_name}/{mv.version}", mv.source
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


def _flatten_flavor(mlflow_model: Path, dst: Path) -> None:
    """Copy the weights, config and tokenizer of a downloaded MLflow model into one HF dir.

    The transformers flavor keeps the model under `<model_binary>/` (`model/`) and each
    component under `components/<name>/`, as its MLmodel file records. Its model card is
    split into `model_card.md` and `model_card_data.yaml`; they are joined back as README.md.
    """
    flavor = yaml.safe_load((mlflow_model / "MLmodel").read_text())["flavors"]["transformers"]
    # The MLmodel file comes from the registry, i.e. from whoever logged the model: the
    # directories it names must stay inside the download, and links are copied as links.
    binary = safe_join(mlflow_model, str(flavor["model_binary"]), what="MLmodel model_binary")
    _refuse_links(mlflow_model)
    shutil.copytree(binary, dst, symlinks=True)
    for component in flavor.get("components", []):
        source = safe_join(mlflow_model / "components", str(component), what="MLmodel component")
        shutil.copytree(source, dst, dirs_exist_ok=True, symlinks=True)
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
    """Download a registered version as a plain Hugging Face directory at `dst`.

    The result loads offline with `AutoModelFor....from_pretrained(dst)` and
    `AutoTokenizer.from_pretrained(dst)`. `dst` is replaced if it exists.

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
        _flatten_flavor(Path(local), staged)
        assert_safetensors_only(staged)
        if dst.exists():
            shutil.rmtree(dst)
        staged.rename(dst)
    return dst
