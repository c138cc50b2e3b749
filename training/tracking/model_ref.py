"""Resolve where an existing model comes from: a local directory or a registry version.

`BaseModelRef` itself is in `training/models/config.py`; a registry version is downloaded once.
Used by fine-tuning (the base model) and distillation (the teacher).
"""

from __future__ import annotations

from pathlib import Path

from training.models.config import BaseModelRef


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
    from training.tracking.registry import download_model, resolve_version

    version = resolve_version(tracking_uri, ref.registry_name, ref.version)
    dst = (workspace / "models" / f"{version.name}-v{version.version}").resolve()
    if not (dst / "config.json").is_file():
        download_model(tracking_uri, version, dst)
    return dst, {"base_model_name": version.name, "base_model_version": version.version}
