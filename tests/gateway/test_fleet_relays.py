"""Relays on their own (`holdback gateway --role relay`) over TCP to flow control on its own (`--role
flow-control`): real processes on loopback, the simulator as replica. A peer without the secret, one that goes
silent and one whose frame fails its MAC are cut off with a logged reason while the relays serve on; a relay whose
flow control is gone finishes its streams, says it is not ready, keeps new requests waiting until their deadline
(then 503) and connects again, and what still waits is answered by the flow control it joins."""

from __future__ import annotations

import asyncio
import json
import secrets
from concurrent.futures import ThreadPoolExecutor

import httpx

from gateway.relays import messages as m
from gateway.relays.handshake import SECRET_ENV, PeerRefused, handshake
from tests.gateway.test_kv_admission_sim import BASE, SIM_ARGS, hdr
from tests.support import free_port, poll, wait_http

SECRET = secrets.token_hex(32)
# The real ends beat every 5 s, so one is cut off only after 15 s of silence: on a loaded two-core machine a process
# can go seconds without the CPU. The rogue peers below announce heartbeats of their own.
CONFIG = BASE + "flowControl:\n  heartbeatSeconds: 5\n"


class Fleet:
    """One flow control and its relays, started through the stack's Processes (so they die with the test)."""

    def __init__(self, stack, replicas: list[str], config: str = CONFIG):
        self.stack = stack
        self.replicas = replicas
        self.config = stack.tmp / "flow.yaml"
        self.config.write_text(config)
        self.channel_port = free_port()
        self.flow = self.start_flow_control()

    def start_flow_control(self):
        return self.stack.procs.start(
            "gateway", "--role", "flow-control", "--relays-listen", f"127.0.0.1:{self.channel_port}",
            "--config", str(self.config), "--replicas", ",".join(self.replicas), name="flow", env={SECRET_ENV: SECRET})

    def relay(self, name: str) -> str:
        port = free_port()
        proc = self.stack.procs.start("gateway", "--role", "relay", "--flow-control",
                                      f"127.0.0.1:{self.channel_port}", "--port", str(port), name=name,
                                      env={SECRET_ENV: SECRET})
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc=proc)
        return url

    def log(self, name: str = "flow") -> str:
        return self.stack.procs.log(name, tail=None)

    def events(self, event: str, name: str = "flow") -> list[dict]:
        return [json.loads(line) for line in self.log(name).splitlines() if f'"event":"{event}"' in line]


def relays_seen(relay: str) -> list[dict]:
    return httpx.get(relay + "/admin/state", timeout=10).json()["relays"]["running"]


def stream(relay: str, tokens: int = 8) -> list[str]:
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": tokens, "stream": True}
    with httpx.stream("POST", relay + "/v1/completions", json=body, headers=hdr("standard"), timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line.startswith("data: ")]


async def _greet(port: int, secret: bytes, heartbeat: float = 1.0):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return reader, writer, await handshake(reader, writer, secret, "relay", heartbeat)


def test_two_relays_on_tcp_serve_streams_and_flow_control_cuts_off_bad_peers(stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    fleet = Fleet(stack, [sim])
    relays = [fleet.relay("relay-a"), fleet.relay("relay-b")]
    poll(lambda: len(relays_seen(relays[0])) == 2, 60, "flow control to list both relays", fleet.log)
    listens = {r["listen"] for r in relays_seen(relays[1])}
    assert listens == {url.removeprefix("http://") for url in relays}
    for relay in relays:
        chunks = stream(relay)
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 2

    async def bad_peers() -> None:
        # Another secret: refused at the handshake, on both ends, with the reason.
        try:
            await _greet(fleet.channel_port, b"w" * 32)
            raise AssertionError("a peer with another secret passed the handshake")
        except PeerRefused as exc:
            assert "does not hold" in exc.reason
        # The right secret, then a frame sealed wrong (the MAC of another connection's frame 0): refused.
        reader, writer, _session = await _greet(fleet.channel_port, SECRET.encode())
        _r2, _w2, other = await _greet(fleet.channel_port, SECRET.encode())
        writer.write(other.seal.seal(m.dump(m.Hello(pid=1, index=None, host="rogue", listen="nowhere"))))
        async with asyncio.timeout(30):
            await reader.read()  # flow control closed it
        _w2.close()
        # The right secret, then silence: closed after three of its (0.2s) heartbeats. Timed from before the
        # handshake: flow control counts silence from its own end of the handshake, which may come before this
        # end's (a run under a CPU burner measured 0.594 s from after it).
        started = asyncio.get_running_loop().time()
        reader, writer, _session = await _greet(fleet.channel_port, SECRET.encode(), heartbeat=0.2)
        async with asyncio.timeout(30):
            await reader.read()
        assert asyncio.get_running_loop().time() - started >= 0.6

    asyncio.run(bad_peers())
    refused = fleet.events("channel_peer_refused")
    assert any("does not hold this channel's secret" in e["reason"] and e["peer"].startswith("127.0.0.1:")
               for e in refused), refused
    assert any("fails its MAC" in e["reason"] for e in refused), refused
    [silent] = fleet.events("channel_peer_silent")
    assert "3 of its heartbeats of 0.2s" in silent["reason"]
    # The relays were not touched: both listed, both serve.
    assert len(relays_seen(relays[0])) == 2
    for relay in relays:
        assert stream(relay)[-1] == "data: [DONE]"
    assert not fleet.events("flow_control_lost", "relay")


def test_a_relay_without_flow_control_finishes_its_stream_keeps_requests_until_their_deadline_and_connects_again(
        stack):
    [sim] = stack.sim(1, *SIM_ARGS)
    fleet = Fleet(stack, [sim])
    relay = fleet.relay("relay-a")
    poll(lambda: httpx.get(relay + "/readyz").status_code == 200, 60, "the relay to be ready")
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", relay + "/v1/completions", json=body, headers=hdr("standard"), timeout=60) as running:
        lines = running.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        stack.procs.stop(fleet.flow)  # flow control goes away mid-stream
        poll(lambda: httpx.get(relay + "/readyz").status_code == 503, 30, "the relay to be unready",
             lambda: fleet.log("relay"))
        # A request that may wait 1 s waits that long for a flow control, then is answered as before.
        refused = httpx.post(relay + "/v1/completions", json={**body, "stream": False},
                             headers={**hdr("standard"), "x-holdback-ttl": "1"}, timeout=30)
        assert refused.status_code == 503 and "cannot reach the gateway's flow control" in refused.text
        assert refused.json()["error"]["message"] and refused.elapsed.total_seconds() >= 0.9
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and len(rest) > 100  # the stream ran to its end
    assert fleet.events("flow_control_lost", "relay-a")
    # One that may wait the config's 60 s is answered by the flow control that comes back.
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(httpx.post, relay + "/v1/completions", json={**body, "stream": False, "max_tokens": 8},
                              headers={**hdr("standard"), "x-request-id": "waits"}, timeout=120)
        poll(lambda: any(e["request_id"] == "waits" for e in fleet.events("request_waiting_for_flow_control",
                                                                            "relay-a")), 30, "the request to wait",
             lambda: fleet.log("relay-a"))
        fleet.flow = fleet.start_flow_control()
        assert waiting.result(timeout=120).status_code == 200
    poll(lambda: httpx.get(relay + "/readyz").status_code == 200, 60, "the relay to connect again",
         lambda: fleet.log("relay-a"))
    assert stream(relay)[-1] == "data: [DONE]"
    assert len(relays_seen(relay)) == 1
