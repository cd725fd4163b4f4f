"""`holdback gateway --workers 2` when a relay dies: flow control releases what it held, and a new relay serves.

The gateway, its two relays and the simulator are real processes; a relay is killed with SIGKILL while it
relays streams, so nothing in it gets to clean up: the flow-control process sees its channel close.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from gateway.relays import messages as m
from gateway.relays.handshake import MAX_SEALED_FRAME, SECRET_ENV, handshake
from tests.gateway.conftest import sim_state
from tests.gateway.test_gateway_sim import wait_until
from tests.gateway.test_kv_admission_sim import BASE, SIM_ARGS, Held, blocks_body, hdr, kv

STREAMS = 4
BLOCKS = 150  # each stream's reservation (2,000 tokens of output: a minute at 30 ms a step)


def relays(gw) -> dict:
    return gw.state()["relays"]


@pytest.mark.parametrize("gateway_workers", [2], indirect=True)
def test_a_relay_killed_mid_stream_leaves_no_reservation_and_is_replaced(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE)

    async def main():
        # One connection per stream, so the two relays share them (whichever accepts first takes each).
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=gw.url, timeout=60, limits=limits) as client:
            await wait_until(lambda: kv(gw, sim)["total_blocks"] == 1000)
            await wait_until(lambda: len(relays(gw)["running"]) == 2)
            held = [Held(client, blocks_body(BLOCKS, 2000), hdr("standard")) for _ in range(STREAMS)]
            await wait_until(lambda: all(h.chunks for h in held))
            assert kv(gw, sim)["reserved_blocks"] == STREAMS * BLOCKS
            before = relays(gw)
            busy = next(r for r in before["running"] if r["requests"])
            os.kill(busy["pid"], signal.SIGKILL)
            # Its streams break at the caller; the others go on.
            await wait_until(lambda: sum(h.task.done() for h in held) == busy["requests"])
            cut = [h for h in held if h.task.done()]
            alive = [h for h in held if not h.task.done()]
            assert all(isinstance(h.task.exception(), httpx.HTTPError) for h in cut)
            # Flow control released what the dead relay held: no reservation, no in-flight request left.
            await wait_until(lambda: gw.state()["in_flight"] == len(alive))
            await wait_until(lambda: kv(gw, sim)["reserved_blocks"] == len(alive) * BLOCKS)
            await wait_until(lambda: sum(r["requests"] for r in relays(gw)["running"]) == len(alive))
            await wait_until(lambda: sim_state(sim)["running"] == len(alive))  # the replica aborted them too
            # A new relay took its place.
            await wait_until(lambda: (r := relays(gw))["restarts"] == 1 and len(r["running"]) == 2)
            assert busy["pid"] not in {r["pid"] for r in relays(gw)["running"]}
            for h in alive:
                await h.close()
            await wait_until(lambda: gw.state()["in_flight"] == 0 and kv(gw, sim)["reserved_blocks"] == 0)
            # Kill the other original relay too: only relays started after the first kill are left, and they serve.
            survivor = next(r["pid"] for r in relays(gw)["running"] if r["pid"] in
                            {p["pid"] for p in before["running"]})
            os.kill(survivor, signal.SIGKILL)
            await wait_until(lambda: (r := relays(gw))["restarts"] == 2 and len(r["running"]) == 2)
            originals = {r["pid"] for r in before["running"]}
            assert not originals & {r["pid"] for r in relays(gw)["running"]}
            for _ in range(4):
                r = await client.post("/v1/completions", json=blocks_body(2, 8, stream=False),
                                      headers=hdr("standard"))
                assert r.status_code == 200, r.text
            state = gw.state()
            assert state["in_flight"] == 0 and kv(gw, sim)["reserved_blocks"] == 0
            assert state["totals"]["dispatched"] == STREAMS + 4

    asyncio.run(main())


@pytest.mark.parametrize("gateway_workers", [2], indirect=True)
def test_a_peer_sending_malformed_frames_is_refused_and_the_gateway_serves_on(stack):
    """A process that holds the run's secret (handed to the relays in their environment, never on their command
    line), passes the handshake and then sends what is not a message (bad JSON, an unknown kind, a wrong type, then
    a frame longer than the limit) is logged and cut off; flow control and its relays go on serving."""
    [sim] = stack.sim(1, *SIM_ARGS)
    gw = stack.gateway([sim], BASE)
    wait = lambda predicate: asyncio.run(wait_until(predicate))  # noqa: E731
    wait(lambda: len(relays(gw)["running"]) == 2)
    relay_pid = relays(gw)["running"][0]["pid"]
    with open(f"/proc/{relay_pid}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    with open(f"/proc/{relay_pid}/environ", "rb") as f:
        environ = dict(entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry)
    secret = environ[SECRET_ENV.encode()]
    assert len(secret) >= 32 and not any(secret in arg for arg in argv)
    channel_path = argv[argv.index(b"--channel") + 1].decode()

    async def rogue() -> bytes:
        reader, writer = await asyncio.open_unix_connection(channel_path)
        session = await handshake(reader, writer, secret, "relay", 1.0)
        for body in (b"{not json", b'[2, {"kind": "shutdown"}]', b'[2, {"kind": "hello", "pid": "x", "index": 9}]'):
            writer.write(session.seal.seal(body))
        writer.write(m.LENGTH.pack(MAX_SEALED_FRAME + 1))
        await wait_until(lambda: gw.log().count("channel_frame_refused") >= 4)
        async with asyncio.timeout(30):
            return await reader.read()  # until flow control closes the channel (heartbeats may come first)

    asyncio.run(rogue())
    answer = httpx.post(gw.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 4},
                        headers=hdr("standard"), timeout=60)
    assert answer.status_code == 200, answer.text
    state = relays(gw)
    assert state["restarts"] == 0 and len(state["running"]) == 2
