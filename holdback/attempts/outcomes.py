"""What an attempt's answer means: the reply it got, and the outcome class of that reply.

ReplyClass classes: 2xx → success; 429 with any drop reason → retry with backoff
until the batch deadline, never counted against a budget; a failing path (gateway unreachable, 502/503,
no replica) → the same, never budgeted: an outage costs time, not results; a stream that broke after it
carried output (how an llm-d eviction reaches us: a bare reset) → the same, resuming from that output;
other 5xx (a failed stream's error event too) and transport errors → retry within a budget of transient
failures, then fail; other 4xx → final failure whose response goes to the error file.
"""

from __future__ import annotations

import email.utils
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from holdback.attempts.headers import header
from holdback.contract import DROP_REASON_HEADER, REPLICA_HEADERS, is_eviction, is_no_endpoints
from holdback.models import AttemptOutcome

# A proxy's own "nobody behind me answered" statuses: the path failed, not the request.
PATH_STATUSES = frozenset({502, 503})


@dataclass(frozen=True)
class ReplyClass:
    """The class of one attempt's answer; `kind` is what the Attempt row records."""

    kind: AttemptOutcome
    status: int | None = None
    drop_reason: str | None = None
    retry_after: float | None = None  # seconds the server asked us to wait, if it did
    path_failure: bool = False  # the way to a replica failed (see `is_path_failure`), not this request
    # A stream broke after it carried output with no word why. Behind llm-d an eviction looks exactly like this
    # (no 429, no event), and the retry resumes from the output, so it is not budgeted. A replica that crashes
    # on this request every time would loop: each such retry has made progress of its own, and the batch's
    # deadline ends the loop (the row is then closed with the batch, never retried past it).
    cut_after_output: bool = False

    @property
    def evicted(self) -> bool:
        return self.kind is AttemptOutcome.evicted

    @property
    def transient(self) -> bool:
        """5xx and transport errors the request may have caused: retried within the transient-failure budget."""
        return (self.kind in (AttemptOutcome.server_error, AttemptOutcome.transport_error)
                and not self.path_failure and not self.cut_after_output)

    @property
    def shed(self) -> bool:
        """429 from the gateway (evicted or rejected): retried until the deadline, never budgeted."""
        return self.kind in (AttemptOutcome.evicted, AttemptOutcome.rejected)


def is_path_failure(status: int | None, drop_reason: str | None = None, *, unreachable: bool = False) -> bool:
    """True when the answer says the way to a replica is down rather than anything about the request:
    no connection could be opened (`unreachable`), a 502/503 (the gateway or a proxy found nobody to
    answer), or a drop reason of the `rejected-no-endpoints` family (no healthy replica). Such a request
    never reached a model, so retrying it later costs time only; the workers' circuit breaker uses the same test."""
    if status is None:
        return unreachable
    return status in PATH_STATUSES or is_no_endpoints(drop_reason)


def classify(status: int | None, headers: Mapping[str, str] | None = None, *, now: float | None = None,
             unreachable: bool = False, cut_after_output: bool = False) -> ReplyClass:
    """Class an answer by its status and headers; `status=None` means no HTTP answer (a transport error),
    `unreachable` that not even a connection was made, `cut_after_output` that a stream broke after it
    carried output."""
    headers = headers or {}
    drop_reason = header(headers, DROP_REASON_HEADER)
    retry_after = parse_retry_after(header(headers, "retry-after"), now=now)
    path = is_path_failure(status, drop_reason, unreachable=unreachable)
    if status is None:
        return ReplyClass(AttemptOutcome.transport_error, path_failure=path, cut_after_output=cut_after_output)
    if 200 <= status < 300:
        return ReplyClass(AttemptOutcome.success, status)
    if status == 429:
        kind = AttemptOutcome.evicted if is_eviction(drop_reason) else AttemptOutcome.rejected
        return ReplyClass(kind, status, drop_reason, retry_after)
    if 400 <= status < 500:
        return ReplyClass(AttemptOutcome.client_error, status, drop_reason)
    # 5xx, and anything else a proxy might answer (1xx/3xx): transient, or a failing path.
    return ReplyClass(AttemptOutcome.server_error, status, drop_reason, retry_after, path_failure=path)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)



@dataclass(frozen=True)
class Reply:
    """What one attempt got back: an HTTP answer, a transport error, or an abort by us."""

    status: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes | None = None
    error: str | None = None  # transport error, what a stream's error event said, or why we aborted
    aborted: bool = False  # we closed the connection: the batch was cancelled or expired, or `resend`
    resend: bool = False  # we took it back from the gateway's queue to send it again at once
    unreachable: bool = False  # no connection could be opened: the request never left
    cut_after_output: bool = False  # a stream broke after it carried output (see `ReplyClass.cut_after_output`)

    @classmethod
    def transport_error(cls, error: str, *, unreachable: bool = False, cut_after_output: bool = False) -> "Reply":
        return cls(error=error, unreachable=unreachable, cut_after_output=cut_after_output)

    @classmethod
    def cancelled(cls, reason: str = "batch cancelled or expired") -> "Reply":
        return cls(error=reason, aborted=True)

    @classmethod
    def withdrawn(cls, reason: str) -> "Reply":
        """Taken back unanswered from the gateway's queue, to be sent again at once."""
        return cls(error=reason, aborted=True, resend=True)

    @property
    def replica(self) -> str | None:
        for name in REPLICA_HEADERS:
            value = header(self.headers, name)
            if value:
                return value[:256]
        return None
