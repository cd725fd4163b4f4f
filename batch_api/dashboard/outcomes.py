"""How the dashboard and the metrics count a batch's finished requests: succeeded, failed, cancelled.

OpenAI's `request_counts.failed` (and `batches.failed`) counts every request that did not succeed; a cancel
is not a failure to the operator, so here `failed` leaves out the rows a cancel closed (`batches.cancelled`).
A batch whose every line failed is `completed` to the API, but not shown as a success.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from holdback.models import Batch, BatchStatus

OUTCOMES = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class Outcomes:
    total: int
    succeeded: int
    failed: int  # did not succeed and was not cancelled (failed or expired)
    cancelled: int

    @classmethod
    def of(cls, batch: Batch) -> "Outcomes":
        cancelled = int(batch.cancelled or 0)
        return cls(int(batch.total or 0), int(batch.completed or 0), int(batch.failed or 0) - cancelled, cancelled)

    @property
    def finished(self) -> int:
        return self.succeeded + self.failed + self.cancelled

    def share(self, n: int) -> float:
        return n / self.total if self.total else 0.0


@dataclass(frozen=True)
class ShownStatus:
    """A batch's status as the dashboard shows it: the API's, unless the API's hides a failure."""

    label: str
    tone: str  # the badge's CSS class suffix
    title: str | None = None


def shown_status(status: str, outcomes: Outcomes) -> ShownStatus:
    if status == BatchStatus.completed.value and outcomes.total and outcomes.succeeded == 0:
        return ShownStatus("completed · all failed", "all-failed",
                           f"All {outcomes.total} requests failed; the API reports status completed, as OpenAI's does.")
    if status == BatchStatus.completed.value and outcomes.failed:
        return ShownStatus(f"completed · {outcomes.failed} failed", "some-failed",
                           f"{outcomes.failed} of {outcomes.total} requests failed; see the error file.")
    return ShownStatus(status.replace("_", " "), status.replace("_", "-"))


def outcome_totals(session: Session) -> dict[str, int]:
    """Finished requests of every batch in the database by outcome, from the batches' own counters."""
    completed, failed, cancelled = session.execute(
        select(func.coalesce(func.sum(Batch.completed), 0), func.coalesce(func.sum(Batch.failed), 0),
               func.coalesce(func.sum(Batch.cancelled), 0))
    ).one()
    return {"succeeded": int(completed), "failed": int(failed) - int(cancelled), "cancelled": int(cancelled)}


class OutcomeCollector(Collector):
    """`holdback_batch_requests_finished{outcome}` on the API server's /metrics, read from the database at
    scrape time (one aggregate over the batches table). Every API server reports the same figures: take
    the max across servers, not the sum. A gauge, because deleting batches lowers it."""

    def __init__(self, sessions: sessionmaker[Session]):
        self.sessions = sessions

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()  # registering asks for the names; no query for that

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        try:
            with self.sessions() as session:
                totals = outcome_totals(session)
        except Exception:  # noqa: BLE001 - a database outage leaves the series out, /metrics still answers
            return
        for outcome in OUTCOMES:
            family.add_metric([outcome], totals[outcome])
        yield family

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "holdback_batch_requests_finished",
            "Finished requests of the batches in the database by outcome: succeeded, failed (failed or expired), "
            "cancelled (closed by a batch cancel; OpenAI's request_counts.failed counts them as failed).",
            labels=["outcome"])
