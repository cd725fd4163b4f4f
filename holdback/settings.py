"""Typed settings for every holdback process, read once from the environment at the edge.

Nothing deeper reads the environment: a process calls `Settings()` at start-up and passes the
object (or the values it needs) down. Command-line flags get their variables from
`holdback.env_flags`.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MB = 1024 * 1024


class TenantLimitOverride(BaseModel):
    """One tenant's own limits in HOLDBACK_TENANT_LIMITS (unset: the HOLDBACK_TENANT_MAX_* default; 0: none)."""

    model_config = ConfigDict(extra="forbid")
    open_batches: int | None = Field(None, ge=0)
    enqueued_requests: int | None = Field(None, ge=0)
    enqueued_tokens: int | None = Field(None, ge=0)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HOLDBACK_", extra="ignore", populate_by_name=True)

    data_dir: Path = Field(Path("./data"), description="Where SQLite, uploaded files and the embedded Redis live.")
    database_url: str | None = Field(
        None,
        validation_alias="DATABASE_URL",
        description="SQLAlchemy URL; default sqlite under data_dir. postgresql://... selects PostgreSQL (psycopg 3).",
    )
    redis_url: str | None = Field(
        None, validation_alias="REDIS_URL", description="redis://...; default an embedded Redis under data_dir."
    )
    redis_namespace: str = Field("holdback", description="Prefix of every queue and key holdback writes to Redis.")
    admin_key: str | None = Field(None, description="Bearer key for the dashboard and operator routes.")
    gateway_url: str = Field("http://127.0.0.1:8200", description="Where workers send batch requests.")
    gateway_key: str | None = Field(None, description="The workers' own gateway API key.")
    validate_models: bool = Field(
        True, description="Check each batch line's body.model against the gateway's GET /v1/models before the batch "
        "runs (a line naming a model not served goes to the error file); while the gateway gives no list, batches "
        "wait in validating.")
    models_refresh_seconds: float = Field(30.0, gt=0, description="How long the processor keeps the gateway's model "
                                          "list before asking again.")
    max_upload_bytes: int = Field(512 * MB, description="Largest file any purpose may upload.")
    max_batch_file_bytes: int = Field(200 * MB, description="Largest file for purpose=batch.")
    max_batch_requests: int = Field(50_000, description="Most lines one batch input may have.")
    upload_min_bytes_per_minute: int = Field(
        16 * 1024, ge=1, description="An upload that sends less than this in any minute (or nothing for a minute) is "
        "answered 408 and dropped: a client that trickles a byte a second would otherwise hold its connection and "
        "an upload slot for ever.")
    migrate_on_start: bool = Field(True, description="Apply migrations when the API server starts.")
    tenant_max_open_batches: int = Field(100, ge=0, description="Most open batches (validating to cancelling) "
                                         "one tenant may have; more are refused with 429 (0: no limit).")
    tenant_max_enqueued_requests: int = Field(
        1_000_000, ge=0, description="Most unfinished requests one tenant's open batches may hold; a batch that "
        "would pass it fails validation with request_limit_exceeded (0: no limit).")
    tenant_max_enqueued_tokens: int = Field(
        250_000_000, ge=0, description="Most prompt tokens (estimated: input bytes / 4) one tenant's open batches may hold; "
        "a batch that would pass it fails with token_limit_exceeded (0: no limit).")
    tenant_limits: dict[str, TenantLimitOverride] = Field(
        default_factory=dict, description='Per-tenant overrides by tenant name, as JSON: '
        '{"acme": {"open_batches": 500, "enqueued_requests": 5000000, "enqueued_tokens": 0}}.')
    trusted_proxies: str = Field(
        "",
        description="Comma-separated addresses or CIDR networks of the reverse proxies in front of the API whose "
        "X-Forwarded-For and X-Forwarded-Proto are believed (e.g. 10.0.0.0/8); unset = none: every client is the "
        "address that connected, so no caller can pick the address the login throttle counts.",
    )
    files_url: str | None = Field(
        None,
        description="Where file bytes live: unset = data_dir/files; file:///dir = a (shared) directory; "
        "s3://bucket/prefix = an S3-compatible object store.",
    )
    s3_endpoint_url: str | None = Field(None, description="S3 endpoint, e.g. http://minio:9000; unset = AWS S3.")
    s3_region: str = Field("us-east-1", description="S3 region (signing); most S3-compatible servers accept any.")
    s3_access_key_id: str | None = Field(None, description="S3 access key; unset = boto3's chain (AWS_*, pod role).")
    s3_secret_access_key: str | None = Field(None, description="S3 secret key; unset = boto3's chain.")
    s3_part_size_mb: int = Field(8, ge=5, le=512, description="Multipart upload part size; about one part per upload is held in memory.")
    file_retention_grace_seconds: int = Field(
        7 * 24 * 3600, ge=0,
        description="How long a deleted or expired file's row is kept after its bytes are gone before the collector removes it.",
    )

    @field_validator("database_url", "redis_url", "files_url", "s3_endpoint_url", "s3_access_key_id",
                     "s3_secret_access_key", mode="before")
    @classmethod
    def _blank_is_unset(cls, value: str | None) -> str | None:
        return value or None

    @field_validator("files_url")
    @classmethod
    def _files_url_scheme(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parsed = urlparse(value)
        if parsed.scheme == "s3" and parsed.netloc:
            return value
        if parsed.scheme == "file" and parsed.netloc in ("", "localhost") and parsed.path.startswith("/"):
            return value
        raise ValueError(f"HOLDBACK_FILES_URL={value!r}: use s3://bucket/prefix, file:///absolute/dir, or leave it unset")

    @cached_property
    def sqlalchemy_url(self) -> str:
        url = self.database_url or f"sqlite:///{(self.data_dir / 'holdback.db').resolve()}"
        # Plain postgresql:// would pick psycopg2, which we do not ship; psycopg 3 is the driver.
        if url.startswith("postgresql://") or url.startswith("postgres://"):
            url = "postgresql+psycopg://" + url.split("://", 1)[1]
        return url

    @property
    def files_dir(self) -> Path:
        return self.data_dir / "files"

