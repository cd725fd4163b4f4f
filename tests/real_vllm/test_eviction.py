"""Eviction against real vLLM: realtime arrives at a full pool, the gateway evicts running batch requests,
vLLM aborts them (its own log says so), and each evicted chat resumes, on the tiny model's chat template and on
one that trims content as Llama 3's does, and ends with the answer vLLM gives the same request uninterrupted,
byte for byte (greedy decoding).

The trimming template is the request's own `chat_template` (the shared server trusts it): vLLM renders it with
the same renderer as a model's own, so no second model or server is needed for it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from tests.real_vllm.conftest import MODEL
from tests.real_vllm.stack import REALTIME_KEY, TERMINAL, RealStack, chat
from tests.real_vllm.tiny_model import CHAT_TEMPLATE
from tests.support import poll

pytestmark = pytest.mark.e2e

# Four slots on the replica; batch may hold half of them; realtime bursts fill the rest and evict.
EVICTION = """
saturation: {detector: concurrency, maxConcurrency: 4}
eviction: {enabled: true, maxPerDecision: 2}
"""


ROWS = 24
# Llama 3's way: every message's content `| trim`med, which drops a continued message's trailing whitespace.
TRIMMING_TEMPLATE = CHAT_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] | trim }}")
assert TRIMMING_TEMPLATE != CHAT_TEMPLATE
TEMPLATES = {"model": None, "trimming": TRIMMING_TEMPLATE}


def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE's printable stand-in for each byte (GPT-2's table), back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def ascii_token_ids() -> list[int]:
    """The tiny model's tokens that are whole ASCII text (no special token). The random weights otherwise write
    bytes that are not UTF-8, which vLLM streams as U+FFFD: its detokenizer cannot be relied on to go on from
    them as it went, so a resume gives them up (see holdback/attempts/resume.py), and an answer would differ
    for that reason alone. Held to these, every answer is text, as a real model's is."""
    tokenizer = json.loads((Path(MODEL) / "tokenizer.json").read_text())
    special = {t["id"] for t in tokenizer["added_tokens"]}
    alphabet = _byte_level_alphabet()
    return sorted(i for piece, i in tokenizer["model"]["vocab"].items()
                  if i not in special and all(alphabet.get(ch, 0x80) < 0x80 for ch in piece))


def long_chat(i: int, allowed: list[int]) -> dict:
    """Row i: greedy, 440 tokens of ASCII text (ignore_eos: the random weights would stop early at random); odd
    rows rendered with the trimming template."""
    template = TEMPLATES["trimming" if i % 2 else "model"]
    return chat(f"long-{i}", f"tell me a long story number {i}", max_tokens=440, ignore_eos=True, temperature=0,
                allowed_token_ids=allowed, **({"chat_template": template} if template else {}))


def template_of(body: dict) -> str:
    return "trimming" if body.get("chat_template") else "model"


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


def test_realtime_evicts_batch_vllm_aborts_it_and_the_chat_resumes_to_the_uninterrupted_answer(backend, tmp_path,
                                                                                                 vllm):
    allowed = ascii_token_ids()
    s = RealStack(backend, tmp_path, [vllm.url], gateway_config=EVICTION)
    stop, answers = threading.Event(), []
    traffic = threading.Thread(target=_bursts, args=(s.gateway_url, stop, answers), daemon=True)
    lines = {}
    try:
        s.wait_identified()

        def submit() -> str:
            batch = [long_chat(i, allowed) for i in range(ROWS)]
            lines.update((line["custom_id"], line["body"]) for line in batch)
            return s.submit(batch)

        batches = [submit()]
        poll(lambda: _batch_in_flight(s) >= 2, 120, "batch running", s.logs)
        traffic.start()

        # Which victim a burst takes is the scheduler's timing: one that had not streamed yet keeps nothing, and
        # one whose output vLLM had all generated (the tiny model outruns the relay) leaves no abort there, so
        # the bursts go on until, on each template, an evicted attempt kept output and vLLM aborted it. On a
        # quiet machine the engine can finish a batch within a few bursts: then another batch gives them running
        # requests to evict.
        def kept_on_both() -> bool | None:
            aborted, seen = vllm.aborted(), set()
            for batch_id in batches:
                rows = {r.id: r for r in s.rows(batch_id)}
                for a in s.attempts(batch_id):
                    if a.evicted and a.partial_output and a.request_id in aborted:
                        seen.add(template_of(lines[rows[a.request_id].custom_id]))
            if seen == set(TEMPLATES):
                return True
            if s.client.batches.retrieve(batches[-1]).status in TERMINAL:
                batches.append(submit())
            return None

        poll(kept_on_both, 240, "an eviction that kept output on each template", s.logs)
        stop.set()
        traffic.join(120)
        results = []
        for batch_id in batches:
            done = s.wait(batch_id, timeout=400)
            assert done.status == "completed" and done.request_counts.completed == ROWS, done
            results.append((s.attempts(batch_id), {r.id: r for r in s.rows(batch_id)},
                            s.lines(done.output_file_id)))
    finally:
        stop.set()
        s.close()
    assert answers and set(answers) == {200}, "realtime is never shed"
    compared = {name: 0 for name in TEMPLATES}
    with httpx.Client(base_url=vllm.url, timeout=120) as direct:
        for attempts, rows, out in results:
            evicted_rows = {a.request_id for a in attempts if a.evicted}
            aborted = {rid for rid in rows if rid in vllm.aborted()}
            assert aborted <= evicted_rows, ("vLLM aborted a row the gateway never evicted", aborted - evicted_rows)
            for row_id, row in rows.items():
                trail = [(a.number, a.outcome, a.evicted, a.tokens_kept, a.output_tokens,
                          (a.partial_output or "")[:30]) for a in attempts if a.request_id == row_id]
                final = [a for a in attempts if a.request_id == row_id and a.outcome == "success"]
                assert len(final) == 1, trail
                if not final[0].tokens_kept:
                    continue  # never evicted, or evicted before it kept anything: it ran from the start
                body = out[row.custom_id]["response"]["body"]
                # The same request answered by vLLM without eviction: the resumed answer is that answer.
                alone = direct.post("/v1/chat/completions", json=lines[row.custom_id]).json()
                assert body["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"], trail
                assert body["choices"][0]["finish_reason"] == "length" and body["object"] == "chat.completion"
                assert body["usage"]["completion_tokens"] == 440, (body["usage"], trail)
                compared[template_of(lines[row.custom_id])] += 1
    assert all(compared.values()), ("a resumed row on each template", compared)
