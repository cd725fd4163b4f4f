"""The operator API's response models (its OpenAPI docs, tag "admin"): request rows and their attempts,
tenants' usage, RQ queues and workers. The functions that build these answers return plain dicts, as `batch_api.schemas`' do."""

from __future__ import annotations

from pydantic import BaseModel, Field


class RequestRowObject(BaseModel):
    id: str
    custom_id: str
    line: int
    status: str
    attempts: int
    evictions: int
    duplicates: int
    transient_failures: int
    created_at: float
    enqueued_at: float | None
    first_attempt_at: float | None
    finished_at: float | None
    input_tokens: int
    output_tokens: int
    response_status: int | None
    error_code: str | None
    error_message: str | None = Field(None, description="the replica's error message, else ours (a cancel, ...)")


class RequestRowList(BaseModel):
    object: str = "list"
    data: list[RequestRowObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class AttemptObject(BaseModel):
    number: int
    worker: str | None
    replica: str | None
    started_at: float
    ended_at: float | None
    outcome: str | None
    status_code: int | None
    drop_reason: str | None
    evicted: bool
    input_tokens: int
    output_tokens: int
    error: str | None
    cached_tokens: int = 0
    tokens_kept: int = Field(0, description="output tokens carried in from earlier attempts (resumed)")
    tokens_recomputed: int = Field(0, description="earlier attempts' prompt + output this attempt computed again")


class AttemptList(BaseModel):
    object: str = "list"
    request_id: str
    batch_id: str
    data: list[AttemptObject]


class TenantUsageObject(BaseModel):
    object: str = "tenant.usage"
    tenant_id: str
    tenant: str
    batches: int = Field(description="batches created in the period")
    succeeded: int = Field(description="requests that finished in the period, by outcome")
    failed: int = Field(description="failed or expired")
    cancelled: int
    input_tokens: int = Field(description="of the requests that finished in the period")
    output_tokens: int
    rejections: int = Field(description="attempts started in the period that the gateway rejected (429, not evicted)")
    evictions: int = Field(description="attempts started in the period that were evicted")
    in_flight: int = Field(description="requests running now")
    in_flight_share: float = Field(description="of every tenant's running requests, now")


class UsageList(BaseModel):
    object: str = "list"
    since: float
    until: float
    data: list[TenantUsageObject]


class QueueObject(BaseModel):
    object: str = "queue"
    name: str
    paused: bool
    queued: int
    started: int
    scheduled: int
    failed: int
    deferred: int
    finished: int
    workers: int


class QueueList(BaseModel):
    object: str = "list"
    data: list[QueueObject]


class QueuePaused(QueueObject):
    changed: bool


class RetriedFailed(BaseModel):
    object: str = "queue.retry_failed"
    queue: str
    examined: int
    requeued: int
    kept: int
    cleared: int


class WorkerObject(BaseModel):
    name: str
    queues: list[str]
    state: str | None
    hostname: str | None
    pid: int | None
    birth: str | None
    last_heartbeat: str | None
    heartbeat_age_s: float | None
    concurrency: int | None
    in_flight: int
    current_jobs: list[str]
    successful_job_count: int
    failed_job_count: int
    total_working_time: float


class WorkerList(BaseModel):
    object: str = "list"
    data: list[WorkerObject]
