"""What a leading flow control says about itself (gateway/relays/takeover.py): on /admin/state's `leadership` and
in /metrics, its relays and the requests they hold, and the last takeover (lease taken -> new requests dispatched
again), against the real Redis at 127.0.0.1:6379 (a lease of its own)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest
from redis import asyncio as aioredis

from gateway.relays import messages as m
from gateway.relays.leadership import Leadership
from gateway.relays.takeover import Takeover

REDIS = "redis://127.0.0.1:6379/0"
WINDOW = 0.3


def _link(link_id: int, host: str, pid: int, held: int) -> SimpleNamespace:
    return SimpleNamespace(link_id=link_id, index=None, channel=SimpleNamespace(peer=f"10.0.0.{link_id}:5000"),
                           hello=SimpleNamespace(host=host, pid=pid), requests=dict.fromkeys(range(held)),
                           pools=SimpleNamespace(pools={}))


def test_a_leader_reports_its_relays_their_requests_and_how_long_its_takeover_took():
    async def run() -> tuple[dict, dict, dict, str]:
        redis = aioredis.from_url(REDIS)
        lease = Leadership(redis, f"test-{uuid.uuid4().hex}", ttl=30, holder="fc-b")
        registry = CollectorRegistry()
        server = SimpleNamespace(links={}, gateway=SimpleNamespace(metrics=SimpleNamespace(registry=registry)))
        takeover = Takeover(server, lease, WINDOW)  # type: ignore[arg-type]
        try:
            before = takeover.state()
            await redis.set(lease.token_key, 4)  # four terms led before this one: taking the lease is a takeover
            began = time.time()
            assert await lease.acquire()
            await asyncio.sleep(0)  # the leadership change is told on the loop's next turn
            assert takeover.holds_back()
            # Two relays find the new leader and re-register what they hold (nothing running here).
            server.links = {1: _link(1, "relay-a", 11, held=3), 2: _link(2, "relay-b", 12, held=1)}
            for link in server.links.values():
                takeover.adopt(link, m.Holding(requests=()))
            during = takeover.state()
            # Wait for the takeover to end (its window's timer ran), not for holds_back() to turn false: that is
            # read off the clock and turns false a hair before the timer that ends the takeover runs.
            async with asyncio.timeout(30):
                while takeover.last is None or takeover.last["ended_at"] is None:
                    await asyncio.sleep(0.02)
            assert not takeover.holds_back()
            after = takeover.state()
            assert after["last_takeover"]["began_at"] >= began
            return before, during, after, generate_latest(registry).decode()
        finally:
            await redis.delete(lease.key, lease.token_key)
            await redis.aclose()

    before, during, after, exposition = asyncio.run(run())
    assert before["leading"] is False and before["relays"] == 0 and before["last_takeover"] is None
    assert during["leading"] and during["token"] == 5 and during["relays"] == 2 and during["relay_requests"] == 4
    assert during["last_takeover"]["ended_at"] is None and during["last_takeover"]["seconds"] is None
    last = after["last_takeover"]
    assert last["token"] == 5 and last["relays"] == 2 and last["adopted"] == 0 and last["submitted"] == 0
    assert WINDOW <= last["seconds"] < WINDOW + 10
    assert last["ended_at"] - last["began_at"] >= WINDOW - 0.01
    lines = exposition.splitlines()
    assert f"holdback_gateway_flow_control_last_takeover_seconds {last['seconds']}" in lines, exposition
    assert 'holdback_gateway_flow_control_relay_requests{relay="relay-a/11"} 3.0' in lines
    assert 'holdback_gateway_flow_control_relay_requests{relay="relay-b/12"} 1.0' in lines


def test_a_new_leader_ends_its_hold_back_as_soon_as_every_relay_on_the_last_leaders_roster_re_registered():
    # The old leader wrote its roster (the relays it served) at its renewal; it dies, its lease lapses, and the
    # successor holds new requests back only until both relays on the roster re-registered, not for its window.
    async def run() -> tuple[dict, list[str]]:
        redis = aioredis.from_url(REDIS)
        name = f"test-{uuid.uuid4().hex}"
        old, new = (Leadership(redis, name, ttl=30, holder=holder) for holder in ("fc-a", "fc-b"))
        servers = [SimpleNamespace(links={}, gateway=SimpleNamespace(metrics=SimpleNamespace(
            registry=CollectorRegistry()))) for _ in range(2)]
        takeovers = [Takeover(server, lease, 60) for server, lease in zip(servers, (old, new))]  # type: ignore
        try:
            assert await old.acquire()
            local = _link(3, "fc-a-host", 13, held=0)
            local.index = 0  # a relay of the old leader's `--workers N`: it stops with it, nobody waits for it
            servers[0].links = {1: _link(1, "relay-a", 11, held=0), 2: _link(2, "relay-b", 12, held=0), 3: local}
            assert await old.renew()
            roster = takeovers[0].roster()
            await redis.delete(old.key)  # the old leader died and its lease lapsed
            assert await new.acquire()
            await asyncio.sleep(0)  # the leadership change is told on the loop's next turn
            takeover = takeovers[1]
            assert takeover.holds_back() and takeover.awaited == {"relay-a/11", "relay-b/12"}
            servers[1].links = {1: _link(1, "relay-a", 11, held=0)}
            takeover.adopt(servers[1].links[1], m.Holding(requests=()))
            # One relay back; the other may still come: still held back, and still on this leader's roster.
            assert takeover.holds_back() and takeover.roster() == ["relay-a/11", "relay-b/12"]
            servers[1].links[2] = _link(2, "relay-b", 12, held=0)
            takeover.adopt(servers[1].links[2], m.Holding(requests=()))
            assert not takeover.holds_back()
            return dict(takeover.last or {}), roster
        finally:
            await redis.delete(old.key, old.token_key, old.roster_key)
            await redis.aclose()

    last, roster = asyncio.run(run())
    assert roster == ["relay-a/11", "relay-b/12"]
    assert last["ended_by"] == "relays" and last["awaited"] == 2 and last["relays"] == 2 and last["seconds"] < 5


def test_a_relay_that_joins_is_on_the_leaders_roster_at_once_not_at_the_next_renewal():
    # A leader that dies within a third of a lease of a relay joining: its successor must wait for that relay too.
    async def run() -> dict:
        redis = aioredis.from_url(REDIS)
        lease = Leadership(redis, f"test-{uuid.uuid4().hex}", ttl=30, holder="fc-a")  # next renewal in 10 s
        server = SimpleNamespace(links={}, gateway=SimpleNamespace(metrics=SimpleNamespace(
            registry=CollectorRegistry())))
        takeover = Takeover(server, lease, WINDOW)  # type: ignore[arg-type]
        try:
            assert await lease.acquire()
            for link_id, pid in ((1, 11), (2, 12)):  # two join at once: both end up on it
                server.links[link_id] = link = _link(link_id, "relay-a", pid, held=0)
                takeover.joined(link)
            async with asyncio.timeout(5):
                while True:
                    raw = await redis.get(lease.roster_key)
                    if raw is not None and len(json.loads(raw)["relays"]) == 2:
                        return json.loads(raw)
                    await asyncio.sleep(0.02)
        finally:
            await redis.delete(lease.key, lease.token_key, lease.roster_key)
            await redis.aclose()

    assert asyncio.run(run()) == {"token": 1, "relays": ["relay-a/11", "relay-a/12"]}
