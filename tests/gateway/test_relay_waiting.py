"""A relay run alone whose channel to flow control is down: an undecided request waits, new ones queue, each until
its deadline (then the old 503 answer), a withdrawn one is dropped without a message, and the flow control the relay
joins next learns each waiting request once, from `Holding`. A relay of `--workers N` still refuses at once."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest

from gateway.flow.interface import Outcome
from gateway.flow.request import Ask, DropReason, FlowRequest, Status
from gateway.relays import messages as m
from gateway.relays.relay import Relay
from gateway.relays.remote_flow import UNREACHABLE
from gateway.responses import drop_response
from gateway.settings.loading import parse_config

pytestmark = pytest.mark.unit

# Seconds a request with no limit of its own may wait (the config's flowControl.defaultRequestTTL).
TTL = 0.3
LOADED = parse_config(f"flowControl:\n  defaultRequestTTL: {TTL}\n", "test", {})


class FakeUplink:
    """The relay's link, opened and closed by the test; what the relay sends is kept."""

    def __init__(self) -> None:
        self.closed = False
        self.sent: list[m.Message] = []

    def set_heartbeat(self, seconds: float) -> None:
        pass

    def send(self, message: m.Message) -> None:
        if not self.closed:
            self.sent.append(message)

    def kinds(self) -> list[str]:
        return [message.kind for message in self.sent]


def relay(uplink: FakeUplink, index: int | None = None) -> Relay:
    relay = Relay(uplink, index, "127.0.0.1:0")  # type: ignore[arg-type]
    ledger = m.LedgerSettings(block_tokens=16, safety_factor=1.0, window=30.0)
    relay.handle(m.Configure(token=1, loaded=LOADED, pools=(m.PoolConfig(name="default", loaded=LOADED,
                                                                         ledger=ledger),)))
    return relay


def request(name: str, wait: float = math.inf) -> FlowRequest:
    now = time.monotonic()
    return FlowRequest(Ask(request_id=name, objective="realtime", priority=100, fairness_id="t", tenant="t",
                           arrived=now, expires_at=now + wait))


def held(relay: Relay) -> list[tuple[str, str | None]]:
    assert relay.pools is not None
    return [(h.ask.request_id, h.url) for h in relay.pools.holding()]


async def outcome(req: FlowRequest) -> Outcome:
    assert req.waiter is not None
    return await asyncio.wait_for(asyncio.shield(req.waiter), 30)


def test_a_new_request_queues_is_held_and_expires_at_its_deadline_with_the_unreachable_answer(caplog):
    async def run() -> None:
        uplink = FakeUplink()
        alone = relay(uplink)
        flow = alone.pools.flow("default")
        uplink.closed = True
        alone.left("flow control closed the channel")
        own, by_config = request("own-ttl", wait=0.1), request("config-ttl")
        assert flow.wait_deadline(by_config) == by_config.arrived + TTL
        for req in (own, by_config):
            assert flow.submit(req) is Outcome.QUEUED and req.status is Status.QUEUED
        assert held(alone) == [("own-ttl", None), ("config-ttl", None)]
        assert uplink.sent == []  # no Submit on a closed channel
        for req in (own, by_config):
            assert await outcome(req) is Outcome.REJECTED
            assert time.monotonic() >= flow.wait_deadline(req)
            assert req.status is Status.REJECTED and req.drop_reason is DropReason.NO_ENDPOINTS
            assert req.drop_message == UNREACHABLE
        assert alone.pools.requests == {}
        # The proxy's answer to it, as before: 503, rejected-no-endpoints, saying flow control is unreachable.
        answer = drop_response(by_config.drop_reason, "r1", by_config.drop_message)
        assert answer.status == 503 and "cannot reach the gateway's flow control" in answer.text

    with caplog.at_level(logging.INFO, logger="gateway.relay"):
        asyncio.run(run())
    waiting = [r.fields for r in caplog.records if r.getMessage() == "request_waiting_for_flow_control"]
    assert [(w["request_id"], w["waits_seconds"]) for w in waiting] == [("own-ttl", 0.1), ("config-ttl", TTL)]


