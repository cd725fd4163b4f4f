"""Rolling upgrades (#46): a relay asked to stop (SIGTERM) drains: not ready at once, accepting through its grace,
then not accepting, its running streams finishing until the drain deadline and what still runs then cut and
released with flow control; a leader asked to stop hands the lease over and its standby leads at once, long before
the lease would have lapsed, with the streams running through the relays going on to their end."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import httpx
import pytest

from gateway.relays.handshake import SECRET_ENV
from tests.gateway import test_fleet_leadership as leased
from tests.gateway.test_fleet_leadership import TAKEOVER_CONFIG, LeasedFleet, _accepts, state
from tests.gateway.test_fleet_relays import SECRET, Fleet, relays_seen
from tests.gateway.test_gateway_sim import wait_until
from tests.gateway.test_kv_admission_sim import SIM_ARGS, Held, blocks_body, hdr
from tests.support import free_port, poll, wait_http

GRACE, DRAIN = 2.0, 4.0


def _events(fleet, event: str, name: str) -> list[dict]:
    return [json.loads(line) for line in fleet.stack.procs.log(name, tail=None).splitlines()
            if f'"event":"{event}"' in line]


def test_a_relay_asked_to_stop_drains_finishes_what_it_can_and_cuts_the_rest_at_its_deadline(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    fleet = Fleet(stack, [sim])
    observer = fleet.relay("relay-b")
    port = free_port()
    proc = stack.procs.start("gateway", "--role", "relay", "--flow-control", f"127.0.0.1:{fleet.channel_port}",
                             "--port", str(port), "--drain-grace", str(GRACE), "--drain-seconds", str(DRAIN),
                             name="relay-a", env={SECRET_ENV: SECRET})
    relay = f"http://127.0.0.1:{port}"
    wait_http(relay + "/health", proc=proc)
    poll(lambda: httpx.get(relay + "/readyz").status_code == 200, 60, "relay-a to be ready")
    poll(lambda: len(relays_seen(observer)) == 2, 60, "flow control to list both relays", fleet.log)

    async def main() -> tuple[Held, Held, float]:
        async with httpx.AsyncClient(base_url=relay, timeout=120) as client:
            # 40 tokens at 30 ms end well inside the drain; 2,000 would take a minute: cut at the deadline.
            short = Held(client, blocks_body(4, 40), hdr("standard"))
            long = Held(client, blocks_body(130, 2000), hdr("standard"))
            await wait_until(lambda: short.chunks and long.chunks, 60)
            asked = time.time()
            proc.send_signal(signal.SIGTERM)
            answer = await wait_until(lambda: (r := httpx.get(relay + "/readyz")).status_code == 503
                                      and r.json(), 30, what=lambda: stack.procs.log("relay-a"))
            assert answer["status"] == "draining" and answer["drain_deadline"] >= asked + GRACE + DRAIN - 1
            seen = await wait_until(lambda: [r for r in relays_seen(observer) if r["draining"]], 30)
            assert seen[0]["listen"] == f"127.0.0.1:{port}" and seen[0]["drain_deadline"] == answer["drain_deadline"]
            exposition = httpx.get(observer + "/metrics", timeout=10).text
            assert f'holdback_gateway_relay_drain_deadline_seconds{{relay="{socket.gethostname()}/{proc.pid}"}}' \
                in exposition, [x for x in exposition.splitlines() if "drain" in x]
            await asyncio.wait_for(asyncio.gather(short.task, long.task, return_exceptions=True), 60)
            return short, long, asked

    short, long, _asked = asyncio.run(main())
    assert short.status == 200 and short.text.rstrip().endswith("data: [DONE]"), short.text[-300:]
    # The long stream was cut: its connection closed before the end of the answer (the worker retries such a row).
    assert long.status == 200 and "data: [DONE]" not in long.text and isinstance(long.task.exception(), httpx.HTTPError)
    assert proc.wait(30) == 0
    [draining] = _events(fleet, "draining", "relay-a")
    assert draining["grace_seconds"] == GRACE and _events(fleet, "drain_stopped_accepting", "relay-a")
    [drained] = _events(fleet, "drained", "relay-a")
    assert drained["cut"] == 1 and drained["seconds"] >= GRACE + DRAIN - 0.1
    assert not _accepts(port)
    # Flow control released what the cut stream held: nothing in flight, nothing reserved.
    poll(lambda: (s := httpx.get(observer + "/admin/state").json())["in_flight"] == 0
         and s["kv"]["replicas"][sim]["reserved_blocks"] == 0, 30, "the cut stream to be released", fleet.log)
    assert [r["listen"] for r in relays_seen(observer)] == [observer.removeprefix("http://")]


@pytest.fixture
def long_lease(stack, monkeypatch):
    # A lease of 30 s: a standby that only waited for it to lapse, or tried it every third of a lease (10 s), would
    # take far longer than the hand-over allows.
    monkeypatch.setattr(leased, "LEASE_SECONDS", "30")
    [sim] = stack.sim(1, *SIM_ARGS, "--max-num-seqs", "3")
    fleet = LeasedFleet(stack, [sim], TAKEOVER_CONFIG)
    yield fleet
    fleet.close()


def test_a_leader_asked_to_stop_hands_the_lease_over_and_the_standby_leads_at_once(long_lease, stack):
    fleet = long_lease
    first = fleet.flow_control("flow-a")
    poll(fleet.leader, 60, "flow-a to take the lease", lambda: stack.procs.log("flow-a"))
    fleet.flow_control("flow-b")
    poll(lambda: fleet.events("lease_watched", "flow-b"), 60, "flow-b to watch the lease",
         lambda: stack.procs.log("flow-b"))
    relay = fleet.relay("relay", ["flow-a", "flow-b"])
    poll(lambda: httpx.get(relay + "/readyz").status_code == 200, 60, "the relay to be ready",
         lambda: stack.procs.log("relay"))
    _, token = fleet.leader()

    async def main() -> float:
        async with httpx.AsyncClient(base_url=relay, timeout=120) as client:
            held = [Held(client, blocks_body(80, 600), hdr("standard")) for _ in range(2)]
            await wait_until(lambda: all(h.chunks for h in held), 60)
            asked = time.monotonic()
            first.send_signal(signal.SIGTERM)
            await wait_until(lambda: (lead := fleet.leader()) and lead[1] > token, 30,
                             what=lambda: stack.procs.log("flow-b"))
            took = time.monotonic() - asked
            assert fleet.leader()[0] == fleet.procs["flow-b"].pid
            assert not any(h.task.done() for h in held)
            await asyncio.wait_for(asyncio.gather(*(h.task for h in held)), 120)
            for h in held:  # neither stream was cut
                assert h.status == 200 and h.text.rstrip().endswith("data: [DONE]"), h.text[-300:]
            return took

    took = asyncio.run(main())
    assert took < 3.0, f"the standby took {took:.1f}s to lead after the leader's SIGTERM (lease: 30 s)"
    assert first.wait(30) == 0
    [handed] = fleet.events("leadership_handed_over", "flow-a")
    assert handed["given_back"] is True
    taken = [e for e in fleet.events("leadership_taken", "flow-b") if e["token"] > token]
    assert taken and taken[0]["handed_over_by"] and str(first.pid) in taken[0]["handed_over_by"]
    leadership = state(relay)["leadership"]
    assert leadership["leading"] and leadership["handover"]["token"] == token
    assert str(first.pid) in leadership["handover"]["holder"]
