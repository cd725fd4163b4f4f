"""Flow controls that elect a leader through Redis (`--lease-redis`): a standby turns relays away, a relay given
every address finds the leader, every decision carries the leader's fencing token and a relay refuses an older one;
when the leader is killed the standby takes over with a higher token and the relay serves again through it, and
requests that reached the relay meanwhile waited there and are answered."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import time
import uuid

import httpx
import pytest
import redis

from gateway.relays import messages as m
from gateway.relays.handshake import SECRET_ENV
from gateway.relays.leadership import PREFIX
from gateway.relays.relay import Relay
from gateway.settings import load_config
from tests.gateway.conftest import sim_state
from tests.gateway.test_fleet_relays import CONFIG, SECRET
from tests.gateway.test_gateway_sim import wait_until
from tests.gateway.test_kv_admission_sim import BASE, SIM_ARGS, Held, blocks_body, hdr
from tests.support import free_port, poll, wait_http

REDIS = "redis://127.0.0.1:6379/0"
LEASE_SECONDS = "3"


class LeasedFleet:
    """Two flow controls contending for one lease, and relays listing both (the test's Processes stop them)."""

    def __init__(self, stack, replicas: list[str], config: str = CONFIG):
        self.stack = stack
        self.replicas = replicas
        self.config = stack.tmp / "flow.yaml"
        self.config.write_text(config)
        self.name = f"test-{uuid.uuid4().hex}"
        self.redis = redis.Redis.from_url(REDIS)
        self.ports: dict[str, int] = {}
        self.procs: dict[str, object] = {}

    def flow_control(self, name: str):
        self.ports[name] = port = free_port()
        self.procs[name] = self.stack.procs.start(
            "gateway", "--role", "flow-control", "--relays-listen", f"127.0.0.1:{port}", "--config",
            str(self.config), "--replicas", ",".join(self.replicas), "--lease-redis", REDIS, "--lease-name",
            self.name, "--lease-seconds", LEASE_SECONDS, name=name, env={SECRET_ENV: SECRET})
        return self.procs[name]

    def leader(self) -> tuple[int, int] | None:
        """(pid, token) of the process holding the lease, from Redis."""
        value = self.redis.get(f"{PREFIX}{self.name}:leader")
        if value is None:
            return None
        holder, token = value.decode().rsplit("#", 1)
        return int(holder.split(":")[-2]), int(token)

    def relay(self, name: str, order: list[str]) -> str:
        port = free_port()
        addresses = ",".join(f"127.0.0.1:{self.ports[n]}" for n in order)
        proc = self.stack.procs.start("gateway", "--role", "relay", "--flow-control", addresses, "--port", str(port),
                                      name=name, env={SECRET_ENV: SECRET})
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc=proc)
        return url

    def events(self, event: str, name: str) -> list[dict]:
        return [json.loads(line) for line in self.stack.procs.log(name, tail=None).splitlines()
                if f'"event":"{event}"' in line]

    def close(self) -> None:
        self.redis.delete(f"{PREFIX}{self.name}:leader", f"{PREFIX}{self.name}:fencing-token")
        self.redis.close()


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def state(relay: str) -> dict | None:
    try:
        answer = httpx.get(relay + "/admin/state")
    except httpx.HTTPError:
        return None
    return answer.json() if answer.status_code == 200 else None


def test_a_relay_refuses_a_decision_with_an_older_fencing_token(caplog):
    class Uplink:
        closed = False

        def set_heartbeat(self, seconds: float) -> None:
            pass

        def send(self, message: m.Message) -> None:
            pass

    async def run() -> Relay:
        relay = Relay(Uplink(), None, "127.0.0.1:0")  # type: ignore[arg-type]
        relay.handle(m.Configure(token=7, loaded=load_config(None), pools=()))
        relay.handle(m.Evict(rid=1, token=6))  # from the leader before: refused
        relay.handle(m.Evict(rid=1, token=7))  # from the leader: applied (no such request here: nothing to do)
        relay.handle(m.Configure(token=5, loaded=load_config(None), pools=()))
        return relay

    with caplog.at_level(logging.ERROR, logger="gateway.relay"):
        relay = asyncio.run(run())
    assert relay.token == 7
    refused = [r.fields for r in caplog.records if r.getMessage() == "decision_refused"]
    assert [(r["kind"], r["token"], r["newest_token"]) for r in refused] == [("evict", 6, 7), ("config", 5, 7)]
    assert "no longer leads" in refused[0]["reason"]


SLOTS = 3
# Heartbeats of 2 s: a relay notices a silent leader within 6 s; the new leader holds new requests back until the
# relays on its predecessor's roster re-registered, 3 x 2 + 5 + 1 = 12 s after taking over at most. 2 streams of
# 1,200 tokens at 30 ms a step outlast the takeover.
TAKEOVER_CONFIG = BASE + f"flowControl:\n  heartbeatSeconds: 2\nengine:\n  maxNumSeqs: {SLOTS}\n"
STREAMS = 2
BLOCKS, TOKENS = 80, 1200