def test_a_withdrawn_request_is_dropped_without_a_message_and_no_deadline_means_waiting_on():
    async def run() -> None:
        uplink = FakeUplink()
        alone = relay(uplink)
        flow = alone.pools.flow("default")
        uplink.closed = True
        left, stays = request("left"), request("stays")
        flow.submit(left)
        flow.submit(stays)
        flow.withdraw(left)  # the caller's task was cancelled while it waited
        assert left.status is Status.WITHDRAWN and held(alone) == [("stays", None)]
        uplink.closed = False
        assert uplink.sent == []
        # With defaultRequestTTL 0 (no limit) and none of its own, a request waits until a flow control decides.
        loaded = parse_config("flowControl:\n  defaultRequestTTL: 0\n", "test", {})
        flow.configure(loaded, m.LedgerSettings(block_tokens=16, safety_factor=1.0, window=30.0))
        assert flow.wait_deadline(request("any")) == math.inf

    asyncio.run(run())


def test_what_waited_is_reported_once_in_holding_and_a_joined_flow_control_decides_it_past_its_deadline():
    async def run() -> None:
        uplink = FakeUplink()
        alone = relay(uplink)
        flow = alone.pools.flow("default")
        sent_before = request("sent-before", wait=30)  # submitted to the leader, never decided: the leader dies
        assert flow.submit(sent_before) is Outcome.QUEUED and uplink.kinds() == ["submit"]
        uplink.closed = True
        alone.left("flow control closed the channel")
        queued_alone = request("queued-alone", wait=0.2)
        flow.submit(queued_alone)
        uplink.sent.clear()
        uplink.closed = False  # the standby leads and the relay joins it
        alone.joined()
        assert uplink.kinds() == ["hello", "holding"]  # no Submit again: the new leader submits what `Holding` lists
        [holding] = [message for message in uplink.sent if isinstance(message, m.Holding)]
        assert [(h.rid, h.ask.request_id, h.url) for h in holding.requests] == [
            (sent_before.seq, "sent-before", None), (queued_alone.seq, "queued-alone", None)]
        # Past its deadline the joined flow control has it: the relay leaves the decision to it. (Timers run in
        # the order of their times: this sleep ends after the request's deadline timer ran.)
        await asyncio.sleep(flow.wait_deadline(queued_alone) - time.monotonic() + 0.05)
        assert queued_alone.status is Status.QUEUED
        alone.handle(m.Dispatched(rid=queued_alone.seq, token=2, url="http://r:8000", dispatched_at=time.monotonic(),
                                  enqueued_at=queued_alone.arrived))
        assert await outcome(queued_alone) is Outcome.DISPATCHED
        assert queued_alone.lease is not None and queued_alone.lease.replica.url == "http://r:8000"
        # A request the joined flow control still holds when the channel closes again, past its deadline: answered.
        late = request("late", wait=0.05)
        flow.submit(late)
        await asyncio.sleep(late.expires_at - time.monotonic() + 0.05)
        assert late.status is Status.QUEUED
        uplink.closed = True
        assert alone.pools.wait_alone() == 2  # sent-before and late, until their timers run
        assert await outcome(late) is Outcome.REJECTED and late.drop_message == UNREACHABLE
        assert held(alone) == [("sent-before", None), ("queued-alone", "http://r:8000")]

    asyncio.run(run())


def test_a_relay_of_workers_still_refuses_at_once_when_its_flow_control_is_gone():
    async def run() -> None:
        uplink = FakeUplink()
        worker = relay(uplink, index=0)
        uplink.closed = True
        req = request("refused")
        assert worker.pools.flow("default").submit(req) is Outcome.REJECTED
        assert req.drop_message == UNREACHABLE and worker.pools.requests == {}

    asyncio.run(run())


