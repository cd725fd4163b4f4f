"""File retention: default expiry, which files running batches still need, and the collector.

Files follow OpenAI's defaults: `purpose=batch` inputs and batch output/error files expire 30 days
after creation (or sooner when asked); other purposes persist until deleted. The collector deletes an
expired file's bytes, then, after a grace period, its row, in bounded batches and never for a file a
running batch still reads.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge
from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from holdback.logs import log_event
from holdback.models import Batch, BatchStatus, File
from holdback.storage import FileStore

log = logging.getLogger("holdback.retention")

DEFAULT_FILE_TTL = 30 * 24 * 3600
EXPIRING_PURPOSES = {"batch", "batch_output"}
# A batch in one of these still reads its input file (validating expands it; the others may re-read it).
RUNNING = tuple(s.value for s in (BatchStatus.validating, BatchStatus.in_progress, BatchStatus.finalizing,
                                  BatchStatus.cancelling))


def default_expiry(purpose: str, created_at: int) -> int | None:
    """When a file of this purpose expires if the client did not say: 30 days, or never."""
    return created_at + DEFAULT_FILE_TTL if purpose in EXPIRING_PURPOSES else None


class FileInUse(Exception):
    def __init__(self, file_id: str, batch_ids: list[str]):
        shown = ", ".join(batch_ids[:5]) + (" ..." if len(batch_ids) > 5 else "")
        super().__init__(
            f"File '{file_id}' is the input of {len(batch_ids)} running batch(es) ({shown}); "
            "wait until they finish or cancel them, then delete the file."
        )
        self.file_id = file_id
        self.batch_ids = batch_ids


def batches_needing(session: Session, file_id: str) -> list[str]:
    return list(session.scalars(
        select(Batch.id).where(Batch.input_file_id == file_id, Batch.status.in_(RUNNING)).order_by(Batch.seq)
    ))


def check_deletable(session: Session, file_id: str) -> None:
    """Raise FileInUse when a running batch still needs the file."""
    needing = batches_needing(session, file_id)
    if needing:
        raise FileInUse(file_id, needing)


@dataclass
class RetentionMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.files_expired = Counter(
            "holdback_files_expired_total", "Expired files whose bytes the collector deleted.", registry=r)
        self.bytes_deleted = Counter(
            "holdback_files_expired_bytes_total", "Bytes of expired files the collector deleted.", registry=r)
        self.rows_purged = Counter(
            "holdback_file_rows_purged_total", "Deleted or expired file rows removed after the grace period.",
            registry=r)
        self.kept_in_use = Gauge(
            "holdback_files_expired_in_use", "Expired files kept because a running batch still reads them.",
            registry=r)
        self.runs = Counter("holdback_file_collector_runs_total", "Collector passes, by result.", ["result"],
                            registry=r)


@dataclass
class CollectResult:
    expired: int = 0
    bytes_deleted: int = 0
    purged: int = 0
    kept_in_use: int = 0


@dataclass
class FileCollector:
    """Deletes expired files' bytes and, `grace_seconds` later, their rows; `batch_size` files per step."""

    factory: sessionmaker[Session]
    store: FileStore
    grace_seconds: int = 7 * 24 * 3600
    batch_size: int = 500
    max_batches: int = 20  # per run, so one duty call stays short; the next run continues
    interval: float = 60.0
    metrics: RetentionMetrics = field(default_factory=RetentionMetrics)
    _last_run: float = field(default=float("-inf"), init=False)

    def run_due(self) -> CollectResult | None:
        """The processor's duty: one bounded run every `interval` seconds; errors are logged, not raised."""
        if time.monotonic() - self._last_run < self.interval:
            return None
        self._last_run = time.monotonic()
        try:
            return self.run()
        except Exception:
            self.metrics.runs.labels("error").inc()
            log.exception("file_collector_failed")
            return None

    def run(self, now: int | None = None) -> CollectResult:
        now = int(time.time()) if now is None else now
        result = CollectResult()
        for _ in range(self.max_batches):
            if not self._expire_step(now, result):
                break
        for _ in range(self.max_batches):
            if not self._purge_step(now, result):
                break
        with self.factory() as session:
            result.kept_in_use = session.scalar(
                select(func.count()).select_from(File).where(
                    File.deleted_at.is_(None), File.expires_at <= now,
                    File.id.in_(select(Batch.input_file_id).where(Batch.status.in_(RUNNING))))) or 0
        self.metrics.runs.labels("ok").inc()
        self.metrics.kept_in_use.set(result.kept_in_use)
        if result.expired or result.purged:
            log_event(log, "files_collected", expired=result.expired, bytes_deleted=result.bytes_deleted,
                      purged=result.purged, kept_in_use=result.kept_in_use)
        return result

    def _expire_step(self, now: int, result: CollectResult) -> bool:
        """Mark one batch of expired files deleted (compare-and-set: one collector wins each), then drop their bytes."""
        with self.factory() as session, session.begin():
            in_use = select(Batch.input_file_id).where(Batch.status.in_(RUNNING))
            candidates = session.execute(
                select(File.id, File.storage_key, File.bytes)
                .where(File.deleted_at.is_(None), File.expires_at.is_not(None), File.expires_at <= now,
                       File.id.not_in(in_use))
                .order_by(File.expires_at).limit(self.batch_size)
            ).all()
            if not candidates:
                return False
            won = set(session.scalars(
                update(File).where(File.id.in_([c.id for c in candidates]), File.deleted_at.is_(None))
                .values(deleted_at=now, status="deleted").returning(File.id)
            ))
        for candidate in candidates:
            if candidate.id in won:
                self.store.delete(candidate.storage_key)
                result.expired += 1
                result.bytes_deleted += candidate.bytes
                self.metrics.files_expired.inc()
                self.metrics.bytes_deleted.inc(candidate.bytes)
        return len(candidates) == self.batch_size

    def _purge_step(self, now: int, result: CollectResult) -> bool:
        """Remove one batch of rows deleted longer than the grace period ago (their bytes once more first:
        an API server that died between its commit and its delete left them)."""
        with self.factory() as session:
            old = session.execute(
                select(File.id, File.storage_key)
                .where(File.deleted_at.is_not(None), File.deleted_at <= now - self.grace_seconds)
                .order_by(File.deleted_at).limit(self.batch_size)
            ).all()
        if not old:
            return False
        for row in old:
            self.store.delete(row.storage_key)
        with self.factory() as session, session.begin():
            session.execute(delete(File).where(File.id.in_([row.id for row in old])))
        result.purged += len(old)
        self.metrics.rows_purged.inc(len(old))
        return len(old) == self.batch_size
