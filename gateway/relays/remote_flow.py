"""The relay's flow control: the `FlowControl` interface the proxy calls, answered by the flow-control process.

A relay (`holdback gateway --workers N`) runs the same `Proxy` as the single-process gateway; its controller
is this client. Every decision (admission, queueing, ceilings, the replica, eviction) is made by the one
FlowController in the flow-control process; this object forwards the proxy's calls over the channel and
mirrors what the proxy reads back: the request's status, replica and reservation. There is one per model pool
(`RemotePools` routes by model as flow control described its pools), and each submits to its pool's
FlowController. `submit()` always answers
QUEUED, so the proxy awaits `req.waiter` until flow control has decided. Streamed tokens go back only when a
reservation's blocks change (the mirror ledger says when, exactly as in one process), and an eviction arrives
as a message that cancels the proxy's task, which the proxy answers as it answers an in-process eviction.
While a relay run alone has no channel, its undecided requests wait here, each until its deadline, and the next
flow control it joins learns them from `Holding` (a leader taking over from a killed one takes a few seconds).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from typing import Callable

from gateway.flow import moves
from gateway.flow.interface import Outcome
from gateway.flow.ledger import KvLedger
from gateway.flow.request import DropReason, End, FlowRequest, Lease, Status
from gateway.log import log_event
from gateway.pools import PoolReplicas, PoolRouting
from gateway.relays import messages as m
from gateway.relays.channel import ChannelClosed
from gateway.relays.uplink import Uplink
from gateway.replicas import Replica
from gateway.settings import LoadedConfig

logger = logging.getLogger("gateway.relay")

# The answer to a request a relay cannot ask flow control about (503, as with no replica).
UNREACHABLE = ("This gateway relay cannot reach the gateway's flow control; retry shortly (the gateway's other "
               "relays may answer).")


class RelayPool:
    """The replicas as flow control last described them: the proxy picks one to count tokens on and to list
    models from, and reports a replica that refused a connection."""

    def __init__(self, uplink: Uplink):
        self.uplink = uplink
        self.replicas: list[Replica] = []

    def update(self, views: tuple[m.ReplicaFacts, ...]) -> None:
        by_url = {r.url: r for r in self.replicas}
        replicas = []
        for view in views:
            replica = by_url.get(view.url) or Replica(view.url)
            for f in dataclasses.fields(view):
                setattr(replica, f.name, getattr(view, f.name))
            replicas.append(replica)
        self.replicas = replicas

    def by_url(self, url: str) -> Replica:
        return next((r for r in self.replicas if r.url == url), None) or Replica(url, healthy=True)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.refused is None]

    def mark_down(self, replica: Replica, reason: str) -> None:
        replica.healthy = False
        self.uplink.send(m.MarkDown(url=replica.url, reason=reason))

    def mark_unauthorized(self, replica: Replica, path: str, status: int) -> None:
        replica.healthy = False
        self.uplink.send(m.MarkUnauthorized(url=replica.url, path=path, status=status))


class RemotePools:
    """`FlowPools` for a relay: a RemoteFlowController per model pool, routing as flow control describes it
    (its pools' served names, sent again whenever they change). The relay's request ids are one sequence over
    every pool, so flow control's answers find their request whatever its pool. With `waits` (a relay run alone)
    a request goes on waiting for a decision while no flow control is reachable; without it (a relay of
    `--workers N`, which stops with its flow control) it is refused at once."""

    def __init__(self, uplink: Uplink, config: m.Configure, view: m.PoolView, waits: bool = False):
        self.uplink = uplink
        self.waits = waits
        self.replicas = RelayPool(uplink)
        self.tokenizer_state: Callable[[], dict] = lambda: {}
        self.requests: dict[int, FlowRequest] = {}
        self.ids = itertools.count(1)
        self._flows: dict[str, RemoteFlowController] = {}
        self.update(view)
        self.configure(config)

    def configure(self, config: m.Configure) -> None:
        self.loaded = config.loaded
        for pool in config.pools:
            flow = self._flows.get(pool.name)
            if flow is None:
                self._flows[pool.name] = RemoteFlowController(self, pool.name, pool.loaded, pool.ledger)
            else:
                flow.configure(pool.loaded, pool.ledger)

    def update(self, view: m.PoolView) -> None:
        self.replicas.update(view.replicas)
        self._routing = PoolRouting(list(view.routing))

    # -- FlowPools (gateway/flow/interface.py) --------------------------------------------------------------
    def routing(self) -> PoolRouting:
        return self._routing

    def flow(self, name: str) -> RemoteFlowController:
        return self._flows[name]

    def flows(self) -> list[RemoteFlowController]:
        named = [self._flows[p["name"]] for p in self._routing.pools if p["name"] in self._flows]
        return named or list(self._flows.values())

    # -- messages from flow control -------------------------------------------------------------------------
    def decided(self, message: m.Dispatched | m.Rejected | m.Evict) -> None:
        """Flow control's decision on one of this relay's requests, applied by its pool's controller."""
        req = self.requests.get(message.rid)
        if req is None:
            return  # it ended here first (withdrawn, finished): flow control learns it from our message
        flow = self._flows[req.pool]
        match message:
            case m.Dispatched():
                flow.dispatched(req, message)
            case m.Rejected():
                flow.rejected(req, message)
            case m.Evict():
                flow.evict(req)

    def wait_alone(self) -> int:
        """The channel to flow control closed, and the relay goes on (`--role relay`): requests waiting for a
        decision wait for the next flow control, each until its deadline; dispatched ones run to their end.
        Returns how many wait."""
        waiting = [req for req in self.requests.values() if req.status is Status.QUEUED]
        for req in waiting:
            self._flows[req.pool].wait_alone(req)
        return sum(1 for req in waiting if req.status is Status.QUEUED)

    def holding(self) -> tuple[m.HeldRequest, ...]:
        """What this relay holds, as it reports it to a flow control it (re)joins: each request running on its
        replica with the output so far, or waiting for a decision."""
        held = []
        for rid, req in self.requests.items():
            lease, res = req.lease, req.reservation
            url = lease.replica.url if req.status is Status.DISPATCHED and lease is not None else None
            held.append(m.HeldRequest(rid=rid, ask=req.ask, url=url,
                                      traffic_class=req.traffic_class if res is not None else None,
                                      output_tokens=res.output_tokens if res is not None else 0,
                                      streaming=url is not None and lease is not None and lease.streaming_started))
        return tuple(held)

    def refuse_waiting(self, reason: DropReason) -> int:
        """Refuse what still waits for a decision with `reason` (its caller gets the drop answer), telling flow
        control: the relay is at its drain deadline. Returns how many."""
        waiting = [req for req in self.requests.values() if req.status is Status.QUEUED]
        for req in waiting:
            self._flows[req.pool].refuse(req, reason)
        return len(waiting)

    def lost(self) -> None:
        """Flow control is gone and the relay stops: it cancels what it holds, but not what it already refused
        at its drain deadline (waiting, or running with no answer begun: drain.py): those handlers answer their
        503 as the relay closes."""
        for req in list(self.requests.values()):
            if req.task is not None and req.drop_reason is not DropReason.SHUTTING_DOWN:
                req.task.cancel()


class RemoteFlowController:
    """`FlowControl` for a relay's requests to one model pool: every call goes over the channel to that pool's
    FlowController."""

    def __init__(self, pools: RemotePools, name: str, loaded: LoadedConfig, ledger: m.LedgerSettings):
        self.uplink = pools.uplink
        self.name = name
        self.replicas = pools.replicas
        self.pool = PoolReplicas(pools.replicas, name)  # type: ignore[arg-type]  # the relay's mirror of them
        # The mirror of this relay's reservations: it tells the proxy when a revision is due, as the real one does.
        self.ledger = KvLedger(**dataclasses.asdict(ledger))
        self.configure(loaded, ledger)
        self.tokenizer_state: Callable[[], dict] = lambda: {}
        self._pools = pools
        self._requests = pools.requests
        self._ids = pools.ids

    def configure(self, loaded: LoadedConfig, ledger: m.LedgerSettings) -> None:
        self.loaded = loaded
        self.ledger.configure(**dataclasses.asdict(ledger))

    # -- the FlowControl interface (gateway/flow/interface.py) ----------------------------------------------
    @property
    def admission_enabled(self) -> bool:
        # The proxy only asks whether admission is on (then it counts prompts); flow control applies it.
        return self.loaded.config.admission.enabled

    def count_tokenizer_fallback(self) -> None:
        # Flow control keeps the gateway's count (for /admin/state).
        self.uplink.send(m.Fallbacks(count=1))

    def submit(self, req: FlowRequest) -> Outcome:
        req.seq = rid = next(self._ids)
        alone = self.uplink.closed
        if alone and not self._pools.waits:
            moves.reject(req, DropReason.NO_ENDPOINTS, UNREACHABLE)
            return Outcome.REJECTED
        moves.queue(req, time.monotonic(), asyncio.get_running_loop().create_future())
        self._requests[rid] = req
        if alone:  # no Submit: the flow control this relay joins next learns it from `Holding`, once
            waits = self.wait_deadline(req) - req.arrived
            log_event(logger, "request_waiting_for_flow_control", request_id=req.request_id,
                      waits_seconds=round(waits, 3) if waits < math.inf else None)
            self.wait_alone(req)
        else:
            self.uplink.send(m.Submit(rid=rid, ask=req.ask))
        return Outcome.QUEUED

    def withdraw(self, req: FlowRequest) -> None:
        # Flow control may have dispatched it already: it then releases it as a disconnect.
        if req.status is Status.QUEUED:
            moves.withdraw(req)
            self._requests.pop(req.seq, None)
            if not self.uplink.closed:  # else no flow control holds it: the next learns only what `Holding` lists
                self.uplink.send(m.Withdraw(rid=req.seq, at=time.monotonic()))

    def finish(self, req: FlowRequest, cause: End = End.END, event_at: float | None = None) -> None:
        if req.status is not Status.DISPATCHED:
            return
        evicted = moves.finish(req)
        self._requests.pop(req.seq, None)
        now = time.monotonic()
        if req.reservation is not None:
            self.ledger.release(req.reservation, now)
        # The proxy finishes an evicted request right after closing its upstream: that is when it let go.
        self.uplink.send(m.Finished(rid=req.seq, cause=cause.value, event_at=event_at,
                                   closed_at=now if evicted else None))

    async def reassign(self, req: FlowRequest) -> Replica | None:
        if req.status is not Status.DISPATCHED:
            return None
        try:
            url = await self.uplink.call("reassign", req.seq)
        except (ChannelClosed, TimeoutError):
            return None
        if not isinstance(url, str):
            return None
        lease = req.leased()
        lease.replica = self.replicas.by_url(url)
        if lease.reservation is not None:
            self.ledger.move(lease.reservation, url)
        return lease.replica

    def revise(self, req: FlowRequest, output_tokens: int, done: bool = False) -> None:
        res = req.reservation
        if res is None or req.status is not Status.DISPATCHED:
            return
        self.ledger.revise(res, output_tokens, time.monotonic(), done=done)
        self.uplink.send(m.Revise(rid=req.seq, output_tokens=output_tokens, done=done))

    def started_streaming(self, req: FlowRequest) -> None:
        if req.lease is not None:
            req.lease.streaming_started = True
        self.uplink.send(m.Started(rid=req.seq))

    def count_mid_stream_eviction(self) -> None:
        self.uplink.send(m.MidStream(pool=self.name))

    # -- waiting while no flow control is reachable (a relay run alone) -------------------------------------
    def wait_deadline(self, req: FlowRequest) -> float:
        """Until when (monotonic) `req` may wait for a flow control: its own limit (the TTL or deadline header),
        else the config's `flowControl.defaultRequestTTL` from its arrival (0: no limit, as in flow control)."""
        if req.ask.expires_at < math.inf:
            return req.ask.expires_at
        ttl = self.loaded.config.flowControl.defaultRequestTTL
        return req.arrived + ttl if ttl > 0 else math.inf

    def wait_alone(self, req: FlowRequest) -> None:
        """`req` waits for the next flow control; at its deadline, if none has it, it is answered unreachable."""
        deadline = self.wait_deadline(req)
        if deadline < math.inf:
            asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()), self._expire, req)

    def _expire(self, req: FlowRequest) -> None:
        # A flow control joined meanwhile: it has the request (from `Holding`) and decides it, deadline included.
        if req.status is Status.QUEUED and self.uplink.closed:
            self.rejected(req, m.Rejected(rid=req.seq, token=0, reason=DropReason.NO_ENDPOINTS.value,
                                          message=UNREACHABLE))

    # -- decisions from flow control (RemotePools.decided) --------------------------------------------------
    def dispatched(self, req: FlowRequest, message: m.Dispatched) -> None:
        if req.status is not Status.QUEUED:
            return  # withdrawn meanwhile: flow control releases it when the withdrawal arrives
        lease = Lease(self.replicas.by_url(message.url), message.dispatched_at)
        if message.traffic_class is not None:
            req.traffic_class = message.traffic_class
            lease.reservation = self.ledger.reserve(
                request_id=req.request_id, fairness_id=req.fairness_id, traffic_class=message.traffic_class,
                priority=req.priority, replica=message.url, prompt_tokens=req.prompt_tokens,
                max_new_tokens=req.max_new_tokens, now=message.dispatched_at)
        moves.dispatch(req, lease)
        req.enqueued_at = message.enqueued_at
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.DISPATCHED)

    def rejected(self, req: FlowRequest, message: m.Rejected) -> None:
        if req.status is not Status.QUEUED:
            return
        self._requests.pop(req.seq, None)
        moves.reject(req, DropReason(message.reason), message.message)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.REJECTED)

    def refuse(self, req: FlowRequest, reason: DropReason) -> None:
        """Refused here (`RemotePools.refuse_waiting`); flow control, if it is reachable, takes it out of line."""
        self._requests.pop(req.seq, None)
        if not self.uplink.closed:
            self.uplink.send(m.Withdraw(rid=req.seq, at=time.monotonic(), reason=reason.value))
        moves.reject(req, reason)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.REJECTED)

    def evict(self, req: FlowRequest) -> None:
        if req.status is Status.DISPATCHED:
            moves.evict(req, time.monotonic())
        if req.task is not None:
            req.task.cancel()
