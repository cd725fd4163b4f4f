"""Eviction against real vLLM: realtime arrives at a full pool, the gateway evicts running batch requests,
vLLM aborts them (its own log says so), and each evicted chat resumes through vLLM's real chat template
with `continue_final_message`, so its final text starts with the output the evicted attempt kept.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.real_vllm.stack import REALTIME_KEY, TERMINAL, RealStack, chat
from tests.support import poll

pytestmark = pytest.mark.e2e

# Four slots on the replica; batch may hold half of them; realtime bursts fill the rest and evict.
EVICTION = """
saturation: {detector: concurrency, maxConcurrency: 4}
eviction: {enabled: true, maxPerDecision: 2}
"""


ROWS = 24


def _batch_in_flight(s: RealStack) -> int:
    return sum(b["in_flight"] for b in s.state()["bands"] if b["priority"] < 0)


def _bursts(gateway_url: str, stop: threading.Event, answers: list[int]) -> None:
    # Each realtime answer is long enough to overlap the rest of its burst: the gateway counts a chat's prompt
    # with vLLM's /tokenize, whose latency on a loaded machine spreads a burst's arrivals, and answers of a few
    # tokens (the tiny model streams hundreds a second) were over before the next arrived, so none was ever
    # blocked and nothing evicted. Six at once against two free slots block at least one.
    body = {"model": "tiny", "max_tokens": 200, "ignore_eos": True,
            "messages": [{"role": "user", "content": "realtime question"}]}
    with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {REALTIME_KEY}"}) as client:
        while not stop.is_set():
            threads = [threading.Thread(target=lambda: answers.append(
                client.post(f"{gateway_url}/v1/chat/completions", json=body).status_code)) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stop.wait(0.5)


def test_realtime_evicts_batch_vllm_aborts_it_and_the_chat_resumes_from_its_kept_text(backend, tmp_path, vllm):
    s = RealStack(backend, tmp_path, [vllm.url], gateway_config=EVICTION)
    stop, answers = threading.Event(), []
    traffic = threading.Thread(target=_bursts, args=(s.gateway_url, stop, answers), daemon=True)
    try:
        s.wait_identified()
        # Long outputs (ignore_eos: the random weights would stop early at random) keep batch running.
        def submit() -> str:
            return s.submit([chat(f"long-{i}", f"tell me a long story number {i}", max_tokens=440, ignore_eos=True)
                             for i in range(ROWS)])

        batches = [submit()]
        poll(lambda: _batch_in_flight(s) >= 2, 120, "batch running", s.logs)
        traffic.start()

        # Which victim a burst takes is the scheduler's timing: one that had not streamed yet keeps nothing, and
        # one whose output vLLM had all generated (the tiny model outruns the relay) leaves no abort there, so
        # the bursts go on until an evicted attempt kept output and vLLM aborted an evicted row. On a quiet
        # machine the engine can finish a batch within a few bursts: then another batch gives them running
        # requests to evict.
        def kept_output() -> str | None:
            aborted = vllm.aborted()
            for batch_id in batches:
                evicted = [a for a in s.attempts(batch_id) if a.evicted]
                if any(a.partial_output for a in evicted) and any(a.request_id in aborted for a in evicted):
                    return batch_id
            if s.client.batches.retrieve(batches[-1]).status in TERMINAL:
                batches.append(submit())
            return None

        batch_id = poll(kept_output, 180, "an eviction that kept partial output", s.logs)
        stop.set()
        traffic.join(120)
        for other in batches:
            done = s.wait(other, timeout=400)
            assert done.status == "completed" and done.request_counts.completed == ROWS, done
        batch = s.client.batches.retrieve(batch_id)
        attempts, rows, out = s.attempts(batch_id), {r.id: r for r in s.rows(batch_id)}, s.lines(batch.output_file_id)
    finally:
        stop.set()
        s.close()
    assert answers and set(answers) == {200}, "realtime is never shed"
    evicted = [a for a in attempts if a.evicted]
    assert evicted
    # A victim chosen before its request reached vLLM, or after vLLM had generated all of it (the tiny model
    # outruns the relay), leaves no abort there; the others are aborted inside vLLM, and nothing else is.
    evicted_rows = {a.request_id for a in evicted}
    aborted = poll(lambda: {rid for rid in rows if rid in vllm.aborted()} or None, 30,
                   "vLLM to log an abort of an evicted row", vllm.aborted)
    assert aborted <= evicted_rows, ("vLLM aborted a row the gateway never evicted", aborted - evicted_rows)
    assert any(a.partial_output for a in evicted), "an evicted chat kept its partial output"
    # Each row goes on from its latest cut. A resumed attempt that is refused as resumed (the kept text, with
    # U+FFFD in it, tokenizes longer than the tokens it came from, and the 512 context refuses it) leaves an
    # empty cut, and the row starts again from the caller's body: its answer need not start with what was kept.
    latest = {}
    for a in attempts:  # in number order per row
        if a.partial_output is not None:
            latest[a.request_id] = a
    resumed = [a for a in latest.values() if a.evicted and a.partial_output]
    restarted = [a for a in latest.values() if not a.partial_output and a.outcome == "client_error"]
    assert resumed or restarted, [(a.request_id, a.number, a.outcome, a.evicted) for a in attempts]
    for attempt in resumed:
        row = rows[attempt.request_id]
        text = out[row.custom_id]["response"]["body"]["choices"][0]["message"]["content"]
        final = [a for a in attempts if a.request_id == attempt.request_id and a.outcome == "success"]
        trail = [(a.number, a.outcome, a.evicted, a.tokens_kept, a.output_tokens, (a.partial_output or "")[:30])
                 for a in attempts if a.request_id == attempt.request_id]
        assert len(final) == 1, trail
        if not final[0].tokens_kept:
            # The attempt after the cut restarted from the caller's body, as a resume does when the cut kept no
            # answer text but broken characters, or when it had produced the whole output limit already (the
            # tiny model outruns the relay: the eviction came after the last token, before the finish).
            assert (not attempt.partial_output.rstrip("\ufffd")
                    or attempt.tokens_kept + attempt.output_tokens >= 440), trail
            continue
        assert text.startswith(attempt.partial_output.rstrip("\ufffd")[:40]), (attempt.partial_output[:80], text[:80],
                                                                                trail)
        body = out[row.custom_id]["response"]["body"]
        # It ran on to a limit and never past the caller's. Not always all 440: the random weights write bytes
        # that are not UTF-8, which vLLM streams as U+FFFD; a trailing one is given up and generated again, and
        # one inside the kept text tokenizes again as more than the token it came from, so the context (512)
        # can clamp the resumed limit, as vLLM would.
        assert body["choices"][0]["finish_reason"] == "length", body["choices"][0]
        assert len(text) > len(attempt.partial_output.rstrip("\ufffd")[:40])
        assert body["usage"]["completion_tokens"] <= 440, body["usage"]
