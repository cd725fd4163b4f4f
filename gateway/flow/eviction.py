"""In-flight eviction of sheddable requests (priority < 0) when higher-priority work is blocked.

The `Evictor` tracks dispatched sheddable requests and decides, never acts: flow control asks it for victims
when a dispatch cycle hits a head-of-line block (gateway/flow/eviction_control.py), then cancels each victim's
proxy task, which answers the caller 429 `evicted` and closes the upstream connection so the replica aborts it.
Victim order comes from the configured `VictimPolicy` (gateway/policies/victims.py), which sees read-only views.
Three triggers: a blocked band (saturation sizing below), a replica whose KV occupancy reached the hard
watermark (`decide_kv`: victims on that replica until their reservations cover the excess), and higher-priority
requests waiting inside a replica for an engine slot (`decide_on`: one running victim there per waiting request).
Sizing: deficit = S − ceiling(demand band); credit = S ÷ tracked in-flight;
n = max(1, ceil((deficit − pending) / credit), queued requests of the demand band), at most `maxPerDecision`,
victims strictly below the demand — or, when the bands below hold capacity on loan, at most what they borrowed:
a band's floor is the ceiling it keeps at any demand (gateway/policies/holdback.py), and requests it runs beyond
floor ÷ credit were dispatched on the understanding that a higher band takes them back when it needs them, so
the whole loan comes back in one decision instead of `maxPerDecision` at a time.
A blocked band's victims are those that hold an engine slot first: where the gateway keeps requests waiting
inside a replica (`engine.queueAllowance`), evicting one of those frees no slot, and the realtime request sent in
its place would wait inside and take a second victim (`waits_inside`). When a running victim frees a slot for a
higher-priority request, the lower-priority requests waiting inside that replica go too (`queued_on`): vLLM
hands the slot to whatever it holds at its next step, and the victim's abort may reach it first.
Pacing is stop-and-wait: no new decision until every earlier victim's upstream has closed (or timed out)
and a short grace for the detector to see the freed capacity has passed — unless the controller hands each
victim's slot on when it is chosen (`paced = False`, the concurrency detector): then the reading already
shows the freed capacity and every decision may follow the last at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from gateway.flow.request import FlowRequest
from gateway.policies.victims import NewestFirst, VictimCandidate, VictimPolicy


@dataclass(frozen=True)
class BandDemand:
    """What the evictor needs to know about one band: its priority, ceiling and queued count, and for the
    bands it may take victims from, their in-flight count and floor (None: the ceiling is the floor)."""

    priority: int
    ceiling: float
    queued: int
    in_flight: int = 0
    floor: float | None = None


@dataclass(frozen=True)
class EvictionDecision:
    victims: list[FlowRequest]
    demand_priority: int
    deficit: float
    credit: float


class Evictor:
    def __init__(self, *, max_per_decision: int = 2, confirmation_timeout: float = 10.0, grace: float = 0.01,
                 policy: VictimPolicy | None = None,
                 view: Callable[[FlowRequest, float], VictimCandidate] | None = None):
        self.policy: VictimPolicy = policy or NewestFirst()
        self.view = view or plain_view
        self.max_per_decision = max_per_decision
        self.confirmation_timeout = confirmation_timeout
        self.grace = grace
        self.candidates: set[FlowRequest] = set()
        # victim -> monotonic time of the decision that chose it
        self.pending: dict[FlowRequest, float] = {}
        self.last_settled = -math.inf
        # False: the controller releases a victim's slot at the decision, so there is nothing to wait for.
        self.paced = True

    def track(self, req: FlowRequest) -> None:
        if req.sheddable:
            self.candidates.add(req)

    def untrack(self, req: FlowRequest) -> None:
        self.candidates.discard(req)

    def gate_open(self, now: float) -> bool:
        return not self.paced or self.kv_gate_open(now, self.grace)

    def kv_gate_open(self, now: float, grace: float) -> bool:
        """Whether a KV decision may follow: every earlier victim's upstream closed, and `grace` (a scrape, for
        the freed blocks to show) passed since."""
        return not self.pending and now >= self.last_settled + grace

    def decide(self, saturation: float, bands: Sequence[BandDemand], blocked_priority: int,
               tracked_in_flight: int, now: float) -> EvictionDecision | None:
        """Victims to evict so the blocked band (or a lower one still above the victims) can dispatch."""
        if not self.candidates or tracked_in_flight <= 0 or not self.gate_open(now):
            return None
        lowest = min(r.priority for r in self.candidates)
        demand = None
        for band in sorted(bands, key=lambda b: -b.priority):
            if band.priority > blocked_priority:
                continue
            if band.priority <= lowest:
                break
            if band.ceiling > 0 and saturation >= band.ceiling and band.queued > 0:
                demand = band
                break
        if demand is None:
            return None
        deficit = saturation - demand.ceiling
        credit = saturation / tracked_in_flight
        # Unpaced, the pending victims' slots are free already and the saturation reading shows it.
        pending_reclaim = len(self.pending) * credit if self.paced else 0.0
        wanted = max(1, math.ceil((deficit - pending_reclaim) / credit - 1e-9)) if credit > 0 else 1
        # A band whose ceiling is the whole pool (realtime at 1.0) has no deficit while it waits at a full pool:
        # size by its queue instead, one slot per queued request, so a burst is not served one victim a round.
        wanted = max(wanted, demand.queued)
        limit = max(self.max_per_decision, min(wanted, borrowed_requests(bands, demand.priority, credit)))
        eligible = self._ordered([r for r in self.candidates if r.priority < demand.priority], now)
        # Those that hold an engine slot first: one waiting inside its replica (the queue allowance) frees none.
        eligible.sort(key=waits_inside)  # stable: the policy's order within each group
        victims = eligible[:min(wanted, limit)]
        if not victims:
            return None
        self._mark(victims, now)
        return EvictionDecision(victims, demand.priority, deficit, credit)

    def decide_kv(self, replica: object, excess_blocks: float, grace: float, now: float,
                  limit: int | None = None, frees: Callable[[FlowRequest], float] | None = None) -> list[FlowRequest]:
        """Victims on `replica` whose reservations cover `excess_blocks` (KV occupancy over the hard watermark, or
        what requests waiting for KV need), at most `limit` (None: `maxPerDecision`); `frees`: the blocks a
        victim's end gives back (None: its reservation's)."""
        if not self.kv_gate_open(now, grace):
            return []
        eligible = self._ordered([r for r in self.candidates if r.replica is replica], now)
        victims: list[FlowRequest] = []
        freed = 0
        most = self.max_per_decision if limit is None else limit
        for req in eligible:
            if freed >= excess_blocks or len(victims) >= most:
                break
            victims.append(req)
            if frees is not None:
                freed += frees(req)
            elif req.reservation is not None:
                freed += req.reservation.blocks
        self._mark(victims, now)
        return victims

    def decide_on(self, replica: object, wanted: int, below: int, now: float) -> list[FlowRequest]:
        """Up to `wanted` victims on `replica` below priority `below` that may hold an engine slot, each group in
        the policy's order: those already streaming, then those that asked for no stream (nothing tells whether
        they run or wait). A streamed request that has not answered yet waits in the replica's queue: evicting
        it frees no slot (the order it was sent in is no guide: connections reach the replica in any order), so
        it is never chosen, and when no victim is known to run the decision waits for the next one to stream
        (the controller is woken then)."""
        eligible = self._ordered([r for r in self.candidates if r.replica is replica and r.priority < below], now)
        victims = ([r for r in eligible if r.streaming_started]
                   + [r for r in eligible if not r.streamed and not r.streaming_started])
        victims = victims[:max(0, min(wanted, self.max_per_decision))]
        self._mark(victims, now)
        return victims

    def queued_on(self, replica: object, below: int, now: float) -> list[FlowRequest]:
        """The requests below priority `below` that may be waiting in `replica`'s own queue (`waits_inside`),
        chosen as victims. A slot freed there goes to whatever vLLM holds when its next step is scheduled, and
        the request it was freed for may reach vLLM after the victim's abort does: any of these would take it
        first. Waiting, they hold no slot and have produced nothing; one still in its first step (no answer
        yet, but running) loses that step."""
        waiting = [r for r in self.candidates if r.replica is replica and r.priority < below and waits_inside(r)]
        self._mark(waiting, now)
        return waiting

    def _ordered(self, requests: list[FlowRequest], now: float) -> list[FlowRequest]:
        by_seq = {r.seq: r for r in requests}
        return [by_seq[c.seq] for c in self.policy.order([self.view(r, now) for r in requests], now)]

    def _mark(self, victims: list[FlowRequest], now: float) -> None:
        for victim in victims:
            self.candidates.discard(victim)
            self.pending[victim] = now

    def confirm(self, req: FlowRequest, now: float) -> float | None:
        """The victim's upstream connection has closed; returns decision→close latency."""
        decided = self.pending.pop(req, None)
        if decided is None:
            return None
        if not self.pending:
            self.last_settled = now
        return now - decided

    def expire(self, now: float) -> list[FlowRequest]:
        """Give up waiting for victims not confirmed within the timeout (counted as timed out)."""
        late = [r for r, t in self.pending.items() if now - t > self.confirmation_timeout]
        for r in late:
            del self.pending[r]
        if late and not self.pending:
            self.last_settled = now
        return late


