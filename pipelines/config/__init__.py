"""The root `RunConfig` and `load_config`: one YAML recipe plus dotted command-line overrides.

Each section's model lives next to the code that owns it (the `deployments` and `servers`
sections in this sub-package, beside it, because `ops/` imports the root); this module only
composes them, loads YAML, applies overrides and turns validation errors into messages that
name the key, the value and what is allowed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pipelines.config.deployments import DeploymentsConfig
from pipelines.config.servers import ServersConfig
from tasks.common.io import redact_url
from tasks.common.ray_runtime import RayConfig
from tasks.decontaminate.decontaminate import DecontaminateConfig
from tasks.downstream.config import DatasetConfig, load_dataset_config, parse_yaml
from tasks.encode.encode import EncodeConfig
from tasks.examples.config import ExamplesConfig
from tasks.ingest.ingest import IngestConfig
from tasks.tokenizer.tokenizer import TokenizerConfig
from training.evaluate.config import EvaluateConfig
from training.finetune.config import CompareConfig, FinetuneConfig
from training.pretrain.config import TrainConfig
from training.pretrain.length_schedule import LengthScheduleError, check_length_schedule
from training.runtime.precision import emulated_bf16_problem
from training.tracking.runs import TrackingConfig


class PrefectConfig(BaseModel):
    """Which Prefect API flows report to; None means the ephemeral local API."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    api_url: str | None = Field(None, description="e.g. http://127.0.0.1:4200/api")
    api_key: SecretStr | None = Field(None, description="Prefect Cloud API key (never logged).")
    retries: int = Field(
        2, ge=0, le=10, description="Retries of a data stage after a transient failure."
    )
    retry_delay_s: float = Field(
        10.0, gt=0, description="First retry delay; each later one doubles (exponential back-off)."
    )