@pytest.fixture
def fleet(stack):
    [sim] = stack.sim(1, *SIM_ARGS, "--max-num-seqs", str(SLOTS))
    fleet = LeasedFleet(stack, [sim], TAKEOVER_CONFIG)
    yield fleet
    fleet.close()


def test_a_killed_leaders_streams_run_on_and_are_re_registered_with_the_standby_that_takes_over(fleet, stack):
    sim = fleet.replicas[0]
    first = fleet.flow_control("flow-a")
    poll(fleet.leader, 60, "flow-a to take the lease", lambda: stack.procs.log("flow-a"))
    assert fleet.leader()[0] == first.pid
    fleet.flow_control("flow-b")
    poll(lambda: _accepts(fleet.ports["flow-b"]), 60, "flow-b to listen for relays", lambda: stack.procs.log("flow-b"))
    # The standby is listed first: the relay is turned away there and serves through the leader.
    relay = fleet.relay("relay", ["flow-b", "flow-a"])
    poll(lambda: httpx.get(relay + "/readyz").status_code == 200, 60, "the relay to be ready",
         lambda: stack.procs.log("relay"))
    standby = fleet.events("flow_control_standby", "relay")
    assert standby and standby[0]["peer"] == f"127.0.0.1:{fleet.ports['flow-b']}"
    assert "not the leader" in standby[0]["reason"]
    _, token = fleet.leader()
    leading = state(relay)["leadership"]
    assert leading["leading"] and leading["token"] == token and str(first.pid) in leading["holder"]

    async def main() -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=relay, timeout=120, limits=limits) as client:
            held = [Held(client, blocks_body(BLOCKS, TOKENS), hdr("standard")) for _ in range(STREAMS)]
            await wait_until(lambda: all(h.chunks for h in held), 60)
            assert state(relay)["in_flight"] == STREAMS

            first.send_signal(signal.SIGKILL)  # the leader dies: its lease lapses, the standby takes it
            await wait_until(lambda: (lead := fleet.leader()) and lead[1] > token, 60,
                             what=lambda: stack.procs.log("flow-b"))
            assert fleet.leader()[0] == fleet.procs["flow-b"].pid
            # The relay finds the new leader and re-registers its running streams before anything new is
            # dispatched: in flight on the replica and reserved in the KV ledger, nothing dispatched by it yet.
            taken = await wait_until(lambda: (s := state(relay)) and s["leadership"]["token"] > token and s, 60,
                                     what=lambda: stack.procs.log("relay"))
            assert taken["leadership"]["adopted"] == STREAMS and taken["in_flight"] == STREAMS
            assert taken["totals"]["dispatched"] == 0
            assert taken["kv"]["replicas"][sim]["reserved_blocks"] >= STREAMS * BLOCKS // 2
            assert not any(h.task.done() for h in held)
            exposition = httpx.get(relay + "/metrics", timeout=10).text.splitlines()
            new_token = taken["leadership"]["token"]
            for line in ("holdback_gateway_flow_control_leader 1.0", "holdback_gateway_flow_control_relays 1.0",
                         f"holdback_gateway_flow_control_fencing_token {float(new_token)}",
                         f"holdback_gateway_flow_control_adopted_requests {float(STREAMS)}"):
                assert line in exposition, [x for x in exposition if "flow_control_" in x]
            # A new request waits for the takeover, then runs in the slot left: never more than SLOTS on it.
            answer = await client.post("/v1/completions", json=blocks_body(2, 8, stream=False),
                                       headers=hdr("standard"))
            assert answer.status_code == 200, answer.text
            after = state(relay)
            assert after["totals"]["dispatched"] == 1 and after["in_flight"] == STREAMS
            assert sim_state(sim)["running"] <= SLOTS
            await asyncio.wait_for(asyncio.gather(*(h.task for h in held)), 120)
            for h in held:  # every stream ran to its end: none cut
                lines = [line for line in h.text.splitlines() if line.startswith("data: ")]
                assert h.status == 200 and lines[-1] == "data: [DONE]" and len(lines) > TOKENS // 2, h.text[-300:]
            # Their ends reached the new leader: nothing left in flight or reserved.
            await wait_until(lambda: (s := state(relay))["in_flight"] == 0
                             and s["kv"]["replicas"][sim]["reserved_blocks"] == 0, 30)

    asyncio.run(main())
    [registered] = fleet.events("relay_reregistered", "flow-b")
    assert registered["running"] == STREAMS and registered["token"] > token
    assert fleet.events("takeover_done", "flow-b")


WAITING = 3


def _ready(relay: str) -> int:
    return httpx.get(relay + "/readyz").status_code


