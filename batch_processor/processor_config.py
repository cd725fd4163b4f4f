"""How one processor runs: its name, its pace, the windows it keeps, how it hands rows off and retries them,
how long its leases last and how much whole-batch work a round may do; checked once, when built.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from batch_processor.fairness import QUEUE_ROUNDS


def default_name() -> str:
    return f"processor-{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class ProcessorConfig:
    name: str = field(default_factory=default_name)
    poll_interval: float = 0.2
    window: int = 256  # most rows of one tenant in flight (queued + running + retry_wait)
    queue_rounds: float = QUEUE_ROUNDS  # windows shrink so all tenants keep ~this × worker capacity in flight
    dispatch: str = "async"  # async: RQ jobs for the workers; sync: this process calls the gateway
    sync_concurrency: int = 64
    lease_seconds: float = 30.0
    claim_per_round: int = 16  # new batches claimed per round, so several processors share the work
    max_batches: int = 1000  # most batches one processor holds
    reconcile_interval: float = 5.0
    reconcile_grace: float = 30.0  # a queued / due retry row with no job this long is handed off again
    running_grace: float = 30.0  # a running row untouched this long with no live job is abandoned
    backoff_base: float = 2.0  # the sync mode's retry pacing (holdback.attempts.RetryPolicy)
    backoff_cap: float = 60.0
    request_timeout: float = 600.0
    # Seconds of a round's whole-batch steps (expand, cancel, expire, finalize) after which the rest wait for
    # the next round, so one tenant's many large batches cannot hold up every other batch's dispatch; the
    # steps are taken one tenant at a time in turn, and at least one goes each round.
    round_work_seconds: float = 1.0
    # Within a batch, rows sharing a prompt prefix are queued together (batch_processor.prefix_plan); off: line order.
    prefix_plan: bool = True

    def __post_init__(self) -> None:
        if self.dispatch not in ("async", "sync"):
            raise ValueError(f"dispatch must be 'async' or 'sync', got {self.dispatch!r}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if self.queue_rounds < 0:
            raise ValueError(f"queue rounds must not be negative, got {self.queue_rounds}")
        if self.round_work_seconds < 0:
            raise ValueError(f"round work seconds must not be negative, got {self.round_work_seconds}")
        if self.sync_concurrency < 1:
            raise ValueError(f"sync concurrency must be at least 1, got {self.sync_concurrency}")
        if self.poll_interval <= 0 or self.lease_seconds <= 3 * self.poll_interval:
            raise ValueError("poll interval must be positive and the lease at least three poll intervals long")
