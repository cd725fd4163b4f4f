"""The flow-control process: the single writer, and under `holdback gateway --workers N` the parent of N relays.

Under `--workers N` it binds the listening socket and keeps N relay processes (gateway/relays/relay.py) accepting
on it (gateway/relays/local_relays.py); this process never accepts on it. It runs the one `Gateway` (FlowController, replica checks and scrapes, KV ledger, eviction), serves its
relays over a Unix socket, and relays of any host over TCP with `--role flow-control --relays-listen HOST:PORT`
(gateway/relays/channel.py: the same authenticated channel both ways), and answers their messages by calling the
FlowController of the request's model pool exactly as the in-process proxy does. A relay's channel closing (the
process died, or its channel was cut) releases all it held: queued requests are withdrawn, dispatched ones finished
as disconnects, so no reservation or in-flight count outlives it. With `--lease-redis` it serves relays and decides
only while it leads, and takes over what they hold when it comes to lead (gateway/relays/takeover.py). Asked to
stop, it lets its local relays drain while it decides for them, then hands the lease over before it exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Awaitable

from gateway.app import Gateway
from gateway.flow import moves
from gateway.flow.controller import FlowController, Outcome
from gateway.flow.request import Ask, DropReason, End, FlowRequest, Status
from gateway.log import log_event
from gateway.metrics import merged_exposition, metric_families
from gateway.relays import messages as m
from gateway.relays.channel import SILENT_HEARTBEATS, Channel, secure_channel
from gateway.relays.handshake import PeerRefused
from gateway.relays.leadership import Leadership
from gateway.relays.local_relays import LocalRelays
from gateway.relays.takeover import Takeover
from gateway.relays.uplink import BACKOFF_CAP
from gateway.replicas import Replica
from gateway.settings import ConfigError

logger = logging.getLogger("gateway.flow")


class _Eviction:
    """A relayed request's stand-in for the proxy task in FlowRequest.task: cancelling it evicts the request
    in its relay (the relay cancels its real task, and the proxy answers as it does in one process)."""

    __slots__ = ("link", "rid", "req")

    def __init__(self, link: "RelayLink", rid: int, req: FlowRequest):
        self.link, self.rid, self.req = link, rid, req

    def cancel(self) -> None:
        takeover = self.link.server.takeover
        if takeover.decides():
            self.link.answer(self.rid, self.req)  # the decision before the eviction, if it is still unsent
            self.link.channel.send(m.Evict(rid=self.rid, token=takeover.token))


class RelayLink:
    """One relay's channel: the requests it submitted, by its own ids, and what it last reported."""

    def __init__(self, server: "FlowServer", channel: Channel, link_id: int, hello: m.Hello):
        self.server = server
        self.pools = server.gateway.pools
        self.channel = channel
        self.link_id = link_id
        self.hello = hello
        self.index = hello.index
        self.requests: dict[int, FlowRequest] = {}
        # The FlowController of each request's pool (kept: a reload may drop the pool while it runs).
        self.controllers: dict[int, FlowController] = {}
        self._answered: set[int] = set()
        self.tokenizer: dict = {}
        self.families: list = []
        # When the relay said it drains: it cuts what still runs then (Unix time).
        self.drain_deadline: float | None = None

    # -- decisions back to the relay ------------------------------------------------------------------------
    def answer(self, rid: int, req: FlowRequest) -> None:
        """Send the relay flow control's decision on `req` (once), with the leader's token; nothing once this process
        does not lead (it steps down and closes its channels)."""
        if rid in self._answered or not self.server.takeover.decides():
            return
        token = self.server.takeover.token
        if req.status is Status.DISPATCHED:
            self._answered.add(rid)
            lease = req.leased()
            self.channel.send(m.Dispatched(
                rid=rid, token=token, url=lease.replica.url, dispatched_at=lease.dispatched_at,
                enqueued_at=req.enqueued_at,
                traffic_class=req.traffic_class if lease.reservation is not None else None))
        elif req.status is Status.REJECTED:
            self.requests.pop(rid, None)
            self.controllers.pop(rid, None)
            reason = req.drop_reason or DropReason.NO_ENDPOINTS
            self.channel.send(m.Rejected(rid=rid, token=token, reason=reason.value, message=req.drop_message))

    def _queued(self, rid: int, req: FlowRequest, waiter: asyncio.Future) -> None:
        if not waiter.cancelled():
            self.answer(rid, req)

    # -- messages from the relay ----------------------------------------------------------------------------
    def handle(self, message: m.Message) -> None:
        match message:
            case m.Revise(rid=rid, output_tokens=tokens, done=done):
                if (req := self.requests.get(rid)) is not None:
                    self.controllers[rid].revise(req, tokens, done)
            case m.Submit(rid=rid, ask=ask):
                self.submit(rid, ask)
            case m.Holding():
                self.server.takeover.adopt(self, message)
            case m.Finished(rid=rid, cause=cause, event_at=event_at, closed_at=closed_at):
                req = self.requests.pop(rid, None)
                controller = self.controllers.pop(rid, None)
                self._answered.discard(rid)
                if req is not None and controller is not None:
                    controller.finish(req, End(cause), event_at, closed_at)
            case m.Withdraw(rid=rid, at=at, reason=reason):
                self._withdraw(rid, at, DropReason(reason))
            case m.Started(rid=rid):
                if (req := self.requests.get(rid)) is not None:
                    self.controllers[rid].started_streaming(req)
            case m.MidStream(pool=pool):
                if pool in self.pools.pools:
                    self.pools.flow(pool).count_mid_stream_eviction()
            case m.Fallbacks(count=count):
                self.pools.default().controller.tally.tokenizer_fallbacks += count
            case m.MarkDown(url=url, reason=reason):
                if (replica := self._replica(url)) is not None:
                    self.server.gateway.pool.mark_down(replica, reason)
            case m.MarkUnauthorized(url=url, path=path, status=status):
                if (replica := self._replica(url)) is not None:
                    self.server.gateway.pool.mark_unauthorized(replica, path, status)
            case m.TokenizerReport(state=state):
                self.tokenizer = state
            case m.Draining(deadline=deadline):
                self.drain_deadline = deadline
                log_event(logger, "relay_draining", relay=self.index, pid=self.hello.pid, peer=self.channel.peer,
                          drain_deadline=deadline, requests=len(self.requests))
            case m.Call():
                self.server.call(self, message)
            case _:
                log_event(logger, "relay_message_unexpected", level=logging.ERROR, relay=self.index,
                          kind=message.kind)

    def _replica(self, url: str) -> Replica | None:
        return next((r for r in self.server.gateway.pool.replicas if r.url == url), None)

    def track(self, rid: int, ask: Ask, controller: FlowController | None) -> FlowRequest:
        """A request of this relay, by its id, with the controller of its pool."""
        req = self.requests[rid] = FlowRequest(ask)
        req.task = _Eviction(self, rid, req)
        if controller is not None:
            self.controllers[rid] = controller
        return req

    def submit(self, rid: int, ask: Ask) -> None:
        if self.server.takeover.holds_back():  # a new leader counts what relays report first
            self.server.takeover.defer(self, rid, ask)
            return
        if ask.pool not in self.pools.pools:  # the relay routed by a description a reload has since replaced
            req = self.track(rid, ask, None)
            moves.reject(req, DropReason.NO_ENDPOINTS)
            self.answer(rid, req)
            return
        controller = self.pools.flow(ask.pool)
        req = self.track(rid, ask, controller)
        if controller.submit(req) is Outcome.QUEUED:
            assert req.waiter is not None
            req.waiter.add_done_callback(lambda waiter: self._queued(rid, req, waiter))
        else:
            self.answer(rid, req)

    def _withdraw(self, rid: int, at: float, reason: DropReason = DropReason.CONTEXT_CANCELLED) -> None:
        """The caller left (or the relay refused it, `reason`) while the relay waited for the decision: the
        decision may be made already."""
        req = self.requests.pop(rid, None)
        controller = self.controllers.pop(rid, None)
        self._answered.discard(rid)
        if req is None or controller is None:
            self.server.takeover.forget(self, rid)
            return
        if req.status is Status.QUEUED:
            controller.withdraw(req, reason)
        elif req.status is Status.DISPATCHED:
            controller.finish(req, End.DISCONNECT, at)

    def release_all(self) -> int:
        """The relay is gone: withdraw what it had queued, finish what it had dispatched."""
        now = time.monotonic()
        held = [(req, self.controllers.get(rid)) for rid, req in self.requests.items()]
        self.requests.clear()
        self.controllers.clear()
        for req, controller in held:
            if controller is None:
                continue
            if req.status is Status.QUEUED:
                controller.withdraw(req)
            elif req.status is Status.DISPATCHED:
                controller.finish(req, End.DISCONNECT, now)
        return len(held)


