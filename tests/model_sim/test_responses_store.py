"""The simulator's stored responses, as vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1 keeps them: GET, cancel,
`previous_response_id`, background mode, and the answers (statuses, error envelopes) for unknown ids, checked
against what vLLM 0.32 answered (docs/real-vllm.md, Stored responses)."""

from __future__ import annotations

from model_sim.cli import build_parser, config_from_args
from tests.model_sim.conftest import sim_config, slow
from tests.support import poll

NOT_FOUND = {"message": "Response with id 'resp_nope' not found.", "type": "invalid_request_error",
             "param": "response_id", "code": 404}


def test_a_stored_response_is_retrieved_continued_and_unknown_ids_are_vllms_404(start_sim):
    sim = start_sim(sim_config(responses_store=True))
    first = sim.http.post("/v1/responses", json={"model": "sim-model", "input": "Hello", "max_output_tokens": 4,
                                                 "request_id": "resp_mine"}).json()
    assert first["id"] == "resp_mine"
    assert sim.http.get("/v1/responses/resp_mine").json() == first
    # The continued turn renders the stored conversation first: more input tokens than the new input alone.
    alone = sim.http.post("/v1/responses", json={"model": "sim-model", "input": "More", "max_output_tokens": 2,
                                                 "store": False}).json()
    turn = sim.http.post("/v1/responses", json={"model": "sim-model", "input": "More", "max_output_tokens": 2,
                                                "previous_response_id": "resp_mine"}).json()
    assert turn["previous_response_id"] == "resp_mine"
    assert turn["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert sim.http.get(f"/v1/responses/{alone['id']}").status_code == 404  # store: false is not kept
    for answer in (sim.http.get("/v1/responses/resp_nope"),
                   sim.http.post("/v1/responses/resp_nope/cancel"),
                   sim.http.post("/v1/responses", json={"model": "sim-model", "input": "x",
                                                        "previous_response_id": "resp_nope"})):
        assert answer.status_code == 404 and answer.json() == {"error": NOT_FOUND}
    cancel = sim.http.post("/v1/responses/resp_mine/cancel")
    assert cancel.status_code == 400 and cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    deleted = sim.http.delete("/v1/responses/resp_mine")
    assert deleted.status_code == 405 and deleted.json() == {"detail": "Method Not Allowed"}


def test_background_answers_queued_runs_on_and_can_be_cancelled(start_sim):
    sim = start_sim(sim_config(responses_store=True, timing=slow(decode_ms=10)))
    body = {"model": "sim-model", "input": "Hello", "max_output_tokens": 5, "background": True}
    queued = sim.http.post("/v1/responses", json=body).json()
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    assert queued["usage"] is None
    done = poll(lambda: (r := sim.http.get(f"/v1/responses/{queued['id']}").json())["status"] != "queued" and r,
                30, "the background response to end")
    assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 5 and done["background"] is True
    long = sim.http.post("/v1/responses", json={**body, "max_output_tokens": 5000}).json()
    poll(lambda: sim.state()["running"], 30, "the background generation to run", sim.state)
    cancelled = sim.http.post(f"/v1/responses/{long['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    poll(lambda: not sim.state()["running"], 30, "the cancelled generation to stop", sim.state)
    assert sim.http.get(f"/v1/responses/{long['id']}").json()["status"] == "cancelled"


def test_without_the_store_background_is_refused_as_vllm_refuses_it(start_sim):
    sim = start_sim()
    refused = sim.http.post("/v1/responses", json={"model": "sim-model", "input": "hi", "background": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"
    assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in refused.json()["error"]["message"]
    answer = sim.http.post("/v1/responses", json={"model": "sim-model", "input": "hi", "max_output_tokens": 2})
    assert sim.http.get(f"/v1/responses/{answer.json()['id']}").status_code == 404
    sim_with = start_sim(sim_config(responses_store=True))
    both = sim_with.http.post("/v1/responses", json={"model": "sim-model", "input": "hi", "background": True,
                                                     "store": False})
    assert both.status_code == 400 and both.json()["error"]["message"].startswith("background can only be used")


def test_the_store_is_turned_on_by_vllms_variable_or_the_flag(monkeypatch):
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--port", "1"])).responses_store is False
    assert config_from_args(parser.parse_args(["--port", "1", "--enable-responses-store"])).responses_store
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "1")
    assert config_from_args(build_parser().parse_args(["--port", "1"])).responses_store is True
