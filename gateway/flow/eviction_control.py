"""Eviction as flow control carries it out: its triggers run by stage, the Evictor's decision, each victim's eviction.

The triggers (gateway/flow/triggers.py) are asked at their stage of the dispatch cycle; the `Evictor`
(gateway/flow/eviction.py) sizes each decision and the configured victim policy orders the candidates. Flow control
is seen through `EvictionHost`, the few things eviction reads of it or asks of it. Evicting a victim keeps its place
in line and its replica for the retry that comes back with the same request id (the worker's row id), hands its slot
on at once where the saturation reading is the gateway's own count, and cancels its proxy task, which answers 429
`evicted` and closes the upstream connection; `finished` confirms it when that connection has closed. All of it runs
inside the controller's steps: flow control stays the single writer.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Protocol

from gateway.flow import moves
from gateway.flow.eviction import Evictor, plain_view
from gateway.flow.request import FlowRequest, Status, Trigger
from gateway.flow.triggers import TRIGGERS, Moment, Stage
from gateway.log import log_event
from gateway.policies.picker import Pinned
from gateway.policies.saturation import SaturationDetector
from gateway.policies.victims import VictimCandidate, victim_policy
from gateway.replicas import Replica
from gateway.settings import Eviction

if TYPE_CHECKING:
    from gateway.flow.registry import BandRegistry
    from gateway.flow.tally import FlowTally
    from gateway.policies.admission import Demand, KvAdmission
    from gateway.replicas import ReplicaPool

logger = logging.getLogger("gateway.flow")

# Evicted requests whose place in line is kept for their retry; the oldest is forgotten past this many (a retry
# that never came back, or came back to another gateway).
EVICTED_PLACES = 100_000


class EvictionHost(Protocol):
    """What eviction needs of flow control (gateway/flow/controller.py)."""

    admission: KvAdmission | None
    bands: BandRegistry
    detector: SaturationDetector
    in_flight: int
    pool: ReplicaPool
    tally: FlowTally

    def demand(self, req: FlowRequest) -> Demand: ...

    def release_slot(self, req: FlowRequest) -> None: ...

    def wake(self) -> None: ...


class EvictionControl:
    def __init__(self, host: EvictionHost):
        self.host = host
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
        # Every dispatched request not answering yet -> the replica told its prompt (`Replica.sent`: KV admission
        # counts prompts; 0 when only estimated) and that prompt: what its vLLM may hold waiting, so that its slots
        # are learned while its KV is over half used.
        self.unanswered: dict[FlowRequest, tuple[Replica, int]] = {}
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
        evictions. A request that must run on one replica (its ask's `home`: a stored response's next turn) is
        pinned there instead."""
        req.place, req.affinity, req.evictions = self.places.pop((req.fairness_id, req.request_id), (req.seq, None, 0))
        if req.ask.home is not None:
            req.affinity = Pinned(req.ask.home)
        if req.place != req.seq:
            self.host.tally.places_kept += 1

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
        admission = self.host.admission
        if admission is None:
            return view
        total = sum(admission.pool_tokens(r) for r in self.host.pool.healthy()) or 1
        return dataclasses.replace(view, tenant_over_soft_quota=admission.soft_over(req.fairness_id, total))

    # -- the triggers (gateway/flow/triggers.py) -------------------------------------------------------------
    def run(self, stage: Stage, moment: Moment) -> bool:
        """Ask the triggers of `stage`, in order; True when one handed its victims' slots on at once."""
        if not self.enabled:
            return False
        handed_on = False
        for trigger in TRIGGERS:
            if trigger.stage is stage:
                handed_on = trigger.fire(self, moment) or handed_on
        return handed_on

    def fire(self, name: Trigger, moment: Moment) -> bool:
        """Ask one trigger (a request that may wait inside its replica was just dispatched)."""
        return self.enabled and next(t for t in TRIGGERS if t.trigger is name).fire(self, moment)

    def kv_grace(self) -> float:
        """How long after a KV trigger's victims closed before the next: none beyond their closing, since KV
        admission takes what they held off the scraped usage until a scrape shows it (`KvAdmission.released`)."""
        return 0.0

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
        if (self.host.admission is not None and not lease.streaming_started  # a new leader adopts ones that stream
                and self.unanswered.get(req, (None,))[0] is not lease.replica):
            self._answered(req)  # moved from another replica
            prompt = req.prompt_tokens if req.ask.prompt_exact else 0
            self.unanswered[req] = (lease.replica, prompt)
            lease.replica.sent(prompt)
        if not req.sheddable and lease.replica.max_num_seqs is not None:
            self.awaiting.add(req)
            if lease.dispatched_at == self.freed_at and self.freed[lease.replica] > 0:
                lease.slot_freed = True  # a running victim's slot, freed for it in this cycle
                self.freed[lease.replica] -= 1

    def answering(self, req: FlowRequest) -> None:
        """Its first body chunk went out (or it ended): it waits for no slot."""
        self.awaiting.discard(req)
        self._answered(req)

    def _answered(self, req: FlowRequest) -> None:
        told = self.unanswered.pop(req, None)
        if told is not None:
            told[0].answered(told[1])

    # -- one victim -----------------------------------------------------------------------------------------
    def evict(self, victim: FlowRequest, now: float, trigger: Trigger, **fields: object) -> None:
        moves.evict(victim, now)
        # Like a preempted sequence in vLLM, the victim's retry goes ahead of what was queued after it: it comes
        # back sooner, so its prompt and kept output are more likely still in the replica's prefix cache.
        home = victim.leased().replica.url if self.affinity else None
        self._remember(victim.fairness_id, victim.request_id, (victim.place, home, victim.evictions + 1))
        self.host.tally.eviction("issued")
        log_event(logger, "evict", request_id=victim.request_id, band=victim.priority, trigger=trigger.value,
                  **fields)
        if self.host.detector.release_on_decision and victim.status is Status.DISPATCHED:
            # The gateway's own count is the saturation reading: hand the slot on now rather than one event-loop
            # round later, when the cancelled task closes the upstream. The replica runs the victim a few
            # milliseconds longer; its KV reservation is held until then (released in finish()).
            self.host.release_slot(victim)
        if victim.task is not None:
            victim.task.cancel()

    def finished(self, req: FlowRequest, evicted: bool, closed: float) -> None:
        """A dispatched request ended; an evicted one's upstream closed at `closed` (the eviction is confirmed)."""
        self.evictor.untrack(req)
        self.answering(req)
        if not evicted:
            return
        latency = self.evictor.confirm(req, closed)
        if latency is not None:
            self.host.tally.eviction_confirmed(latency)
            log_event(logger, "eviction_confirmed", request_id=req.request_id,
                      replica=req.leased().replica.url, latency_ms=round(latency * 1000, 2))
        if not self.evictor.pending:
            self._schedule_grace_wake()

    def expire(self, now: float) -> None:
        """Give up on victims whose upstream did not close within the confirmation timeout."""
        for late in self.evictor.expire(now):
            self.host.tally.eviction("timed_out")
            log_event(logger, "eviction_timed_out", level=logging.WARNING, request_id=late.request_id)

    def _schedule_grace_wake(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.host.wake()
            return
        self._grace_timer = loop.call_later(self.evictor.grace + 1e-4, self.host.wake)
