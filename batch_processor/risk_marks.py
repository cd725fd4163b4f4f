"""The processor marks its batches at risk of missing their window (holdback.risk) where the workers read them:
a Redis sorted set (`holdback.contract.at_risk_key`), each batch scored with the time its mark lapses. The owner
renews a mark every few seconds while its batch stays at risk and removes it when the batch is no longer at
risk (or is no longer in progress here); a processor that dies leaves marks that lapse by themselves. It also
logs each batch that turns at risk, with its pace, and counts them for /metrics.
"""

from __future__ import annotations

import logging
import time

import redis
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from batch_processor.metrics import ProcessorMetrics
from holdback.contract import at_risk_key
from holdback.logs import log_event
from holdback.models import Batch
from holdback.risk import pace

log = logging.getLogger("batch_processor")

# How often the marks are renewed, and how long a mark lasts without renewal.
EVERY_SECONDS = 2.0
LAPSE_SECONDS = 30.0


class RiskMarks:
    def __init__(self, factory: sessionmaker[Session], connection: redis.Redis, namespace: str,
                 metrics: ProcessorMetrics):
        self.factory = factory
        self.redis = connection
        self.key = at_risk_key(namespace)
        self.metrics = metrics
        self.marked: set[str] = set()
        self._at = float("-inf")

    def update(self, in_progress: list[str], now: float | None = None, *, force: bool = False) -> set[str]:
        """Judge the owned batches in progress (at most every EVERY_SECONDS unless `force`) and mark those at
        risk; returns the batches marked."""
        if not force and time.monotonic() - self._at < EVERY_SECONDS:
            return self.marked
        self._at = time.monotonic()
        now = time.time() if now is None else now
        at_risk: set[str] = set()
        if in_progress:
            with self.factory() as session:
                rows = session.execute(
                    select(Batch.id, Batch.tenant_id, Batch.in_progress_at, Batch.expires_at, Batch.total,
                           Batch.completed, Batch.failed).where(Batch.id.in_(in_progress))).all()
            for row in rows:
                p = pace(now, row.in_progress_at, row.expires_at, row.total, row.completed + row.failed,
                         marked=row.id in self.marked)
                if p.at_risk:
                    at_risk.add(row.id)
                    if row.id not in self.marked:
                        log_event(log, "batch_at_risk", level=logging.WARNING, batch_id=row.id, tenant=row.tenant_id,
                                  left=p.left, rate_per_s=round(p.rate or 0.0, 3), needs_s=round(p.needs or 0.0, 1),
                                  window_left_s=round(p.remaining, 1))
        cleared = self.marked - at_risk
        with self.redis.pipeline(transaction=False) as pipe:
            if at_risk:
                pipe.zadd(self.key, {batch_id: now + LAPSE_SECONDS for batch_id in at_risk})
            if cleared:
                pipe.zrem(self.key, *cleared)
            pipe.zremrangebyscore(self.key, "-inf", now)  # marks a dead owner left
            pipe.execute()
        for batch_id in cleared:
            log_event(log, "batch_no_longer_at_risk", batch_id=batch_id)
        self.marked = at_risk
        self.metrics.batches_at_risk.set(len(self.marked))
        return self.marked
