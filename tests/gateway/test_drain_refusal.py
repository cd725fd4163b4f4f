"""A gateway process at its drain deadline (SIGTERM, then `--drain-seconds`) refuses what still waits in its queue
with 503 `rejected-shutting-down` (a batch worker retries it without spending its budget; a load balancer sends
the retry to another gateway process), and so what runs with no byte of its answer sent; it cuts what still
streams; flow control counts the refusal as such. The
single-process gateway and the relays of `--workers 2` alike."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from holdback.contract import DROP_REASON_HEADER
from tests.gateway.test_gateway_sim import wait_until
from tests.gateway.conftest import sim_state
from tests.gateway.test_kv_admission_sim import Held, blocks_body, hdr

# One slot and no queue inside the replica: a second request waits in the gateway's queue.
CONFIG = "engine: {maxNumSeqs: 1, queueAllowance: 0}\nmetrics: {scrapeIntervalSeconds: 0.1}\n"


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_what_waits_at_the_drain_deadline_is_refused_shutting_down_and_what_runs_is_cut(stack):
    [sim] = stack.sim(1, "--max-num-seqs", "1", "--decode-base-ms", "30")
    gw = stack.gateway([sim], CONFIG, env={"HOLDBACK_GATEWAY_DRAIN_SECONDS": "1"})

    async def main() -> tuple[Held, httpx.Response]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            running = Held(client, blocks_body(130, 2000), hdr("standard"))  # a minute of tokens: still running
            await wait_until(lambda: running.chunks, 60)
            waiting = asyncio.create_task(client.post("/v1/completions", json=blocks_body(4, 40, stream=False),
                                                      headers=hdr("standard")))
            await wait_until(lambda: gw.state()["queued"] == 1, 60, what=gw.state)
            gw.proc.send_signal(signal.SIGTERM)
            answer = await asyncio.wait_for(waiting, 60)
            await asyncio.wait_for(asyncio.gather(running.task, return_exceptions=True), 60)
            return running, answer

    running, answer = asyncio.run(main())
    assert answer.status_code == 503, answer.text
    assert answer.headers[DROP_REASON_HEADER] == "rejected-shutting-down" and answer.headers["Retry-After"] == "1"
    assert "shutting down" in answer.json()["error"]["message"]
    assert "data: [DONE]" not in running.text, "the running stream is cut at the deadline"
    assert gw.proc.wait(30) == 0
    assert '"refused":1' in gw.log(), gw.log()


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_what_runs_at_the_drain_deadline_with_no_byte_of_its_answer_sent_is_refused_not_cut(stack):
    # A request answered whole (not streamed) sends nothing before its end: at the deadline it is refused with the
    # 503 a caller can retry, as what still waits is, not left to a closed connection. (CI once saw the second
    # relay of `--workers 2` dispatch its waiting request into the slot the first relay's cut had just freed, a
    # moment before its own deadline, and the caller got "server disconnected without a response".)
    [sim] = stack.sim(1, "--max-num-seqs", "1", "--decode-base-ms", "30")
    gw = stack.gateway([sim], CONFIG, env={"HOLDBACK_GATEWAY_DRAIN_SECONDS": "1"})

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
            whole = asyncio.create_task(client.post("/v1/completions", json=blocks_body(130, 2000, stream=False),
                                                    headers=hdr("standard")))  # a minute of tokens
            await wait_until(lambda: sim_state(sim)["running"] == 1, 60)  # dispatched, generating
            gw.proc.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(whole, 60)

    answer = asyncio.run(main())
    assert answer.status_code == 503, answer.text
    assert answer.headers[DROP_REASON_HEADER] == "rejected-shutting-down" and answer.headers["Retry-After"] == "1"
    assert gw.proc.wait(30) == 0
    assert '"refused":1' in gw.log() and '"cut":0' in gw.log(), gw.log()
    assert "refused_at_drain_deadline" in gw.log()
