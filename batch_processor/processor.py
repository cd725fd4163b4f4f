"""The processor loop: one `tick()` does a round of every lifecycle step for the batches it leases.

A round (every poll interval, or at once when a wake-up comes: `jobqueue.Wakes`): renew leases and claim new
batches (none while the gateway is not reached: `gateway_reach`); expand `validating` batches; cancel `cancelling`
ones; expire those past their window; finalize those whose rows are all final; refill every in_progress batch's
window in fair order and hand the rows off (`handoff`: RQ jobs, or the in-process sync mode); and every
`reconcile_interval`, reconcile the database with Redis. Each step commits before the next starts, so a processor
can die anywhere and the next lease holder carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from batch_processor.closing import cancel_batch, expire_batch, was_expiring
from batch_processor.enqueue import in_flight_elsewhere, take_due_retries, take_pending, window_counts
from batch_processor.fairness import BatchWindow, RefillRoundRobin, jump_ahead, tenant_window
from batch_processor.finalize import FinalizeResult, begin_finalizing, finalize_batch
from batch_processor.gateway_reach import GatewayReach
from batch_processor.handoff import Handoff, open_handoff
from batch_processor.ingest import expand_batch, fail_batch
from batch_processor.jobqueue import RequestQueue, Wakes
from batch_processor.lease import ACTIVE_STATUSES, BatchLease
from holdback import tracing
from holdback.logs import log_event
from batch_processor.metrics import ProcessorMetrics
from batch_processor.prefix_plan import PrefixPlans
from batch_processor.processor_config import ProcessorConfig
from batch_processor.reconcile import reconcile
from batch_processor.risk_marks import RiskMarks
from batch_processor.step_errors import StepErrors, describe
from batch_processor.validation import LineError
from holdback import lifecycle
from holdback.attempts import RetryPolicy
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Batch, BatchStatus
from holdback.probes import Heartbeat
from holdback.results import any_unfinished
from holdback.retention import FileCollector, RetentionMetrics
from holdback.settings import Settings
from holdback.storage import FileStore, open_file_store

log = logging.getLogger("batch_processor.processor")

LIVENESS_SECONDS = 300.0  # /healthz fails when the main loop has not turned for this long


@dataclass
class Round:
    """What one tick did (tests and logs read it)."""

    claimed: list[str] = field(default_factory=list)
    expanded: list[str] = field(default_factory=list)
    failed_validation: list[str] = field(default_factory=list)
    finished: dict[str, str] = field(default_factory=dict)  # batch id -> terminal status
    handed_off: list[tuple[str, str]] = field(default_factory=list)
    reconciled: dict[str, int] = field(default_factory=dict)


@dataclass
class _Owned:
    id: str
    tenant_id: str
    status: str
    expires_at: int
    seq: int


class Processor:
    def __init__(
        self,
        settings: Settings,
        config: ProcessorConfig | None = None,
        *,
        factory: sessionmaker[Session] | None = None,
        connection: redis.Redis | None = None,
        store: FileStore | None = None,
        metrics: ProcessorMetrics | None = None,
        gateway: GatewayReach | None = None,
    ):
        from holdback.broker import connect

        self.settings = settings
        self.config = config or ProcessorConfig()
        self.factory = factory or make_sessionmaker(make_engine(settings.sqlalchemy_url))
        self.redis = connection or connect(settings)
        self.store = store or open_file_store(settings)
        self.metrics = metrics or ProcessorMetrics()
        self.gateway = gateway or GatewayReach(settings.gateway_url)
        # Liveness: the loop turns at least every few seconds; a batch's expansion may hold one tick longer.
        self.heartbeat = Heartbeat(stale_after=LIVENESS_SECONDS)
        self.collector = FileCollector(self.factory, self.store, grace_seconds=settings.file_retention_grace_seconds,
                                       metrics=RetentionMetrics(self.metrics.registry))
        self.queue = RequestQueue(self.redis, settings.redis_namespace)
        self.wakes = Wakes(self.redis, settings.redis_namespace)
        self.risk = RiskMarks(self.factory, self.redis, settings.redis_namespace, self.metrics)
        self.lease = BatchLease(self.factory, self.config.name, self.config.lease_seconds)
        self.fair = RefillRoundRobin(self.config.window)
        # Within a batch, rows sharing a prompt prefix are queued together (None: line order).
        self.plans = PrefixPlans() if self.config.prefix_plan else None
        self.step_errors = StepErrors(log)
        self.owned: set[str] = set()
        self._last_reconcile = float("-inf")
        self._rounds = 0
        self._advanced_at = float("-inf")
        # While a round's whole-batch steps run: refills the running batches' windows (see `_between_steps`).
        self._refill_now: Callable[[], None] | None = None
        self._last_renewal = float("-inf")
        self._lease_renewed: dict[str, float] = {}
        self.handoff: Handoff = open_handoff(
            self.config.dispatch, self.queue, self.factory, gateway_url=settings.gateway_url,
            gateway_key=settings.gateway_key, worker_name=f"{self.config.name}/sync",
            max_concurrency=self.config.sync_concurrency,
            policy=RetryPolicy(base=self.config.backoff_base, cap=self.config.backoff_cap),
            request_timeout=self.config.request_timeout, metrics=self.metrics,
        )

    # --- one round ------------------------------------------------------------------------------

    def tick(self) -> Round:
        done = Round()
        now = time.time()
        # Renewing every round would be a write per round; a sixth of the lease leaves ample margin,
        # and every transition is fenced by `claimed_by` in the meantime anyway.
        if now - self._last_renewal >= self.config.lease_seconds / 6:
            held = self.lease.renew(self.owned)
            for batch_id in self.owned - held:
                log_event(log, "batch_lease_lost", level=logging.WARNING, batch_id=batch_id, owner=self.config.name)
            self.owned = held
            self._last_renewal = now
            self._lease_renewed = dict.fromkeys(self.owned, now)
        room = self.config.max_batches - len(self.owned)
        if room > 0 and self.gateway.failure() is None:
            done.claimed = self.lease.claim(min(room, self.config.claim_per_round))
            self.owned.update(done.claimed)
            for batch_id in done.claimed:
                self._lease_renewed[batch_id] = time.time()
                log_event(log, "batch_claimed", batch_id=batch_id, owner=self.config.name)
        batches = self._load_owned()

        # The batches that dispatch this round; those that do not run out their window now are known at once,
        # so their windows can be refilled between whole-batch steps (see `_refill`).
        in_progress = [b for b in batches if b.status == BatchStatus.in_progress.value and now < b.expires_at]
        self._rounds += 1
        deadline = time.monotonic() + self.config.round_work_seconds
        worked = False
        self._refill_now = lambda: self._refill(in_progress, done, self.config.poll_interval / 4)
        for batch in _tenants_in_turn(batches, self._rounds):
            try:
                if batch.status == BatchStatus.in_progress.value:
                    if now < batch.expires_at:
                        continue  # in `in_progress` already
                    if not self._has_unfinished(batch.id):
                        in_progress.append(batch)  # a batch that finished in time still completes
                        continue
                # A whole-batch step only while the round's budget lasts (the first always goes).
                if worked and time.monotonic() >= deadline:
                    continue
                worked = True
                if batch.status == BatchStatus.validating.value:
                    if now >= batch.expires_at:
                        self._expire(batch, done, deadline)
                    elif self._expand(batch, done):
                        batch.status = BatchStatus.in_progress.value
                        in_progress.append(batch)  # its first window goes out in this same round
                elif batch.status == BatchStatus.cancelling.value:
                    self._finish(batch, done, cancel_batch(self.factory, self.store, self, batch.id,
                                                           owner=self.config.name, keepalive=self._keepalive(batch.id),
                                                           deadline=deadline))
                elif batch.status == BatchStatus.finalizing.value:
                    self._finish(batch, done, self._finalize_completed(batch.id))
                elif batch.status == BatchStatus.in_progress.value:
                    self._expire(batch, done, deadline)  # past its window with rows unfinished
            except Exception as exc:  # noqa: BLE001 - one batch's failure must not stop the others
                self._step_failed(batch, exc, done)
            else:
                if batch.status != BatchStatus.in_progress.value:
                    self.step_errors.clear(batch.id)  # an in_progress batch's own steps come in _advance
            self._refill(in_progress, done)
        self._refill_now = None

        self._advance_open(in_progress, done)
        self.risk.update([b.id for b in in_progress if b.id not in done.finished])
        if time.monotonic() - self._last_reconcile >= self.config.reconcile_interval:
            self._last_reconcile = time.monotonic()
            self._reconcile([b.id for b in in_progress if b.id not in done.finished], done)
        self.owned -= set(done.finished)
        self.step_errors.retain(self.owned)
        self.metrics.batches_owned.set(len(self.owned))
        self.metrics.queue_depth.set(self.queue.depth())
        self.collector.run_due()  # retention: expired files, once a minute, bounded
        return done

    def _load_owned(self) -> list[_Owned]:
        if not self.owned:
            return []
        with self.factory() as session:
            rows = session.execute(
                select(Batch.id, Batch.tenant_id, Batch.status, Batch.expires_at, Batch.created_at,
                       Batch.window_seconds, Batch.seq, Batch.claimed_by)
                .where(Batch.id.in_(sorted(self.owned)))
                .order_by(Batch.seq)
            ).all()
        mine = [_Owned(r.id, r.tenant_id, r.status, r.expires_at or (r.created_at + r.window_seconds), r.seq)
                for r in rows if r.status in ACTIVE_STATUSES and r.claimed_by == self.config.name]
        # Finished elsewhere (failed by another path, say) or taken over after our lease ran out: let go.
        self.owned = {b.id for b in mine}
        return mine

    def _expand(self, batch: _Owned, done: Round) -> bool:
        """Validate and expand; True if the batch is now in_progress."""
        with tracing.span("batch.ingest", parent=self._trace_context(batch.id),
                          attributes={"batch_id": batch.id, "tenant_id": batch.tenant_id}) as span:
            result = expand_batch(self.factory, self.store, batch.id,
                                  max_requests=self.settings.max_batch_requests, owner=self.config.name,
                                  settings=self.settings, between=self._between_steps)
            span.set_attribute("batch.status", result.status)
            span.set_attribute("batch.total", result.total)
            if result.status == BatchStatus.in_progress.value and tracing.enabled():
                # The workers' attempts continue from this span: the trace reads API → processor → worker.
                self._store_trace_context(batch.id, tracing.current_traceparent())
        if result.status == BatchStatus.in_progress.value:
            done.expanded.append(batch.id)
            self.metrics.ingest_seconds.observe(result.seconds)
            self.metrics.batch_transitions.labels(BatchStatus.in_progress.value).inc()
            return True
        if result.status == BatchStatus.failed.value:
            done.failed_validation.append(batch.id)
            done.finished[batch.id] = BatchStatus.failed.value
            self.metrics.batch_transitions.labels(BatchStatus.failed.value).inc()
            for error in result.errors:
                self.metrics.validation_failures.labels(error["code"]).inc()
        return False

    def _step_failed(self, batch: _Owned, exc: Exception, done: Round) -> None:
        """Log the failure (quietly when it repeats); fail a batch whose validation keeps raising."""
        if not self.step_errors.record(batch.id, batch.status, exc):
            return
        error = LineError("processing_failed", f"The batch could not be validated and expanded "
                          f"({describe(exc)}); it failed {self.step_errors.max_strikes} times in a row. Check the "
                          "input file for unusual content and create a new batch.", None, "input_file_id")
        result = fail_batch(self.factory, batch.id, self.config.name, [error])
        if result.status == BatchStatus.failed.value:
            self.step_errors.clear(batch.id)
            done.failed_validation.append(batch.id)
            done.finished[batch.id] = BatchStatus.failed.value
            self.metrics.batch_transitions.labels(BatchStatus.failed.value).inc()
            self.metrics.validation_failures.labels(error.code).inc()

    def _expire(self, batch: _Owned, done: Round, deadline: float | None = None) -> None:
        self._finish(batch, done, expire_batch(self.factory, self.store, self, batch.id, owner=self.config.name,
                                               deadline=deadline,
                                               keepalive=self._keepalive(batch.id)))

    def _finalize_completed(self, batch_id: str) -> FinalizeResult | None:
        with tracing.span("batch.finalize", parent=self._trace_context(batch_id), attributes={"batch_id": batch_id}):
            return finalize_batch(self.factory, self.store, batch_id, to_status=BatchStatus.completed,
                                  from_statuses=(BatchStatus.finalizing,), owner=self.config.name,
                                  keepalive=self._keepalive(batch_id))

    def _trace_context(self, batch_id: str) -> str | None:
        """The batch's stored trace context (holdback.tracing); not read while tracing is off."""
        if not tracing.enabled():
            return None
        with self.factory() as session:
            return session.scalar(select(Batch.trace_context).where(Batch.id == batch_id))

    def _store_trace_context(self, batch_id: str, traceparent: str | None) -> None:
        with transaction(self.factory) as session:
            session.execute(update(Batch).where(Batch.id == batch_id).values(trace_context=traceparent))

    def _has_unfinished(self, batch_id: str) -> bool:
        with self.factory() as session:
            return any_unfinished(session, batch_id)

    def _finish(self, batch: _Owned, done: Round, result: FinalizeResult | None) -> None:
        if result is None:
            return
        done.finished[batch.id] = result.status
        self.metrics.batch_transitions.labels(result.status).inc()
        self.metrics.finalize_seconds.observe(result.seconds)

    def _refill(self, in_progress: list[_Owned], done: Round, interval: float | None = None) -> None:
        """Between a round's whole-batch steps (and, every quarter of one, inside a long step): the running
        batches' windows are refilled once a poll interval has passed since the last time, so a round busy
        with another tenant's large batches does not leave them without queued work while it lasts."""
        if time.monotonic() - self._advanced_at >= (self.config.poll_interval if interval is None else interval):
            self._advance_open(in_progress, done)

    def _advance_open(self, in_progress: list[_Owned], done: Round) -> None:
        """`_advance` for the batches not finished yet this round, and when it was done."""
        self._advance([b for b in in_progress if b.id not in done.finished], done)
        self._advanced_at = time.monotonic()

    def _advance(self, in_progress: list[_Owned], done: Round) -> None:
        """Finalize batches with nothing left to run, refill the windows of the others, hand their rows off."""
        if not in_progress:
            self.metrics.rows_in_flight.set(0)
            return
        with self.factory() as session:
            counts = window_counts(session, [b.id for b in in_progress])
            idle = [b for b in in_progress if counts[b.id].in_flight == 0 and counts[b.id].pending == 0]
            expiring = {b.id for b in idle if was_expiring(session, b.id)}
            # A tenant's window spans every processor: count its rows in batches the others hold.
            elsewhere = in_flight_elsewhere(session, {b.tenant_id for b in in_progress}, self.owned)
        for batch in idle:
            try:
                if batch.id in expiring:
                    self._expire(batch, done)  # an expiry that a dead processor left half-way
                elif begin_finalizing(self.factory, batch.id, self.config.name):
                    self.metrics.batch_transitions.labels(BatchStatus.finalizing.value).inc()
                    self._finish(batch, done, self._finalize_completed(batch.id))
            except Exception as exc:  # noqa: BLE001 - one batch's failure must not stop the others
                self._step_failed(batch, exc, done)
            else:
                self.step_errors.clear(batch.id)
        open_batches = [b for b in in_progress if b not in idle]
        self.metrics.rows_in_flight.set(sum(counts[b.id].in_flight for b in open_batches))
        window = tenant_window(self.config.window, len({b.tenant_id for b in open_batches}),
                               self.handoff.capacity(), self.config.queue_rounds)
        steps = self.fair.plan([BatchWindow(b.id, b.tenant_id, counts[b.id].in_flight, counts[b.id].pending)
                                for b in open_batches], window, elsewhere)
        jobs: list[tuple[str, str]] = []
        if not self.handoff.schedules_retries:
            # Due retries first: they already waited their backoff, and they count against the window.
            jobs += take_due_retries(self.factory, [b.id for b in open_batches], self.config.name,
                                     limit=self.config.window * max(1, len(open_batches)))
        if self.plans is not None:
            self.plans.retain(b.id for b in open_batches)
        jobs += take_pending(self.factory, steps, self.config.name, self.plans)
        held: dict[str, int] = dict(elsewhere)
        for b in open_batches:
            held[b.tenant_id] = held.get(b.tenant_id, 0) + counts[b.id].in_flight
        front, back = jump_ahead(jobs, {b.id: b.tenant_id for b in open_batches},
                                 {t for t, n in held.items() if n == 0}, self.fair.chunk)
        self._hand_off(front, at_front=True)
        self._hand_off(back)
        done.handed_off = front + back

    def _hand_off(self, rows: list[tuple[str, str]], at_front: bool = False) -> None:
        if not rows:
            return
        self.handoff.push(rows, at_front=at_front)
        self.metrics.rows_enqueued.labels(self.config.dispatch).inc(len(rows))

    def _reconcile(self, batch_ids: list[str], done: Round) -> None:
        found = reconcile(self.factory, batch_ids, self.handoff.live_ids, self.queue.heartbeating_ids,
                          grace=self.config.reconcile_grace, running_grace=self.config.running_grace)
        for kind, n in found.counts().items():
            if n:
                self.metrics.reconciled_rows.labels(kind).inc(n)
        self._hand_off(found.rows)
        done.reconciled = found.counts()

    # --- BatchStopper (cancel and expiry) -------------------------------------------------------

    def stop_batch(self, batch_id: str, request_ids: list[str]) -> None:
        listeners = self.handoff.stop(batch_id, request_ids)
        log_event(log, "batch_cancel_published", batch_id=batch_id, listeners=listeners, jobs=len(request_ids))

    def _keepalive(self, batch_id: str):
        """Called between the chunks of a long step (expanding, closing or finalizing a large batch): renews
        the batch's lease at most every ttl/3, and refills the other running batches' windows once a poll
        interval has passed, so another tenant's workers do not run dry while it lasts (a window of 64
        rows lasts a fraction of a second; a 10,000-row step, longer)."""
        def renew() -> None:
            if time.time() - self._lease_renewed.get(batch_id, 0) >= self.config.lease_seconds / 3:
                self.lease.renew({batch_id})
                self._lease_renewed[batch_id] = time.time()
            self._between_steps()
        return renew

    def _between_steps(self) -> None:
        """Inside a round's long whole-batch step: refill the running batches' windows (`_refill`)."""
        refill, self._refill_now = self._refill_now, None  # not from inside itself (a refill finalizes)
        if refill is None:
            return
        try:
            refill()
        except Exception as exc:  # noqa: BLE001 - not the step's failure: the round's own refill retries
            log_event(log, "refill_failed", level=logging.WARNING, error=repr(exc))
        finally:
            self._refill_now = refill

    # --- running ----------------------------------------------------------------------------------

    def run(self, stop: threading.Event, once: bool = False) -> None:
        log_event(log, "processor_started", owner=self.config.name, dispatch=self.config.dispatch,
                  window=self.config.window, namespace=self.settings.redis_namespace)
        failures = 0
        while not stop.is_set():
            self.heartbeat.beat()
            try:
                self.tick()
                failures = 0
            except Exception:
                # Database or Redis trouble: keep the process, back off, and try again.
                failures += 1
                self.metrics.tick_errors.inc()
                log.exception("tick_failed", extra={"fields": {"owner": self.config.name, "failures": failures}})
            if once:
                break
            if failures:
                stop.wait(min(self.config.poll_interval * (2 ** min(failures, 5)), 5.0))
            else:
                self.wakes.wait(stop, self.config.poll_interval)  # or at once, for a batch to act on

    def close(self) -> None:
        """Clean stop: hand rows the hand-off never started (sync mode) back to pending and release every lease."""
        self.wakes.close()
        unstarted = self.handoff.close()
        if unstarted:
            with transaction(self.factory) as session:
                lifecycle.hand_back(session, unstarted)
        try:
            self.lease.release(self.owned)
        finally:
            log_event(log, "processor_stopped", owner=self.config.name, released=len(self.owned))
            self.owned.clear()


def _tenants_in_turn(batches: list[_Owned], round_number: int) -> list[_Owned]:
    """The batches one tenant at a time in turn (each tenant's own in their order), starting each round
    with the next tenant: a round's budget for whole-batch steps is shared between tenants, not used up
    by the one with the most batches."""
    by_tenant: dict[str, list[_Owned]] = {}
    for batch in batches:
        by_tenant.setdefault(batch.tenant_id, []).append(batch)
    queues = list(by_tenant.values())
    if not queues:
        return []
    start = round_number % len(queues)
    queues = queues[start:] + queues[:start]
    out: list[_Owned] = []
    for i in range(max(len(q) for q in queues)):
        out.extend(q[i] for q in queues if i < len(q))
    return out