def waits_inside(req: FlowRequest) -> bool:
    """Whether `req` may be waiting inside its replica for an engine slot: its replica's slots are known and it
    holds more requests than them (the queue allowance), and `req`, streamed, has not answered yet."""
    replica = req.replica
    slots = replica.max_num_seqs if replica is not None else None
    return (replica is not None and slots is not None and replica.in_flight > slots
            and req.streamed and not req.streaming_started)


def borrowed_requests(bands: Sequence[BandDemand], below: int, credit: float) -> int:
    """In-flight requests of the bands below priority `below` beyond what their floors allow (floor ÷ credit)."""
    if credit <= 0:
        return 0
    total = 0
    for band in bands:
        if band.priority >= below:
            continue
        floor = band.ceiling if band.floor is None else band.floor
        total += max(0, band.in_flight - math.floor(floor / credit + 1e-9))
    return total


def refill_tokens(req: FlowRequest) -> int:
    """What evicting `req` makes its replica compute again (0 when admission is off: no block size is known)."""
    lease, res = req.leased(), req.reservation
    if res is None:
        return 0
    held = res.prompt_tokens + max(lease.tokens_relayed, res.output_tokens)
    return held % res.block_size if req.resumable else held


def plain_view(req: FlowRequest, now: float) -> VictimCandidate:
    """A view without KV details (tests and the concurrency-only path)."""
    lease, res = req.leased(), req.reservation
    return VictimCandidate(
        request_id=req.request_id, fairness_id=req.fairness_id, priority=req.priority, objective=req.objective,
        replica=lease.replica.url, started_at=lease.dispatched_at, enqueued_at=req.enqueued_at,
        deadline=None if req.deadline == math.inf else req.deadline, prompt_tokens=req.prompt_tokens,
        max_new_tokens=req.max_new_tokens, output_tokens=res.output_tokens if res is not None else 0,
        streaming_started=req.streaming_started, resumable=req.resumable, cached_prefix_tokens=0,
        tenant_over_soft_quota=0.0, reserved_blocks=res.blocks if res is not None else 0, seq=req.seq,
        evictions=req.evictions, refill_tokens=refill_tokens(req),
        block_reached_at=res.revised_at if res is not None else 0.0)
