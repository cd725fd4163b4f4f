"""Whether a batch is at risk of missing its completion window: the one rule, read by the processor (which marks
at-risk batches for the workers and counts them), the workers (whose requests of an at-risk batch may use the
gateway's at-risk floor) and the dashboard (which warns before the batch expires).

A batch is at risk when, at the pace it has kept since it started (requests finished per second), the requests
it has left would take longer than what is left of its window, less a margin: the mark must come while the
gateway's floor can still finish it. A batch that has run for less than a twentieth of its window is not judged
yet: its pace means nothing so early (15 s of a 5-minute window, 72 minutes of a day's). The pace counts one more
request as finishing now: a batch that has finished nothing is at risk only when even that pace would not
finish it. A batch already marked stays at risk until its projection leaves a wider margin (RELEASE): the floor's
help raises its pace, and a mark dropped at the first sign of that would starve it again.
"""

from __future__ import annotations

from dataclasses import dataclass

# At risk when the projected finish would use more than this share of the time left; once marked, until it uses
# less than RELEASE of it.
MARGIN = 0.9
RELEASE = 0.7
# No verdict before this share of the window has passed.
GRACE_SHARE = 0.05


@dataclass(frozen=True)
class Pace:
    """A batch's pace so far and what it projects; `at_risk` is the verdict."""

    left: int  # requests not final yet
    rate: float | None  # requests finished per second since the batch started (None: not judged yet)
    needs: float | None  # seconds the requests left need at that rate, one more counted as finishing now
    remaining: float  # seconds left of the window
    at_risk: bool


def pace(now: float, started: float | None, expires_at: float | None, total: int, finished: int,
         marked: bool = False) -> Pace:
    """The pace of a batch in progress since `started` (unix seconds) whose window ends at `expires_at`;
    `marked`: it was at risk at the last look."""
    left = max(0, total - finished)
    remaining = (expires_at - now) if expires_at is not None else float("inf")
    if started is None or expires_at is None or left == 0 or remaining <= 0:
        return Pace(left, None, None, max(0.0, remaining), False)
    elapsed = now - started
    if elapsed < GRACE_SHARE * (expires_at - started):
        return Pace(left, None, None, remaining, False)
    rate = finished / elapsed
    needs = left * elapsed / (finished + 1)
    return Pace(left, rate, needs, remaining, needs > (RELEASE if marked else MARGIN) * remaining)