def test_a_takeover_hold_back_whose_timer_fires_early_still_submits_what_waited():
    """The hold-back's timer may fire a hair before its end (uvloop counts milliseconds): what waited is then
    submitted when the window really ends, never left waiting for good."""
    import types

    from gateway.relays.takeover import Takeover

    submitted = []
    link = types.SimpleNamespace(channel=types.SimpleNamespace(closed=False),
                                 submit=lambda rid, ask: submitted.append(rid))

    async def main():
        takeover = Takeover(types.SimpleNamespace(), None, window=0.0)
        takeover.until = time.monotonic() + 0.05
        takeover.waiting = {(1, 7): (link, object())}
        takeover._release()  # early: the window has 50 ms to go
        assert submitted == [] and takeover.holds_back()
        deadline = time.monotonic() + 30
        while not submitted and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert submitted == [7] and not takeover.holds_back()

    asyncio.run(main())


def test_a_relay_turned_away_by_a_standby_asks_again_every_quarter_second_and_joins_soon_after_it_leads():
    # A leader is being elected (the old one's lease has yet to lapse): the standby answers at once, so the relay
    # asks it again every STANDBY_RETRY instead of backing off (0.2, 0.4, 0.8, 1.6 s...), and joins it soon after
    # it leads. The standby here turns the relay away five times, then leads.
    from gateway.relays.channel import secure_channel
    from gateway.relays.handshake import PeerRefused, run_secret
    from gateway.relays.uplink import STANDBY_RETRY, Uplink

    secret, refusals = run_secret(), 5

    async def main() -> tuple[float, int]:
        asked, led_at = [0], [0.0]

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            asked[0] += 1
            standby = asked[0] <= refusals
            try:
                channel = await secure_channel(reader, writer, secret, "flow-control", 1.0, standby=standby)
            except PeerRefused:
                return
            if standby:
                channel.close()
                if asked[0] == refusals:
                    led_at[0] = time.monotonic()  # it leads from now on
                return
            await channel.serve(lambda message: None)

        server = await asyncio.start_server(accept, "127.0.0.1", 0)
        uplink = Uplink([f"127.0.0.1:{server.sockets[0].getsockname()[1]}"], secret)
        joined = asyncio.Event()
        running = asyncio.create_task(uplink.run(lambda message: None, joined.set, lambda reason: None, True))
        try:
            await asyncio.wait_for(joined.wait(), 60)
            return time.monotonic() - led_at[0], asked[0]
        finally:
            running.cancel()
            if uplink.channel is not None:
                uplink.channel.close()
            server.close()

    after, asked = asyncio.run(main())
    # Backing off, the sixth attempt would come 3.2 s after the fifth; asking every quarter second, 0.25 s after.
    assert asked == refusals + 1 and after < STANDBY_RETRY + 1.0, after


