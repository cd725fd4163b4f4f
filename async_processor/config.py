"""The worker's configuration: flags over `HOLDBACK_WORKER_*` environment defaults, read once at start-up.

`holdback up`, the study and tests can scale time down (backoff, heartbeats) without new flags, and an
operator sees every knob in `holdback worker --help`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from holdback.contract import cancel_channel, wake_channel, work_channel
from holdback.attempts import Jitter, RetryPolicy
from holdback.attempts.resume import STREAM_INTERVAL


class WorkerSettings(BaseSettings):
    """Environment defaults for `holdback worker` (prefix HOLDBACK_WORKER_); flags override them."""

    model_config = SettingsConfigDict(env_prefix="HOLDBACK_WORKER_", extra="ignore")

    concurrency: int = Field(64, description="requests in flight per process")
    backoff_base: float = Field(2.0, description="first retry step, seconds")
    backoff_cap: float = Field(60.0, description="largest retry step, seconds")
    jitter: Jitter = Field(Jitter.equal, description="full: [0, step); equal: [step/2, step)")
    transient_budget: int = Field(5, description="a row fails on this many 5xx/transport failures (outages excluded)")
    closing_recheck: float = Field(30.0, description="seconds a row of a closing batch waits before its job looks again")
    request_timeout: float = Field(600.0, description="seconds one gateway request may take")
    heartbeat_ttl: int = Field(9, description="seconds an in-flight job stays started without a heartbeat")
    scheduler_interval: float = Field(0.1, description="seconds between moves of due retries to the queue")
    db_lanes: int = Field(2, description="database threads, each grouping waiting calls into one transaction (SQLite: 1)")
    probe_interval: float = Field(1.0, description="seconds between probes of the gateway while its circuit is open")
    resume: bool = Field(True, description="an evicted streamed request continues from its partial output")
    stream_interval: int = Field(STREAM_INTERVAL, description="tokens per event of a resumable stream (vLLM's "
                                 "stream_interval; 1: every token, the field not sent)")


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs, resolved from flags, WorkerSettings and holdback Settings."""

    name: str
    queue_name: str
    namespace: str
    redis_url: str
    database_url: str
    gateway_url: str
    gateway_key: str | None
    concurrency: int = 64
    policy: RetryPolicy = RetryPolicy()
    request_timeout: float = 600.0
    # A dead worker's jobs are requeued within TTL + TTL/3 (one maintenance interval): 12 s at 9.
    heartbeat_ttl: int = 9
    scheduler_interval: float = 0.1
    probe_interval: float = 1.0
    db_lanes: int = 2
    resume: bool = True
    stream_interval: int = STREAM_INTERVAL
    burst: bool = False
    metrics_port: int | None = None
    drain_timeout: float = 30.0
    claim_batch: int = 32
    failure_ttl: int = 7 * 24 * 3600  # how long a failed row's job stays in the FailedJobRegistry

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError(f"concurrency (-n) must be at least 1, got {self.concurrency}")
        if self.heartbeat_ttl < 3:
            raise ValueError(f"heartbeat TTL must be at least 3 seconds, got {self.heartbeat_ttl}")
        if self.request_timeout <= 0:
            raise ValueError(f"request timeout must be positive, got {self.request_timeout}")
        if self.probe_interval <= 0:
            raise ValueError(f"probe interval must be positive, got {self.probe_interval}")
        if self.stream_interval < 1:
            raise ValueError(f"stream interval (--stream-interval) must be at least 1, got {self.stream_interval}")

    @property
    def heartbeat_interval(self) -> float:
        """Refresh started-registry entries and the worker key well inside their TTL."""
        return min(30.0, self.heartbeat_ttl / 3)

    @property
    def cancel_channel(self) -> str:
        return cancel_channel(self.namespace)

    @property
    def wake_channel(self) -> str:
        return wake_channel(self.namespace)

    @property
    def work_channel(self) -> str:
        return work_channel(self.namespace)
