"""Each line's model is checked against the gateway's GET /v1/models before a batch runs: a batch of unknown
models fails naming the models served, a mixed one runs with the unknown lines in its error file, and while the
gateway gives no list the batch waits in validating. Against a real gateway and simulator, on both backends.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from batch_processor.served_models import KnownModels, ModelsUnavailable, ServedModels, parse_model_list
from tests.batch_processor.test_processor_support import Harness, chat, jsonl
from tests.support import Processes, free_port, poll, wait_http

# vLLM's /v1/models card (vllm/entrypoints/serve/engine/protocol.py ModelCard), one base model and a LoRA.
VLLM_MODELS = {"object": "list", "data": [
    {"id": "llama", "object": "model", "created": 1, "owned_by": "vllm", "root": "/models/llama-3",
     "parent": None, "max_model_len": 8192, "permission": []},
    {"id": "llama-sql-lora", "object": "model", "created": 1, "owned_by": "vllm", "root": "/adapters/sql",
     "parent": "llama", "max_model_len": None, "permission": []}]}


def test_the_list_is_the_cards_ids_and_nothing_else_counts_as_one():
    assert parse_model_list(VLLM_MODELS) == {"llama", "llama-sql-lora"}
    for body in ({"object": "list", "data": []}, {"detail": "Not Found"}, [], {"data": [{"root": "x"}]}):
        with pytest.raises(ValueError):
            parse_model_list(body)


class _Gateway:
    """A local HTTP server answering GET /v1/models with whatever the test sets, counting the calls."""

    def __init__(self):
        self.status, self.body, self.calls, self.auth = 200, VLLM_MODELS, 0, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.calls += 1
                outer.auth.append(self.headers.get("Authorization"))
                data = json.dumps(outer.body).encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # noqa: ANN002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_gateway() -> Iterator[_Gateway]:
    g = _Gateway()
    try:
        yield g
    finally:
        g.close()


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_list_is_kept_for_the_refresh_interval_and_asked_with_the_workers_key(fake_gateway):
    clock = _Clock()
    served = ServedModels(fake_gateway.url, "batch-key", refresh_seconds=30, clock=clock)
    assert served.names() == {"llama", "llama-sql-lora"}
    clock.now += 29
    assert served.names() == {"llama", "llama-sql-lora"} and fake_gateway.calls == 1
    fake_gateway.body = {"object": "list", "data": [{"id": "mistral"}]}
    clock.now += 2
    assert served.names() == {"mistral"} and fake_gateway.calls == 2
    assert fake_gateway.auth == ["Bearer batch-key"] * 2


def test_a_name_the_kept_list_lacks_is_looked_for_in_a_fresh_one_once_per_batch(fake_gateway):
    clock = _Clock()
    served = ServedModels(fake_gateway.url, refresh_seconds=30, clock=clock)
    known = KnownModels(served)
    clock.now += 10
    fake_gateway.body = {"object": "list", "data": [{"id": "llama"}, {"id": "added-just-now"}]}
    assert "llama" in known and fake_gateway.calls == 1  # a served name costs nothing
    assert "added-just-now" in known and fake_gateway.calls == 2  # an old list is asked again before refusing
    assert "gpt-4o" not in known and "gpt-4o" not in known and fake_gateway.calls == 2  # fresh: no third call
    assert known.listing() == "added-just-now, llama"


def test_no_list_is_no_verdict_and_the_gateway_is_asked_again_only_after_the_retry_pause(fake_gateway):
    clock = _Clock()
    served = ServedModels(fake_gateway.url, "wrong-key", retry_seconds=2, clock=clock)
    fake_gateway.status, fake_gateway.body = 401, {"error": "Unauthorized"}
    with pytest.raises(ModelsUnavailable, match="HTTP 401 .check HOLDBACK_GATEWAY_KEY"):
        served.names()
    clock.now += 1
    with pytest.raises(ModelsUnavailable):
        served.names()
    assert fake_gateway.calls == 1
    fake_gateway.status, fake_gateway.body = 503, {"error": {"message": "no healthy replica"}}
    clock.now += 1.5
    with pytest.raises(ModelsUnavailable, match="HTTP 503"):
        served.names()
    fake_gateway.status, fake_gateway.body = 200, VLLM_MODELS
    clock.now += 2
    assert "llama" in served.names() and fake_gateway.calls == 3
    refused = ServedModels(f"http://127.0.0.1:{free_port()}", clock=clock)
    with pytest.raises(ModelsUnavailable, match="ConnectError"):
        refused.names()


# --- through the processor, a real gateway and a simulator ------------------------------------------------


class _Stack:
    """`holdback sim` serving sim-model and `holdback gateway` in front of it; the processor dispatches itself
    (sync mode) to that gateway, with the model check on."""

    def __init__(self, backend, tmp_path, procs: Processes):
        self.procs = procs
        self.sim_url = f"http://127.0.0.1:{free_port()}"
        self.gateway_port = free_port()
        self.gateway_url = f"http://127.0.0.1:{self.gateway_port}"
        sim = procs.start("sim", "--port", self.sim_url.rsplit(":", 1)[1], "--model", "sim-model",
                          "--zero-latency", name="sim")
        wait_http(f"{self.sim_url}/health", proc=sim)
        self.harness = Harness(backend, gateway_url=self.gateway_url, validate_models=True,
                               models_refresh_seconds=30)
        self.gateway = None

    def start_gateway(self) -> None:
        self.gateway = self.procs.start("gateway", "--port", str(self.gateway_port), "--replicas", self.sim_url,
                                        name="gateway")
        wait_http(f"{self.gateway_url}/health", proc=self.gateway)

    def run_until(self, processor, batch_id: str, statuses: tuple[str, ...], timeout: float = 60.0):
        def reached():
            processor.tick()
            return self.harness.batch(batch_id).status in statuses
        poll(reached, timeout, f"batch {batch_id} to reach {statuses}",
             lambda: f"{self.harness.batch(batch_id).status}\n{self.procs.log('gateway')}", interval=0.05)
        return self.harness.batch(batch_id)


@pytest.fixture
def stack(backend, tmp_path) -> Iterator[_Stack]:
    with Processes(env=backend.env, log_dir=tmp_path / "logs") as procs:
        s = _Stack(backend, tmp_path, procs)
        try:
            yield s
        finally:
            s.harness.close()


def test_a_batch_whose_every_line_names_an_unknown_model_fails_naming_the_models_served(stack):
    stack.start_gateway()
    batch_id = stack.harness.submit(jsonl([chat(i, model="gpt-4o", max_tokens=4) for i in range(3)]))
    batch = stack.run_until(stack.harness.processor(dispatch="sync"), batch_id, ("failed", "in_progress"))

    assert batch.status == "failed" and batch.completed_at is None
    assert [(e["code"], e["line"], e["param"]) for e in batch.errors] == [
        ("model_not_found", line, "body.model") for line in (1, 2, 3)]
    assert "'gpt-4o'" in batch.errors[0]["message"] and "sim-model" in batch.errors[0]["message"]
    assert stack.harness.rows(batch_id) == []


def test_a_mixed_batch_runs_and_its_unknown_model_lines_are_in_the_error_file(stack):
    stack.start_gateway()
    lines = [chat(i, model="sim-model" if i % 2 else "gpt-4o", max_tokens=4) for i in range(6)]
    batch_id = stack.harness.submit(jsonl(lines))
    batch = stack.run_until(stack.harness.processor(dispatch="sync"), batch_id, ("completed", "failed"))

    assert batch.status == "completed", batch.errors
    assert (batch.total, batch.completed, batch.failed) == (6, 3, 3)
    assert batch.model == "sim-model" and not batch.errors
    output = stack.harness.read_file(batch.output_file_id)
    assert sorted(x["custom_id"] for x in output) == ["req-1", "req-3", "req-5"]
    assert all(x["response"]["status_code"] == 200 for x in output)
    errors = stack.harness.read_file(batch.error_file_id)
    assert sorted(x["custom_id"] for x in errors) == ["req-0", "req-2", "req-4"]
    for line in errors:  # OpenAI's line error: no response, an error with a code and a message
        assert line["response"] is None and line["id"].startswith("batch_req_")
        assert line["error"]["code"] == "model_not_found"
        assert "'gpt-4o'" in line["error"]["message"] and "sim-model" in line["error"]["message"]


def test_while_the_gateway_is_down_the_batch_waits_in_validating_and_runs_once_it_answers(stack):
    batch_id = stack.harness.submit(jsonl([chat(i, model="sim-model", max_tokens=4) for i in range(4)]))
    processor = stack.harness.processor(dispatch="sync")
    deadline = time.monotonic() + 3  # several retry pauses of the model list, not one sample
    while time.monotonic() < deadline:
        processor.tick()
        batch = stack.harness.batch(batch_id)
        assert batch.status == "validating" and not batch.errors
        time.sleep(0.05)
    assert stack.harness.rows(batch_id) == []

    stack.start_gateway()
    batch = stack.run_until(processor, batch_id, ("completed", "failed"))
    assert batch.status == "completed" and (batch.total, batch.completed, batch.failed) == (4, 4, 0)