def test_a_relay_whose_first_address_is_silent_asks_the_next_at_once_and_joins_it_when_it_leads():
    # A leader paused mid-handshake (SIGSTOP, a GC pause, a partition) accepts the connection (the kernel does) and
    # answers nothing. Asked in order, it held the relay for the handshake's timeout before the standby was asked.
    # Here the first address is such a peer, the second a standby that turns the relay away three times, then
    # leads: the relay asks both at once, asks the standby again meanwhile (the silent one once only), and the
    # standby leads for it while the silent handshake still waits; the relay then gives that one up.
    from gateway.relays.channel import secure_channel
    from gateway.relays.handshake import PeerRefused, run_secret
    from gateway.relays.uplink import Uplink

    secret, refusals = run_secret(), 3

    async def main() -> list[str]:
        events: list[str] = []
        asked = [0]

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            events.append("silent asked")
            await reader.read()  # nothing is answered; returns when the relay closes the connection
            events.append("silent given up")

        async def standby(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            asked[0] += 1
            events.append("standby asked")
            try:
                channel = await secure_channel(reader, writer, secret, "flow-control", 1.0,
                                               standby=asked[0] <= refusals)
            except PeerRefused:
                return
            if asked[0] <= refusals:
                channel.close()
                return
            events.append("led")
            await channel.serve(lambda message: None)

        servers = [await asyncio.start_server(handler, "127.0.0.1", 0) for handler in (silent, standby)]
        uplink = Uplink([f"127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in servers], secret)
        joined = asyncio.Event()
        running = asyncio.create_task(uplink.run(lambda message: None, joined.set, lambda reason: None, True))
        try:
            await asyncio.wait_for(joined.wait(), 60)
            events.append("joined")
            await _until(lambda: "silent given up" in events)
            return events
        finally:
            _stop(running, uplink, servers)

    events = asyncio.run(main())
    assert events.count("silent asked") == 1 and events.count("standby asked") == refusals + 1, events
    assert events.index("led") < events.index("silent given up"), events  # not given up by its own timeout


def test_a_relay_whose_leader_goes_quiet_moves_to_a_standby_that_leads_before_the_silence_cut():
    # The leader passes the handshake, saying it beats every 2 s, then sends nothing (paused). The standby turns the
    # relay's first ask away (the lease is the leader's), then leads. The relay asks it again once the leader has
    # missed a heartbeat and moves to it: the channel it leaves closes with the standby named, not by the silence
    # cut (three of the leader's heartbeats, 6 s).
    from gateway.relays.channel import secure_channel
    from gateway.relays.handshake import PeerRefused, run_secret
    from gateway.relays.uplink import Uplink

    secret = run_secret()

    async def main() -> tuple[list[str], list[str], list[str]]:
        asked, reasons, held = [0], [], []

        async def leader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(await secure_channel(reader, writer, secret, "flow-control", 2.0))  # then silent

        async def standby(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            asked[0] += 1
            try:
                channel = await secure_channel(reader, writer, secret, "flow-control", 1.0, standby=asked[0] == 1)
            except PeerRefused:
                return
            await channel.serve(lambda message: None)

        servers = [await asyncio.start_server(handler, "127.0.0.1", 0) for handler in (leader, standby)]
        addresses = [f"127.0.0.1:{server.sockets[0].getsockname()[1]}" for server in servers]
        uplink = Uplink(addresses, secret)
        joined = []
        moved = asyncio.Event()

        def left(reason: str) -> None:
            reasons.append(reason)
            moved.set()
        running = asyncio.create_task(uplink.run(lambda message: None, lambda: joined.append(uplink.channel.peer),
                                                 left, True))
        try:
            await asyncio.wait_for(moved.wait(), 60)
            await _until(lambda: len(joined) == 2)
            return addresses, joined, reasons
        finally:
            for channel in held:
                channel.close()
            _stop(running, uplink, servers)

    (leader, standby), joined, reasons = asyncio.run(main())
    assert joined == [leader, standby], joined
    assert reasons[0].startswith(f"{standby} leads now, while {leader} has been silent"), reasons


async def _until(predicate, timeout: float = 60) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def _stop(running: asyncio.Task, uplink, servers: list) -> None:  # noqa: ANN001 - an Uplink, asyncio servers
    running.cancel()
    if uplink.channel is not None:
        uplink.channel.close()
    for server in servers:
        server.close()


def test_a_relay_serves_only_once_it_has_both_the_config_and_the_view_of_the_replicas():
    """Flow control sends a joining relay its config, then its view of the replicas, in two frames: a relay that
    listened on the config alone would answer a request for a model it serves 404, no pool being known yet (seen on
    a loaded machine, where the two frames came in two reads)."""
    async def run() -> None:
        ledger = m.LedgerSettings(block_tokens=16, safety_factor=1.0, window=30.0)
        configure = m.Configure(token=1, loaded=LOADED, pools=(m.PoolConfig(name="default", loaded=LOADED,
                                                                            ledger=ledger),))
        view = m.PoolView(replicas=(m.ReplicaFacts(url="http://r:8000", healthy=True, refused=None, model="m",
                                                   model_root=None, runtime_version=None, max_model_len=None,
                                                   pool="default", listed=()),), routing=())
        first = Relay(FakeUplink(), 0, "127.0.0.1:0")  # type: ignore[arg-type]
        first.handle(configure)
        assert not first.configured.done()
        first.handle(view)
        assert first.configured.done() and first.pools is not None
        assert [r.url for r in first.pools.flow("default").pool.replicas] == ["http://r:8000"]
        other = Relay(FakeUplink(), 1, "127.0.0.1:0")  # type: ignore[arg-type]
        other.handle(view)  # the other order
        assert not other.configured.done()
        other.handle(configure)
        assert other.configured.done()
    asyncio.run(run())
