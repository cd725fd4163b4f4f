"""How retries are paced and bounded: exponential backoff with jitter, a server's `Retry-After` as its floor,
and the budget of transient failures a row may spend."""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from dataclasses import dataclass


class Jitter(str, enum.Enum):
    full = "full"  # uniform in [0, x)
    equal = "equal"  # uniform in [x/2, x): never retries sooner than half the step


def backoff(
    attempt: int,
    retry_after: float | None = None,
    *,
    base: float = 2.0,
    cap: float = 60.0,
    jitter: Jitter | str = Jitter.equal,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait after failed attempt number `attempt` (1-based): base doubling to cap, jittered.

    A server's `Retry-After` is a floor: we never come back sooner than it asked.
    """
    step = min(cap, base * (2 ** max(0, attempt - 1)))
    if Jitter(jitter) is Jitter.full:
        delay = step * rand()
    else:
        delay = step / 2 + (step / 2) * rand()
    if retry_after is not None:
        delay = max(delay, retry_after)
    return delay


@dataclass(frozen=True)
class RetryPolicy:
    """How retries are paced and bounded; defaults: 2 s doubling to 60 s with jitter, 5 transient failures."""

    base: float = 2.0
    cap: float = 60.0
    jitter: Jitter = Jitter.equal
    transient_budget: int = 5  # the row fails on its N-th transient failure (5xx or transport error)
    # A row whose batch is past its deadline (or being cancelled) waits this long for the processor to
    # close it before its job looks again.
    closing_recheck: float = 30.0

    def __post_init__(self) -> None:
        if self.base <= 0 or self.cap < self.base:
            raise ValueError(f"backoff needs 0 < base <= cap, got base={self.base} cap={self.cap}")
        if self.transient_budget < 1:
            raise ValueError(f"transient_budget must be at least 1, got {self.transient_budget}")
        if self.closing_recheck <= 0:
            raise ValueError(f"closing_recheck must be positive, got {self.closing_recheck}")

    def delay(self, attempt: int, retry_after: float | None = None, rand: Callable[[], float] = random.random) -> float:
        return backoff(attempt, retry_after, base=self.base, cap=self.cap, jitter=self.jitter, rand=rand)

