"""Stored responses through a pool (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1, here the simulator's store): a
turn naming `previous_response_id` runs on the replica that stored it, found again after a gateway restart by
asking the replicas; GET, DELETE and cancel of /v1/responses/{id} reach that replica; unknown ids are vLLM's 404;
`background` responses hold their slot until their replica reports them ended, or are refused when configured."""

from __future__ import annotations

import httpx
import pytest

from gateway.policies.picker import EndpointPicker, Pinned
from gateway.policies.saturation import ConcurrencyDetector
from gateway.replicas import Replica
from gateway.stored_responses import ResponseHomes
from tests.support import poll

STORE = "--enable-responses-store"
NOT_FOUND = {"message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error",
             "param": "response_id", "code": 404}


def test_a_pinned_request_runs_on_its_replica_only_and_waits_while_it_is_down():
    picker, detector = EndpointPicker(max_concurrency=2), ConcurrencyDetector(max_concurrency=2)
    full = Replica("http://full", healthy=True, in_flight=2)
    idle = Replica("http://idle", healthy=True, in_flight=0)
    assert picker.pick([full, idle], detector, 0.0, prefer="http://full") is idle  # a preference yields
    assert picker.pick([full, idle], detector, 0.0, prefer=Pinned("http://full")) is full  # a pin does not
    full.healthy = False
    assert picker.pick([full, idle], detector, 0.0, prefer=Pinned("http://full")) is None
    assert picker.pick([full, idle], detector, 0.0, prefer=Pinned("http://full"), fits=lambda r: False) is None


def test_response_homes_forget_past_their_ttl_and_their_bound():
    now = [0.0]
    homes = ResponseHomes(ttl=10, max_entries=2, clock=lambda: now[0])
    homes.remember("a", "http://r1", "t")
    homes.remember("b", "http://r2", "t")
    homes.remember("c", "http://r1", "t")
    assert homes.home("a") is None and homes.home("b").url == "http://r2" and len(homes) == 2
    now[0] = 10.0
    assert homes.home("c") is None and len(homes) == 0


def _create(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/responses", json={"model": "sim-model", "max_output_tokens": 3, **body}, timeout=30)


def _conversation_on_its_replica(gw_url: str, turns: int) -> tuple[str, str]:
    first = _create(gw_url, input="Hello")
    assert first.status_code == 200, first.text
    home, previous = first.headers["x-holdback-replica"], first.json()["id"]
    for i in range(turns):
        turn = _create(gw_url, input=f"and {i}", previous_response_id=previous)
        assert turn.status_code == 200, turn.text
        assert turn.headers["x-holdback-replica"] == home and turn.json()["previous_response_id"] == previous
        previous = turn.json()["id"]
    return home, previous


@pytest.mark.parametrize("gateway_workers", [1, 2], ids=["one-process", "workers-2"], indirect=True)
def test_every_turn_runs_where_its_previous_response_is_stored(stack):
    sims = stack.sim(3, STORE, "--zero-latency")
    gw = stack.gateway(sims)
    home, last = _conversation_on_its_replica(gw.url, 8)
    assert gw.state()["totals"]["evicted_replica_kept"] == 0, "a pinned turn is not an evicted request's retry"
    stored = httpx.get(f"{gw.url}/v1/responses/{last}", timeout=10)
    assert stored.status_code == 200 and stored.json()["id"] == last
    cancel = httpx.post(f"{gw.url}/v1/responses/{last}/cancel", timeout=10)
    assert cancel.status_code == 400 and cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    assert httpx.delete(f"{gw.url}/v1/responses/{last}", timeout=10).status_code == 405  # vLLM has no DELETE
    for answer in (httpx.get(f"{gw.url}/v1/responses/resp_nope", timeout=10),
                   httpx.post(f"{gw.url}/v1/responses/resp_nope/cancel", timeout=10),
                   _create(gw.url, input="x", previous_response_id="resp_nope")):
        assert answer.status_code == 404 and answer.json() == {"error": NOT_FOUND}, answer.text


def test_after_a_gateway_restart_a_response_is_found_on_its_replica(stack):
    sims = stack.sim(3, STORE, "--zero-latency")
    first = stack.gateway(sims)
    home, last = _conversation_on_its_replica(first.url, 1)
    first.proc.terminate()
    first.proc.wait(30)
    again = stack.gateway(sims)
    for i in range(6):
        turn = _create(again.url, input=f"then {i}", previous_response_id=last)
        assert turn.status_code == 200 and turn.headers["x-holdback-replica"] == home, turn.text
    assert again.log().count('"event":"response_found"') == 1, "asked the replicas once, then remembered"


def _in_flight(gw) -> int:  # noqa: ANN001
    return gw.state()["in_flight"]


def test_a_background_response_holds_its_slot_until_its_replica_reports_it_ended(stack):
    sims = stack.sim(1, STORE, "--decode-base-ms", "20", "--step-overhead-ms", "1")
    gw = stack.gateway(sims, "responses: {pollSeconds: 0.1}\n")
    queued = _create(gw.url, input="Hello", background=True, max_output_tokens=60)
    assert queued.status_code == 200 and queued.json()["status"] == "queued", queued.text
    response_id = queued.json()["id"]
    assert _in_flight(gw) == 1, "answered at once, still generating: counted"
    done = poll(lambda: (r := httpx.get(f"{gw.url}/v1/responses/{response_id}", timeout=10).json())["status"]
                != "queued" and r, 60, "the background response to end")
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 60
    poll(lambda: _in_flight(gw) == 0, 30, "the gateway to release its slot", gw.state)
    long = _create(gw.url, input="Hello", background=True, max_output_tokens=5000).json()
    assert _in_flight(gw) == 1
    cancelled = httpx.post(f"{gw.url}/v1/responses/{long['id']}/cancel", timeout=10)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    poll(lambda: _in_flight(gw) == 0, 30, "the cancelled response's slot to be released", gw.state)


def test_background_is_refused_at_the_door_when_the_config_says_so(stack):
    sims = stack.sim(1, STORE, "--zero-latency")
    gw = stack.gateway(sims, "responses: {allowBackground: false}\n")
    refused = _create(gw.url, input="Hello", background=True)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "background" and "responses.allowBackground" in error["message"]
    assert _create(gw.url, input="Hello").status_code == 200
