"""The flow-control process of `holdback gateway --workers N`: the single writer, and the parent of N relays.

It binds the listening socket once and hands it to N relay processes (gateway/relays/relay.py) that inherit it, so
every relay accepts from the same queue: a relay that dies leaves no accepted-but-unserved connections behind
(with SO_REUSEPORT each relay would have its own queue, and a killed relay's queued connections would be reset),
and its replacement serves on the same socket without binding again. This process never accepts on it.
It runs the one `Gateway` (FlowController, replica checks and scrapes, KV ledger, eviction), serves the relays
over a Unix socket (gateway/relays/channel.py) and answers their messages by calling the FlowController of the
request's model pool exactly as the in-process proxy does. A relay's channel closing (the process died) releases all it held: queued requests
are withdrawn, dispatched ones finished as disconnects, so no reservation or in-flight count outlives it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable

from gateway.app import Gateway
from gateway.config import ConfigError
from gateway.flow.controller import FlowController, Outcome
from gateway.flow.request import DropReason, FlowRequest, Status
from gateway.log import log_event
from gateway.metrics import merged_exposition, metric_families
from gateway.relays.channel import Channel

logger = logging.getLogger("gateway.flow")

# Fields of a replica the relays need: which ones take work, and what they serve (for prompt counting).
_REPLICA_VIEW = ("url", "healthy", "refused", "model", "model_root", "runtime_version", "max_model_len", "pool",
                 "listed")
# A relay that dies sooner than this after its start is restarted after a growing pause, not at once.
_QUICK_EXIT = 5.0


def listening_socket(host: str, port: int) -> socket.socket:
    """The one listening socket every relay accepts from."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    sock.set_inheritable(True)
    return sock


class _Eviction:
    """A relayed request's stand-in for the proxy task in FlowRequest.task: cancelling it evicts the request
    in its relay (the relay cancels its real task, and the proxy answers as it does in one process)."""

    __slots__ = ("link", "rid", "req")

    def __init__(self, link: "RelayLink", rid: int, req: FlowRequest):
        self.link, self.rid, self.req = link, rid, req

    def cancel(self) -> None:
        self.link.answer(self.rid, self.req)  # the decision before the eviction, if it is still unsent
        self.link.channel.send(("evict", self.rid))


