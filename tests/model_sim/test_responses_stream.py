"""The simulator streams /v1/responses as vLLM 0.32 does: the events (their names, order, key sets, numbering)
against the bytes the CPU build sent (tests/fixtures/vllm/responses_stream*.sse), through the official client, and
an engine failure that cuts the stream with no last event, as vLLM's does."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

from model_sim.generation import output_text
from tests.model_sim.conftest import sim_config, slow
from tests.model_sim.test_engine_http import prompt_of
from tests.real_vllm import surface

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm"


def events(raw: str) -> list[tuple[str, dict]]:
    """Each event's `event:` name and its data, checking the framing vLLM uses: both lines, and no `[DONE]`."""
    out = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def sequence_shape(raw: str) -> list[tuple[str, object]]:
    """The event names in order, each with its data's key sets and types; repeated deltas count once (vLLM sends
    one per engine output, which may carry several tokens)."""
    out: list[tuple[str, object]] = []
    for name, data in events(raw):
        assert data["type"] == name
        entry = (name, surface.shape(data))
        if not out or out[-1] != entry:
            out.append(entry)
    return out


def test_a_streamed_response_has_vllms_events_and_is_stored_whole(start_sim):
    sim = start_sim(sim_config(responses_store=True))
    body = {"model": "sim-model", "input": "Say hello", "max_output_tokens": 8, "stream": True}
    r = sim.http.post("/v1/responses", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    vllm = (FIXTURES / "responses_stream.sse").read_text()
    assert sequence_shape(r.text) == sequence_shape(vllm)
    got = events(r.text)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    deltas = [data["delta"] for name, data in got if name == "response.output_text.delta"]
    assert deltas == [output_text(i, i + 1) for i in range(8)]  # one event per token
    final = got[-1][1]["response"]
    assert final["status"] == "incomplete" and final["output"][0]["content"][0]["text"] == output_text(0, 8)
    assert got[0][1]["response"]["id"] == final["id"] and got[0][1]["response"]["status"] == "in_progress"
    # The final response is the one stored, and the same body a request that does not stream gets.
    assert sim.http.get(f"/v1/responses/{final['id']}").json() == final
    whole = sim.http.post("/v1/responses", json={**body, "stream": False}).json()
    assert set(whole) == set(final) and whole["usage"] == final["usage"]


def test_the_official_client_reads_the_stream(sim):
    oai = openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)
    with oai.responses.stream(model="sim-model", input="Hi", max_output_tokens=5) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_text == output_text(0, 5)


def test_an_engine_failure_cuts_a_responses_stream_with_no_last_event(start_sim):
    # As vLLM 0.32's: its error is not a Responses event, so writing it fails and the body is left unfinished.
    sim = start_sim(timing=slow(decode_ms=5), num_blocks=12, block_size=16, max_num_seqs=8, preemption=False)
    body = {"model": "sim-model", "input": prompt_of(20), "max_output_tokens": 70, "ignore_eos": True,
            "stream": True}
    together = threading.Barrier(4)

    def one(_: int) -> tuple[str, str | None]:
        together.wait()
        text, error = "", None
        try:
            with httpx.stream("POST", sim.url + "/v1/responses", json=body, timeout=60) as r:
                for chunk in r.iter_text():
                    text += chunk
        except httpx.RemoteProtocolError as exc:
            error = str(exc)
        return text, error

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(4)))
    cut = [text for text, error in answers if error is not None]
    assert cut, answers
    vllm = events((FIXTURES / "responses_stream_engine_error.sse").read_text())
    assert vllm[-1][0] == "response.output_text.delta"
    for text in cut:
        got = events(text)
        assert got[-1][0] == "response.output_text.delta", got[-1]
        assert not any(name in ("error", "response.failed", "response.completed") for name, _ in got)
