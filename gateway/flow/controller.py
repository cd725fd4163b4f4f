"""The flow controller: the single writer that decides dispatch, rejection, expiry and eviction.

All state changes happen on the event loop without awaiting in between, so the controller is the single
writer. Two ways in: `submit()` dispatches inline when nothing at or above the request's priority is queued
and the request may run now (the fast path), else it queues the request and wakes the dispatch loop.
The loop (`run()`, one task) wakes on enqueue, completion, eviction confirmed, replica changes and a short
tick for TTLs, and walks bands strictly from high to low priority: a band with queued work whose head may not
run now stops the walk (head-of-line blocking), which is where in-flight eviction is considered.
Whether a request may run now, and where, is one decision (`_place`) for both: under its band's ceiling, with
KV room (`KvAdmission`), on the replica the picker chooses. Every reservation lives in the `KvLedger`; the
controller only calls reserve/revise/release at the request's transitions. It owns the bands (`BandRegistry`),
the queue deadlines (`Deadlines`), the counts (`FlowTally`) and eviction (`EvictionControl`); /admin/state is
read out by gateway/flow/state.py. What a running request holds (its slot, in-flight counts, reservation) is
counted by the `RunningRequests` part (gateway/flow/running.py), at dispatch and when a new leader adopts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from typing import Callable

from gateway.calibration import Profile
from gateway.flow import moves, state
from gateway.flow.assembly import assemble, configure_replicas, objectives_by_priority
from gateway.flow.band import PriorityBand
from gateway.flow.cached_first import CachedPrefixes
from gateway.flow.deadlines import Deadlines
from gateway.flow.eviction_control import EvictionControl
from gateway.flow.floor import AtRiskFloor
from gateway.flow.interface import Outcome
from gateway.flow.ledger import KvLedger
from gateway.flow.placement import BLOCKED, WAIT_KV, Placement, Verdict
from gateway.flow.registry import BandRegistry
from gateway.flow.replica_checks import check_identified
from gateway.flow.running import RunningRequests
from gateway.flow.request import DropReason, FlowRequest, Lease, Status, Trigger
from gateway.flow.tally import FlowTally
from gateway.flow.triggers import Moment, Stage
from gateway.log import log_event
from gateway.metrics import GatewayMetrics
from gateway.policies.admission import Decision, Demand, KvAdmission, KvOutcome
from gateway.policies.saturation import SaturationDetector
from gateway.replicas import Replica, ReplicaPool
from gateway.settings import LoadedConfig

logger = logging.getLogger("gateway.flow")

HISTORY = 10


class FlowController(RunningRequests):
    """`FlowControl` in one process (gateway/flow/interface.py); the flow-control process of `--workers N` too."""

    def __init__(self, loaded: LoadedConfig, pool: ReplicaPool, metrics: GatewayMetrics,
                 clock: Callable[[], float] = time.monotonic, *, pool_name: str = "default",
                 owns_replicas: bool = True):
        # `pool`: the replicas it dispatches to; the gateway's model pools pass a view of their members
        # (gateway/pools.py), which owns their membership and health settings (`owns_replicas` False).
        self.pool = pool
        self.pool_name = pool_name
        self.owns_replicas = owns_replicas
        self.metrics = metrics
        self.clock = clock
        self.bands = BandRegistry()
        self.tally = FlowTally(metrics, clock, pool_name)
        self.eviction = EvictionControl(self)
        self.floor = AtRiskFloor()
        self.cached = CachedPrefixes()
        self.admission: KvAdmission | None = None
        self.ledger: KvLedger | None = None
        self.profile: Profile | None = None
        self.total_queued = 0
        self.in_flight = 0
        # How prompts are counted (the proxy's PromptCounter.state), for /admin/state.
        self.tokenizer_state: Callable[[], dict] = lambda: {}
        # The last applied configs, oldest first (rollback goes to the one before the running one).
        self.history: list[tuple[LoadedConfig, float]] = []
        self._seq = itertools.count(1)
        self.deadlines = Deadlines()
        self._wake = asyncio.Event()
        self.loaded: LoadedConfig
        self.apply_config(loaded)

    # -- configuration --------------------------------------------------------------------------------------
    def apply_config(self, loaded: LoadedConfig) -> None:
        """Swap in a validated config; queued and in-flight requests keep their places."""
        cfg = loaded.config
        # Built first: a profile that cannot be read rejects the whole config before anything changes.
        parts = assemble(cfg, self.ledger, self._occupancy_share)
        self.loaded = loaded
        self.history.append((loaded, time.time()))
        del self.history[:-HISTORY]
        self.detector: SaturationDetector = parts.detector
        self.picker = parts.picker
        self.eviction.configure(cfg.eviction, self.detector, cfg.picker.evictedAffinity)
        # Reservations outlive configs: a reload or rollback changes the rules, never what is held.
        self.ledger, self.admission, self.profile = parts.ledger, parts.admission, parts.profile
        self.pool.on_identify = self._on_identify
        for replica in self.pool.replicas:
            replica.refused = None
            if replica.model is not None:
                self._on_identify(replica)
        self.tick = cfg.flowControl.tickSeconds
        self.floor.share = cfg.flowControl.atRiskFloor
        self.lookahead = cfg.flowControl.cachedFirstLookahead
        self.global_max_requests = cfg.flowControl.maxRequests
        self.traffic_classes, self.objective_names = objectives_by_priority(cfg)
        for band in self.bands.configure(cfg):
            self.deadlines.apply_ttl(band)
        configure_replicas(self.pool, cfg, self.owns_replicas)
        self.wake()

    def _on_identify(self, replica: Replica) -> None:
        """A replica told us what it serves and (when exported) its KV pool: check both against the config."""
        if check_identified(replica, self.loaded.config, self.profile, self.admission):
            self.wake()

    # -- the FlowControl interface (gateway/flow/interface.py) ----------------------------------------------
    @property
    def admission_enabled(self) -> bool:
        return self.admission is not None

    def submit(self, req: FlowRequest) -> Outcome:
        """Dispatch `req` now, reject it, or queue it (then await `req.waiter`)."""
        now = self.clock()
        req.seq = next(self._seq)
        self.eviction.restore_place(req)
        req.traffic_class = self.traffic_classes.get(req.priority) or self.loaded.config.traffic_class(req.priority)
        band = self.bands.band_for(req.priority, self.loaded.config)
        healthy = self.pool.healthy()
        if not healthy:
            return self._reject(req, DropReason.NO_ENDPOINTS, band)
        if band.ttl > 0:
            req.expires_at = min(req.expires_at, req.arrived + band.ttl)
        if req.deadline <= now:
            return self._reject(req, DropReason.TTL_EXPIRED, band)
        # KV admission at arrival, whatever is queued: what can never run is refused before it queues, and a wait
        # for KV room is timed from now.
        kv = self.admission.decide(self.demand(req), healthy, now) if self.admission is not None else None
        if kv is not None and kv.outcome is KvOutcome.REJECT:
            return self._reject_kv(req, kv, band)
        kv_wait = kv is not None and kv.outcome is KvOutcome.QUEUE
        self._follow_demand(healthy, now)
        if not kv_wait and not self.bands.queued_at_or_above(req.priority):
            placed = self._place(req, healthy, now, self.detector.saturation(healthy, now), kv)
            if placed.replica is not None:
                self._dispatch(req, placed.replica, band, now, "inline")
                # It may wait inside its replica: free a slot now.
                self.eviction.fire(Trigger.WAITING_IN_REPLICA, Moment(now, healthy))
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
        moves.queue(req, now, asyncio.get_running_loop().create_future())
        band.push(req)
        self.floor.queued(req)
        self.total_queued += 1
        if req.expires_at < math.inf:
            self.deadlines.push(req)
        if self.eviction.enabled and not self.eviction.evictor.paced and not req.sheddable and not kv_wait:
            # Eviction hands slots on at the decision: run the cycle now rather than when the loop task is next
            # scheduled (tens of milliseconds on a busy loop, which is a whole engine step for a burst).
            self.cycle()
        self.wake()
        return Outcome.QUEUED

    def withdraw(self, req: FlowRequest, reason: DropReason = DropReason.CONTEXT_CANCELLED) -> None:
        """The caller left while `req` was queued (or its relay refused it, `reason`): take it out now."""
        if req.status is not Status.QUEUED:
            return
        moves.withdraw(req)
        band = self.bands[req.priority]
        band.forget(req)
        self.total_queued -= 1
        self.tally.rejection(req, reason, band.priority, self.clock())
        log_event(logger, "withdrawn", request_id=req.request_id, band=req.priority, reason=reason.value)
        self.wake()

    def refuse_waiting(self, reason: DropReason) -> int:
        """Refuse every queued request with `reason` (its caller gets the drop answer): the process is at its
        drain deadline (gateway/relays/drain.py). Returns how many."""
        refused = 0
        for band in self.bands.desc:
            for req in band.waiting():
                band.forget(req)
                self.total_queued -= 1
                self._reject(req, reason, band)
                refused += 1
        return refused

    def count_mid_stream_eviction(self) -> None:
        self.tally.eviction("mid_stream")

    def count_tokenizer_fallback(self) -> None:
        self.tally.tokenizer_fallbacks += 1

    def wake(self) -> None:
        self._wake.set()

    def snapshot(self) -> dict:
        """The /admin/state document (gateway/flow/state.py)."""
        return state.snapshot(self)

    # -- the dispatch loop ----------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            timeout = self.tick if (self.total_queued or self.eviction.evictor.pending) else None
            if not self._wake.is_set():
                # The tick: expire TTLs, time out evictions. asyncio.timeout, not wait_for: on Python 3.11 a
                # wake-up landing with a cancel made wait_for swallow the cancel, and the loop never stopped.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(timeout):
                        await self._wake.wait()
            self._wake.clear()
            try:
                self.cycle()
            except Exception:  # a bug in one cycle must not stop dispatching for good
                logger.exception("dispatch_cycle_failed")

    def cycle(self) -> None:
        """One dispatch cycle: expire, then dispatch as much as the ceilings allow, then maybe evict."""
        now = self.clock()
        self._expire(now)
        self.eviction.expire(now)
        healthy = self.pool.healthy()
        self._follow_demand(healthy, now)
        self.eviction.run(Stage.CYCLE, Moment(now, healthy))
        if not self.total_queued or not healthy:
            return
        self._fill_floor(healthy, now)
        while self.total_queued:
            saturation = self.detector.saturation(healthy, now)
            blocked: PriorityBand | None = None
            progressed = False
            for band in self.bands.desc:
                req = band.peek() if band.queued else None
                if req is None:
                    continue
                placed = self._place(req, healthy, now, saturation)
                if placed.verdict is Verdict.BLOCKED:
                    blocked = band
                    break
                if placed.verdict is Verdict.WAIT_KV:
                    self._start_kv_wait(req, now)
                    self.eviction.run(Stage.KV_WAIT, Moment(now, healthy, waiting=req))
                    break  # head-of-line: this band and the ones below wait for KV room
                ahead = self._cached_first(band, req, placed, healthy, now, saturation)
                if ahead is not None:
                    req, placed = ahead
                    band.take(req)
                else:
                    band.pop(req)
                self.total_queued -= 1
                if placed.verdict is Verdict.REJECT:
                    self._reject_kv(req, placed.kv, band)
                else:
                    self._dispatch(req, placed.replica, band, now, "loop")
                progressed = True
                break
            if not progressed:
                if blocked is not None and self.eviction.run(Stage.BLOCKED, Moment(now, healthy, saturation, blocked)):
                    continue  # the victims' slots were handed on at once: dispatch into them now
                return

    def _cached_first(self, band: PriorityBand, head: FlowRequest, placed: Placement, healthy: list[Replica],
                      now: float, saturation: float) -> tuple[FlowRequest, Placement] | None:
        """A request of the head's flow, within the lookahead, with more of its prefix cached on the replica the
        head would run on, and its placement there; None: the head goes (gateway/flow/cached_first.py)."""
        if (placed.verdict is not Verdict.RUN or not head.sheddable or self.lookahead == 0
                or head.passed_over >= self.lookahead or head.evictions or not head.ask.prefix):
            return None  # an evicted request's retry keeps its place: its blocks were just cached; so does a prompt
            # whose blocks are not known (token ids: the workers resume an evicted request so)
        url = placed.replica.url
        if self.admission is not None:
            self.cached.trim(url, self.admission.pool_tokens(placed.replica) - self.admission.occupancy(placed.replica))
        if not self.cached.knows(url):
            return None
        best, most = head, self.cached.held(url, head.ask.prefix)
        for req in band.flows[head.fairness_id].first(self.lookahead)[1:]:
            held = self.cached.held(url, req.ask.prefix)
            if held > most:
                best, most = req, held
        if best is head:
            return None
        ahead = self._place(best, healthy, now, saturation, prefer=url)
        if ahead.verdict is not Verdict.RUN or ahead.replica is not placed.replica:
            return None  # no KV room for it there, or it must run elsewhere (a pinned turn): it waits for its turn
        head.passed_over += 1
        self.tally.cached_first += 1
        return best, ahead

    def _fill_floor(self, healthy: list[Replica], now: float) -> None:
        """Requests of at-risk batches first, past every band, while the floor has room (gateway/flow/floor.py)."""
        while (req := self.floor.next(self._capacity(healthy))) is not None:
            placed = self._place(req, healthy, now, saturation=0.0)  # past its band's ceiling, not past KV or room
            if placed.verdict is not Verdict.RUN:
                return
            band = self.bands[req.priority]
            band.forget(req)
            self.total_queued -= 1
            self.floor.dispatched(req)
            self._dispatch(req, placed.replica, band, now, "floor", in_floor=True)

    # -- the decision and the transitions -------------------------------------------------------------------
    def _place(self, req: FlowRequest, healthy: list[Replica], now: float, saturation: float,
               kv: Decision | None = None, prefer: str | None = None) -> Placement:
        """Can `req` run now, and where: the one dispatch decision, for the head of a band (`cycle`) and for an
        arrival (`submit`, which passes KV admission's answer at arrival as `kv`). Under its band's ceiling, with
        KV room for it, on the replica the picker chooses among those with room (an evicted request's retry
        prefers the replica its attempt ran on; else `prefer`, the replica cached-first dispatch chose it for)."""
        if saturation >= self.bands.ceilings[req.priority]:
            return BLOCKED
        if self.admission is not None:
            if kv is None:
                kv = self.admission.decide(self.demand(req), healthy, now)
            if kv.outcome is KvOutcome.REJECT:
                return Placement(Verdict.REJECT, kv=kv)
            if kv.outcome is KvOutcome.QUEUE:
                return WAIT_KV
        fits = kv.fits if kv is not None else None
        if self.eviction.awaiting:  # a higher-priority request not answering yet keeps lower ones off its replica
            within, control = fits, self.eviction
            fits = lambda r: (within is None or within(r)) and not control.holds_back(r, req.priority)  # noqa: E731
        replica = self.picker.pick(healthy, self.detector, now, fits, prefer=req.affinity or prefer,
                                   prefix=req.ask.prefix)
        return Placement(Verdict.RUN, replica) if replica is not None else BLOCKED

    def _dispatch(self, req: FlowRequest, replica: Replica, band: PriorityBand, now: float, path: str,
                  in_floor: bool = False) -> None:
        self._occupy(req, Lease(replica, now, in_floor=in_floor), band, now)
        replica.dispatches += 1
        if req.evictions and req.affinity == replica.url:  # an evicted request's retry, not a pinned turn
            self.tally.affinity_kept += 1
        band.dispatched += 1
        self.eviction.dispatched(req)
        self.tally.dispatch(req, band.priority, replica.url, path, now)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.DISPATCHED)

    def _reject(self, req: FlowRequest, reason: DropReason, band: PriorityBand,
                message: str | None = None) -> Outcome:
        moves.reject(req, reason, message)
        self.eviction.keep_place(req)
        self.tally.rejection(req, reason, band.priority, self.clock())
        log_event(logger, "rejected", request_id=req.request_id, reason=reason.value,
                  band=band.priority, fairness_id=req.fairness_id, detail=message)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.REJECTED)
        return Outcome.REJECTED

    def _reject_kv(self, req: FlowRequest, decision: Decision | None, band: PriorityBand) -> Outcome:
        assert decision is not None and decision.reason is not None
        self.tally.kv_rejection(decision.reason, self.demand(req).held_tokens)
        return self._reject(req, decision.reason, band, decision.message)

    def _expire(self, now: float) -> None:
        for req in self.deadlines.due(now):
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

    def _start_kv_wait(self, req: FlowRequest, now: float) -> None:
        if self.admission is not None:
            self.deadlines.start_kv_wait(req, now + self.admission.queue_deadline)

    # -- readings -------------------------------------------------------------------------------------------
    def _capacity(self, healthy: list[Replica]) -> float:
        default = self.loaded.config.saturation.maxConcurrency
        return sum(r.capacity or default for r in healthy)

    def _follow_demand(self, healthy: list[Replica], now: float) -> None:
        self.bands.follow_demand(self._capacity(healthy), now)

    def _occupancy_share(self, replica: Replica) -> float:
        if self.admission is None:
            return replica.kv_usage or 0.0
        return self.admission.occupancy(replica) / self.admission.pool_tokens(replica)

    def demand(self, req: FlowRequest) -> Demand:
        return Demand(req.prompt_tokens, req.max_new_tokens, req.priority, req.traffic_class, req.fairness_id,
                      sequences=req.sequences, limit_param=req.limit_param, prompt_exact=req.prompt_exact,
                      prefix=req.ask.prefix, prefix_tokens=req.prefix_tokens)