class RelayLink:
    """One relay's channel: the requests it submitted, by its own ids, and what it last reported."""

    def __init__(self, server: "FlowServer", channel: Channel, pid: int, index: int):
        self.server = server
        self.pools = server.gateway.pools
        self.channel = channel
        self.pid = pid
        self.index = index
        self.requests: dict[int, FlowRequest] = {}
        # The FlowController of each request's pool (kept: a reload may drop the pool while it runs).
        self.controllers: dict[int, FlowController] = {}
        self._answered: set[int] = set()
        self.tokenizer: dict = {}
        self.families: list = []

    # -- decisions back to the relay ------------------------------------------------------------------------
    def answer(self, rid: int, req: FlowRequest) -> None:
        """Send the relay flow control's decision on `req` (once)."""
        if rid in self._answered:
            return
        if req.status is Status.DISPATCHED:
            self._answered.add(rid)
            res = req.reservation
            self.channel.send(("dispatched", rid, req.replica.url, req.dispatched_at,  # type: ignore[union-attr]
                               req.enqueued_at, req.traffic_class if res is not None else None))
        elif req.status is Status.REJECTED:
            self.requests.pop(rid, None)
            self.controllers.pop(rid, None)
            self.channel.send(("rejected", rid, req.drop_reason.value,  # type: ignore[union-attr]
                               req.drop_message))

    def _queued(self, rid: int, req: FlowRequest, waiter: asyncio.Future) -> None:
        if not waiter.cancelled():
            self.answer(rid, req)

    # -- messages from the relay ----------------------------------------------------------------------------
    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "revise":
            req = self.requests.get(message[1])
            if req is not None:
                self.controllers[message[1]].revise(req, message[2], message[3])
        elif kind == "submit":
            self._submit(*message[1:])
        elif kind == "finish":
            req = self.requests.pop(message[1], None)
            controller = self.controllers.pop(message[1], None)
            self._answered.discard(message[1])
            if req is not None and controller is not None:
                controller.finish(req, message[2], message[3], message[4])
        elif kind == "withdraw":
            self._withdraw(message[1], message[2])
        elif kind == "started":
            req = self.requests.get(message[1])
            if req is not None:
                self.controllers[message[1]].started_streaming(req)
        elif kind == "mid_stream":
            if message[1] in self.pools.pools:
                self.pools.flow(message[1]).count_mid_stream_eviction()
        elif kind == "fallbacks":
            self.pools.default().controller.tally.tokenizer_fallbacks += message[1]
        elif kind in ("mark_down", "mark_unauthorized"):
            replica = next((r for r in self.server.gateway.pool.replicas if r.url == message[1]), None)
            if replica is not None:
                getattr(self.server.gateway.pool, kind)(replica, *message[2:])
        elif kind == "tokenizer":
            self.tokenizer = message[1]
        elif kind == "call":
            self.server.call(self, message[1], message[2], *message[3:])
        else:
            log_event(logger, "relay_message_unknown", level=logging.ERROR, relay=self.index, kind=kind)

    def _submit(self, pool: str, rid: int, request_id: str, objective: str, priority: int, fairness_id: str,
                tenant: str, arrived: float, expires_at: float, deadline: float, prompt_tokens: int,
                max_new_tokens: int, resumable: bool, limit_param: str | None, sequences: int,
                streamed: bool, prompt_exact: bool, at_risk: bool) -> None:
        req = FlowRequest(request_id, objective, priority, fairness_id, tenant, arrived, pool=pool,
                          expires_at=expires_at, deadline=deadline, prompt_tokens=prompt_tokens,
                          max_new_tokens=max_new_tokens, resumable=resumable, limit_param=limit_param,
                          sequences=sequences, streamed=streamed, prompt_exact=prompt_exact, at_risk=at_risk)
        req.task = _Eviction(self, rid, req)  # type: ignore[assignment]
        if pool not in self.pools.pools:  # the relay routed by a description a reload has since replaced
            req.status = Status.REJECTED
            req.drop_reason = DropReason.NO_ENDPOINTS
            self.requests[rid] = req
            self.answer(rid, req)
            return
        controller = self.controllers[rid] = self.pools.flow(pool)
        self.requests[rid] = req
        if controller.submit(req) is Outcome.QUEUED:
            req.waiter.add_done_callback(lambda waiter: self._queued(rid, req, waiter))  # type: ignore[union-attr]
        else:
            self.answer(rid, req)

    def _withdraw(self, rid: int, at: float) -> None:
        """The caller left while the relay waited for the decision: the decision may be made already."""
        req = self.requests.pop(rid, None)
        controller = self.controllers.pop(rid, None)
        self._answered.discard(rid)
        if req is None or controller is None:
            return
        if req.status is Status.QUEUED:
            controller.withdraw(req)
        elif req.status is Status.DISPATCHED:
            controller.finish(req, "disconnect", at)

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
                controller.finish(req, "disconnect", now)
        return len(held)


