"""The flow controller: owns the priority bands, decides dispatch, rejection, expiry and eviction.

All state changes happen on the event loop without awaiting in between, so the controller is the single
writer. Two ways in: `submit()` dispatches inline when nothing at or above the request's priority is queued
and the band is under its ceiling (the fast path), else it queues the request and wakes the dispatch loop.
The loop (`run()`, one task) wakes on enqueue, completion, eviction confirmed, replica changes and a short
tick for TTLs, and walks bands strictly from high to low priority: a band with queued work whose ceiling is
reached stops the walk (head-of-line blocking), which is where in-flight eviction is considered.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import itertools
import logging
import math
import time
from collections import Counter
from typing import Callable

from gateway.admission import KvAdmission, Verdict
from gateway.band import PriorityBand
from gateway.config import LoadedConfig
from gateway.eviction import BandDemand, Evictor
from gateway.holdback import band_ceilings, holdback_policy
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.picker import EndpointPicker
from gateway.replicas import Replica, ReplicaPool
from gateway.request import DropReason, FlowRequest, Status
from gateway.saturation import SaturationDetector, saturation_detector

logger = logging.getLogger("gateway.flow")


class Outcome(enum.Enum):
    DISPATCHED = "dispatched"
    QUEUED = "queued"
    REJECTED = "rejected"


class FlowController:
    def __init__(self, loaded: LoadedConfig, pool: ReplicaPool, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        self.bands: dict[int, PriorityBand] = {}
        self.bands_desc: list[PriorityBand] = []
        self.ceilings: dict[int, float] = {}
        self.evictor = Evictor()
        self.admission: KvAdmission | None = None
        self.total_queued = 0
        self.in_flight = 0
        self.tenant_blocks: Counter[str] = Counter()
        self.dispatched_total = 0
        self.rejections: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self._seq = itertools.count(1)
        self._expiry: list[tuple[float, int, FlowRequest]] = []
        self._wake = asyncio.Event()
        self._grace_timer: asyncio.TimerHandle | None = None
        self.loaded: LoadedConfig
        self.apply_config(loaded)

    # -- configuration --------------------------------------------------------------------------------------
    def apply_config(self, loaded: LoadedConfig) -> None:
        """Swap in a validated config; queued and in-flight requests keep their places."""
        cfg = loaded.config
        self.loaded = loaded
        sat = cfg.saturation
        self.detector: SaturationDetector = saturation_detector(
            sat.detector, max_concurrency=sat.maxConcurrency, headroom=sat.headroom,
            queue_depth_threshold=sat.queueDepthThreshold, kv_util_threshold=sat.kvCacheUtilThreshold,
            staleness=sat.metricsStalenessSeconds, scrape_interval=cfg.metrics.scrapeIntervalSeconds)
        self.picker = EndpointPicker(max_concurrency=sat.maxConcurrency,
                                     in_flight_weight=cfg.picker.inFlightWeight,
                                     kv_usage_weight=cfg.picker.kvUsageWeight)
        ev = cfg.eviction
        self.eviction_enabled = ev.enabled
        self.evictor.max_per_decision = ev.maxPerDecision
        self.evictor.confirmation_timeout = ev.confirmationTimeoutSeconds
        self.evictor.grace = ev.graceSeconds if ev.graceSeconds is not None else self.detector.confirmation_grace
        self.admission = KvAdmission(cfg.admission) if cfg.admission.enabled else None
        self.tick = cfg.flowControl.tickSeconds
        self.global_max_requests = cfg.flowControl.maxRequests
        self.objective_names: dict[int, list[str]] = {}
        for name, obj in cfg.objectives.items():
            self.objective_names.setdefault(obj.priority, []).append(name)

        configured = cfg.band_priorities()
        for p in configured:
            s = cfg.band_settings(p)
            kwargs = dict(max_requests=s.maxRequests, ttl=s.ttl, fairness=s.fairness, ordering=s.ordering,
                          ceiling_override=s.ceiling)
            if p in self.bands:
                self.bands[p].configure(**kwargs)
            else:
                self.bands[p] = PriorityBand(p, **kwargs)
        self._drop_idle_bands(keep=set(configured))
        self._configured = set(configured)
        policy = holdback_policy(cfg.usageLimit.policy, min_ceiling=cfg.usageLimit.minCeiling,
                                 max_ceiling=cfg.usageLimit.maxCeiling, domain=cfg.usageLimit.domain,
                                 threshold=cfg.usageLimit.threshold)
        self._policy = policy
        self._refresh_ceilings()
        self.pool.health_interval = cfg.health.intervalSeconds
        self.pool.health_timeout = cfg.health.timeoutSeconds
        self.pool.failures_to_down = cfg.health.failuresToDown
        self.pool.scrape_interval = cfg.metrics.scrapeIntervalSeconds
        if [r.url for r in self.pool.replicas] != cfg.replicas:
            self.pool.set_urls(cfg.replicas)
        self.wake()

    def _refresh_ceilings(self) -> None:
        self.bands_desc = sorted(self.bands.values(), key=lambda b: -b.priority)
        self.ceilings = band_ceilings(self._policy, [b.priority for b in self.bands_desc],
                                      {b.priority: b.ceiling_override for b in self.bands_desc})

    def _drop_idle_bands(self, keep: set[int]) -> None:
        for p in [p for p, b in self.bands.items() if p not in keep and not b.queued and not b.in_flight]:
            del self.bands[p]

    def band_for(self, priority: int) -> PriorityBand:
        band = self.bands.get(priority)
        if band is None:
            # Only reachable for a priority outside the config (cannot happen via objectives); give it the
            # default band settings rather than failing the request.
            s = self.loaded.config.band_settings(priority)
            band = self.bands[priority] = PriorityBand(priority, max_requests=s.maxRequests, ttl=s.ttl,
                                                       fairness=s.fairness, ordering=s.ordering,
                                                       ceiling_override=s.ceiling)
            self._refresh_ceilings()
        return band

    # -- entry points from the proxy ------------------------------------------------------------------------
    def submit(self, req: FlowRequest) -> Outcome:
        """Dispatch `req` now, reject it, or queue it (then await `req.waiter`)."""
        now = self.clock()
        req.seq = next(self._seq)
        band = self.band_for(req.priority)
        healthy = self.pool.healthy()
        if not healthy:
            return self._reject(req, DropReason.NO_ENDPOINTS, band)
        if band.ttl > 0:
            req.expires_at = min(req.expires_at, req.arrived + band.ttl)
        if req.deadline <= now:
            return self._reject(req, DropReason.TTL_EXPIRED, band)
        verdict = Verdict.DISPATCH
        fits = None
        if self.admission is not None:
            verdict = self.admission.check(req.kv_blocks, req.priority, req.fairness_id, healthy,
                                           self.tenant_blocks)
            if verdict is Verdict.REJECT_QUOTA:
                return self._reject(req, DropReason.TENANT_QUOTA, band)
            if verdict is Verdict.REJECT_KV:
                return self._reject(req, DropReason.KV_ADMISSION, band)
            fits = self._fits(req)
        if verdict is Verdict.DISPATCH and not self._queued_at_or_above(req.priority):
            if self.detector.saturation(healthy, now) < self.ceilings[req.priority]:
                replica = self.picker.pick(healthy, self.detector, now, fits)
                if replica is not None:
                    self._dispatch(req, replica, band, now, "inline")
                    return Outcome.DISPATCHED
        if req.expires_at <= now:
            return self._reject(req, DropReason.TTL_EXPIRED, band)
        if band.max_requests and band.queued >= band.max_requests:
            return self._reject(req, DropReason.SATURATED, band)
        if self.global_max_requests and self.total_queued >= self.global_max_requests:
            return self._reject(req, DropReason.SATURATED, band)
        if verdict is Verdict.QUEUE:
            self._start_kv_wait(req, now)
        req.status = Status.QUEUED
        req.enqueued_at = now
        req.waiter = asyncio.get_running_loop().create_future()
        band.push(req)
        self.total_queued += 1
        if req.expires_at < math.inf:
            heapq.heappush(self._expiry, (req.expires_at, req.seq, req))
        self.wake()
        return Outcome.QUEUED

    def withdraw(self, req: FlowRequest) -> None:
        """The caller left while `req` was queued: take it out now."""
        if req.status is not Status.QUEUED:
            return
        req.status = Status.WITHDRAWN
        req.drop_reason = DropReason.CONTEXT_CANCELLED
        band = self.bands[req.priority]
        band.forget(req)
        self.total_queued -= 1
        self._count_rejection(DropReason.CONTEXT_CANCELLED, band)
        log_event(logger, logging.INFO, "withdrawn", request_id=req.request_id, band=req.priority)
        self.wake()

    def finish(self, req: FlowRequest) -> None:
        """A dispatched request is over (completed, failed, client gone or evicted): release its slot."""
        if req.status is not Status.DISPATCHED:
            return
        now = self.clock()
        evicted = req.drop_reason is DropReason.EVICTED
        req.status = Status.EVICTED if evicted else Status.FINISHED
        replica: Replica = req.replica  # type: ignore[assignment]
        replica.in_flight -= 1
        if req.kv_blocks:
            replica.committed_blocks -= req.kv_blocks
            self.tenant_blocks[req.fairness_id] -= req.kv_blocks
            if self.tenant_blocks[req.fairness_id] <= 0:
                del self.tenant_blocks[req.fairness_id]
        band = self.bands[req.priority]
        band.in_flight -= 1
        self.in_flight -= 1
        self.evictor.untrack(req)
        if evicted:
            latency = self.evictor.confirm(req, now)
            if latency is not None:
                self.evictions["confirmed"] += 1
                self.metrics.child(self.metrics.evictions, "confirmed").inc()
                self.metrics.eviction_confirmation.observe(latency)
                log_event(logger, logging.INFO, "eviction_confirmed", request_id=req.request_id,
                          replica=replica.url, latency_ms=round(latency * 1000, 2))
            if not self.evictor.pending:
                self._schedule_grace_wake()
        if self.total_queued:
            self.wake()
        if band.priority not in self._configured and not band.queued and not band.in_flight:
            self._drop_idle_bands(keep=self._configured)
            self._refresh_ceilings()

    def reassign(self, req: FlowRequest) -> Replica | None:
        """Move a dispatched request whose replica refused the connection to another replica, if any."""
        if req.status is not Status.DISPATCHED:
            return None
        old: Replica = req.replica  # type: ignore[assignment]
        others = [r for r in self.pool.healthy() if r is not old]
        fits = self._fits(req) if self.admission is not None else None
        new = self.picker.pick(others, self.detector, self.clock(), fits)
        if new is None:
            return None
        old.in_flight -= 1
        old.committed_blocks -= req.kv_blocks
        new.in_flight += 1
        new.dispatches += 1
        new.committed_blocks += req.kv_blocks
        req.replica = new
        return new

    def count_mid_stream_eviction(self) -> None:
        self.evictions["mid_stream"] += 1
        self.metrics.child(self.metrics.evictions, "mid_stream").inc()

    def wake(self) -> None:
        self._wake.set()

    # -- the dispatch loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            timeout = self.tick if (self.total_queued or self.evictor.pending) else None
            if not self._wake.is_set():
                with contextlib.suppress(asyncio.TimeoutError):  # the tick: expire TTLs, time out evictions
                    await asyncio.wait_for(self._wake.wait(), timeout)
            self._wake.clear()
            try:
                self.cycle()
            except Exception:  # a bug in one cycle must not stop dispatching for good
                logger.exception("event=dispatch_cycle_failed")

    def cycle(self) -> None:
        """One dispatch cycle: expire, then dispatch as much as the ceilings allow, then maybe evict."""
        now = self.clock()
        self._expire(now)
        for late in self.evictor.expire(now):
            self.evictions["timed_out"] += 1
            self.metrics.child(self.metrics.evictions, "timed_out").inc()
            log_event(logger, logging.WARNING, "eviction_timed_out", request_id=late.request_id)
        if not self.total_queued:
            return
        healthy = self.pool.healthy()
        if not healthy:
            return
        while self.total_queued:
            saturation = self.detector.saturation(healthy, now)
            blocked: PriorityBand | None = None
            progressed = False
            for band in self.bands_desc:
                if not band.queued:
                    continue
                if saturation >= self.ceilings[band.priority]:
                    blocked = band
                    break
                req = band.peek()
                if req is None:
                    continue
                fits = None
                if self.admission is not None:
                    verdict = self.admission.check(req.kv_blocks, req.priority, req.fairness_id, healthy,
                                                   self.tenant_blocks)
                    if verdict in (Verdict.REJECT_QUOTA, Verdict.REJECT_KV):
                        band.pop(req)
                        self.total_queued -= 1
                        reason = DropReason.TENANT_QUOTA if verdict is Verdict.REJECT_QUOTA else DropReason.KV_ADMISSION
                        self._reject(req, reason, band)
                        progressed = True
                        break
                    if verdict is Verdict.QUEUE:
                        self._start_kv_wait(req, now)
                        break  # head-of-line: this band and the ones below wait for KV room
                    fits = self._fits(req)
                replica = self.picker.pick(healthy, self.detector, now, fits)
                if replica is None:
                    blocked = band
                    break
                band.pop(req)
                self.total_queued -= 1
                self._dispatch(req, replica, band, now, "loop")
                progressed = True
                break
            if not progressed:
                if blocked is not None and self.eviction_enabled:
                    self._maybe_evict(saturation, blocked, now)
                return

    # -- internals ------------------------------------------------------------------------------------------
    def _queued_at_or_above(self, priority: int) -> bool:
        for band in self.bands_desc:
            if band.priority < priority:
                return False
            if band.queued:
                return True
        return False

    def _fits(self, req: FlowRequest) -> Callable[[Replica], bool]:
        admission = self.admission
        assert admission is not None
        return lambda r: admission.fits(req.kv_blocks, req.priority, r)

    def _start_kv_wait(self, req: FlowRequest, now: float) -> None:
        if req.kv_wait_deadline < math.inf or self.admission is None:
            return
        req.kv_wait_deadline = now + self.admission.queue_deadline
        if req.kv_wait_deadline < req.expires_at:
            req.expires_at = req.kv_wait_deadline
            if req.status is Status.QUEUED:
                heapq.heappush(self._expiry, (req.expires_at, req.seq, req))

    def _dispatch(self, req: FlowRequest, replica: Replica, band: PriorityBand, now: float, path: str) -> None:
        req.status = Status.DISPATCHED
        req.dispatched_at = now
        req.replica = replica
        replica.in_flight += 1
        replica.dispatches += 1
        if req.kv_blocks:
            replica.committed_blocks += req.kv_blocks
            self.tenant_blocks[req.fairness_id] += req.kv_blocks
        band.in_flight += 1
        self.in_flight += 1
        self.dispatched_total += 1
        if req.sheddable:
            self.evictor.track(req)
        m = self.metrics
        m.child(m.dispatches, str(band.priority), path).inc()
        if req.waiter is not None:
            m.child(m.queue_wait, str(band.priority)).observe(now - req.arrived)
            if not req.waiter.done():
                req.waiter.set_result(Outcome.DISPATCHED)
        if logger.isEnabledFor(logging.DEBUG):
            log_event(logger, logging.DEBUG, "dispatch", request_id=req.request_id, band=band.priority,
                      replica=replica.url, path=path, queue_ms=round((now - req.arrived) * 1000, 2))

    def _reject(self, req: FlowRequest, reason: DropReason, band: PriorityBand) -> Outcome:
        req.status = Status.REJECTED
        req.drop_reason = reason
        self._count_rejection(reason, band)
        log_event(logger, logging.INFO, "rejected", request_id=req.request_id, reason=reason.value,
                  band=band.priority, fairness_id=req.fairness_id)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.REJECTED)
        return Outcome.REJECTED

    def _count_rejection(self, reason: DropReason, band: PriorityBand) -> None:
        self.rejections[reason.value] += 1
        self.metrics.child(self.metrics.rejections, reason.value, str(band.priority)).inc()

    def _expire(self, now: float) -> None:
        heap = self._expiry
        while heap and heap[0][0] <= now:
            at, _seq, req = heapq.heappop(heap)
            if req.status is not Status.QUEUED or at != req.expires_at:
                continue
            band = self.bands[req.priority]
            band.forget(req)
            self.total_queued -= 1
            if not self.pool.healthy():
                reason = DropReason.NO_ENDPOINTS
            elif req.expires_at == req.kv_wait_deadline:
                reason = DropReason.KV_ADMISSION
            else:
                reason = DropReason.TTL_EXPIRED
            self._reject(req, reason, band)

    def _maybe_evict(self, saturation: float, blocked: PriorityBand, now: float) -> None:
        bands = [BandDemand(b.priority, self.ceilings[b.priority], b.queued) for b in self.bands_desc]
        decision = self.evictor.decide(saturation, bands, blocked.priority, self.in_flight, now)
        if decision is None:
            return
        for victim in decision.victims:
            victim.drop_reason = DropReason.EVICTED
            victim.evicted_at = now
            self.evictions["issued"] += 1
            self.metrics.child(self.metrics.evictions, "issued").inc()
            log_event(logger, logging.INFO, "evict", request_id=victim.request_id, band=victim.priority,
                      replica=getattr(victim.replica, "url", None), demand_band=decision.demand_priority,
                      saturation=round(saturation, 4), deficit=round(decision.deficit, 4),
                      victims=len(decision.victims))
            if victim.task is not None:
                victim.task.cancel()

    def _schedule_grace_wake(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.wake()
            return
        self._grace_timer = loop.call_later(self.evictor.grace + 1e-4, self.wake)

    # -- state for /admin/state and /metrics ----------------------------------------------------------------
    def snapshot(self) -> dict:
        now = self.clock()
        healthy = self.pool.healthy()
        saturation = self.detector.saturation(healthy, now)
        cfg = self.loaded.config
        return {
            "config": {"digest": self.loaded.digest, "source": self.loaded.source},
            "detector": self.detector.name,
            "saturation": round(saturation, 6),
            "stale_replicas": self.detector.stale_count(healthy, now),
            "queued": self.total_queued,
            "in_flight": self.in_flight,
            "bands": [
                {"priority": b.priority, "objectives": self.objective_names.get(b.priority, []),
                 "queued": b.queued, "in_flight": b.in_flight, "ceiling": round(self.ceilings[b.priority], 6),
                 "blocked": bool(b.queued) and saturation >= self.ceilings[b.priority],
                 "max_requests": b.max_requests, "ttl": b.ttl, "fairness": b.fairness.name,
                 "ordering": b.ordering.name, "queues": b.queue_sizes()}
                for b in self.bands_desc
            ],
            "replicas": [
                {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight,
                 "limit": cfg.saturation.maxConcurrency * (1 + cfg.saturation.headroom),
                 "kv_usage": r.kv_usage, "waiting": r.waiting, "running": r.running,
                 "committed_blocks": r.committed_blocks,
                 "metrics_age_s": round(now - r.metrics_at, 3) if r.metrics_at else None}
                for r in self.pool.replicas
            ],
            "eviction": {"enabled": self.eviction_enabled, "pending": len(self.evictor.pending),
                         "candidates": len(self.evictor.candidates)},
            "admission": self.admission.state() if self.admission else {"enabled": False},
            "totals": {"dispatched": self.dispatched_total, "evictions": dict(self.evictions),
                       "rejections": dict(self.rejections)},
        }