class TaskRef(BaseModel):
    """The downstream task: a dataset YAML (configs/tasks/*.yaml) or an inline definition.

    Relative paths inside the dataset resolve against `base_dir` (e.g. ../shared/data, or the
    demo data directory).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    config: Path | None = Field(None, description="A dataset YAML, e.g. configs/tasks/cola.yaml.")
    dataset: DatasetConfig | None = Field(None, description="The dataset, inline.")
    base_dir: Path = Field(Path("."), description="Where the dataset's relative paths start.")
    max_examples: dict[str, int] | None = Field(
        None, description="Per-split caps that replace the dataset's own `max_examples`."
    )

    @model_validator(mode="after")
    def _load(self) -> TaskRef:
        if (self.config is None) == (self.dataset is None):
            raise ValueError("set exactly one of `config` (a YAML file) and `dataset` (inline)")
        dataset = self.dataset
        if dataset is None and self.config is not None:
            # Read now, so a bad task file stops the run before any work (names the file).
            dataset = load_dataset_config(self.config)
        if dataset is not None and self.max_examples is not None:
            data = dataset.model_dump(exclude_unset=True) | {"max_examples": self.max_examples}
            dataset = DatasetConfig.model_validate(data)
        object.__setattr__(self, "dataset", dataset)
        return self

    def resolved(self) -> DatasetConfig:
        """The dataset config (loaded from `config` at validation)."""
        assert self.dataset is not None
        return self.dataset


class RunConfig(BaseModel):
    """Everything one lmpipe run needs; the single root of the configuration."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field("lmpipe", description="Run name: used in MLflow run names and paths.")
    workspace: Path = Field(Path("workspace"), description="Directory that holds every output.")
    seed: int = Field(0, ge=0, description="Run seed for everything random downstream.")
    ray: RayConfig = Field(default_factory=RayConfig)
    prefect: PrefectConfig = Field(default_factory=PrefectConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    ingest: IngestConfig | None = Field(
        None, description="The corpus; needed by every stage from ingest to pretraining."
    )
    decontaminate: DecontaminateConfig = Field(default_factory=DecontaminateConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    encode: EncodeConfig = Field(default_factory=EncodeConfig)
    examples: ExamplesConfig = Field(default_factory=ExamplesConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    task: TaskRef | None = Field(None, description="Downstream task for finetune and compare.")
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    compare: CompareConfig = Field(default_factory=CompareConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    deployments: DeploymentsConfig = Field(
        default_factory=DeploymentsConfig,
        description="Prefect deployments of this recipe and their schedules (`lmpipe serve`).",
    )
    servers: ServersConfig = Field(
        default_factory=ServersConfig,
        description="The local Prefect and MLflow servers of `lmpipe up` / `lmpipe down`.",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", value):
            raise ValueError(f"{value!r} must be 1-100 letters, digits, '_', '.' or '-'")
        return value

    @field_validator("tracking", "prefect", "ray", "servers")
    @classmethod
    def _no_password_in_urls(cls, value: BaseModel, info: ValidationInfo) -> BaseModel:
        # Plain URL fields are logged, tracked and sent to Prefect as flow parameters; a
        # password belongs in a SecretStr field (tracking.password, ...) or the environment.
        for key in _URL_FIELDS[str(info.field_name)]:
            url = getattr(value, key)
            if isinstance(url, str) and redact_url(url) != url:
                raise ValueError(
                    f"{info.field_name}.{key} has a password inside its URL; remove it and set "
                    "the credential in its secret field or the environment (never logged)"
                )
        return value

    @model_validator(mode="after")
    def _length_schedule_fits_the_examples(self) -> RunConfig:
        # Needs both sections, so it is checked here, before any stage runs (the training
        # loop checks again at its first step).
        full = self.examples.sequence_length
        try:
            check_length_schedule(self.train.length_schedule, self.examples.objective, full)
        except LengthScheduleError as err:
            raise ValueError(str(err)) from None
        return self

    @model_validator(mode="after")
    def _bf16_is_native_where_it_trains(self, info: ValidationInfo) -> RunConfig:
        # Needs the ray section: with a cluster address the workers' CPUs, not this one's,
        # run the training. `RAY_ADDRESS` fills `ray.address` only after loading
        # (pipelines/ops/runtime.py), and a recipe checked before `lmpipe submit` trains on
        # the cluster (context `remote`), so neither is this machine's CPU either.
        remote = bool(info.context and info.context.get("remote"))
        cluster = self.ray.address is not None or bool(os.environ.get("RAY_ADDRESS")) or remote
        sections = (("train", self.train), ("finetune", self.finetune))
        problems = [
            emulated_bf16_problem(
                name, section.precision, section.allow_emulated_bf16, section.scale.use_gpu, cluster
            )
            for name, section in sections
        ]
        if any(problems):
            raise ValueError("; ".join(p for p in problems if p))
        return self


# Plain-text URL fields of each section, checked for an embedded `user:password@`.
_URL_FIELDS = {
    "tracking": ("tracking_uri", "ui_url"),
    "prefect": ("api_url",),
    "ray": ("address",),
    "servers": ("prefect_ui_api_url", "mlflow_s3_endpoint_url", "mlflow_artifacts_destination"),
}


# Keys whose values are never echoed in an error: secrets, and URLs that may embed credentials.
_SECRET_KEYS = (
    "password",
    "api_key",
    "storage_options",
    "auth_string",
    "database_url",
    "backend_store_uri",
    "secret",
)


class ConfigError(ValueError):
    """The config file or an override is invalid; the message names the key and the value."""


def load_config(
    path: Path | str, overrides: list[str] | tuple[str, ...] = (), *, remote: bool = False
) -> RunConfig:
    """Read a YAML recipe, apply `a.b=value` overrides (values parsed as YAML) and validate.

    Relative paths in the recipe stay relative to the current directory, like the CLI's.
    `remote`: the recipe will train on a Ray cluster (`lmpipe submit`), not on this machine.

    Raises:
        ConfigError: unreadable YAML, a malformed override, or any invalid key or value.
    """
    path = Path(path)
    data = read_recipe(path)
    for override in overrides:
        _apply_override(data, override)
    try:
        return RunConfig.model_validate(data, context={"remote": remote})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, str(path))) from None


def read_recipe(path: Path) -> dict[str, Any]:
    """Read a YAML recipe into a mapping of sections, unvalidated.

    Raises:
        ConfigError: the file is missing, is not YAML, or its top level is not a mapping.
    """
    try:
        data = parse_yaml(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {path} does not exist") from exc
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"config file {path} cannot be read: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return data


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w]*(\.[\w]+)*", key):
        raise ConfigError(f"override {override!r} must look like section.key=value")
    try:
        value = parse_yaml(raw) if raw else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: value is not valid YAML: {exc}") from exc
    node: Any = data
    parts = key.split(".")
    for depth, part in enumerate(parts[:-1]):
        node = _child(node, part, ".".join(parts[: depth + 1]))
    last = parts[-1]
    if isinstance(node, list):
        node[_index(node, last, key)] = value
    elif isinstance(node, dict):
        node[last] = value
    else:  # `name.x=1`: the parent is a value, not a section
        where = ".".join(parts[:-1])
        raise ConfigError(f"override key {key!r}: {where!r} is a {type(node).__name__}, no keys")


def _child(node: Any, part: str, where: str) -> Any:
    if isinstance(node, list):
        return node[_index(node, part, where)]
    if not isinstance(node, dict):
        raise ConfigError(f"override key {where!r}: {type(node).__name__} has no keys")
    return node.setdefault(part, {})


def _index(node: list[Any], part: str, where: str) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override key {where!r}: index {part!r} is not in 0..{len(node) - 1}")
    return int(part)


def format_validation_error(exc: ValidationError, origin: str) -> str:
    """Render each pydantic error as `origin: key.path = value: what is allowed`."""
    lines = [f"{origin}: invalid configuration ({exc.error_count()} error(s))"]
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"]) or "<root>"
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            listing = _keys_command(error["loc"])
            message = f"unknown key (misspelled?); {listing} lists the valid keys"
        elif error["type"] == "literal_error":
            message = f"must be one of {error.get('ctx', {}).get('expected', '')}"
        if not error["loc"]:  # a check across sections: its input is the whole config
            lines.append(f"  {message}")
            continue
        shown = "<missing>" if error["type"] == "missing" else repr(error.get("input"))
        if any(word in key for word in _SECRET_KEYS):
            shown = "<hidden>"
        shown = redact_url(shown)  # a URL's password, wherever it appears
        lines.append(f"  {key} = {shown[:120]}: {message}")
    return "\n".join(lines)


def _keys_command(loc: tuple[int | str, ...]) -> str:
    """The `lmpipe config --keys SECTION` command for the section that holds the key at `loc`."""
    parts = []
    for part in loc[:-1]:
        if isinstance(part, int) or str(part).isdigit():
            break  # a list index: list the keys of the whole list's items
        parts.append(str(part))
    section = f" {'.'.join(parts)}" if parts else ""
    return f"`lmpipe config --keys{section}`"