class FlowServer:
    def __init__(self, gateway: Gateway, workers: int, sock: socket.socket, log_level: str):
        self.gateway = gateway
        self.pools = gateway.pools
        self.workers = workers
        self.sock = sock
        self.log_level = log_level
        self.links: dict[int, RelayLink] = {}
        # Counters and histograms of relays that exited, as last collected: the totals never go backwards.
        self.retired_families: list[list] = []
        self.restarts = 0
        self._relays: dict[int, asyncio.subprocess.Process] = {}
        self._stopping = False
        self._pool_view: tuple = ()
        self._dir = tempfile.mkdtemp(prefix="holdback-gateway-")
        self.channel_path = str(Path(self._dir) / "flow.sock")
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
        state["relays"] = {"workers": self.workers, "restarts": self.restarts,
                           "running": [{"index": link.index, "pid": link.pid, "requests": len(link.requests)}
                                       for link in sorted(self.links.values(), key=lambda l: l.index)]}
        return state

    async def exposition(self) -> bytes:
        """/metrics over all processes: flow control's own, plus each relay's counters and histograms."""
        links = list(self.links.values())
        answers = await asyncio.gather(*(link.channel.call("collect", timeout=5.0) for link in links),
                                       return_exceptions=True)
        for link, answer in zip(links, answers):
            if not isinstance(answer, BaseException):
                link.families = answer
        relay_families = [link.families for link in links] + self.retired_families
        return merged_exposition(metric_families(self.gateway.metrics.registry), relay_families)

    # -- calls from relays ----------------------------------------------------------------------------------
    def call(self, link: RelayLink, call_id: int, name: str, *args: object) -> None:
        if name == "state":
            link.channel.reply(call_id, self.snapshot())
        elif name == "rollback":
            try:
                link.channel.reply(call_id, ("ok", self.gateway.rollback(args[0])))  # type: ignore[arg-type]
            except ConfigError as exc:
                link.channel.reply(call_id, ("refused", str(exc)))
        elif name == "reassign":
            asyncio.ensure_future(self._reassign(link, call_id, args[0]))  # type: ignore[arg-type]
        elif name == "metrics":
            asyncio.ensure_future(self._metrics(link, call_id))
        else:
            link.channel.reply(call_id, None)

    async def _reassign(self, link: RelayLink, call_id: int, rid: int) -> None:
        req, controller = link.requests.get(rid), link.controllers.get(rid)
        replica = await controller.reassign(req) if req is not None and controller is not None else None
        link.channel.reply(call_id, replica.url if replica is not None else None)

    async def _metrics(self, link: RelayLink, call_id: int) -> None:
        link.channel.reply(call_id, await self.exposition())

    # -- broadcasts -----------------------------------------------------------------------------------------
    def _config_message(self) -> tuple:
        """("config", the gateway's config, per pool its name, config and ledger settings)."""
        pools = []
        for controller in self.pools.flows():
            ledger = controller.ledger
            assert ledger is not None
            pools.append((controller.pool_name, controller.loaded, {
                "block_tokens": ledger.block_tokens, "safety_factor": ledger.safety_factor,
                "window": ledger.meter.window}))
        return ("config", self.pools.loaded, pools)

    def _config_changed(self) -> None:
        self._use_relay_tokenizers()  # the in-process proxy's reconfigure pointed it at its own counter
        message = self._config_message()
        for link in self.links.values():
            link.channel.send(message)

    def _views(self) -> list[dict]:
        return [{name: getattr(r, name) for name in _REPLICA_VIEW} for r in self.gateway.pool.replicas]

    def _pool_changed(self) -> None:
        self.pools.wake()
        views = (self._views(), self.pools.describe())
        if views != self._pool_view:
            self._pool_view = views
            for link in self.links.values():
                link.channel.send(("pool", *views))

    def _pools_changed(self) -> None:
        """A pool was added (a replica reported a new model) or a replica changed pools: its config first."""
        message = self._config_message()
        for link in self.links.values():
            link.channel.send(message)
        self._pool_changed()

    # -- the channel ----------------------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer)
        link: RelayLink | None = None

        def handle(message: tuple) -> None:
            nonlocal link
            if link is not None:
                link.handle(message)
            elif message[0] == "hello":  # ("hello", pid, index): the relay's first message
                link = RelayLink(self, channel, message[1], message[2])
                self.links[link.index] = link
                channel.send(self._config_message())
                channel.send(("pool", self._views(), self.pools.describe()))

        await channel.serve(handle)
        if link is not None:
            if self.links.get(link.index) is link:
                del self.links[link.index]
            if link.families:
                self.retired_families.append(link.families)
            released = link.release_all()
            log_event(logger, "relay_channel_closed", level=logging.WARNING if not self._stopping else logging.INFO,
                      relay=link.index, pid=link.pid, released_requests=released)

    # -- relay processes ------------------------------------------------------------------------------------
    async def _keep_relay(self, index: int) -> None:
        """Run relay `index`; when it exits (killed, crashed), start another in its place."""
        pause = 0.1
        while not self._stopping:
            started = time.monotonic()
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "gateway.relays.relay", "--fd", str(self.sock.fileno()), "--channel",
                self.channel_path, "--index", str(index), "--log-level", self.log_level,
                pass_fds=(self.sock.fileno(),))
            self._relays[index] = proc
            log_event(logger, "relay_started", relay=index, pid=proc.pid)
            code = await proc.wait()
            if self._stopping:
                return
            self.restarts += 1
            log_event(logger, "relay_exited", level=logging.ERROR, relay=index, pid=proc.pid, returncode=code,
                      hint="a new relay takes its place")
            if time.monotonic() - started < _QUICK_EXIT:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 5.0)
            else:
                pause = 0.1

    async def run(self, stopped: Awaitable[None]) -> None:
        """Serve the relays and keep `workers` of them running until `stopped` completes."""
        # mkdtemp made the directory for this user only: no other user can connect to the channel.
        server = await asyncio.start_unix_server(self._accept, path=self.channel_path)
        await self.gateway.start()
        keepers = [asyncio.create_task(self._keep_relay(i), name=f"relay-{i}") for i in range(self.workers)]
        try:
            await stopped
        finally:
            self._stopping = True
            for proc in self._relays.values():
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*keepers, return_exceptions=True), 10)
            for proc in self._relays.values():
                if proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            server.close()
            await self.gateway.stop()
            self.sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.channel_path)
                os.rmdir(self._dir)

