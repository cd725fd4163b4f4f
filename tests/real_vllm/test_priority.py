"""The gateway's priority inside a real vLLM that runs `--scheduling-policy priority` with one engine slot.

Requests the gateway lets wait inside the replica (`engine.queueAllowance`) wait in vLLM's queue: with
`engine.schedulingPolicy: priority` the gateway's `X-Vllm-Priority` puts a realtime request ahead of the batch
requests that were waiting there before it, and with eviction on, the realtime request waiting there evicts
the running batch request, which vLLM aborts, and the batch requests waiting there (vLLM gives the freed slot to
whatever it holds at its next step, and the abort may reach it before the realtime request). The control is the
same replica told nothing (`fcfs`): the realtime request waits behind every batch request queued before it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time

import httpx
import pytest

from tests.real_vllm.conftest import SECOND_CPU, SERVED, VllmServer
from tests.support import in_process_gateway, poll

pytestmark = pytest.mark.e2e

BATCH = 6
ALLOWANCE = f"anonymous: {{enabled: true, objectives: [realtime, batch]}}\nadmission: {{enabled: false}}\n" \
            f"usageLimit: {{policy: static, threshold: 1.0}}\n"


@pytest.fixture(scope="module")
def priority_vllm(tmp_path_factory):
    """One engine slot and vLLM's priority policy: everything past the first request waits in vLLM's queue.

    The server and its engine run on one CPU, leaving the other to this process (the gateway and its clients).
    Unpinned, vLLM's engine-core process polls its worker on the second CPU: this process then went without
    CPU for seconds at a time, and vLLM had worked through its whole queue before the realtime request came."""
    log = tmp_path_factory.mktemp("vllm-priority") / "vllm.log"
    server = VllmServer(log, cpu=SECOND_CPU, args=("--max-num-seqs", "1", "--scheduling-policy", "priority",
                                   "--enable-log-requests", "--enable-log-outputs", "--no-enable-log-deltas",
                                   "--max-log-len", "16")).start()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


async def completion(client: httpx.AsyncClient, url: str, objective: str, max_tokens: int,
                     done: list[tuple[str, float, str]], name: str) -> None:
    """A streamed chat completion; appends (name, when it ended, how: the finish reason, or the error's code:
    `evicted` mid-stream or as a 429 before anything went out)."""
    body = {"model": SERVED, "messages": [{"role": "user", "content": f"{name} please write"}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    how = "none"
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"x-llm-d-inference-objective": objective, "x-request-id": name}) as resp:
        if resp.status_code != 200:
            error = json.loads(await resp.aread()).get("error") or {}
            how = error.get("code") or f"status {resp.status_code}"  # 429 `evicted` while nothing went out
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                how = event["error"].get("code") or "error"
            for choice in event.get("choices", ()):
                how = choice.get("finish_reason") or how
    done.append((name, time.monotonic(), how))


class EngineLog:
    """vLLM's log read as it grows (its /metrics answers late while it streams on a busy machine): one run's
    requests as vLLM added them to its engine and completed their streams, in vLLM's order."""

    EVENT = re.compile(r"(Added request|Generated response) chatcmpl-(\S+?)(?:-[0-9a-f]{8}\.| \(streaming complete\))")

    def __init__(self, server: VllmServer, run: str):
        self.path, self.prefix, self.offset = server.log_path, f"{run}-", 0
        self.events: list[tuple[str, str]] = []  # ("added" | "completed", name)

    def read(self) -> "EngineLog":
        with self.path.open("rb") as log:
            log.seek(self.offset)
            chunk = log.read()
        whole = chunk.rfind(b"\n") + 1  # a line still being written is read next time
        self.offset += whole
        for line in chunk[:whole].decode(errors="replace").splitlines():
            if (m := self.EVENT.search(line)) and m.group(2).startswith(self.prefix):
                self.events.append(("added" if m.group(1) == "Added request" else "completed", m.group(2)))
        return self

    def batch(self, kind: str, events: list[tuple[str, str]] | None = None) -> list[str]:
        return [name for k, name in (self.events if events is None else events) if k == kind and "-batch-" in name]

    def waiting_at(self, at: int | None = None) -> int:
        """Batch requests vLLM had added and not completed (before event `at`), less the one in the one slot."""
        events = self.events[:at]
        return len(self.batch("added", events)) - len(self.batch("completed", events)) - 1


