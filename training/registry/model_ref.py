"""Where an existing model comes from: a local Hugging Face directory or a registry version.

Used by fine-tuning (the base model) and distillation (the teacher).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator


class BaseModelRef(BaseModel):
    """Where the model to fine-tune comes from: a local HF directory or a registry version."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: Path | None = Field(
        None, description="A local Hugging Face model directory (safetensors weights only)."
    )
    registry_name: str | None = Field(
        None, description="A registered MLflow model name, e.g. demo-bert."
    )
    version: str = Field(
        "candidate", description="Registry alias or version number of `registry_name`."
    )

    @model_validator(mode="after")
    def _one_source(self) -> BaseModelRef:
        if (self.path is None) == (self.registry_name is None):
            raise ValueError("set exactly one of `path` and `registry_name`")
        return self


def resolve_base_model(
    ref: BaseModelRef, tracking_uri: str | None, workspace: Path
) -> tuple[Path, dict[str, str]]:
    """The base model's local directory and the lineage tags that name it.

    A registry reference is downloaded once to `<workspace>/models/<name>-v<version>/`.

    Raises:
        ValueError: a registry reference without a tracking URI.
    """
    if ref.path is not None:
        return ref.path, {"base_model_path": str(ref.path.resolve())}
    if tracking_uri is None or ref.registry_name is None:
        raise ValueError("finetune.base.registry_name needs MLflow tracking (tracking.enabled)")
    from training.registry.registry import download_model, resolve_version

    version = resolve_version(tracking_uri, ref.registry_name, ref.version)
    dst = (workspace / "models" / f"{version.name}-v{version.version}").resolve()
    if not (dst / "config.json").is_file():
        download_model(tracking_uri, version, dst)
    return dst, {"base_model_name": version.name, "base_model_version": version.version}
