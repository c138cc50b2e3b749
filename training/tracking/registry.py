"""Register exported models in the MLflow model registry, find them again and load them offline.

Here: `register_export` (log an export as an MLflow model attached to a run, register it, alias
it, tag its lineage), `resolve_version` and `download_model`. Not here: writing the export
(`training/models/export.py`, `training/finetune/strategies.py`) and run tracking
(`training/tracking/runs.py`).

Each export layout (`training.models.export.export_layout`) is logged so that loading the
registered version never gives the model without its adapters: a plain export and a peft adapter
export as the transformers flavor (`mlflow.transformers.load_model` returns the peft model with
the base model from inside the artifact), lmpipe's bottleneck adapters as a flavor of their own
that MLflow's loaders refuse (`download_model`, then `training.finetune.adapters.load_finetuned`).

MLflow is imported inside the functions: importing it costs seconds and most callers never
register anything.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard as HubModelCard

from tasks.common.io import UnsafePathError, safe_join, safe_name
from training.models.export import (
    BASE_MODEL_DIR,
    PEFT_CONFIG_FILE,
    PEFT_WEIGHTS_FILE,
    PIPELINE_TASKS,
    TASK_PIPELINES,
    assert_safetensors_only,
    export_layout,
    load_export,
    load_peft_export,
)

log = logging.getLogger(__name__)

MODEL_NAME_IN_RUN = "model"  # the LoggedModel's name
HF_ARTIFACT_DIR = "hf_model"  # the export, verbatim, among the run's artifacts
# Explicit, because inferring them imports torchvision, which we do not install (docs/stack.md,
# "MLflow's transformers flavor").
_PIP_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")
_URI_VARIABLE = "MLFLOW_TRACKING_URI"
# The MLmodel flavor of a bottleneck-adapter export: not `transformers` nor `python_function`, so
# MLflow's loaders refuse it rather than load the model without its adapters.
ADAPTERS_FLAVOR = "lmpipe_bottleneck_adapters"


@dataclass(frozen=True)
class Registration:
    """Where `register_export` puts a new model version, and the tags it gives it.

    Attributes:
        model_name: Registered model name.
        alias: Alias to point at the new version, e.g. `candidate`.
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


def pip_requirements(with_peft: bool = False) -> list[str]:
    """Pin the packages a logged model needs to the installed versions (no local labels)."""
    names = (*_PIP_PACKAGES, "peft") if with_peft else _PIP_PACKAGES
    return [f"{name}=={version(name).split('+')[0]}" for name in names]


def _set_base_path(adapter_dir: Path, base: str) -> None:
    """Point a peft adapter's `base_model_name_or_path` at `base` (a relative path)."""
    config_file = adapter_dir / PEFT_CONFIG_FILE
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class _PeftTransformersFlavor:
    """`mlflow.transformers` for a peft model, with the untouched base model's weights.

    MLflow 3.17 saves a peft model's base with `model.base_model.model.save_pretrained`: with
    LoRA injected, the projections are saved as `...query.base_layer.weight`, which
    `from_pretrained` does not match, so the loaded base would get fresh random projections
    under the adapter. The export's own `base_model/` replaces them. `mlflow.transformers.
    load_model` gives the base to peft itself, so the adapter's relative path is only a hint
    for a reader of the artifact.
    """

    __name__ = "mlflow.transformers"

    def __init__(self, base_dir: Path) -> None:
        """Log the weights of `base_dir` as the peft model's base."""
        self.base_dir = base_dir

    def save_model(self, path: str, mlflow_model: Any, **kwargs: Any) -> None:
        """Save as `mlflow.transformers.save_model` does, then put the clean base in place."""
        import mlflow

        mlflow.transformers.save_model(path=path, mlflow_model=mlflow_model, **kwargs)
        root = Path(path)
        flavor = yaml.safe_load((root / "MLmodel").read_text())["flavors"]["transformers"]
        binary, adapter = root / str(flavor["model_binary"]), root / str(flavor["peft_adaptor"])
        shutil.rmtree(binary)
        shutil.copytree(self.base_dir, binary)
        _set_base_path(adapter, os.path.relpath(binary, adapter))
        (adapter / "README.md").unlink(missing_ok=True)  # peft's template: this machine's paths


