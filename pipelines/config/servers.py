"""The `servers:` section: bind address, ports, databases, artifacts and authentication.

What `lmpipe up` starts is configured here and checked before anything starts: a bind address
other than loopback needs authentication for both servers, URLs need a scheme each server
accepts, and the two ports differ. Starting and stopping the servers is `pipelines.ops.servers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})

# The admin password of the basic_auth.ini older MLflow versions shipped: no authentication.
MLFLOW_LEGACY_DEFAULT_PASSWORD = "password1234"


def exposure_problem(host: str, auth: dict[str, Any]) -> str | None:
    """Say why binding `host` with these auth settings is refused; None when it is not.

    A loopback host needs no authentication; any other needs both `prefect_auth_string` and
    `mlflow_admin_password` (set, not None) among `auth`, whatever else it holds.
    """
    if host in LOOPBACK_HOSTS:
        return None
    keys = ("prefect_auth_string", "mlflow_admin_password")
    missing = [f"servers.{key}" for key in keys if auth.get(key) is None]
    if not missing:
        return None
    return (
        "not a loopback address (127.0.0.1, ::1, localhost), so both servers need "
        f"authentication: set {' and '.join(missing)}"
    )


# Field -> (accepted URL prefixes, whether a local path is accepted too).
_URL_PREFIXES: dict[str, tuple[tuple[str, ...], bool]] = {
    "prefect_database_url": (("postgresql+asyncpg://", "sqlite+aiosqlite:///"), False),
    "prefect_ui_api_url": (("http://", "https://"), False),
    "mlflow_backend_store_uri": (("postgresql://", "postgresql+", "sqlite:///"), False),
    "mlflow_artifacts_destination": (("s3://", "file://"), True),
    "mlflow_s3_endpoint_url": (("http://", "https://"), False),
}


class ServersConfig(BaseModel):
    """The local Prefect server and MLflow tracking server that `lmpipe up` starts."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    # The auth fields come before `host`: pydantic validates in field order, so host's
    # validator sees them and the refusal is reported under the key `host`.
    prefect_auth_string: SecretStr | None = Field(
        None, description="Basic auth 'user:password' for the Prefect API and UI."
    )
    mlflow_admin_password: SecretStr | None = Field(
        None, description="Turns on MLflow basic auth (needs mlflow[auth]): the admin password."
    )
    host: str = Field(
        "127.0.0.1",
        description="Bind address of both servers; one other than 127.0.0.1, ::1 or localhost "
        "needs prefect_auth_string and mlflow_admin_password.",
    )
    prefect_port: int = Field(4200, ge=1, le=65535, description="Prefect server port.")
    mlflow_port: int = Field(5000, ge=1, le=65535, description="MLflow server port.")
    state_dir: Path | None = Field(
        None, description="Logs, state files, auth config; None = <workspace>/.servers."
    )
    prefect_database_url: SecretStr | None = Field(
        None,
        description="None = the workspace's Prefect home, or postgresql+asyncpg://U:P@HOST/DB.",
    )
    prefect_ui_api_url: str | None = Field(
        None, description="API URL the UI calls if browsers use another name: http://HOST:PORT/api"
    )
    mlflow_backend_store_uri: SecretStr | None = Field(
        None,
        description="None = the workspace's mlflow.db, or postgresql://U:P@HOST/DB (psycopg2).",
    )
    mlflow_artifacts_destination: str | None = Field(
        None, description="None = the workspace's mlartifacts/, or s3://BUCKET/PREFIX (boto3)."
    )
    mlflow_s3_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO), exported as MLFLOW_S3_ENDPOINT_URL."
    )
    mlflow_admin_username: str = Field("admin", min_length=1, description="MLflow admin user.")
    mlflow_workers: int = Field(1, ge=1, le=64, description="MLflow server worker processes.")
    mlflow_allowed_hosts: str | None = Field(
        None, description="MLflow --allowed-hosts; None = localhost and private addresses."
    )
    startup_timeout_s: float = Field(120.0, gt=0, description="How long `up` waits for health.")
    stop_timeout_s: float = Field(20.0, gt=0, description="`down`: SIGTERM, this wait, SIGKILL.")

    @field_validator("host")
    @classmethod
    def _loopback_or_authenticated(cls, value: str, info: ValidationInfo) -> str:
        problem = exposure_problem(value, info.data)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("prefect_auth_string")
    @classmethod
    def _user_colon_password(cls, value: SecretStr | None) -> SecretStr | None:
        user, sep, password = (value.get_secret_value() if value else "x:x").partition(":")
        if not (user and sep and password):
            raise ValueError("must look like 'user:password'")
        return value

    @field_validator("mlflow_admin_password")
    @classmethod
    def _mlflow_password_policy(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 12:
            raise ValueError("must be at least 12 characters (MLflow's password policy)")
        if value is not None and value.get_secret_value() == MLFLOW_LEGACY_DEFAULT_PASSWORD:
            raise ValueError(
                "must not be the default password older MLflow versions shipped "
                "(publicly known: GHSA-gq3w-7jj3-x7gr)"
            )
        return value

    @field_validator(*_URL_PREFIXES)
    @classmethod
    def _url_scheme(cls, value: SecretStr | str | None, info: ValidationInfo) -> Any:
        text = value.get_secret_value() if isinstance(value, SecretStr) else value
        prefixes, local_ok = _URL_PREFIXES[str(info.field_name)]
        if text is not None and not (text.startswith(prefixes) or (local_ok and "://" not in text)):
            raise ValueError(
                f"must start with {' or '.join(prefixes)}" + local_ok * " or be a path"
            )
        return value

    @field_validator("mlflow_port")
    @classmethod
    def _distinct_ports(cls, value: int, info: ValidationInfo) -> int:
        if value == info.data.get("prefect_port"):
            raise ValueError("must differ from servers.prefect_port")
        return value