@dataclasses.dataclass
class Run:
    done: list[tuple[str, float, str]]  # each end as this process read it: (name, when, finish reason or code)
    queued: int  # batch requests waiting inside vLLM when vLLM added the realtime one
    before: list[str]  # the batch requests vLLM completed before the realtime one, and after it
    after: list[str]


async def realtime_among_waiting_batch(server: VllmServer, config: str, run: str) -> Run:
    """BATCH long batch requests into the one slot and its queue, then, once one of them answers, a realtime one;
    every count and order is read from vLLM's log."""
    done: list[tuple[str, float, str]] = []
    log = EngineLog(server, run)
    async with in_process_gateway([server.url], config) as (gw, url), httpx.AsyncClient(timeout=120) as client:
        deadline = time.monotonic() + 60
        while not gw.pool.healthy():
            assert time.monotonic() < deadline, "the gateway never identified the replica"
            await asyncio.sleep(0.05)
        batch = [asyncio.create_task(completion(client, url, "batch", 480, done, f"{run}-batch-{i}"))
                 for i in range(BATCH)]
        # Realtime goes the moment the gateway has sent every batch request on (read in this event loop, so
        # no thread or file read stands between the two); how many waited in vLLM is read from vLLM's log.
        deadline = time.monotonic() + 60
        while sum(r.in_flight for r in gw.pool.replicas) < BATCH:
            assert time.monotonic() < deadline, "the gateway never sent the batch requests on"
            await asyncio.sleep(0.005)
        # And one of them runs in the one slot (its answer has begun): a realtime request that reached vLLM
        # before any batch request was scheduled would simply run first, with nothing to show.
        while not any(r.streaming_started for r in gw.controller.eviction.evictor.candidates):
            assert time.monotonic() < deadline, "no batch request began its answer"
            await asyncio.sleep(0.005)
        await completion(client, url, "realtime", 8, done, f"{run}-realtime")
        await asyncio.gather(*batch)
    realtime = f"{run}-realtime"
    poll(lambda: ("completed", realtime) in log.read().events, 30, "vLLM to log the realtime stream's end",
         lambda: f"ends read here: {done}\n{server.log_tail()}")
    added, ended = log.events.index(("added", realtime)), log.events.index(("completed", realtime))
    return Run(done, log.waiting_at(added), log.batch("completed", log.events[:ended]),
               log.batch("completed", log.events[ended:]))


def with_batch_waiting(server: VllmServer, config: str, run: str, caplog=None) -> Run:  # noqa: ANN001
    """A run in which at least three batch requests waited inside vLLM when the realtime one arrived. On a
    loaded machine this process can stall for seconds while vLLM works through its queue, so realtime arrives
    after it emptied: such a run shows nothing about the order, and it is run again (a few times at most)."""
    runs = []
    for attempt in range(4):
        if caplog is not None:
            caplog.clear()
        runs.append(asyncio.run(realtime_among_waiting_batch(server, config, f"{run}{attempt}")))
        if runs[-1].queued >= 3:
            return runs[-1]
    raise AssertionError(f"realtime never arrived while three batch requests waited in vLLM: {runs}")


def test_the_gateways_priority_puts_realtime_ahead_of_batch_waiting_inside_vllm(priority_vllm):
    told = "engine: {schedulingPolicy: priority, maxNumSeqs: 1, queueAllowance: 16}\neviction: {policy: none}\n"
    run = with_batch_waiting(priority_vllm, ALLOWANCE + told, "told")
    assert all(how == "length" for _n, _at, how in run.done), run
    # Ahead of the batch requests that waited there before it (one more may have been scheduled meanwhile).
    assert len(run.after) >= run.queued - 1, run

    control = "engine: {schedulingPolicy: fcfs, maxNumSeqs: 1, queueAllowance: 16}\neviction: {policy: none}\n"
    run = with_batch_waiting(priority_vllm, ALLOWANCE + control, "fcfs")
    # Behind every one that waited before it, and the one running then.
    assert len(run.before) >= run.queued + 1, run