class _AdaptersFlavor:
    """A bottleneck-adapter export, verbatim under `model/`, in a flavor MLflow cannot load."""

    __name__ = ADAPTERS_FLAVOR

    def __init__(self, hf_dir: Path, task_type: str) -> None:
        """Log the export `hf_dir` of a `task_type` model."""
        self.hf_dir, self.task_type = hf_dir, task_type

    def save_model(self, path: str, mlflow_model: Any, **kwargs: Any) -> None:
        """Copy the export and write an MLmodel naming lmpipe's loader."""
        shutil.copytree(self.hf_dir, Path(path) / "model")
        mlflow_model.add_flavor(
            ADAPTERS_FLAVOR,
            model_binary="model",
            task_type=self.task_type,
            loader="training.finetune.adapters.load_finetuned (after download_model)",
        )
        mlflow_model.save(str(Path(path) / "MLmodel"))


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
    """Log `hf_dir` as an MLflow model of `run` (see the module docstring); return its id.

    The LoggedModel is created first, in the run's experiment: given only `run_id`,
    `log_model` files it under the *active* experiment (Default, with artifacts under
    `./mlruns` of the cwd) instead. Nothing here starts or ends the run.
    """
    import mlflow
    from transformers import AutoTokenizer

    layout = export_layout(hf_dir)
    if layout != "model" and task_type is None:
        raise ValueError(f"{hf_dir} is an adapter export: register it with its task_type")
    logged = client.create_logged_model(
        experiment_id=run.info.experiment_id, name=MODEL_NAME_IN_RUN, source_run_id=run.info.run_id
    )
    ids = {"name": MODEL_NAME_IN_RUN, "model_id": logged.model_id, "run_id": run.info.run_id}
    if layout == "adapters" and task_type is not None:
        mlflow.models.Model.log(None, _AdaptersFlavor(hf_dir, task_type), **ids)
        return str(logged.model_id)
    task = PIPELINE_TASKS[family] if task_type is None else TASK_PIPELINES[task_type]
    if layout == "model":
        # load_export refuses pickle-only weights: before anything else reads the directory.
        model, tok = load_export(hf_dir, family, task_type)
        card = HubModelCard.load(hf_dir / "README.md")
        components: dict[str, Any] = {"model": model, "tokenizer": tok}
        mlflow.transformers.log_model(
            components, task=task, model_card=card, pip_requirements=pip_requirements(), **ids
        )
        return str(logged.model_id)
    tok = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    peft_model = load_peft_export(hf_dir, str(task_type))
    card = HubModelCard.load(hf_dir / "README.md")
    # peft's save asks the hub whether the base's vocabulary changed unless this names a local
    # directory; the artifact gets a relative path (`_PeftTransformersFlavor`).
    base_dir = (hf_dir / BASE_MODEL_DIR).resolve()
    peft_model.peft_config["default"].base_model_name_or_path = str(base_dir)
    components = {"model": peft_model, "tokenizer": tok}
    mlflow.models.Model.log(
        None,
        _PeftTransformersFlavor(hf_dir / BASE_MODEL_DIR),
        transformers_model=components,
        task=task,
        model_card=card,
        pip_requirements=pip_requirements(with_peft=True),
        **ids,
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
    registration: Registration,
    task_type: str | None = None,
) -> ModelVersionRef:
    """Log an export to run `run_id`, register it as a new version of a model, alias and tag it.

    The run's status is left as it was (a RUNNING run stays RUNNING): the run is only
    written to through `MlflowClient`, never entered with `mlflow.start_run`.

    Args:
        hf_dir: An export written by `training.models.export.export_model`, or a fine-tuned
            export in any layout (`training.finetune.strategies.StrategyPlan.save_export`).
        family: Model family; picks the Auto class and the pipeline task.
        tracking_uri: MLflow tracking URI (also the registry), e.g. `sqlite:////abs/mlflow.db`.
        run_id: The run that produced the model.
        registration: The registered model's name, the alias to point at the new version and
            the version's lineage tags.
        task_type: For a fine-tuned export, its downstream task type (picks the Auto class and
            the pipeline task); None for a pretrained export.

    Returns:
        The new version.
    """
    import mlflow

    model_name, alias = registration.model_name, registration.alias
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
            tags={"family": family, **registration.tags},
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
    component under `components/<name>/`, as its MLmodel file records; a peft model's adapter
    is under `<peft_adaptor>/` and becomes an adapter export again (the base in `base_model/`).
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
        _set_base_path(dst, BASE_MODEL_DIR)
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
    `training.finetune.adapters.load_finetuned(dst, task_type)`, or with peft from inside `dst`.
    `dst` is replaced if it exists.

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
        for home in (staged, staged / BASE_MODEL_DIR):
            if home.is_dir():
                assert_safetensors_only(home)
        if dst.exists():
            shutil.rmtree(dst)
        staged.rename(dst)
    return dst
