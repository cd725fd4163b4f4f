"""The asyncio worker: up to N request jobs in flight per process on one shared HTTP session.

It consumes RQ's queue itself (see `async_processor.queue`), keeps every running job in the
StartedJobRegistry with a heartbeat, parks retries in the ScheduledJobRegistry instead of holding a slot,
takes turns at RQ's scheduler lock to move due retries back, requeues the jobs of dead workers, and
aborts the in-flight requests of a batch when the processor publishes its id on `<namespace>:cancel`. An idle
worker claims again as soon as the processor publishes on `<namespace>:work` that it pushed jobs.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import aiohttp
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from async_processor.log import logger
from async_processor.circuit import GatewayCircuit
from async_processor.config import WorkerConfig
from async_processor.metrics import WorkerMetrics
from async_processor.queue import Claim, Finish, ClaimQueue
from async_processor.registration import Registration
from holdback import tracing
from holdback.attempts import BATCH_CONTEXTS, AttemptResult, Disposition, InFlight, Runtime, Skip, run_attempt
from holdback.contract import at_risk_key, pause_key
from holdback.logs import log_event
from holdback.models import RequestStatus
from holdback.probes import Heartbeat

IDLE_POLL_MIN = 0.01
IDLE_POLL_MAX = 0.25
INTERNAL_ERROR_DELAY = 5.0  # a job whose database or Redis work failed runs again after this
CANCEL_MEMORY = 600.0  # seconds a cancelled batch id is remembered (for attempts opening meanwhile)
PAUSE_CHECK = 0.5  # seconds between reads of the operator's pause flag (holdback.broker.pause_key)


class AsyncWorker:
    def __init__(self, config: WorkerConfig, metrics: WorkerMetrics | None = None):
        self.config = config
        self.metrics = metrics or WorkerMetrics(config.name)
        self.inflight: dict[str, InFlight] = {}
        self.claims: dict[str, Claim] = {}
        self.tasks: set[asyncio.Task] = set()
        self.cancelled_batches: dict[str, float] = {}
        # Batches the processor marked at risk of missing their window (holdback.risk): their attempts say so.
        self.at_risk: set[str] = set()
        self.stopping = asyncio.Event()  # stop claiming, drain
        self.closing = asyncio.Event()  # drained: stop the helper loops
        self.slot_freed = asyncio.Event()
        self.work_pushed = asyncio.Event()  # the processor pushed jobs since the last claim (`work_channel`)
        self.requeued: list[Claim] = []  # claims put back on the queue at the drain timeout
        self.holds_scheduler = False
        self.paused = False
        self.pause_checked_at = float("-inf")
        # Probes (async_processor.health): the heartbeat loop beats; Redis's last answer to it decides readiness.
        self.heartbeat = Heartbeat(stale_after=3 * config.heartbeat_interval + 10)
        self.redis_failure: str | None = "not registered yet"

    def stop(self) -> None:
        if not self.stopping.is_set():
            log_event(logger, "worker_stopping", worker=self.config.name, in_flight=len(self.inflight))
        self.stopping.set()
        self.slot_freed.set()

    # -- life cycle -------------------------------------------------------------------------------------

    async def run(self) -> int:
        cfg = self.config
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        self.redis = aioredis.Redis.from_url(cfg.redis_url, health_check_interval=30)
        self.queue = ClaimQueue(self.redis, cfg.queue_name, cfg.name, cfg.heartbeat_ttl, cfg.failure_ttl)
        self.registration = Registration(self.redis, self.queue, cfg.concurrency, cfg.heartbeat_ttl)
        self.rt = Runtime.build(cfg.database_url, gateway_url=cfg.gateway_url, gateway_key=cfg.gateway_key,
                                policy=cfg.policy, worker_name=cfg.name, request_timeout=cfg.request_timeout,
                                db_lanes=cfg.db_lanes, resume=cfg.resume, stream_interval=cfg.stream_interval)
        connector = aiohttp.TCPConnector(limit=cfg.concurrency + 8, limit_per_host=0, keepalive_timeout=30)
        self.http = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))
        self.circuit = GatewayCircuit(self.redis, cfg.namespace, cfg.name, cfg.gateway_url, cfg.gateway_key,
                                      self.metrics, cfg.probe_interval)
        try:
            await self.registration.register_birth()
            await self._read_at_risk()  # before the first claim: an at-risk batch's first attempts say so too
            self.redis_failure = None
            log_event(logger, "worker_started", worker=cfg.name, queue=cfg.queue_name,
                      concurrency=cfg.concurrency, gateway=cfg.gateway_url, burst=cfg.burst or None)
            helpers = [asyncio.create_task(c) for c in (
                self._heartbeat_loop(), self._scheduler_loop(), self._channel_listener(), self._depth_loop(),
                self.circuit.watch(self.http, self.closing))]
            try:
                await self._claim_loop()
                await self._drain()
            finally:
                # Helpers stop at their next pause; cancelling alone is not enough, because redis-py can
                # swallow a cancellation that lands inside a command.
                self.closing.set()
                _done, stuck = await asyncio.wait(helpers, timeout=5)
                for t in stuck:
                    t.cancel()
                # No heartbeat runs now: take back any started entry one re-added for a job requeued at the drain
                # (it read the claim just before the requeue), which would show the job started with no worker.
                await _quietly(self.queue.forget(self.requeued))
                await self.circuit.close()
                if self.holds_scheduler:
                    await _quietly(self.registration.release_scheduler())
                await _quietly(self.registration.register_death())
        finally:
            await self.http.close()
            await self.redis.aclose()
            self.rt.close()
        log_event(logger, "worker_stopped", worker=cfg.name)
        return 0

    async def _drain(self) -> None:
        """Let in-flight requests finish for drain_timeout; put the rest back on the queue."""
        if not self.tasks:
            return
        log_event(logger, "worker_draining", worker=self.config.name, in_flight=len(self.tasks),
                  timeout=self.config.drain_timeout)
        _done, pending = await asyncio.wait(set(self.tasks), timeout=self.config.drain_timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)

    # -- claiming -----------------------------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        cfg = self.config
        idle = IDLE_POLL_MIN
        while not self.stopping.is_set():
            free = cfg.concurrency - len(self.tasks)
            if free <= 0:
                self.slot_freed.clear()
                await self.slot_freed.wait()
                await asyncio.sleep(0)  # let a few more finish: claim them in one round trip
                continue
            try:
                # Paused by an operator, or the gateway circuit is open: in-flight jobs go on, no new ones.
                if await self._paused() or await self.circuit.is_open():
                    await self._sleep(PAUSE_CHECK)
                    continue
                self.work_pushed.clear()  # a push from here on wakes the idle wait below
                claims, missing = await self.queue.claim(min(free, cfg.claim_batch))
            except RedisError as exc:
                log_event(logger, "claim_failed", level=logging.WARNING, worker=cfg.name,
                          error=f"{type(exc).__name__}: {exc}")
                await self._sleep(1.0)
                continue
            if missing:
                log_event(logger, "dropped_jobs_without_hash", worker=cfg.name, count=missing)
            if not claims:
                if cfg.burst and not self.tasks:
                    log_event(logger, "burst_done", worker=cfg.name)
                    return
                await self._idle(idle)
                idle = min(idle * 2, IDLE_POLL_MAX)
                continue
            idle = IDLE_POLL_MIN
            for claim in claims:
                task = asyncio.create_task(self._handle(claim))
                self.tasks.add(task)
                task.add_done_callback(self._task_done)
            self.metrics.in_flight.set(len(self.tasks))

    async def _paused(self) -> bool:
        now = time.monotonic()
        if now - self.pause_checked_at >= PAUSE_CHECK:
            self.pause_checked_at = now
            paused = bool(await self.redis.exists(pause_key(self.config.namespace, self.config.queue_name)))
            if paused != self.paused:  # logged on change: from here on this worker claims nothing (or resumes)
                log_event(logger, "dispatch_paused" if paused else "dispatch_resumed", worker=self.config.name)
            self.paused = paused
        return self.paused

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.metrics.in_flight.set(len(self.tasks))
        self.slot_freed.set()

    async def _idle(self, seconds: float) -> None:
        """The queue was empty: wait until the processor pushes jobs (or at most `seconds`, or a stop)."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self.work_pushed, self.stopping)]
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass

    # -- one job --------------------------------------------------------------------------------------------

    async def _handle(self, claim: Claim) -> None:
        row_id = claim.job_id
        if row_id in self.inflight:
            # The same row is already in flight here: a duplicate delivery; the running one decides.
            self.metrics.duplicates.labels("delivery").inc()
            log_event(logger, "duplicate_delivery", request_id=row_id, worker=self.config.name)
            await _quietly(self.queue.finish(claim, Finish.none))
            return
        job = InFlight(row_id)
        self.inflight[row_id] = job
        self.claims[row_id] = claim
        try:
            result = await run_attempt(self.rt, self.http, job, self._was_cancelled, self.at_risk.__contains__)
        except asyncio.CancelledError:
            # Shutdown after the drain timeout: the job goes back to the front of the queue; the next
            # delivery's begin closes this attempt as abandoned.
            await asyncio.shield(_quietly(self.queue.finish(claim, Finish.requeue)))
            self.requeued.append(claim)
            log_event(logger, "requeued_on_shutdown", batch_id=job.batch_id, request_id=row_id)
            raise
        except Exception as exc:  # the database or Redis failed beyond its retries
            self.metrics.internal_errors.inc()
            log_event(logger, "job_error", level=logging.ERROR, batch_id=job.batch_id, request_id=row_id,
                      error=f"{type(exc).__name__}: {exc}", retry_in=INTERNAL_ERROR_DELAY, exc_info=True)
            await _quietly(self.queue.finish(claim, Finish.schedule, time.time() + INTERNAL_ERROR_DELAY,
                                             succeeded=False))
            return
        finally:
            self.inflight.pop(row_id, None)
            self.claims.pop(row_id, None)
        try:
            await self._place(claim, job, result)
        except RedisError as exc:
            # The row is recorded; the job's execution will expire and be requeued, then dropped as final.
            self.metrics.internal_errors.inc()
            log_event(logger, "finish_failed", level=logging.WARNING, batch_id=job.batch_id, request_id=row_id,
                      error=f"{type(exc).__name__}: {exc}")

    async def _place(self, claim: Claim, job: InFlight, result: AttemptResult) -> None:
        """Move the job in Redis to match what the attempt did to the row; count and log it."""
        m, row_id = self.metrics, claim.job_id
        if result.skip is Skip.final:
            m.duplicates.labels("delivery").inc()
            log_event(logger, "already_final", request_id=row_id)
            await self.queue.finish(claim, Finish.delete)
            return
        if result.skip is Skip.closing:
            wake = time.time() + self.rt.policy.closing_recheck
            log_event(logger, "batch_closing", request_id=row_id, recheck_in=self.rt.policy.closing_recheck)
            await self.queue.finish(claim, Finish.schedule, wake)
            return
        d, rec = result.attempt, result.recorded
        outcome = rec.outcome
        m.attempts.labels(outcome.kind.value).inc()
        m.attempt_seconds.labels(outcome.kind.value).observe(result.seconds)
        if outcome.evicted:
            m.evictions.inc()
        if outcome.path_failure:
            self.circuit.suspect(self.http, f"{outcome.kind.value} {outcome.status or ''}".strip())
        fields = dict(batch_id=d.batch_id, request_id=row_id, custom_id=d.custom_id, attempt=d.number,
                      outcome=outcome.kind.value, status=outcome.status, drop_reason=outcome.drop_reason,
                      seconds=result.seconds)
        if tracing.enabled():  # the outcome is logged after the attempt's span: name the batch's trace
            trace_id = tracing.trace_id_of(BATCH_CONTEXTS.cached(d.batch_id)[1])
            if trace_id is not None:
                fields["trace_id"] = trace_id
        if rec.disposition is Disposition.final:
            m.results.labels(rec.final_status.value).inc()
            failed = rec.final_status is not RequestStatus.succeeded
            log_event(logger, "request_final", level=logging.WARNING if failed else logging.DEBUG,
                      final=rec.final_status.value, **fields)
            await self.queue.finish(claim, Finish.failed if failed else Finish.delete, succeeded=not failed,
                                    reason=rec.reason)
            if rec.batch_done:  # its last row: the processors finalize it now, not at their next poll
                try:
                    await self.redis.publish(self.config.wake_channel, d.batch_id)
                except RedisError as exc:  # the job is done; the processors find the batch at their next poll
                    log_event(logger, "wake_not_published", level=logging.WARNING, batch_id=d.batch_id,
                              error=f"{type(exc).__name__}: {exc}")
        elif rec.disposition is Disposition.duplicate:
            m.duplicates.labels("result").inc()
            log_event(logger, "duplicate_result", **fields)
            await self.queue.finish(claim, Finish.delete)
        elif rec.disposition is Disposition.retry:
            m.retries.labels(outcome.kind.value).inc()
            log_event(logger, "retry_scheduled", delay=rec.delay, **fields)
            # No wait (an eviction): straight back to the front of the queue, not a scheduler round later.
            await self.queue.finish(claim, Finish.requeue if not rec.delay else Finish.schedule, rec.wake_at)
        elif rec.disposition is Disposition.closing:
            m.left_for_expiry.inc()
            log_event(logger, "left_for_expiry", **fields)
            await self.queue.finish(claim, Finish.schedule, rec.wake_at)
        else:  # cancelled
            m.cancelled.inc()
            log_event(logger, "request_aborted", reason=job.abort_reason, **fields)
            await self.queue.finish(claim, Finish.delete)

    # -- cancel ----------------------------------------------------------------------------------------------

    def _was_cancelled(self, batch_id: str) -> bool:
        return batch_id in self.cancelled_batches

    def cancel_batch(self, batch_id: str) -> int:
        """Abort every in-flight request of the batch; returns how many were aborted."""
        now = time.time()
        self.cancelled_batches[batch_id] = now
        for b, at in list(self.cancelled_batches.items()):
            if now - at > CANCEL_MEMORY:
                del self.cancelled_batches[b]
        aborted = sum(1 for job in list(self.inflight.values())
                      if job.batch_id == batch_id and job.abort("batch cancelled or expired"))
        log_event(logger, "batch_cancel_received", batch_id=batch_id, aborted=aborted, worker=self.config.name)
        return aborted

    async def _channel_listener(self) -> None:
        """The processor's cancels (abort the batch's requests here) and pushes (claim now)."""
        channel, work = self.config.cancel_channel, self.config.work_channel.encode()
        while not self.closing.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel, work)
                while not self.closing.is_set():
                    message = await pubsub.get_message(timeout=0.5)
                    if message is None or message.get("type") != "message":
                        continue
                    if message["channel"] == work:
                        self.work_pushed.set()
                        continue
                    data = message["data"]
                    self.cancel_batch(data.decode() if isinstance(data, bytes) else str(data))
            except RedisError as exc:
                log_event(logger, "cancel_channel_lost", level=logging.WARNING, channel=channel, error=str(exc))
                await self._pause(1.0)
            finally:
                await _quietly(pubsub.aclose())

    # -- heartbeat, scheduler, gauges --------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self.closing.is_set():
            await self._pause(self.config.heartbeat_interval)
            if self.closing.is_set():
                return  # a heartbeat after register_death would register this worker again
            self.heartbeat.beat()
            try:
                self.registration.state = "busy" if self.inflight else "idle"
                await self.registration.heartbeat(len(self.inflight))
                await self.queue.heartbeat(list(self.claims.values()))
                self.redis_failure = None
            except RedisError as exc:
                self.redis_failure = f"heartbeat failed: {exc}"
                log_event(logger, "heartbeat_failed", level=logging.WARNING, worker=self.config.name, error=str(exc))

    async def _scheduler_loop(self) -> None:
        cfg = self.config
        refresh = min(5.0, cfg.heartbeat_interval)
        lock_ttl = max(6, int(3 * refresh))
        next_lock = next_maintenance = 0.0
        while not self.closing.is_set():
            now = time.monotonic()
            try:
                if now >= next_lock:
                    held = await self.registration.acquire_scheduler(lock_ttl)
                    if held != self.holds_scheduler:
                        log_event(logger, "scheduler_role", worker=cfg.name, held=held)
                    self.holds_scheduler = held
                    next_lock = now + refresh
                if self.holds_scheduler:
                    await self.queue.move_due()
                    if now >= next_maintenance:
                        next_maintenance = now + cfg.heartbeat_interval
                        # Our own executions first: after this process stalled past the TTL (starved of CPU,
                        # or stopped), this loop may wake before the heartbeat loop, and would take our own
                        # live requests for a dead worker's and deliver them again.
                        await self.queue.heartbeat(list(self.claims.values()))
                        for row_id in await self.queue.requeue_abandoned():
                            self.metrics.requeued_abandoned.inc()
                            log_event(logger, "requeued_abandoned", level=logging.WARNING, request_id=row_id)
            except RedisError as exc:
                log_event(logger, "scheduler_failed", level=logging.WARNING, worker=cfg.name, error=str(exc))
                self.holds_scheduler = False
                await self._pause(1.0)
            await self._pause(cfg.scheduler_interval if self.holds_scheduler else refresh)

    async def _depth_loop(self) -> None:
        """Every second: the queue's depth gauges (one worker exports them), and the batches marked at risk."""
        while not self.closing.is_set():
            try:
                await self._read_at_risk()
                if self.holds_scheduler:  # one worker exports the shared depth, so a sum over workers is right
                    for state, n in (await self.queue.depth()).items():
                        self.metrics.queue_depth.labels(state).set(n)
                else:
                    self.metrics.queue_depth.clear()
            except RedisError:
                pass  # the gauges and marks keep their last values; claim/heartbeat log the outage
            await self._pause(1.0)

    async def _read_at_risk(self) -> None:
        """The batches marked at risk; a batch newly marked has its attempts still waiting in the gateway's queue
        sent again, marked (the gateway then gives them its at-risk floor)."""
        marked = await self.redis.zrangebyscore(at_risk_key(self.config.namespace), time.time(), "+inf")
        before, self.at_risk = self.at_risk, {m.decode() if isinstance(m, bytes) else m for m in marked}
        if newly := self.at_risk - before:
            again = sum(job.send_again("its batch turned at risk of missing its window: sent again, marked")
                        for job in list(self.inflight.values()) if job.batch_id in newly)
            log_event(logger, "batches_at_risk", batches=sorted(newly), sent_again=again)

    async def _pause(self, seconds: float) -> None:
        """Sleep, but wake at once when the worker is closing."""
        try:
            await asyncio.wait_for(self.closing.wait(), timeout=seconds)
        except asyncio.TimeoutError:
            pass


async def _quietly(coro) -> None:
    """Best-effort cleanup: a Redis outage here is repaired by heartbeat expiry and reconciliation."""
    try:
        await coro
    except (RedisError, OSError) as exc:
        log_event(logger, "cleanup_failed", level=logging.WARNING, error=f"{type(exc).__name__}: {exc}")
