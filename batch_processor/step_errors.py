"""What the processor does when one batch's step keeps raising: say it once, then give up on the batch.

A step that fails because the database or Redis is unreachable, or the file store is full (writing a
batch's output), is the platform's trouble and is retried every round: the batch finalizes once there is room. Any other exception is the batch's: the first one is logged with its traceback, repeats one
line each (at most once a minute), and after `MAX_STRIKES` consecutive failures a batch still being
validated is failed with an error that names the exception — nothing has been created for it yet, so
failing it loses nothing. Later steps (dispatch, finalize, cancel) keep retrying quietly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError
from sqlalchemy.exc import InterfaceError, OperationalError

from holdback.logs import log_event
from holdback.models import BatchStatus
from holdback.storage import StorageFull

MAX_STRIKES = 3
REPEAT_EVERY = 60.0  # seconds between repeat log lines for a batch that keeps failing
_PLATFORM_ERRORS = (OperationalError, InterfaceError, RedisConnectionError, RedisTimeoutError, OSError, StorageFull)


@dataclass
class _Streak:
    strikes: int = 0
    logged_at: float = float("-inf")


@dataclass
class StepErrors:
    """Consecutive step failures per batch; `record` logs and says whether to give up on the batch."""

    log: logging.Logger
    max_strikes: int = MAX_STRIKES
    _streaks: dict[str, _Streak] = field(default_factory=dict)

    def record(self, batch_id: str, status: str, exc: Exception) -> bool:
        """Log this failure (quietly if it repeats); True once a validating batch should be failed."""
        streak = self._streaks.setdefault(batch_id, _Streak())
        platform = isinstance(exc, _PLATFORM_ERRORS)
        if not platform:
            streak.strikes += 1
        now = time.monotonic()
        fields = dict(batch_id=batch_id, status=status, error=describe(exc), strikes=streak.strikes)
        if streak.logged_at == float("-inf"):
            self.log.error("batch_step_failed", exc_info=exc, extra={"fields": fields})
            streak.logged_at = now
        elif now - streak.logged_at >= REPEAT_EVERY:
            log_event(self.log, "batch_step_failing", level=logging.WARNING, **fields)
            streak.logged_at = now
        return not platform and status == BatchStatus.validating.value and streak.strikes >= self.max_strikes

    def clear(self, batch_id: str) -> None:
        """The batch's step went through."""
        self._streaks.pop(batch_id, None)

    def retain(self, batch_ids: set[str]) -> None:
        """Forget batches this processor no longer holds."""
        for batch_id in [b for b in self._streaks if b not in batch_ids]:
            del self._streaks[batch_id]


def describe(exc: BaseException, limit: int = 300) -> str:
    """`Type: message`, cut short, with nothing a database text column could refuse."""
    text = f"{type(exc).__name__}: {exc}".replace("\x00", "\\u0000")
    text = text.encode("utf-8", errors="backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit - 3] + "..."
