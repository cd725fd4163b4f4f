"""What flow control counts for a request while it runs on a replica: the slot, the band's and the pool's
in-flight and the KV reservation it takes at dispatch (or when a new leader adopts it), the reservation following its
output, a move to another replica, and its end. `FlowController` (gateway/flow/controller.py) decides; this is the
bookkeeping of what its decisions hold, one writer with it on the event loop.
"""

from __future__ import annotations

from gateway.flow import moves
from gateway.flow.band import PriorityBand
from gateway.flow.cached_first import ENDED_MAX
from gateway.flow.request import End, FlowRequest, Lease, Status
from gateway.replicas import Replica


class RunningRequests:
    """The running-request part of a `FlowController`: its fields and readings are the controller's own (pool,
    bands, ledger, admission, eviction, floor, tally, cached, in_flight, total_queued, clock, loaded,
    traffic_classes, picker, detector, demand)."""

    def adopt(self, req: FlowRequest, replica: Replica, now: float, traffic_class: str | None, output_tokens: int,
              streaming: bool) -> None:
        """Count a request another leader dispatched as running on `replica` (gateway/relays/takeover.py): its
        slot, its band's and the pool's in-flight, a KV reservation with the output so far; not a dispatch."""
        req.seq = req.place = next(self._seq)  # victims are told apart by it
        req.traffic_class = (traffic_class or self.traffic_classes.get(req.priority)
                             or self.loaded.config.traffic_class(req.priority))
        lease = Lease(replica, now)
        lease.streaming_started = streaming
        self._occupy(req, lease, self.bands.band_for(req.priority, self.loaded.config), now)
        if output_tokens and lease.reservation is not None and self.ledger is not None:
            self.ledger.revise(lease.reservation, output_tokens, now)
        if not req.sheddable:
            self.eviction.dispatched(req)

    def _occupy(self, req: FlowRequest, lease: Lease, band: PriorityBand, now: float) -> None:
        """What a running request holds, counted: its slot, its band's and the pool's in-flight, its KV
        reservation (the output clamped to the context, every sequence's own, as the replica runs it)."""
        moves.dispatch(req, lease)
        replica = lease.replica
        replica.in_flight += 1
        band.in_flight += 1
        self.in_flight += 1
        self.cached.ran(replica.url, req.ask.prefix)
        if self.admission is not None and self.ledger is not None:
            demand = self.admission.within_context(self.demand(req), self.pool.healthy())
            lease.reservation = self.ledger.reserve(
                request_id=req.request_id, fairness_id=req.fairness_id, traffic_class=req.traffic_class,
                priority=req.priority, replica=replica.url, prompt_tokens=req.prompt_tokens,
                max_new_tokens=demand.output_tokens, block_size=self.admission.block_size(replica), now=now,
                prefix=req.ask.prefix, prefix_tokens=req.prefix_tokens, sharing=bool(replica.prefix_caching))
        if req.sheddable and not req.in_floor:
            self.eviction.evictor.track(req)

    def finish(self, req: FlowRequest, cause: End = End.END, event_at: float | None = None,
               closed_at: float | None = None) -> None:
        """A dispatched request is over (completed, failed, client gone or evicted): release its slot and its
        KV reservation. `cause` (how it let go) and `event_at` (monotonic time the
        cause was seen) measure release latency. `closed_at`: when an evicted request's upstream connection
        closed, if earlier than now (a relay of `--workers` closes it, then tells flow control)."""
        if req.status is not Status.DISPATCHED:
            return
        now = self.clock()
        closed = min(now, closed_at) if closed_at is not None else now
        evicted = moves.finish(req)
        if not req.slot_released:
            self.release_slot(req)
        replica = req.leased().replica
        if req.reservation is not None:  # KV admission on: the replica's free KV bounds what counts (`_cached_first`)
            self.cached.ended(replica.url, req.ask.prefix, req.reservation.used_kv_tokens, ENDED_MAX)
        else:
            self.cached.ended(replica.url, req.ask.prefix, 0,
                              replica.capacity or self.loaded.config.saturation.maxConcurrency)
        self.floor.ended(req)
        if req.reservation is not None and self.ledger is not None:
            freed = self.ledger.unshared(req.reservation, req.reservation.used_kv_tokens)
            if self.ledger.release(req.reservation, now):
                if self.admission is not None:
                    self.admission.released(req.leased().replica, freed, now)
                if evicted:
                    self.tally.release(req, "evict", req.evicted_at, now, closed)
                else:
                    self.tally.release(req, cause.value, event_at if event_at is not None else now, now)
        self.eviction.finished(req, evicted, closed)
        if self.total_queued:
            self.wake()
        self.bands.forget_if_idle(self.bands[req.priority])

    def release_slot(self, req: FlowRequest) -> None:
        """Hand the request's slot on: at its end, or when it is chosen as a victim (eviction_control.py)."""
        self.tally.slot_released_at = self.clock()
        lease = req.leased()
        lease.slot_released = True
        lease.replica.in_flight -= 1
        self.bands[req.priority].in_flight -= 1
        self.in_flight -= 1

    async def reassign(self, req: FlowRequest) -> Replica | None:
        """Move a dispatched request whose replica refused the connection to another replica, if any.
        A coroutine (that never awaits, so the move is one step of the single writer) because a relay's
        controller must ask the flow-control process for the answer (gateway/relays/remote_flow.py)."""
        if req.status is not Status.DISPATCHED or req.slot_released:
            return None
        lease = req.leased()
        old = lease.replica
        others = [r for r in self.pool.healthy() if r is not old]
        fits = None
        admission, res = self.admission, req.reservation
        if admission is not None and res is not None:
            # Its blocks are held on the old replica; quotas already count them, only room matters here.
            demand = admission.within_context(self.demand(req), others)
            fits = lambda r: admission.fits(demand, admission.kv_tokens(demand, r), r)  # noqa: E731
        new = self.picker.pick(others, self.detector, self.clock(), fits)
        if new is None:
            return None
        old.in_flight -= 1
        new.in_flight += 1
        new.dispatches += 1
        if res is not None and self.ledger is not None:
            self.ledger.move(res, new.url, admission.block_size(new) if admission else None,
                             sharing=bool(new.prefix_caching))
        lease.replica = new
        self.cached.moved(old.url, new.url, req.ask.prefix)
        self.eviction.dispatched(req)  # it may wait inside the new replica as well
        return new

    def revise(self, req: FlowRequest, output_tokens: int, done: bool = False) -> None:
        """Relayed output so far: the ledger's reservation follows it; a finished generation frees the rest."""
        res = req.reservation
        if self.ledger is None or res is None or req.status is not Status.DISPATCHED:
            return
        before = res.kv_tokens
        self.ledger.revise(res, output_tokens, self.clock(), done=done)
        if res.kv_tokens < before and self.total_queued:
            self.wake()

    def started_streaming(self, req: FlowRequest) -> None:
        """The response's first body chunk went out: evicting it now cuts a stream (victim policies weigh it)."""
        if req.lease is None:
            return
        req.lease.streaming_started = True
        awaited = req in self.eviction.awaiting
        self.eviction.answering(req)
        if (req.sheddable and self.eviction.awaiting) or (awaited and self.total_queued):
            # A request waiting inside this replica may now have a victim that runs; or lower-priority ones held
            # back from this replica while this one waited (`holds_back`) may go.
            self.wake()
