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
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable, Iterator

from gateway.config import LoadedConfig
from gateway.flow.interface import Outcome
from gateway.flow.ledger import KvLedger, Reservation
from gateway.flow.request import DropReason, FlowRequest, Status
from gateway.log import log_event
from gateway.pools import PoolReplicas, PoolRouting
from gateway.relays.channel import Channel
from gateway.replicas import Replica

logger = logging.getLogger("gateway.relay")


class RelayPool:
    """The replicas as flow control last described them: the proxy picks one to count tokens on and to list
    models from, and reports a replica that refused a connection."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.replicas: list[Replica] = []

    def update(self, views: list[dict]) -> None:
        by_url = {r.url: r for r in self.replicas}
        replicas = []
        for view in views:
            replica = by_url.get(view["url"]) or Replica(view["url"])
            for name, value in view.items():
                setattr(replica, name, value)
            replicas.append(replica)
        self.replicas = replicas

    def by_url(self, url: str) -> Replica:
        return next((r for r in self.replicas if r.url == url), None) or Replica(url, healthy=True)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.refused is None]

    def mark_down(self, replica: Replica, reason: str) -> None:
        replica.healthy = False
        self.channel.send(("mark_down", replica.url, reason))

    def mark_unauthorized(self, replica: Replica, path: str, status: int) -> None:
        replica.healthy = False
        self.channel.send(("mark_unauthorized", replica.url, path, status))


class RemotePools:
    """`FlowPools` for a relay: a RemoteFlowController per model pool, routing as flow control describes it
    (its pools' served names, sent again whenever they change). The relay's request ids are one sequence over
    every pool, so flow control's answers find their request whatever its pool."""

    def __init__(self, channel: Channel, loaded: LoadedConfig, pools: list[tuple[str, LoadedConfig, dict]],
                 replicas: list[dict], routing: list[dict]):
        self.channel = channel
        self.replicas = RelayPool(channel)
        self.replicas.update(replicas)
        self.tokenizer_state: Callable[[], dict] = lambda: {}
        self.requests: dict[int, FlowRequest] = {}
        self.ids = itertools.count(1)
        self._flows: dict[str, RemoteFlowController] = {}
        self._routing = PoolRouting(routing)
        self.configure(loaded, pools)

    def configure(self, loaded: LoadedConfig, pools: list[tuple[str, LoadedConfig, dict]]) -> None:
        self.loaded = loaded
        for name, own, ledger in pools:
            flow = self._flows.get(name)
            if flow is None:
                self._flows[name] = RemoteFlowController(self, name, own, ledger)
            else:
                flow.configure(own, ledger)

    def update(self, replicas: list[dict], routing: list[dict]) -> None:
        self.replicas.update(replicas)
        self._routing = PoolRouting(routing)

    # -- FlowPools (gateway/flow/interface.py) --------------------------------------------------------------
    def routing(self) -> PoolRouting:
        return self._routing

    def flow(self, name: str) -> RemoteFlowController:
        return self._flows[name]

    def flows(self) -> list[RemoteFlowController]:
        named = [self._flows[p["name"]] for p in self._routing.pools if p["name"] in self._flows]
        return named or list(self._flows.values())

    # -- messages from flow control -------------------------------------------------------------------------
    def _of(self, rid: int) -> Iterator[RemoteFlowController]:
        req = self.requests.get(rid)
        if req is not None:
            yield self._flows[req.pool]

    def dispatched(self, rid: int, *decision: object) -> None:
        for flow in self._of(rid):
            flow.dispatched(rid, *decision)  # type: ignore[arg-type]

    def rejected(self, rid: int, reason: str, message: str | None) -> None:
        for flow in self._of(rid):
            flow.rejected(rid, reason, message)

    def evict(self, rid: int) -> None:
        for flow in self._of(rid):
            flow.evict(rid)

    def lost(self) -> None:
        """Flow control is gone: nothing this relay holds can be decided any more."""
        log_event(logger, "flow_control_lost", level=logging.ERROR, requests=len(self.requests))
        for req in list(self.requests.values()):
            if req.task is not None:
                req.task.cancel()


class RemoteFlowController:
    """`FlowControl` for a relay's requests to one model pool: every call goes over the channel to that pool's
    FlowController."""

    def __init__(self, pools: RemotePools, name: str, loaded: LoadedConfig, ledger: dict):
        self.channel = pools.channel
        self.name = name
        self.replicas = pools.replicas
        self.pool = PoolReplicas(pools.replicas, name)  # type: ignore[arg-type]  # the relay's mirror of them
        # The mirror of this relay's reservations: it tells the proxy when a revision is due, as the real one does.
        self.ledger = KvLedger(**ledger)
        self.configure(loaded, ledger)
        self.tokenizer_state: Callable[[], dict] = lambda: {}
        self._requests = pools.requests
        self._ids = pools.ids

    def configure(self, loaded: LoadedConfig, ledger: dict) -> None:
        self.loaded = loaded
        self.ledger.configure(**ledger)

    # -- the FlowControl interface (gateway/flow/interface.py) ----------------------------------------------
    @property
    def admission_enabled(self) -> bool:
        # The proxy only asks whether admission is on (then it counts prompts); flow control applies it.
        return self.loaded.config.admission.enabled

    def count_tokenizer_fallback(self) -> None:
        # Flow control keeps the gateway's count (for /admin/state).
        self.channel.send(("fallbacks", 1))

    def submit(self, req: FlowRequest) -> Outcome:
        req.seq = rid = next(self._ids)
        req.status = Status.QUEUED
        req.waiter = asyncio.get_running_loop().create_future()
        self._requests[rid] = req
        self.channel.send(("submit", self.name, rid, req.request_id, req.objective, req.priority, req.fairness_id,
                           req.tenant, req.arrived, req.expires_at, req.deadline, req.prompt_tokens,
                           req.max_new_tokens, req.resumable, req.limit_param, req.sequences, req.streamed,
                           req.prompt_exact, req.at_risk))
        return Outcome.QUEUED

    def withdraw(self, req: FlowRequest) -> None:
        # Flow control may have dispatched it already: it then releases it as a disconnect.
        if req.status is Status.QUEUED:
            req.status = Status.WITHDRAWN
            self.channel.send(("withdraw", self._requests.pop(req.seq).seq, time.monotonic()))

    def finish(self, req: FlowRequest, cause: str = "end", event_at: float | None = None) -> None:
        if req.status is not Status.DISPATCHED:
            return
        req.status = Status.EVICTED if req.drop_reason is DropReason.EVICTED else Status.FINISHED
        self._requests.pop(req.seq, None)
        now = time.monotonic()
        if isinstance(req.reservation, Reservation):
            self.ledger.release(req.reservation, now)
        # The proxy finishes an evicted request right after closing its upstream: that is when it let go.
        self.channel.send(("finish", req.seq, cause, event_at, now if req.status is Status.EVICTED else None))

    async def reassign(self, req: FlowRequest) -> Replica | None:
        if req.status is not Status.DISPATCHED:
            return None
        url = await self.channel.call("reassign", req.seq)
        if url is None:
            return None
        req.replica = self.replicas.by_url(url)
        if isinstance(req.reservation, Reservation):
            self.ledger.move(req.reservation, url)
        return req.replica

    def revise(self, req: FlowRequest, output_tokens: int, done: bool = False) -> None:
        res = req.reservation
        if not isinstance(res, Reservation) or req.status is not Status.DISPATCHED:
            return
        self.ledger.revise(res, output_tokens, time.monotonic(), done=done)
        self.channel.send(("revise", req.seq, output_tokens, done))

    def started_streaming(self, req: FlowRequest) -> None:
        req.streaming_started = True
        self.channel.send(("started", req.seq))

    def count_mid_stream_eviction(self) -> None:
        self.channel.send(("mid_stream", self.name))

    # -- messages from flow control -------------------------------------------------------------------------
    def dispatched(self, rid: int, url: str, dispatched_at: float, enqueued_at: float,
                   traffic_class: str | None) -> None:
        req = self._requests.get(rid)
        if req is None or req.status is not Status.QUEUED:
            return  # withdrawn meanwhile: flow control releases it when the withdrawal arrives
        req.status = Status.DISPATCHED
        req.replica = self.replicas.by_url(url)
        req.dispatched_at, req.enqueued_at = dispatched_at, enqueued_at
        if traffic_class is not None:
            req.traffic_class = traffic_class
            req.reservation = self.ledger.reserve(
                request_id=req.request_id, fairness_id=req.fairness_id, traffic_class=traffic_class,
                priority=req.priority, replica=url, prompt_tokens=req.prompt_tokens,
                max_new_tokens=req.max_new_tokens, now=dispatched_at)
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.DISPATCHED)

    def rejected(self, rid: int, reason: str, message: str | None) -> None:
        req = self._requests.pop(rid, None)
        if req is None:
            return
        req.status = Status.REJECTED
        req.drop_reason = DropReason(reason)
        req.drop_message = message
        if req.waiter is not None and not req.waiter.done():
            req.waiter.set_result(Outcome.REJECTED)

    def evict(self, rid: int) -> None:
        req = self._requests.get(rid)
        if req is None:
            return  # it ended here first; its finish is on the way
        req.drop_reason = DropReason.EVICTED
        if req.task is not None:
            req.task.cancel()
