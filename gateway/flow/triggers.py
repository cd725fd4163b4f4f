"""The eviction triggers: one object per reason flow control evicts a running request.

Each trigger names its `Trigger` (the `trigger` field of the `evict` log line) and the point of the dispatch cycle
where it is asked (`Stage`): before the walk over the bands (`CYCLE`: the replicas as they are), at a band's head
waiting for KV room (`KV_WAIT`), or at a band's head blocked by the usage limit (`BLOCKED`). `EvictionControl`
runs a stage's triggers in `TRIGGERS` order; each sizes its decision with the `Evictor` and evicts through
`EvictionControl.evict`. Two of them also clear the replica's own queue of lower-priority requests as they free
a slot there (`replica-queue`, `EvictionControl.clear_queue`): that is a follow-up, not a trigger of its own.
Adding a trigger is one class here, one `Trigger` value and one test.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from gateway.flow.eviction import BandDemand, waits_inside
from gateway.flow.request import FlowRequest, Trigger

if TYPE_CHECKING:
    from gateway.flow.band import PriorityBand
    from gateway.flow.eviction_control import EvictionControl
    from gateway.replicas import Replica


class Stage(enum.Enum):
    CYCLE = "cycle"  # every cycle, before the bands are walked
    KV_WAIT = "kv-wait"  # the walk stopped at a head that waits for KV room
    BLOCKED = "blocked"  # the walk stopped at a head the usage limit holds back


@dataclass(frozen=True, slots=True)
class Moment:
    """What a trigger looks at: the time, the healthy replicas, and where the walk stopped."""

    now: float
    healthy: list[Replica]
    saturation: float = 0.0
    blocked: PriorityBand | None = None
    waiting: FlowRequest | None = None


class EvictionTrigger(Protocol):
    trigger: ClassVar[Trigger]
    stage: ClassVar[Stage]

    def fire(self, control: EvictionControl, moment: Moment) -> bool:
        """Evict what this trigger calls for; True when the victims' slots were handed on at once (the walk may
        dispatch into them in this cycle)."""


class HardWatermark:
    """A replica whose KV occupancy reached the hard watermark: evict recoverable batch work until under it."""

    trigger = Trigger.KV_HARD_WATERMARK
    stage = Stage.CYCLE

    def fire(self, control: EvictionControl, moment: Moment) -> bool:
        admission = control.host.admission
        if admission is None:
            return False
        grace = control.kv_grace()
        for replica in moment.healthy:
            pool = admission.pool_tokens(replica)
            excess = admission.occupancy(replica) - admission.cfg.hardWatermark * pool
            if excess < 0:
                continue
            # The evictor counts the victims' blocks, all of this replica's block size.
            victims = control.evictor.decide_kv(replica, excess / admission.block_size(replica) + 1, grace,
                                                moment.now, frees=lambda victim: admission.frees(victim.reservation))
            for victim in victims:
                control.evict(victim, moment.now, self.trigger, replica=replica.url,
                              occupancy=round(admission.occupancy(replica) / pool, 4))
            if victims:
                break
        return False


class WaitingInReplica:
    """Higher-priority requests waiting inside their replica for an engine slot, as surely as in our queue.

    A replica with `maxNumSeqs` slots and more requests than that in flight (the queue allowance) runs
    `maxNumSeqs` of them and keeps the rest waiting: vLLM preempts a running request only when KV runs out,
    never for priority, so a realtime request waits there until one ends. Such a request, not answering yet,
    is counted as waiting whenever its replica holds more than its slots; one running batch request on that
    replica is evicted per waiting request (those that stream first: they hold the slots), so vLLM schedules the
    waiting one in its next step (first, under its priority policy). Each waiting request is served once: if the
    freed slot goes to another (an fcfs replica's queue), it waits for the next end. Asked at arrival too."""

    trigger = Trigger.WAITING_IN_REPLICA
    stage = Stage.CYCLE

    def fire(self, control: EvictionControl, moment: Moment) -> bool:
        now = moment.now
        if not control.awaiting or not control.evictor.gate_open(now):
            return False
        waiting: dict[Replica, list[FlowRequest]] = {}
        for req in control.awaiting:
            replica = req.leased().replica
            if req.slot_freed or replica.max_num_seqs is None:
                continue
            if replica.in_flight > replica.max_num_seqs:
                waiting.setdefault(replica, []).append(req)
        for replica, reqs in waiting.items():
            wanted = min(len(reqs), replica.in_flight - (replica.max_num_seqs or 0))
            below = min(r.priority for r in reqs)
            victims = control.evictor.decide_on(replica, wanted, below, now)
            if not victims:
                continue
            queued = control.evictor.queued_on(replica, below, now)
            for req in sorted(reqs, key=lambda r: r.dispatched_at)[:len(victims)]:
                req.leased().slot_freed = True
            for victim in victims:
                control.evict(victim, now, self.trigger, replica=replica.url, in_flight=replica.in_flight,
                              slots=replica.max_num_seqs)
            control.clear_queue(replica, queued, now, demand_band=below)
        return False


class KvWait:
    """A request above batch that KV admission keeps waiting: evict batch work for it, as for one waiting for a
    request slot. The replica is the one where the least must be freed and the batch reservations there cover it.
    The victims (the policy's order) cover its shortfall and what every other request above batch queued behind
    it needs there, in one decision: a burst is not served `maxPerDecision` victims a scrape. As the hard-watermark
    trigger's, a decision waits only for the last one's victims to close: what they held is taken off the scraped
    usage until a scrape shows it (`KvAdmission.released`)."""

    trigger = Trigger.KV_WAIT
    stage = Stage.KV_WAIT

    def fire(self, control: EvictionControl, moment: Moment) -> bool:
        host, req, healthy, now = control.host, moment.waiting, moment.healthy, moment.now
        admission, evictor = host.admission, control.evictor
        grace = control.kv_grace()
        if (req is None or req.sheddable or admission is None or not evictor.candidates
                or not evictor.kv_gate_open(now, grace)):
            return False
        demand = admission.within_context(host.demand(req), healthy)
        soft = admission.soft_over(req.fairness_id, sum(admission.pool_tokens(r) for r in healthy)) > 0
        held: collections.Counter[Replica] = collections.Counter()
        for victim in evictor.candidates:  # all sheddable: below `req`
            res = victim.reservation
            if res is not None:
                held[victim.leased().replica] += admission.frees(res) * res.block_size
        choice: tuple[float, Replica] | None = None
        for replica in healthy:
            short = admission.shortfall(demand, replica, soft)
            if short <= 0:
                return False  # it fits there: what holds it back is not KV
            if held[replica] >= short and (choice is None or short < choice[0]):
                choice = (short, replica)
        if choice is None:
            return False
        short, replica = choice
        for band in host.bands.desc:
            if band.priority < 0:
                break  # the sheddable bands wait for batch's own room
            for other in band.waiting():
                if other is not req:
                    short += admission.kv_tokens(admission.within_context(host.demand(other), healthy), replica)
        victims = evictor.decide_kv(replica, short / admission.block_size(replica), grace, now,
                                    limit=len(evictor.candidates),
                                    frees=lambda victim: admission.frees(victim.reservation))
        for victim in victims:
            control.evict(victim, now, self.trigger, replica=replica.url, waiting=req.request_id,
                          shortfall_tokens=round(short))
        return False


class BlockedBand:
    """A band whose head the usage limit holds back: the Evictor sizes the deficit against the bands' ceilings and
    floors and evicts strictly lower-priority requests for it; where the saturation reading is the gateway's own
    count their slots are handed on at once, and the walk goes on."""

    trigger = Trigger.BLOCKED_BAND
    stage = Stage.BLOCKED

    def fire(self, control: EvictionControl, moment: Moment) -> bool:
        host, blocked, now = control.host, moment.blocked, moment.now
        if blocked is None:
            return False
        bands = [BandDemand(b.priority, host.bands.ceilings[b.priority], b.queued, b.in_flight,
                            host.bands.floors[b.priority]) for b in host.bands.desc]
        decision = control.evictor.decide(moment.saturation, bands, blocked.priority, host.in_flight, now)
        if decision is None:
            return False
        control.freed.clear()
        control.freed_at = now
        for victim in decision.victims:
            replica = victim.leased().replica
            if replica.max_num_seqs is not None and not waits_inside(victim):
                control.freed[replica] += 1
        # Read before any victim's slot is handed on: `waits_inside` counts the replica's requests.
        queued = {replica: control.evictor.queued_on(replica, decision.demand_priority, now)
                  for replica in control.freed}
        for victim in decision.victims:
            control.evict(victim, now, self.trigger, replica=victim.leased().replica.url,
                          demand_band=decision.demand_priority, saturation=round(moment.saturation, 4),
                          deficit=round(decision.deficit, 4), victims=len(decision.victims))
        for replica, waiting in queued.items():
            control.clear_queue(replica, waiting, now, demand_band=decision.demand_priority)
        return host.detector.release_on_decision


# In the order a stage runs them.
TRIGGERS: tuple[EvictionTrigger, ...] = (HardWatermark(), WaitingInReplica(), KvWait(), BlockedBand())