def test_realtime_waiting_inside_vllm_evicts_the_running_batch_request_which_vllm_aborts(priority_vllm, caplog):
    caplog.set_level(logging.INFO, logger="gateway")
    evicting = "engine: {schedulingPolicy: priority, maxNumSeqs: 1, queueAllowance: 16}\n" \
               "eviction: {policy: newest-first}\n"
    run = with_batch_waiting(priority_vllm, ALLOWANCE + evicting, "evict", caplog)
    evictions = [getattr(r, "fields", {}) for r in caplog.records if r.getMessage() == "evict"]
    # The running one for the realtime request, then every batch request still waiting inside vLLM.
    triggers = [e["trigger"] for e in evictions]
    assert triggers[0] == "waiting-in-replica" and set(triggers[1:]) == {"replica-queue"}, evictions
    running = evictions[0]["request_id"]
    evicted = [name for name, _at, how in run.done if how == "evicted"]
    assert len(evicted) == len(evictions) and running in evicted, run
    assert [how for name, _at, how in run.done if name.endswith("-realtime")] == ["length"], run
    assert not run.before, run  # vLLM completed no batch request ahead of it
    poll(lambda: running in priority_vllm.aborted(), 30, "vLLM to log the running request's abort",
         priority_vllm.log_tail)


# A stream waiting in vLLM's queue gets no answer until its turn, however long that is on a busy CPU: no read
# deadline on its client (a 120 s one timed out the last of 32 streams through one slot beside a CPU burner). What
# bounds a run is progress: some stream ends within STALL seconds, or vLLM is stuck.
STALL = 120.0


async def learn_slots(server: VllmServer, requests: int) -> int | None:
    """`requests` long batch requests at once through a gateway told nothing of the engine, so that vLLM's queue
    stays full: the slots the gateway learned from vLLM's metrics (None: none by the time they all ended). Once it
    learned them, the streams still waiting are let go (closed by their callers): the queue has shown what it had
    to."""
    done: list[tuple[str, float, str]] = []
    config = ALLOWANCE + "metrics: {scrapeIntervalSeconds: 0.1}\n"
    async with in_process_gateway([server.url], config) as (gw, url), \
            httpx.AsyncClient(timeout=httpx.Timeout(30, read=None)) as client:
        deadline = time.monotonic() + 60
        while not gw.pool.healthy():
            assert time.monotonic() < deadline, "the gateway never identified the replica"
            await asyncio.sleep(0.05)
        replica = gw.pool.replicas[0]
        assert replica.capacity is None  # maxConcurrency until learned
        pending = {asyncio.create_task(completion(client, url, "batch", 480, done, f"learn-batch-{i}"))
                   for i in range(requests)}
        last_end = time.monotonic()
        while pending and replica.learned_slots is None:
            ended, pending = await asyncio.wait(pending, timeout=0.2)
            for task in ended:
                task.result()
            last_end = time.monotonic() if ended else last_end
            assert time.monotonic() - last_end < STALL, f"no stream ended in {STALL:.0f} s: {done}"
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        assert all(how == "length" for _n, _at, how in done), done
        if replica.learned_slots is not None:
            assert replica.capacity == replica.max_num_seqs == replica.learned_slots
        return replica.learned_slots


def test_the_gateway_learns_the_engines_max_num_seqs_from_its_metrics(priority_vllm):
    """One slot (`--max-num-seqs 1`) and a gateway allowed 48 there: 32 streams of 480 tokens keep vLLM's queue
    full for several seconds, longer than the 2 s of scrapes that must see one running and requests waiting. On a
    loaded machine vLLM's /metrics can answer late while it streams, so a run whose scrapes all came late is run
    again (twice more at most)."""
    for _ in range(3):
        learned = asyncio.run(learn_slots(priority_vllm, 32))
        if learned is not None:
            assert learned == 1
            return
    raise AssertionError("three runs with vLLM's queue full and the slots never learned")
