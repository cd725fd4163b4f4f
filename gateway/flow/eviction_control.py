"""Eviction as flow control carries it out: the two triggers, the Evictor's decision, each victim's eviction.

The triggers are a dispatch cycle stopped at a blocked band (`for_blocked_band`), a replica whose KV
occupancy reached the hard watermark (`over_hard_watermark`), a request above batch that KV admission keeps
waiting (`for_kv_wait`), and a higher-priority request waiting inside its replica for an engine slot
(`for_waiting_inside`); the `Evictor` (gateway/flow/eviction.py) sizes the
decision and the configured victim policy orders the candidates. Evicting a victim keeps its place in line and
its replica for the retry that comes back with the same request id (the worker's row id), hands its slot on at
once where the saturation reading is the gateway's own count, and cancels its proxy task, which answers 429
`evicted` and closes the upstream connection; `finished` confirms it when that connection has closed. All of it
runs inside the controller's steps: flow control stays the single writer.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import TYPE_CHECKING

from gateway.config import Eviction
from gateway.flow.eviction import BandDemand, Evictor, plain_view, waits_inside
from gateway.flow import moves
from gateway.flow.request import FlowRequest, Status, Trigger
from gateway.log import log_event
from gateway.policies.saturation import SaturationDetector
from gateway.policies.victims import VictimCandidate, victim_policy
from gateway.replicas import Replica

if TYPE_CHECKING:
    from gateway.flow.band import PriorityBand
    from gateway.flow.controller import FlowController

logger = logging.getLogger("gateway.flow")

# Evicted requests whose place in line is kept for their retry; the oldest is forgotten past this many (a retry
# that never came back, or came back to another gateway).
EVICTED_PLACES = 100_000


class EvictionControl:
    def __init__(self, controller: FlowController):
        self.fc = controller
        self.evictor = Evictor(view=self.victim_view)
        self.enabled = True
        # An evicted request's retry goes back to the replica its attempt ran on (picker.evictedAffinity).
        self.affinity = True
        # (fairness id, request id) -> (the victim's place, the replica it ran on, its evictions so far), taken by
        # its retry.
        self.places: collections.OrderedDict[tuple[str, str], tuple[int, str | None, int]] = collections.OrderedDict()
        # Dispatched non-sheddable requests whose answer has not begun, on replicas whose engine slots are known
        # (maxNumSeqs): each may be waiting inside vLLM behind running batch work.
        self.awaiting: set[FlowRequest] = set()
        # Engine slots the last blocked-band decision freed on each replica, and that decision's time: the request
        # it was for is dispatched in the same cycle (the same time) and takes one, so it is not also counted as
        # waiting inside that replica (which would evict a second running request for it).
        self.freed: collections.Counter[Replica] = collections.Counter()
        self.freed_at = -1.0
        self._grace_timer: asyncio.TimerHandle | None = None

    def configure(self, ev: Eviction, detector: SaturationDetector, affinity: bool) -> None:
        evictor = self.evictor
        evictor.policy = victim_policy(ev.policy_name())
        self.enabled = ev.policy_name() != "none"
        evictor.max_per_decision = ev.maxPerDecision
        evictor.confirmation_timeout = ev.confirmationTimeoutSeconds
        evictor.grace = ev.graceSeconds if ev.graceSeconds is not None else detector.confirmation_grace
        evictor.paced = not detector.release_on_decision
        self.affinity = affinity

    def restore_place(self, req: FlowRequest) -> None:
        """The retry of an evicted request takes back the victim's place in line, its replica and its count of
        evictions."""
        req.place, req.affinity, req.evictions = self.places.pop((req.fairness_id, req.request_id), (req.seq, None, 0))
        if req.place != req.seq:
            self.fc.tally.places_kept += 1

    def keep_place(self, req: FlowRequest) -> None:
        """A retry of an evicted request was refused before it ran (its wait ran out, the queue was full): its next
        retry still comes back to its place."""
        if req.evictions:
            self._remember(req.fairness_id, req.request_id, (req.place, req.affinity, req.evictions))

    def _remember(self, fairness_id: str, request_id: str, place: tuple[int, str | None, int]) -> None:
        places = self.places
        places[(fairness_id, request_id)] = place
        while len(places) > EVICTED_PLACES:
            places.popitem(last=False)

    def victim_view(self, req: FlowRequest, now: float) -> VictimCandidate:
        view = plain_view(req, now)
        admission = self.fc.admission
        if admission is None:
            return view
        total = sum(admission.pool_tokens(r) for r in self.fc.pool.healthy()) or 1
        return dataclasses.replace(view, tenant_over_soft_quota=admission.soft_over(req.fairness_id, total))

    # -- the triggers ---------------------------------------------------------------------------------------
    def for_blocked_band(self, saturation: float, blocked: PriorityBand, now: float) -> bool:
        """Evict for the blocked band; True when the victims' slots are free already (dispatch may go on)."""
        fc = self.fc
        bands = [BandDemand(b.priority, fc.bands.ceilings[b.priority], b.queued, b.in_flight,
                            fc.bands.floors[b.priority]) for b in fc.bands.desc]
        decision = self.evictor.decide(saturation, bands, blocked.priority, fc.in_flight, now)
        if decision is None:
            return False
        self.freed.clear()
        self.freed_at = now
        for victim in decision.victims:
            replica = victim.leased().replica
            if replica.max_num_seqs is not None and not waits_inside(victim):
                self.freed[replica] += 1
        # Read before any victim's slot is handed on: `waits_inside` counts the replica's requests.
        queued = {replica: self.evictor.queued_on(replica, decision.demand_priority, now) for replica in self.freed}
        for victim in decision.victims:
            self.evict(victim, now, replica=victim.leased().replica.url, trigger=Trigger.BLOCKED_BAND,
                       demand_band=decision.demand_priority, saturation=round(saturation, 4),
                       deficit=round(decision.deficit, 4), victims=len(decision.victims))
        for replica, waiting in queued.items():
            self.clear_queue(replica, waiting, now, demand_band=decision.demand_priority)
        return fc.detector.release_on_decision

    def over_hard_watermark(self, healthy: list[Replica], now: float) -> None:
        """Per replica at or above the hard watermark: evict recoverable batch work until under it."""
        admission = self.fc.admission
        assert admission is not None
        grace = self.kv_grace()
        for replica in healthy:
            pool = admission.pool_tokens(replica)
            excess = admission.occupancy(replica) - admission.cfg.hardWatermark * pool
            if excess < 0:
                continue
            # The evictor counts the victims' blocks, all of this replica's block size.
            victims = self.evictor.decide_kv(replica, excess / admission.block_size(replica) + 1, grace, now)
            for victim in victims:
                self.evict(victim, now, replica=replica.url, trigger=Trigger.KV_HARD_WATERMARK,
                           occupancy=round(admission.occupancy(replica) / pool, 4))
            if victims:
                return

    def for_kv_wait(self, req: FlowRequest, healthy: list[Replica], now: float) -> None:
        """A request above batch that KV admission keeps waiting: evict batch work for it, as for one waiting
        for a request slot. The replica is the one where the least must be freed and the batch reservations
        there cover it. The victims (the policy's order) cover its shortfall and what every other request above
        batch queued behind it needs there, in one decision: a burst is not served `maxPerDecision` victims a
        scrape. Decisions are paced as the hard-watermark trigger's (the freed blocks show after a scrape)."""
        admission = self.fc.admission
        grace = self.kv_grace()
        if (req.sheddable or admission is None or not self.evictor.candidates
                or not self.evictor.kv_gate_open(now, grace)):
            return
        demand = admission.within_context(self.fc.demand(req), healthy)
        soft = admission.soft_over(req.fairness_id, sum(admission.pool_tokens(r) for r in healthy)) > 0
        held: collections.Counter[Replica] = collections.Counter()
        for victim in self.evictor.candidates:  # all sheddable: below `req`
            res = victim.reservation
            if res is not None:
                held[victim.leased().replica] += res.kv_tokens
        choice: tuple[float, Replica] | None = None
        for replica in healthy:
            short = admission.shortfall(demand, replica, soft)
            if short <= 0:
                return  # it fits there: what holds it back is not KV
            if held[replica] >= short and (choice is None or short < choice[0]):
                choice = (short, replica)
        if choice is None:
            return
        short, replica = choice
        for band in self.fc.bands.desc:
            if band.priority < 0:
                break  # the sheddable bands wait for batch's own room
            for other in band.waiting():
                if other is not req:
                    short += admission.kv_tokens(admission.within_context(self.fc.demand(other), healthy), replica)
        victims = self.evictor.decide_kv(replica, short / admission.block_size(replica), grace, now,
                                         limit=len(self.evictor.candidates))
        for victim in victims:
            self.evict(victim, now, replica=replica.url, trigger=Trigger.KV_WAIT, waiting=req.request_id,
                       shortfall_tokens=round(short))

    def kv_grace(self) -> float:
        """How long after a KV trigger's victims closed before the next: the scraped usage shows the freed
        blocks only after a scrape."""
        return max(self.evictor.grace, self.fc.pool.scrape_interval + 0.05)

    def for_waiting_inside(self, now: float) -> None:
        """Higher-priority requests waiting inside their replica for an engine slot, as surely as in our queue.

        A replica with `maxNumSeqs` slots and more requests than that in flight (the queue allowance) runs
        `maxNumSeqs` of them and keeps the rest waiting: vLLM preempts a running request only when KV runs out,
        never for priority, so a realtime request waits there until one ends. Such a request, not answering yet,
        is counted as waiting whenever its replica holds more than its slots; one running batch request on that
        replica is evicted per waiting request (those that stream first: they hold the slots), so vLLM
        schedules the waiting one in its next step (first, under its priority policy). Each waiting request is
        served once: if the freed slot goes to another (an fcfs replica's queue), it waits for the next end."""
        if not self.awaiting or not self.evictor.gate_open(now):
            return
        waiting: dict[Replica, list[FlowRequest]] = {}
        for req in self.awaiting:
            replica, slots = req.leased().replica, req.leased().replica.max_num_seqs
            if req.slot_freed or slots is None:
                continue
            if replica.in_flight > slots:
                waiting.setdefault(replica, []).append(req)
        for replica, reqs in waiting.items():
            wanted = min(len(reqs), replica.in_flight - (replica.max_num_seqs or 0))
            below = min(r.priority for r in reqs)
            victims = self.evictor.decide_on(replica, wanted, below, now)
            if not victims:
                continue
            queued = self.evictor.queued_on(replica, below, now)
            for req in sorted(reqs, key=lambda r: r.dispatched_at)[:len(victims)]:
                req.leased().slot_freed = True
            for victim in victims:
                self.evict(victim, now, replica=replica.url, trigger=Trigger.WAITING_IN_REPLICA,
                           in_flight=replica.in_flight, slots=replica.max_num_seqs)
            self.clear_queue(replica, queued, now, demand_band=below)

    def clear_queue(self, replica: Replica, waiting: list[FlowRequest], now: float, **fields: object) -> None:
        """Evict `waiting` (`Evictor.queued_on`), lower-priority requests in `replica`'s own queue, as a slot there
        is freed for a higher-priority one: whichever vLLM holds at its next step takes that slot. Their retries
        come back behind the request the slot was freed for, and no lower-priority request is sent to the
        replica until it answers (`holds_back`)."""
        for req in waiting:
            self.evict(req, now, replica=replica.url, trigger=Trigger.REPLICA_QUEUE, **fields)

    def holds_back(self, replica: Replica, priority: int) -> bool:
        """Whether a request of `priority` must not go to `replica` now: every engine slot there is held and a
        higher-priority request sent there has not answered yet. Sent now, it could reach vLLM's queue before
        that request does and take the slot freed for it; once that request answers, it runs."""
        slots = replica.max_num_seqs
        if slots is None or replica.in_flight < slots:
            return False
        return any(r.replica is replica and r.priority > priority for r in self.awaiting)

    def dispatched(self, req: FlowRequest) -> None:
        lease = req.leased()
        if not req.sheddable and lease.replica.max_num_seqs is not None:
            self.awaiting.add(req)
            if lease.dispatched_at == self.freed_at and self.freed[lease.replica] > 0:
                lease.slot_freed = True  # a running victim's slot, freed for it in this cycle
                self.freed[lease.replica] -= 1

    def answering(self, req: FlowRequest) -> None:
        """Its first body chunk went out (or it ended): it waits for no slot."""
        self.awaiting.discard(req)

    # -- one victim -----------------------------------------------------------------------------------------
    def evict(self, victim: FlowRequest, now: float, trigger: Trigger, **fields: object) -> None:
        moves.evict(victim, now)
        # Like a preempted sequence in vLLM, the victim's retry goes ahead of what was queued after it: it comes
        # back sooner, so its prompt and kept output are more likely still in the replica's prefix cache.
        home = victim.leased().replica.url if self.affinity else None
        self._remember(victim.fairness_id, victim.request_id, (victim.place, home, victim.evictions + 1))
        self.fc.tally.eviction("issued")
        log_event(logger, "evict", request_id=victim.request_id, band=victim.priority, trigger=trigger.value,
                  **fields)
        if self.fc.detector.release_on_decision and victim.status is Status.DISPATCHED:
            # The gateway's own count is the saturation reading: hand the slot on now rather than one event-loop
            # round later, when the cancelled task closes the upstream. The replica runs the victim a few
            # milliseconds longer; its KV reservation is held until then (released in finish()).
            self.fc.release_slot(victim)
        if victim.task is not None:
            victim.task.cancel()

    def finished(self, req: FlowRequest, evicted: bool, closed: float) -> None:
        """A dispatched request ended; an evicted one's upstream closed at `closed` (the eviction is confirmed)."""
        self.evictor.untrack(req)
        self.awaiting.discard(req)
        if not evicted:
            return
        latency = self.evictor.confirm(req, closed)
        if latency is not None:
            self.fc.tally.eviction("confirmed")
            self.fc.metrics.child(self.fc.metrics.eviction_confirmation, self.fc.pool_name).observe(latency)
            log_event(logger, "eviction_confirmed", request_id=req.request_id,
                      replica=req.leased().replica.url, latency_ms=round(latency * 1000, 2))
        if not self.evictor.pending:
            self._schedule_grace_wake()

    def expire(self, now: float) -> None:
        """Give up on victims whose upstream did not close within the confirmation timeout."""
        for late in self.evictor.expire(now):
            self.fc.tally.eviction("timed_out")
            log_event(logger, "eviction_timed_out", level=logging.WARNING, request_id=late.request_id)

    def _schedule_grace_wake(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.fc.wake()
            return
        self._grace_timer = loop.call_later(self.evictor.grace + 1e-4, self.fc.wake)
