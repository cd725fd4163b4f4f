"""What the API accepts and returns, apart from the DB models.

Request bodies are pydantic models whose validators say what to change; responses are built by
`file_to_api` and `batch_to_api` (the dashboard reuses the latter) and documented by the
response models, which FastAPI also checks them against.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from holdback.contract import INFERENCE_PATHS
from holdback.models import Batch, File

UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
BATCH_OUTPUT_PURPOSE = "batch_output"

EXPIRES_AFTER_MIN = 3600
EXPIRES_AFTER_MAX = 2_592_000  # 30 days

METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY = 64
METADATA_MAX_VALUE = 512

WINDOW_MIN_SECONDS = 60
WINDOW_MAX_SECONDS = 7 * 86400
_WINDOW = re.compile(r"^([1-9][0-9]{0,6})([smhd])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
WINDOW_FORMAT = (
    "completion_window must be '24h' or a duration such as '90s', '30m', '1h' or '2d' "
    f"(a whole number followed by s, m, h or d) between {WINDOW_MIN_SECONDS}s and {WINDOW_MAX_SECONDS // 86400}d"
)


def parse_completion_window(text: str) -> int:
    """Seconds in a completion window such as '24h'; ValueError (with the accepted format) otherwise."""
    match = _WINDOW.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{WINDOW_FORMAT}; got {text!r}.")
    seconds = int(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    if not WINDOW_MIN_SECONDS <= seconds <= WINDOW_MAX_SECONDS:
        raise ValueError(f"{WINDOW_FORMAT}; {text!r} is {seconds}s.")
    return seconds


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > METADATA_MAX_PAIRS:
        raise ValueError(
            f"metadata may hold at most {METADATA_MAX_PAIRS} key-value pairs; it has {len(metadata)}. Remove some."
        )
    for key, value in metadata.items():
        if len(key) > METADATA_MAX_KEY:
            raise ValueError(
                f"metadata keys may be at most {METADATA_MAX_KEY} characters; {key[:20]!r}... has {len(key)}."
            )
        if len(value) > METADATA_MAX_VALUE:
            raise ValueError(
                f"metadata values may be at most {METADATA_MAX_VALUE} characters; "
                f"the value of {key!r} has {len(value)}."
            )
    return metadata


# ---- requests ----------------------------------------------------------------------------------


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    anchor: Literal["created_at"] = Field(description="Only 'created_at' is supported.")
    seconds: int = Field(ge=EXPIRES_AFTER_MIN, le=EXPIRES_AFTER_MAX, description="3600 (1 hour) to 2592000 (30 days).")


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(description="A file uploaded with purpose=batch.")
    endpoint: str = Field(description="One of " + ", ".join(INFERENCE_PATHS) + ".")
    completion_window: str = Field(description="'24h', or as an extension a duration such as '1h', '30m', '2d'.")
    metadata: dict[str, str] | None = Field(None, description="Up to 16 string pairs; keys ≤64, values ≤512 chars.")
    output_expires_after: ExpiresAfter | None = Field(None, description="Expiry of the output and error files.")

    @field_validator("endpoint")
    @classmethod
    def _known_endpoint(cls, value: str) -> str:
        if value not in INFERENCE_PATHS:
            raise ValueError(f"endpoint must be one of {', '.join(INFERENCE_PATHS)}; got {value!r}.")
        return value

    @field_validator("completion_window")
    @classmethod
    def _valid_window(cls, value: str) -> str:
        parse_completion_window(value)
        return value.strip()

    @field_validator("metadata")
    @classmethod
    def _valid_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @property
    def window_seconds(self) -> int:
        return parse_completion_window(self.completion_window)


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(min_length=1, max_length=128, pattern=r"\S", description="Tenant name; created if new.")


# ---- responses ---------------------------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    expires_at: int | None
    status_details: str | None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    output_file_id: str | None
    error_file_id: str | None
    errors: BatchErrors | None
    request_counts: RequestCounts
    usage: Usage
    model: str | None
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class AdminBatch(BatchObject):
    tenant_id: str


class AdminBatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdminBatch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class CreatedKey(BaseModel):
    object: Literal["api_key"] = "api_key"
    tenant: str
    tenant_id: str
    key: str = Field(description="The secret; shown only in this response.")


# ---- serialisation -----------------------------------------------------------------------------


def file_to_api(file: File) -> dict:
    return {
        "id": file.id,
        "object": "file",
        "bytes": int(file.bytes),
        "created_at": int(file.created_at),
        "filename": file.filename,
        "purpose": file.purpose,
        "status": file.status or "processed",
        "expires_at": _int_or_none(file.expires_at),
        "status_details": None,
    }


def batch_to_api(batch: Batch) -> dict:
    """The OpenAI Batch object for a batch row: every field, integer unix seconds, null where not reached."""
    input_tokens = int(batch.input_tokens or 0)
    output_tokens = int(batch.output_tokens or 0)
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "input_file_id": batch.input_file_id,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "created_at": int(batch.created_at),
        "in_progress_at": _int_or_none(batch.in_progress_at),
        "expires_at": _int_or_none(batch.expires_at),
        "finalizing_at": _int_or_none(batch.finalizing_at),
        "completed_at": _int_or_none(batch.completed_at),
        "failed_at": _int_or_none(batch.failed_at),
        "expired_at": _int_or_none(batch.expired_at),
        "cancelling_at": _int_or_none(batch.cancelling_at),
        "cancelled_at": _int_or_none(batch.cancelled_at),
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "errors": _errors_to_api(batch.errors),
        "request_counts": {
            "total": int(batch.total or 0),
            "completed": int(batch.completed or 0),
            "failed": int(batch.failed or 0),
        },
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": int(batch.cached_tokens or 0)},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": int(batch.reasoning_tokens or 0)},
            "total_tokens": input_tokens + output_tokens,
        },
        "model": batch.model,
        "metadata": batch.metadata_,
    }


def list_page(items: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


def _errors_to_api(errors: list | dict | None) -> dict | None:
    # The row holds the list of {code, message, param, line}; an already wrapped list object is accepted too.
    if not errors:
        return None
    if isinstance(errors, dict):
        return {"object": "list", "data": list(errors.get("data") or [])}
    return {"object": "list", "data": list(errors)}


def _int_or_none(value: int | float | None) -> int | None:
    return None if value is None else int(value)
