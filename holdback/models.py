"""Database models: tenants and their API keys, files, batches, request rows and attempts.

Timestamps that the OpenAI API shows (`created_at`, `in_progress_at`, ...) are integer unix
seconds; attempt timings are float seconds because latency is measured from them.
A request row's status changes only through `holdback.lifecycle`; its terminal transition is a
compare-and-set (see `holdback.results`).
"""

from __future__ import annotations

import enum
import secrets
import time
from collections.abc import Iterator

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    # 24 hex chars: sortable enough for humans, unguessable across tenants.
    return f"{prefix}{secrets.token_hex(12)}"


def new_ids(prefix: str, batch: int = 1024) -> Iterator[str]:
    """Endless ids like `new_id`'s, their random part drawn for `batch` ids at a time (one system call for
    them all, not one an id: ingest makes one for every line)."""
    while True:
        digits = secrets.token_hex(12 * batch)
        for start in range(0, 24 * batch, 24):
            yield prefix + digits[start:start + 24]


class Base(DeclarativeBase):
    pass


class BatchStatus(str, enum.Enum):
    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


BATCH_TERMINAL = {BatchStatus.failed, BatchStatus.completed, BatchStatus.expired, BatchStatus.cancelled}


class RequestStatus(str, enum.Enum):
    pending = "pending"
    queued = "queued"
    running = "running"
    retry_wait = "retry_wait"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"


REQUEST_TERMINAL = {RequestStatus.succeeded, RequestStatus.failed, RequestStatus.cancelled, RequestStatus.expired}
REQUEST_TERMINAL_VALUES = tuple(s.value for s in REQUEST_TERMINAL)
# The database refuses any other status (migration 0007); the moves between them are holdback.lifecycle's.
REQUEST_STATUS_CHECK = "status IN ({})".format(", ".join(f"'{s.value}'" for s in RequestStatus))


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("tnt_"))
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("key_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    # sha256 of the secret; the secret itself is shown once and never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    revoked_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class File(Base):
    __tablename__ = "files"
    __table_args__ = (
        Index("ix_files_tenant_created", "tenant_id", "created_at"),
        # The retention collector walks expired, then long-deleted files in bounded steps.
        Index("ix_files_expires_at", "expires_at"),
        Index("ix_files_deleted_at", "deleted_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("file-"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    status: Mapped[str] = mapped_column(String(16), default="processed")
    storage_key: Mapped[str] = mapped_column(String(256))
    # Monotonic insertion order: ties in created_at (same second) still page stably.
    seq: Mapped[int] = mapped_column(BigInteger, default=lambda: time.time_ns())
    deleted_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_tenant_seq", "tenant_id", "seq"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("batch_"))
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    window_seconds: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=BatchStatus.validating.value)
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[list | None] = mapped_column(JSON, nullable=True)
    output_expires_after: Mapped[int | None] = mapped_column(Integer, nullable=True)

    created_at: Mapped[int] = mapped_column(BigInteger, default=now)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    expires_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    expired_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)

    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)

    # Live counters, moved by the same transaction that makes a row terminal.
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)  # OpenAI's: every request that did not succeed
    cancelled: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # of `failed`, closed by a cancel
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, default=0)

    # Processor lease: which processor owns this batch's lifecycle work, until when.
    claimed_by: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    seq: Mapped[int] = mapped_column(BigInteger, default=lambda: time.time_ns())
    # W3C traceparent that later work on the batch continues (holdback.tracing); None when tracing is off.
    trace_context: Mapped[str | None] = mapped_column(String(128), nullable=True)


class RequestRow(Base):
    __tablename__ = "request_rows"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id", name="uq_request_rows_batch_custom_id"),
        Index("ix_request_rows_batch_status", "batch_id", "status"),
        Index("ix_request_rows_status_next", "status", "next_attempt_at"),
        # The processor takes a batch's next pending rows, and finalizes by status, in line order.
        Index("ix_request_rows_batch_status_line", "batch_id", "status", "line"),
        # An operator's search finds the batch of a custom_id (the dashboard's batches list).
        Index("ix_request_rows_custom_id", "custom_id"),
        CheckConstraint(REQUEST_STATUS_CHECK, name="ck_request_rows_status"),
    )

    # Stable across every attempt and every re-run: it is the RQ job id and the gateway x-request-id.
    id: Mapped[str] = mapped_column(String(48), primary_key=True, default=lambda: new_id("batch_req_"))
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(40))
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(512))
    url: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.pending.value)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    evictions: Mapped[int] = mapped_column(Integer, default=0)
    transient_failures: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    enqueued_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # Final result, written once by the compare-and-set.
    response_status: Mapped[int | None] = mapped_column(Integer, nullable=True)
    response_body: Mapped[str | None] = mapped_column(Text, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(Text, nullable=True)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(Integer, default=0)
    duplicates: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float, default=time.time)
    updated_at: Mapped[float] = mapped_column(Float, default=time.time)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AttemptOutcome(str, enum.Enum):
    success = "success"
    evicted = "evicted"
    rejected = "rejected"  # 429 from the gateway other than an eviction
    server_error = "server_error"
    transport_error = "transport_error"
    client_error = "client_error"
    cancelled = "cancelled"
    abandoned = "abandoned"  # its worker died; found by reconciliation


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (UniqueConstraint("request_id", "number", name="uq_attempts_request_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(ForeignKey("request_rows.id", ondelete="CASCADE"), index=True)
    batch_id: Mapped[str] = mapped_column(String(40), index=True)
    number: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(String(128), nullable=True)
    replica: Mapped[str | None] = mapped_column(String(256), nullable=True)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    outcome: Mapped[str | None] = mapped_column(String(24), nullable=True)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    drop_reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    evicted: Mapped[bool] = mapped_column(Boolean, default=False)
    input_tokens: Mapped[int] = mapped_column(Integer, default=0)
    output_tokens: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)
    # Resume after eviction (holdback.attempts.resume): prompt tokens served from the prefix cache, the
    # output so far when a stream was cut (every attempt's answer text, so the next attempt continues from
    # it; only text), what else that output needs to continue (reasoning, token ids: a JSON object, NULL
    # when the text is all there is; migration 0008), output tokens carried in from earlier attempts, and
    # earlier work this attempt had to compute again.
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    partial_output: Mapped[str | None] = mapped_column(Text, nullable=True)
    # none_as_null: Python None is SQL NULL, not the JSON text 'null'.
    partial_state: Mapped[dict | None] = mapped_column(JSON(none_as_null=True), nullable=True)
    tokens_kept: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    tokens_recomputed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