class FlowServer:
    """Serves relays over the channel: `workers` local ones it starts on `sock` (Unix socket), and any that connect
    to `relays_listen` (TCP), all with `secret`. With a `leadership` it serves relays only while it leads."""

    def __init__(self, gateway: Gateway, workers: int, sock: socket.socket | None, log_level: str, secret: bytes,
                 relays_listen: tuple[str, int] | None = None, leadership: Leadership | None = None):
        self.gateway = gateway
        self.pools = gateway.pools
        self.workers = workers
        self.sock = sock
        self.log_level = log_level
        self.secret = secret
        self.relays_listen = relays_listen
        self.links: dict[int, RelayLink] = {}
        self._link_ids = itertools.count(1)
        # Counters and histograms of relays that exited, as last collected: the totals never go backwards.
        self.retired_families: list[list] = []
        self._stopping = False
        self._pool_view: m.PoolView | None = None
        # A relay notices a silent leader after three of its heartbeats, then finds this one within its longest pause.
        self.takeover = Takeover(self, leadership, SILENT_HEARTBEATS * self.heartbeat() + BACKOFF_CAP + 1)
        self._dir = tempfile.mkdtemp(prefix="holdback-gateway-")
        self.channel_path = str(Path(self._dir) / "flow.sock")
        self.relays = LocalRelays(workers, sock, self.channel_path, secret, log_level, gateway.drain, logger)
        gateway.drains.relays = lambda: {f"{link.hello.host}/{link.hello.pid}": link.drain_deadline
                                         for link in self.links.values() if link.drain_deadline is not None}
        self._use_relay_tokenizers()
        gateway.on_config.append(self._config_changed)
        gateway.pool.on_change = self._pool_changed
        gateway.pools.on_pools.append(self._pools_changed)

    # -- state the relays report ----------------------------------------------------------------------------
    def _use_relay_tokenizers(self) -> None:
        self.pools.tokenizer_state = self.tokenizer_state

    def tokenizer_state(self) -> dict:
        """The relays' prompt counters, merged: a replica's verdict from any relay, counts summed."""
        merged: dict = {"mode": self.pools.loaded.config.admission.tokenizer, "replicas": {}, "counted_by": {},
                        "disagreements": 0}
        for link in self.links.values():
            state = link.tokenizer
            merged["replicas"].update(state.get("replicas", {}))
            for source, n in state.get("counted_by", {}).items():
                merged["counted_by"][source] = merged["counted_by"].get(source, 0) + n
            merged["disagreements"] += state.get("disagreements", 0)
        return merged

    def snapshot(self) -> dict:
        state = self.pools.snapshot()
        state["relays"] = {"workers": self.workers, "restarts": self.relays.restarts,
                           "running": [{"index": link.index, "pid": link.hello.pid, "host": link.hello.host,
                                        "listen": link.hello.listen, "peer": link.channel.peer,
                                        "requests": len(link.requests), "draining": link.drain_deadline is not None,
                                        "drain_deadline": link.drain_deadline} for link in self.links.values()]}
        state["drain"] = self.gateway.drain.state()
        state["leadership"] = self.takeover.state()
        return state

    async def exposition(self) -> bytes:
        """/metrics over all processes: flow control's own, plus each relay's counters and histograms."""
        links = list(self.links.values())
        answers = await asyncio.gather(*(link.channel.call("collect", timeout=5.0) for link in links),
                                       return_exceptions=True)
        for link, answer in zip(links, answers):
            if isinstance(answer, list):  # the relay's metric families (malformed ones are skipped in the merge)
                link.families = answer
        relay_families = [link.families for link in links] + self.retired_families
        return merged_exposition(metric_families(self.gateway.metrics.registry), relay_families)

    # -- calls from relays ----------------------------------------------------------------------------------
    def call(self, link: RelayLink, call: m.Call) -> None:
        call_id, arg = call.call_id, call.args[0] if call.args else None
        if call.name == "state":
            link.channel.reply(call_id, self.snapshot())
        elif call.name == "rollback":
            lower = float(arg) if isinstance(arg, (int, float)) and not isinstance(arg, bool) else None
            try:
                link.channel.reply(call_id, ["ok", self.gateway.rollback(lower)])
            except ConfigError as exc:
                link.channel.reply(call_id, ["refused", str(exc)])
        elif call.name == "reassign" and isinstance(arg, int):
            asyncio.ensure_future(self._reassign(link, call_id, arg))
        elif call.name == "metrics":
            asyncio.ensure_future(self._metrics(link, call_id))
        else:
            link.channel.reply(call_id, None)

    async def _reassign(self, link: RelayLink, call_id: int, rid: int) -> None:
        req, controller = link.requests.get(rid), link.controllers.get(rid)
        replica = await controller.reassign(req) if req is not None and controller is not None else None
        link.channel.reply(call_id, replica.url if replica is not None else None)

    async def _metrics(self, link: RelayLink, call_id: int) -> None:
        link.channel.reply(call_id, (await self.exposition()).decode())

    # -- broadcasts -----------------------------------------------------------------------------------------
    def _config_message(self) -> m.Configure:
        """The gateway's config, and per pool its name, config and ledger settings."""
        pools = []
        for controller in self.pools.flows():
            ledger = controller.ledger
            assert ledger is not None
            pools.append(m.PoolConfig(name=controller.pool_name, loaded=controller.loaded, ledger=m.LedgerSettings(
                block_tokens=ledger.block_tokens, safety_factor=ledger.safety_factor, window=ledger.meter.window)))
        return m.Configure(token=self.takeover.token, loaded=self.pools.loaded, pools=tuple(pools))

    def heartbeat(self) -> float:
        return self.pools.loaded.config.flowControl.heartbeatSeconds

    def _config_changed(self) -> None:
        self._use_relay_tokenizers()  # the in-process proxy's reconfigure pointed it at its own counter
        message = self._config_message()
        for link in self.links.values():
            link.channel.heartbeat = self.heartbeat()
            link.channel.send(message)

    def _pool_message(self) -> m.PoolView:
        views = tuple(m.ReplicaFacts(url=r.url, healthy=r.healthy, refused=r.refused, model=r.model,
                                    model_root=r.model_root, runtime_version=r.runtime_version,
                                    max_model_len=r.max_model_len, pool=r.pool, listed=r.listed)
                      for r in self.gateway.pool.replicas)
        return m.PoolView(replicas=views, routing=tuple(self.pools.describe()))

    def _pool_changed(self) -> None:
        self.pools.wake()
        message = self._pool_message()
        if message != self._pool_view:
            self._pool_view = message
            for link in self.links.values():
                link.channel.send(message)

    def _pools_changed(self) -> None:
        """A pool was added (a replica reported a new model) or a replica changed pools: its config first."""
        message = self._config_message()
        for link in self.links.values():
            link.channel.send(message)
        self._pool_changed()

    # -- the channel ----------------------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            channel = await secure_channel(reader, writer, self.secret, "flow-control", self.heartbeat(),
                                           standby=not self.takeover.decides())
        except PeerRefused:
            return
        if not self.takeover.decides():  # a standby: the relay tries its next address
            channel.close()
            return
        link: RelayLink | None = None

        def handle(message: m.Message) -> None:
            nonlocal link
            if link is not None:
                link.handle(message)
            elif isinstance(message, m.Hello) and not self.takeover.decides():
                channel.close()  # it stepped down during the handshake
            elif isinstance(message, m.Hello):  # the relay's first message
                link = RelayLink(self, channel, next(self._link_ids), message)
                self.links[link.link_id] = link
                log_event(logger, "relay_joined", relay=link.index, pid=message.pid, host=message.host,
                          listen=message.listen, peer=channel.peer)
                channel.send(self._config_message())
                channel.send(self._pool_message())
                self.takeover.joined(link)

        await channel.serve(handle)
        if link is not None:
            del self.links[link.link_id]
            if link.families:
                self.retired_families.append(link.families)
            released = link.release_all()
            log_event(logger, "relay_channel_closed", level=logging.WARNING if not self._stopping else logging.INFO,
                      relay=link.index, pid=link.hello.pid, peer=channel.peer, released_requests=released,
                      reason=channel.reason or "closed")

    async def run(self, stopped: Awaitable[None]) -> None:
        """Serve the relays and keep `workers` of them running until `stopped` completes; then let the local relays
        drain (this process decides for them meanwhile) and hand the lease over."""
        # mkdtemp made the directory for this user only; and a peer must hold the secret.
        servers = [await asyncio.start_unix_server(self._accept, path=self.channel_path)] if self.workers else []
        if self.relays_listen is not None:
            host, port = self.relays_listen
            servers.append(await asyncio.start_server(self._accept, host, port, reuse_address=True))
        await self.gateway.start()
        lease = self.takeover.leadership
        contending = asyncio.create_task(lease.run()) if lease is not None else None
        self.relays.start()
        try:
            await stopped
        finally:
            self._stopping = True
            await self.relays.stop()
            for server in servers:  # a relay that connects again goes on to its next address: the standby
                server.close()
            if contending is not None and lease is not None:
                contending.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(lease.resign(), 2)
                for link in list(self.links.values()):  # they re-register with the standby that now leads
                    link.channel.close()
            await self.gateway.stop()
            with contextlib.suppress(OSError):
                os.unlink(self.channel_path)
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)
