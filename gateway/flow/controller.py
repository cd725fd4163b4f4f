"""The flow controller: owns the priority bands, decides dispatch, rejection, expiry and eviction.

All state changes happen on the event loop without awaiting in between, so the controller is the single
writer. Two ways in: `submit()` dispatches inline when nothing at or above the request's priority is queued
and the band is under its ceiling (the fast path), else it queues the request and wakes the dispatch loop.
The loop (`run()`, one task) wakes on enqueue, completion, eviction confirmed, replica changes and a short
tick for TTLs, and walks bands strictly from high to low priority: a band with queued work whose ceiling is
reached stops the walk (head-of-line blocking), which is where in-flight eviction is considered.
With KV admission on, every admission decision comes from `KvAdmission` and every reservation lives in the
`KvLedger`; the controller only calls reserve/revise/release at the request's transitions, and evicts batch
work from a replica whose KV occupancy reached the hard watermark.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import heapq
import itertools
import logging
import math
import time
from collections import Counter, deque
from typing import Callable

from gateway.policies.admission import LEVELS, Decision, Demand, KvAdmission, reported_pool_tokens
from gateway.policies.admission import Outcome as KvOutcome
from gateway.flow.band import PriorityBand
from gateway.calibration import Profile, load_profile
from gateway.config import LoadedConfig
from gateway.flow.eviction import BandDemand, Evictor, plain_view
from gateway.flow.interface import Outcome
from gateway.flow.ledger import KvLedger, Reservation
from gateway.policies.holdback import band_ceilings, configured_policy
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.policies.picker import EndpointPicker
from gateway.replicas import Replica, ReplicaPool
from gateway.flow.request import DropReason, FlowRequest, Status
from gateway.policies.saturation import SaturationDetector, saturation_detector
from gateway.tokenization import load_local_tokenizer
from gateway.policies.victims import VictimCandidate, victim_policy

logger = logging.getLogger("gateway.flow")

HISTORY = 10
# Recent KV releases kept for /admin/state (an outside observer times a cancel against `at`).
RECENT_RELEASES = 32
# Evicted requests whose place in line is kept for their retry; the oldest is forgotten past this many (a retry
# that never came back, or came back to another gateway).
EVICTED_PLACES = 100_000


class FlowController:
    def __init__(self, loaded: LoadedConfig, pool: ReplicaPool, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.metrics = metrics
        self.clock = clock
        self.bands: dict[int, PriorityBand] = {}
        self.bands_desc: list[PriorityBand] = []
        self.ceilings: dict[int, float] = {}
        # The ceiling each band keeps at any demand; what it holds above it is on loan (see gateway/flow/eviction.py).
        self.floors: dict[int, float] = {}
        self.evictor = Evictor(view=self._victim_view)
        self.admission: KvAdmission | None = None
        self.ledger: KvLedger | None = None
        self.profile: Profile | None = None
        self.total_queued = 0
        self.in_flight = 0
        self.rejected_tokens: Counter[str] = Counter()
        self.tokenizer_fallbacks = 0
        # When a request slot was last handed back (a finish, or an eviction decision that hands it on): what a
        # blocked arrival waited for (the blocked_release histogram).
        self._slot_released_at: float | None = None
        self.recent_releases: deque[dict] = deque(maxlen=RECENT_RELEASES)
        # How prompts are counted (the proxy's PromptCounter.state), for /admin/state.
        self.tokenizer_state: Callable[[], dict] = lambda: {}
        # Dispatches per second (exponentially weighted), for the estimated wait by priority.
        self._rate = 0.0
        self._rate_at = clock()
        self.dispatched_total = 0
        self.rejections: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        # The last applied configs, oldest first (rollback goes to the one before the running one).
        self.history: list[tuple[LoadedConfig, float]] = []
        self._seq = itertools.count(1)
        # Evicted requests keep their place in line and their replica: (fairness id, request id) -> (the victim's
        # place, the replica it ran on), taken by the retry that comes back with the same request id (the worker's
        # row id, stable across attempts).
        self._evicted_places: collections.OrderedDict[tuple[str, str], tuple[int, str | None]] = \
            collections.OrderedDict()
        self.places_kept = 0
        self.affinity_kept = 0  # evicted requests' retries dispatched to the replica their attempt ran on
        self._expiry: list[tuple[float, int, FlowRequest]] = []
        self._wake = asyncio.Event()
        self._grace_timer: asyncio.TimerHandle | None = None
        self.loaded: LoadedConfig
        self.apply_config(loaded)

    # -- configuration --------------------------------------------------------------------------------------
    def apply_config(self, loaded: LoadedConfig) -> None:
        """Swap in a validated config; queued and in-flight requests keep their places."""
        cfg = loaded.config
        adm = cfg.admission
        # Read first: a profile that cannot be read rejects the whole config before anything changes.
        profile = load_profile(adm.calibrationProfile) if adm.calibrationProfile else None
        if adm.enabled and adm.tokenizer in ("local", "auto") and adm.tokenizerFile:
            load_local_tokenizer(adm.tokenizerFile)
        self.loaded = loaded
        self.history.append((loaded, time.time()))
        del self.history[:-HISTORY]
        sat = cfg.saturation
        self.detector: SaturationDetector = saturation_detector(
            sat.detector, max_concurrency=sat.maxConcurrency, headroom=sat.headroom,
            queue_depth_threshold=sat.queueDepthThreshold, kv_util_threshold=sat.kvCacheUtilThreshold,
            staleness=sat.metricsStalenessSeconds, scrape_interval=cfg.metrics.scrapeIntervalSeconds)
        self.picker = EndpointPicker(max_concurrency=sat.maxConcurrency, policy=cfg.picker.policy,
                                     in_flight_weight=cfg.picker.inFlightWeight,
                                     kv_usage_weight=cfg.picker.kvUsageWeight, occupancy=self._occupancy_share)
        self.evicted_affinity = cfg.picker.evictedAffinity
        ev = cfg.eviction
        self.evictor.policy = victim_policy(ev.policy_name())
        self.eviction_enabled = ev.policy_name() != "none"
        self.evictor.max_per_decision = ev.maxPerDecision
        self.evictor.confirmation_timeout = ev.confirmationTimeoutSeconds
        self.evictor.grace = ev.graceSeconds if ev.graceSeconds is not None else self.detector.confirmation_grace
        self.evictor.paced = not self.detector.release_on_decision
        # Reservations outlive configs: a reload or rollback changes the rules, never what is held.
        # A calibration profile's measured factor raises the configured one, never lowers it.
        safety = max(adm.safetyFactor, profile.safety_factor if profile else 1.0)
        if self.ledger is None:
            self.ledger = KvLedger(block_tokens=adm.blockTokens, safety_factor=safety,
                                   window=adm.tokenSecondsWindowSeconds)
        else:
            self.ledger.configure(block_tokens=adm.blockTokens, safety_factor=safety,
                                  window=adm.tokenSecondsWindowSeconds)
        self.profile = profile
        self.admission = KvAdmission(adm, self.ledger, self.profile) if adm.enabled else None
        self.pool.on_identify = self._on_identify
        for replica in self.pool.replicas:
            replica.refused = None
            if replica.model is not None:
                self._on_identify(replica)
        self.tick = cfg.flowControl.tickSeconds
        self.global_max_requests = cfg.flowControl.maxRequests
        self.traffic_classes = {obj.priority: obj.traffic_class() for obj in cfg.objectives.values()}
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
                self._apply_ttl(self.bands[p])
            else:
                self.bands[p] = PriorityBand(p, **kwargs)
        self._drop_idle_bands(keep=set(configured))
        self._configured = set(configured)
        self._policy = configured_policy(cfg.usageLimit)
        self._refresh_ceilings()
        self.pool.health_interval = cfg.health.intervalSeconds
        self.pool.health_timeout = cfg.health.timeoutSeconds
        self.pool.failures_to_down = cfg.health.failuresToDown
        self.pool.scrape_interval = cfg.metrics.scrapeIntervalSeconds
        if [r.url for r in self.pool.replicas] != cfg.replicas:
            self.pool.set_urls(cfg.replicas)
        self.wake()

    def _apply_ttl(self, band: PriorityBand) -> None:
        """A reloaded (or rolled-back) band TTL holds for requests already queued too, counted from their arrival:
        after a bad config is rolled back, what queued under it past the restored deadlines is answered 429 at
        once instead of flooding the replicas ahead of new traffic. A TTL never lengthens a request's wait."""
        if band.ttl <= 0:
            return
        for req in band.waiting():
            expires = req.arrived + band.ttl
            if expires < req.expires_at:
                req.expires_at = expires
                heapq.heappush(self._expiry, (expires, req.seq, req))

    def _refresh_ceilings(self) -> None:
        self.bands_desc = sorted(self.bands.values(), key=lambda b: -b.priority)
        priorities = [b.priority for b in self.bands_desc]
        overrides = {b.priority: b.ceiling_override for b in self.bands_desc}
        self.ceilings = band_ceilings(self._policy, priorities, overrides)
        self.floors = band_ceilings(self._policy, priorities, overrides, floors=True)

    def _follow_demand(self, healthy: list[Replica], now: float) -> None:
        """Feed a demand-following policy the bands' queued + in-flight counts; recompute ceilings if they moved."""
        policy = self._policy
        if policy.follows_demand and policy.observe(
                [(b.priority, b.queued + b.in_flight) for b in self.bands_desc],
                len(healthy) * self.loaded.config.saturation.maxConcurrency, now):
            self._refresh_ceilings()

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
        req.place, req.affinity = self._evicted_places.pop((req.fairness_id, req.request_id), (req.seq, None))
        if req.place != req.seq:
            self.places_kept += 1
        req.traffic_class = self.traffic_classes.get(req.priority) or self.loaded.config.traffic_class(req.priority)
        band = self.band_for(req.priority)
        healthy = self.pool.healthy()
        if not healthy:
            return self._reject(req, DropReason.NO_ENDPOINTS, band)
        if band.ttl > 0:
            req.expires_at = min(req.expires_at, req.arrived + band.ttl)
        if req.deadline <= now:
            return self._reject(req, DropReason.TTL_EXPIRED, band)
        kv_wait = False
        fits = None
        if self.admission is not None:
            decision = self.admission.decide(self._demand(req), healthy, now)
            if decision.outcome is KvOutcome.REJECT:
                return self._reject_kv(req, decision, band)
            kv_wait = decision.outcome is KvOutcome.QUEUE
            fits = _within(decision)
        self._follow_demand(healthy, now)
        if not kv_wait and not self._queued_at_or_above(req.priority):
            if self.detector.saturation(healthy, now) < self.ceilings[req.priority]:
                replica = self.picker.pick(healthy, self.detector, now, fits, prefer=req.affinity)
                if replica is not None:
                    self._dispatch(req, replica, band, now, "inline")
                    return Outcome.DISPATCHED
        if req.expires_at <= now:
            return self._reject(req, DropReason.TTL_EXPIRED, band)
        if band.max_requests and band.queued >= band.max_requests:
            return self._reject(req, DropReason.SATURATED, band)
        if self.global_max_requests and self.total_queued >= self.global_max_requests:
            return self._reject(req, DropReason.SATURATED, band)
        if kv_wait:
            self._start_kv_wait(req, now)
        else:
            req.blocked_on_arrival = not req.sheddable
        req.status = Status.QUEUED
        req.enqueued_at = now
        req.waiter = asyncio.get_running_loop().create_future()
        band.push(req)
        self.total_queued += 1
        if req.expires_at < math.inf:
            heapq.heappush(self._expiry, (req.expires_at, req.seq, req))
        if self.eviction_enabled and not self.evictor.paced and not req.sheddable and not kv_wait:
            # Eviction hands slots on at the decision: run the cycle now rather than when the loop task is next
            # scheduled (tens of milliseconds on a busy loop, which is a whole engine step for a burst).
            self.cycle()
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
        self._count_rejection(req, DropReason.CONTEXT_CANCELLED, band)
        log_event(logger, logging.INFO, "withdrawn", request_id=req.request_id, band=req.priority)
        self.wake()

    def finish(self, req: FlowRequest, cause: str = "end", event_at: float | None = None,
               closed_at: float | None = None) -> None:
        """A dispatched request is over (completed, failed, client gone or evicted): release its slot and its
        KV reservation. `cause` (end, cancel, disconnect, evict, error) and `event_at` (monotonic time the
        cause was seen) measure release latency. `closed_at`: when an evicted request's upstream connection
        closed, if earlier than now (a relay of `--workers` closes it, then tells flow control)."""
        if req.status is not Status.DISPATCHED:
            return
        now = self.clock()
        closed = min(now, closed_at) if closed_at is not None else now
        evicted = req.drop_reason is DropReason.EVICTED
        req.status = Status.EVICTED if evicted else Status.FINISHED
        replica: Replica = req.replica  # type: ignore[assignment]
        if not req.slot_released:
            self._release_slot(req)
        if isinstance(req.reservation, Reservation) and self.ledger is not None:
            if self.ledger.release(req.reservation, now):
                cause = "evict" if evicted else cause
                start = req.evicted_at if evicted else (event_at if event_at is not None else now)
                self.metrics.child(self.metrics.kv_release, cause).observe(max(0.0, now - start))
                release = {"request_id": req.request_id, "fairness_id": req.fairness_id, "cause": cause,
                           "at": time.time(), "seconds_after_cause": round(max(0.0, now - start), 6)}
                if evicted:
                    release["upstream_closed_after_cause"] = round(max(0.0, closed - start), 6)
                self.recent_releases.append(release)
        band = self.bands[req.priority]
        self.evictor.untrack(req)
        if evicted:
            latency = self.evictor.confirm(req, closed)
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

    def _release_slot(self, req: FlowRequest) -> None:
        self._slot_released_at = self.clock()
        req.slot_released = True
        req.replica.in_flight -= 1  # type: ignore[union-attr]
        self.bands[req.priority].in_flight -= 1
        self.in_flight -= 1

    async def reassign(self, req: FlowRequest) -> Replica | None:
        """Move a dispatched request whose replica refused the connection to another replica, if any.
        A coroutine (that never awaits, so the move is one step of the single writer) because a relay's
        controller must ask the flow-control process for the answer (gateway/relays/remote_flow.py)."""
        if req.status is not Status.DISPATCHED or req.slot_released:
            return None
        old: Replica = req.replica  # type: ignore[assignment]
        others = [r for r in self.pool.healthy() if r is not old]
        fits = None
        admission, res = self.admission, req.reservation
        if admission is not None and isinstance(res, Reservation):
            # Its blocks are held on the old replica; quotas already count them, only room matters here.
            demand = admission.within_context(self._demand(req), others)
            fits = lambda r: admission.fits(demand, admission.kv_tokens(demand, r), r)  # noqa: E731
        new = self.picker.pick(others, self.detector, self.clock(), fits)
        if new is None:
            return None
        old.in_flight -= 1
        new.in_flight += 1
        new.dispatches += 1
        if isinstance(req.reservation, Reservation) and self.ledger is not None:
            self.ledger.move(req.reservation, new.url, admission.block_size(new) if admission else None)
        req.replica = new
        return new

    def revise(self, req: FlowRequest, output_tokens: int, done: bool = False) -> None:
        """Relayed output so far: the ledger's reservation follows it; a finished generation frees the rest."""
        res = req.reservation
        if self.ledger is None or not isinstance(res, Reservation) or req.status is not Status.DISPATCHED:
            return
        before = res.kv_tokens
        self.ledger.revise(res, output_tokens, self.clock(), done=done)
        if res.kv_tokens < before and self.total_queued:
            self.wake()

    def started_streaming(self, req: FlowRequest) -> None:
        """The response's first body chunk went out: evicting it now cuts a stream (victim policies weigh it)."""
        req.streaming_started = True

    @property
    def admission_enabled(self) -> bool:
        return self.admission is not None

    def count_tokenizer_fallback(self) -> None:
        self.tokenizer_fallbacks += 1

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
                logger.exception("dispatch_cycle_failed")

    def cycle(self) -> None:
        """One dispatch cycle: expire, then dispatch as much as the ceilings allow, then maybe evict."""
        now = self.clock()
        self._expire(now)
        for late in self.evictor.expire(now):
            self.evictions["timed_out"] += 1
            self.metrics.child(self.metrics.evictions, "timed_out").inc()
            log_event(logger, logging.WARNING, "eviction_timed_out", request_id=late.request_id)
        healthy = self.pool.healthy()
        self._follow_demand(healthy, now)
        if self.admission is not None and self.eviction_enabled:
            self._evict_over_hard_watermark(healthy, now)
        if not self.total_queued or not healthy:
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
                    decision = self.admission.decide(self._demand(req), healthy, now)
                    if decision.outcome is KvOutcome.REJECT:
                        band.pop(req)
                        self.total_queued -= 1
                        self._reject_kv(req, decision, band)
                        progressed = True
                        break
                    if decision.outcome is KvOutcome.QUEUE:
                        self._start_kv_wait(req, now)
                        break  # head-of-line: this band and the ones below wait for KV room
                    fits = _within(decision)
                replica = self.picker.pick(healthy, self.detector, now, fits, prefer=req.affinity)
                if replica is None:
                    blocked = band
                    break
                band.pop(req)
                self.total_queued -= 1
                self._dispatch(req, replica, band, now, "loop")
                progressed = True
                break
            if not progressed:
                if blocked is not None and self.eviction_enabled and self._maybe_evict(saturation, blocked, now):
                    continue  # the victims' slots were handed on at once: dispatch into them now
                return

    # -- internals ------------------------------------------------------------------------------------------
    def _queued_at_or_above(self, priority: int) -> bool:
        for band in self.bands_desc:
            if band.priority < priority:
                return False
            if band.queued:
                return True
        return False

    def _occupancy_share(self, replica: Replica) -> float:
        if self.admission is None:
            return replica.kv_usage or 0.0
        return self.admission.occupancy(replica) / self.admission.pool_tokens(replica)

    def _demand(self, req: FlowRequest) -> Demand:
        return Demand(req.prompt_tokens, req.max_new_tokens, req.priority, req.traffic_class, req.fairness_id,
                      sequences=req.sequences, limit_param=req.limit_param)

    def _reject_kv(self, req: FlowRequest, decision: Decision, band: PriorityBand) -> Outcome:
        assert decision.reason is not None
        asked = self._demand(req).held_tokens
        self.rejected_tokens[decision.reason.value] += asked
        self.metrics.child(self.metrics.kv_rejected_tokens, decision.reason.value).inc(asked)
        return self._reject(req, decision.reason, band, decision.message)

    def _on_identify(self, replica: Replica) -> None:
        """A replica told us what it serves and (when exported) its KV pool: check both against the config."""
        self._check_calibration(replica)
        adm = self.loaded.config.admission
        if self.admission is None:
            return
        block_size = self.admission.block_size(replica)
        pool = reported_pool_tokens(replica, block_size)
        if not pool:
            return
        running = adm.maxRunningSequences or self.loaded.config.saturation.maxConcurrency
        pool_blocks = pool // block_size
        room = adm.growth_room(pool_blocks)
        if room < running:
            # The config passed its check against the configured pool; this replica's real pool is smaller.
            log_event(logger, logging.WARNING, "kv_growth_room_short", replica=replica.url,
                      pool_blocks=pool_blocks, block_size=block_size, room_blocks=room, running_sequences=running,
                      hint="lower admission.hardWatermark or admission.maxRunningSequences")

    def _check_calibration(self, replica: Replica) -> None:
        """Refuse a replica the calibration profile was not measured on (its estimate is false headroom)."""
        if self.profile is None:
            return
        reason = self.profile.mismatch(replica)
        if reason != replica.refused:
            replica.refused = reason
            log_event(logger, logging.ERROR if reason else logging.INFO,
                      "calibration_refused" if reason else "calibration_accepted", replica=replica.url,
                      reason=reason, profile=self.loaded.config.admission.calibrationProfile,
                      hint="run `holdback gateway calibrate` against this replica" if reason else None)
            self.wake()

    def _victim_view(self, req: FlowRequest, now: float) -> VictimCandidate:
        view = plain_view(req, now)
        if self.admission is None:
            return view
        total = sum(self.admission.pool_tokens(r) for r in self.pool.healthy()) or 1
        return dataclasses.replace(view, tenant_over_soft_quota=self.admission.soft_over(req.fairness_id, total))

    def _evict_over_hard_watermark(self, healthy: list[Replica], now: float) -> None:
        """Per replica at or above the hard watermark: evict recoverable batch work until under it."""
        admission = self.admission
        assert admission is not None
        # The scraped usage shows the freed blocks only after a scrape: wait that long between decisions.
        grace = max(self.evictor.grace, self.pool.scrape_interval + 0.05)
        for replica in healthy:
            pool = admission.pool_tokens(replica)
            excess = admission.occupancy(replica) - admission.cfg.hardWatermark * pool
            if excess < 0:
                continue
            # The evictor counts the victims' blocks, all of this replica's block size.
            victims = self.evictor.decide_kv(replica, excess / admission.block_size(replica) + 1, grace, now)
            for victim in victims:
                self._evict(victim, now, replica=replica.url, trigger="kv-hard-watermark",
                            occupancy=round(admission.occupancy(replica) / pool, 4))
            if victims:
                return

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
        if req.affinity is not None and req.affinity == replica.url:
            self.affinity_kept += 1
        if self.admission is not None and self.ledger is not None:
            # As the replica runs it: the output clamped to the context, every sequence's own.
            demand = self.admission.within_context(self._demand(req), self.pool.healthy())
            req.reservation = self.ledger.reserve(
                request_id=req.request_id, fairness_id=req.fairness_id, traffic_class=req.traffic_class,
                priority=req.priority, replica=replica.url, prompt_tokens=req.prompt_tokens,
                max_new_tokens=demand.output_tokens, block_size=self.admission.block_size(replica), now=now)
        elapsed = max(now - self._rate_at, 1e-3)
        self._rate = self._rate * math.exp(-elapsed / 5.0) + 1.0 / 5.0
        self._rate_at = now
        band.in_flight += 1
        band.dispatched += 1
        self.in_flight += 1
        self.dispatched_total += 1
        if req.sheddable:
            self.evictor.track(req)
        m = self.metrics
        m.child(m.dispatches, str(band.priority), path).inc()
        m.child(m.flow_queue_duration, req.fairness_id, str(band.priority), "dispatched").observe(now - req.arrived)
        if req.blocked_on_arrival:
            released = self._slot_released_at
            if released is None or released < req.arrived:
                released = now  # no slot came back since it arrived: a ceiling or the pool changed
            m.child(m.blocked_release, str(band.priority)).observe(released - req.arrived)
        if req.waiter is not None:
            m.child(m.queue_wait, str(band.priority)).observe(now - req.arrived)
            if not req.waiter.done():
                req.waiter.set_result(Outcome.DISPATCHED)
        if logger.isEnabledFor(logging.DEBUG):
            log_event(logger, logging.DEBUG, "dispatch", request_id=req.request_id, band=band.priority,
                      replica=replica.url, path=path, queue_ms=round((now - req.arrived) * 1000, 2))

    def _reject(self, req: FlowRequest, reason: DropReason, band: PriorityBand,
                message: str | None = None) -> Outcome:
        req.status = Status.REJECTED
        req.drop_reason = reason
        req.drop_message = message
        self._count_rejection(req, reason, band)
        log_event(logger, logging.INFO, "rejected", request_id=req.request_id, reason=reason.value,
                  band=band.priority, fairness_id=req.fairness_id, detail=message)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.REJECTED)
        return Outcome.REJECTED

    def _count_rejection(self, req: FlowRequest, reason: DropReason, band: PriorityBand) -> None:
        self.rejections[reason.value] += 1
        m = self.metrics
        m.child(m.rejections, reason.value, str(band.priority)).inc()
        m.child(m.flow_queue_duration, req.fairness_id, str(band.priority), reason.value).observe(
            max(0.0, self.clock() - req.arrived))

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
                waited = self.loaded.config.admission.queueDeadlineMs
                self._reject_kv(req, Decision(KvOutcome.REJECT, DropReason.KV_CAPACITY, (
                    f"no replica had KV room for this request ({req.prompt_tokens} prompt + {req.max_new_tokens} "
                    f"max new tokens) within admission.queueDeadlineMs ({waited} ms); retry later or lower "
                    f"max_tokens.")), band)
                continue
            else:
                reason = DropReason.TTL_EXPIRED
            self._reject(req, reason, band)

    def _maybe_evict(self, saturation: float, blocked: PriorityBand, now: float) -> bool:
        """Evict for the blocked band; True when the victims' slots are free already (dispatch may go on)."""
        bands = [BandDemand(b.priority, self.ceilings[b.priority], b.queued, b.in_flight, self.floors[b.priority])
                 for b in self.bands_desc]
        decision = self.evictor.decide(saturation, bands, blocked.priority, self.in_flight, now)
        if decision is None:
            return False
        for victim in decision.victims:
            self._evict(victim, now, replica=getattr(victim.replica, "url", None), trigger="blocked-band",
                        demand_band=decision.demand_priority, saturation=round(saturation, 4),
                        deficit=round(decision.deficit, 4), victims=len(decision.victims))
        return self.detector.release_on_decision

    def _evict(self, victim: FlowRequest, now: float, **fields: object) -> None:
        victim.drop_reason = DropReason.EVICTED
        victim.evicted_at = now
        # Like a preempted sequence in vLLM, the victim's retry goes ahead of what was queued after it: it comes
        # back sooner, so its prompt and kept output are more likely still in the replica's prefix cache.
        places = self._evicted_places
        home = getattr(victim.replica, "url", None) if self.evicted_affinity else None
        places[(victim.fairness_id, victim.request_id)] = (victim.place, home)
        while len(places) > EVICTED_PLACES:
            places.popitem(last=False)
        self.evictions["issued"] += 1
        self.metrics.child(self.metrics.evictions, "issued").inc()
        log_event(logger, logging.INFO, "evict", request_id=victim.request_id, band=victim.priority, **fields)
        if self.detector.release_on_decision and victim.status is Status.DISPATCHED:
            # The gateway's own count is the saturation reading: hand the slot on now rather than one event-loop
            # round later, when the cancelled task closes the upstream. The replica runs the victim a few
            # milliseconds longer; its KV reservation is held until then (released in finish()).
            self._release_slot(victim)
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
    def _kv_state(self, now: float) -> dict:
        admission, ledger = self.admission, self.ledger
        assert ledger is not None
        replicas = {}
        total_pool = 0
        for r in self.pool.replicas:
            totals = ledger.by_replica.get(r.url)
            reserved = totals.kv_tokens if totals else 0
            used = totals.used_kv_tokens if totals else 0
            # In KV tokens, and in blocks of the replica's own block size (what its vLLM counts).
            size = admission.block_size(r) if admission else (r.kv_block_size or ledger.block_tokens)
            pool = admission.pool_tokens(r) if admission else (reported_pool_tokens(r, size) or 0)
            if r.healthy and r.refused is None:
                total_pool += pool
            scraped = round((r.kv_usage or 0.0) * pool) if r.kv_usage is not None else None
            replicas[r.url] = {
                "block_size": size, "total_kv_tokens": pool, "reserved_kv_tokens": reserved, "used_kv_tokens": used,
                "scraped_used_kv_tokens": scraped, "total_blocks": pool // size,
                "reserved_blocks": math.ceil(reserved / size), "used_blocks": math.ceil(used / size),
                "scraped_used_blocks": round(scraped / size) if scraped is not None else None,
                "fragmentation": round((reserved - used) / reserved, 4) if reserved else 0.0,
                "level": admission.level(r) if admission else LEVELS[0]}
        tenants = {}
        ledger.accrue_all(now)
        for fid, totals in ledger.by_tenant.items():
            tenants[fid] = {"reserved_kv_tokens": totals.kv_tokens, "reserved_tokens": totals.reserved_tokens,
                            "share": round(totals.kv_tokens / total_pool, 6) if total_pool else 0.0,
                            "active_sequences": totals.active,
                            "token_seconds": round(ledger.token_seconds(fairness_id=fid, now=now, accrued=True), 1)}
        classes = {name: {"reserved_kv_tokens": t.kv_tokens, "reserved_tokens": t.reserved_tokens,
                          "active_sequences": t.active} for name, t in ledger.by_class.items()}
        waiting: dict[str, int] = {}
        wait_s: dict[str, float] = {}
        ahead = 0
        for band in self.bands_desc:
            ahead += band.queued
            waiting[str(band.priority)] = band.queued
            # Everything queued at or above this band goes first, at the recent dispatch rate.
            rate = self._rate * math.exp(-(now - self._rate_at) / 5.0)
            wait_s[str(band.priority)] = round(ahead / rate, 3) if ahead and rate > 1e-6 else 0.0
        return {"enabled": admission is not None, "replicas": replicas, "tenants": tenants, "classes": classes,
                "rejected_tokens": dict(self.rejected_tokens), "waiting_by_priority": waiting,
                "estimated_wait_s_by_priority": wait_s, "tokenizer_fallbacks": self.tokenizer_fallbacks,
                "recent_releases": list(self.recent_releases),
                "tokenizer": self.tokenizer_state()}

    def snapshot(self) -> dict:
        now = self.clock()
        healthy = self.pool.healthy()
        saturation = self.detector.saturation(healthy, now)
        cfg = self.loaded.config
        return {
            "config": {"digest": self.loaded.digest, "source": self.loaded.source,
                       "history": [{"digest": c.digest, "applied_at": at} for c, at in self.history]},
            "detector": self.detector.name,
            "saturation": round(saturation, 6),
            "stale_replicas": self.detector.stale_count(healthy, now),
            "queued": self.total_queued,
            "in_flight": self.in_flight,
            "bands": [
                {"priority": b.priority, "objectives": self.objective_names.get(b.priority, []),
                 "queued": b.queued, "in_flight": b.in_flight, "dispatched": b.dispatched,
                 "ceiling": round(self.ceilings[b.priority], 6),
                 "blocked": bool(b.queued) and saturation >= self.ceilings[b.priority],
                 "max_requests": b.max_requests, "ttl": b.ttl, "fairness": b.fairness.name,
                 "ordering": b.ordering.name, "queues": b.queue_sizes()}
                for b in self.bands_desc
            ],
            "replicas": [
                {"url": r.url, "healthy": r.healthy, "in_flight": r.in_flight,
                 "limit": cfg.saturation.maxConcurrency * (1 + cfg.saturation.headroom),
                 "kv_usage": r.kv_usage, "kv_usage_max": r.kv_usage_max, "waiting": r.waiting,
                 "running": r.running, "model": r.model, "model_root": r.model_root,
                 "max_model_len": r.max_model_len, "refused": r.refused, "unauthorized": r.unauthorized,
                 "metrics_age_s": round(now - r.metrics_at, 3) if r.metrics_at else None}
                for r in self.pool.replicas
            ],
            "holdback": {"policy": self._policy.name,
                         "forecast": self._policy.state(),
                         "ceilings": {str(p): round(c, 6) for p, c in self.ceilings.items()}},
            "eviction": {"enabled": self.eviction_enabled, "pending": len(self.evictor.pending),
                         "candidates": len(self.evictor.candidates)},
            "admission": self.admission.state() if self.admission else {"enabled": False},
            "kv": self._kv_state(now),
            "totals": {"dispatched": self.dispatched_total, "evictions": dict(self.evictions),
                       "rejections": dict(self.rejections), "evicted_places_kept": self.places_kept,
                       "evicted_replica_kept": self.affinity_kept,
                       "evicted_places_waiting": len(self._evicted_places)},
        }


def _within(decision: Decision) -> Callable[[Replica], bool]:
    fitting = set(decision.replicas)
    return lambda replica: replica in fitting