def test_requests_sent_while_no_leader_leads_wait_at_the_relay_and_are_answered_once_the_standby_leads(fleet, stack):
    # While the standby is held stopped (so that it cannot lead yet), realtime requests sent to the relay wait there,
    # the relay reporting not ready; once the standby leads, the relay reports them in `Holding`, the new leader
    # submits them after its takeover hold-back, and every one is answered 200.
    first = fleet.flow_control("flow-a")
    poll(fleet.leader, 60, "flow-a to take the lease", lambda: stack.procs.log("flow-a"))
    standby = fleet.flow_control("flow-b")
    relay = fleet.relay("relay", ["flow-a", "flow-b"])
    poll(lambda: _ready(relay) == 200, 60, "the relay to be ready", lambda: stack.procs.log("relay"))
    _, token = fleet.leader()
    ids = [f"waiting-{i}" for i in range(WAITING)]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=relay, timeout=180) as client:
            # The standby cannot take the lease while it is stopped: the requests below reach the relay with no
            # leader anywhere, whatever the machine's load.
            standby.send_signal(signal.SIGSTOP)
            try:
                first.send_signal(signal.SIGKILL)
                await wait_until(lambda: _ready(relay) == 503, 60, what=lambda: stack.procs.log("relay"))
                sent = [asyncio.create_task(client.post(
                    "/v1/completions", json=blocks_body(2, 8, stream=False),
                    headers={**hdr("realtime"), "x-request-id": rid})) for rid in ids]
                waiting = await wait_until(
                    lambda: {e["request_id"] for e in fleet.events("request_waiting_for_flow_control", "relay")}
                    >= set(ids), 60, what=lambda: stack.procs.log("relay"))
                assert waiting and not any(task.done() for task in sent)
                assert _ready(relay) == 503  # the load balancer keeps sending new clients elsewhere
                lead = fleet.leader()
                assert lead is None or lead[1] == token  # nobody took over yet
            finally:
                standby.send_signal(signal.SIGCONT)
            await wait_until(lambda: (lead := fleet.leader()) and lead[1] > token, 60,
                             what=lambda: stack.procs.log("flow-b"))
            answers = await asyncio.wait_for(asyncio.gather(*sent), 150)
            for answer in answers:
                assert answer.status_code == 200, answer.text
            await wait_until(lambda: _ready(relay) == 200, 60, what=lambda: stack.procs.log("relay"))
            taken = state(relay)
            assert taken["leadership"]["token"] > token and taken["totals"]["dispatched"] == WAITING

    asyncio.run(main())
    lost = fleet.events("flow_control_lost", "relay")
    assert lost and lost[0]["waiting"] == 0
    # The new leader learned each waiting request once, from the relay's `Holding`, and dispatched each once.
    registered = fleet.events("relay_reregistered", "flow-b")
    assert [r["waiting"] for r in registered] == [WAITING]
    assert fleet.events("takeover_done", "flow-b")


def test_after_a_leader_is_killed_the_standby_dispatches_as_soon_as_both_relays_on_its_roster_re_registered(
        fleet, stack):
    # The leader keeps its relays on a roster in Redis; killed, its successor reads it with the lease and holds new
    # requests back only until both relays re-registered (each finds it within a quarter second of its leading),
    # not for its whole window (3 heartbeats of 2 s + 5 s + 1 s = 12 s here).
    first = fleet.flow_control("flow-a")
    poll(fleet.leader, 60, "flow-a to take the lease", lambda: stack.procs.log("flow-a"))
    fleet.flow_control("flow-b")
    poll(lambda: _accepts(fleet.ports["flow-b"]), 60, "flow-b to listen for relays", lambda: stack.procs.log("flow-b"))
    relays = [fleet.relay(f"relay-{i}", ["flow-a", "flow-b"]) for i in range(2)]
    for relay in relays:
        poll(lambda: _ready(relay) == 200, 60, "the relays to be ready", lambda: stack.procs.log("flow-a"))
    _, token = fleet.leader()
    roster = f"{PREFIX}{fleet.name}:leader:relays"
    poll(lambda: (raw := fleet.redis.get(roster)) and len(json.loads(raw)["relays"]) == 2, 60,
         "the leader's roster to list both relays", lambda: stack.procs.log("flow-a"))

    async def main() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=relays[0], timeout=120) as client:
            first.send_signal(signal.SIGKILL)
            answer = await client.post("/v1/completions", json=blocks_body(2, 8, stream=False),
                                       headers=hdr("realtime"))
            return answer, time.time()

    answer, answered_at = asyncio.run(main())
    assert answer.status_code == 200, answer.text
    lead = state(relays[0])["leadership"]
    assert lead["token"] > token and lead["leading"]
    last = lead["last_takeover"]
    assert last["ended_by"] == "relays" and last["awaited"] == 2 and last["relays"] == 2, last
    assert last["seconds"] <= 2.5, last
    assert answered_at - lead["since"] <= 4.0, (answered_at - lead["since"], last)
    [started] = fleet.events("takeover_started", "flow-b")
    assert len(started["roster"]) == 2 and started["roster_token"] == token
