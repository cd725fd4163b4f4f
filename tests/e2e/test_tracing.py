"""One batch request is one trace across the processes: API → processor → worker attempt → gateway → replica.

Every child process writes its finished spans to one file (`HOLDBACK_TRACE_FILE`, holdback.tracing); the test
follows the parent links from the API's `POST /v1/batches` span down to the simulator's span.
"""

from __future__ import annotations

import json

import pytest

from holdback.tracing import TRACE_FILE_ENV, read_spans
from tests.e2e.test_e2e_pipeline import Platform
from tests.support import chat_lines, poll, submit_batch

pytestmark = pytest.mark.e2e


def _spans(path) -> list[dict]:  # noqa: ANN001
    return list(read_spans(str(path))) if path.exists() else []


def _child(spans: list[dict], parent: dict, service: str, name_prefix: str) -> dict | None:
    return next((s for s in spans if s["parent_span_id"] == parent["span_id"] and s["service"] == service
                 and s["name"].startswith(name_prefix)), None)


@pytest.mark.parametrize("dispatch", ["async", "sync"])
def test_one_batch_is_one_trace_from_api_to_replica(backend, tmp_path, dispatch):  # noqa: ANN001
    """async: the worker sends each attempt; sync: the processor sends them itself (its `attempt` spans)."""
    trace_file = tmp_path / "spans.jsonl"
    backend.extra_env[TRACE_FILE_ENV] = str(trace_file)
    sender = "holdback-worker" if dispatch == "async" else "holdback-processor"
    platform = Platform(backend, tmp_path, replicas=1, processor_args=("--dispatch", dispatch))
    try:
        batch_id = submit_batch(platform.client, chat_lines(2, max_tokens=4))
        batch = platform.wait(batch_id, timeout=90)
        assert batch.status == "completed", (batch.status, batch.errors)

        def chain() -> list[dict] | None:
            spans = _spans(trace_file)
            created = [s for s in spans if s["service"] == "holdback-api" and s["name"] == "POST /v1/batches"]
            if len(created) != 1:
                return None
            ingest = _child(spans, created[0], "holdback-processor", "batch.ingest")
            if ingest is None:
                return None
            attempts = [s for s in spans if s["parent_span_id"] == ingest["span_id"]
                        and s["service"] == sender and s["name"] == "attempt"]
            for attempt in attempts:
                gateway = _child(spans, attempt, "holdback-gateway", "gateway POST /v1/chat/completions")
                replica = gateway and _child(spans, gateway, "holdback-sim", "sim /v1/chat/completions")
                if replica is not None:
                    return [created[0], ingest, attempt, gateway, replica]
            return None

        # Spans are written when they end; the finalize span may land after the batch reads completed.
        found = poll(chain, timeout=30, what=f"API → processor → {sender} attempt → gateway → replica spans",
                     detail=lambda: "\n".join(json.dumps(s) for s in _spans(trace_file)))
        trace_ids = {s["trace_id"] for s in found}
        assert len(trace_ids) == 1, found
        trace_id = trace_ids.pop()
        api, ingest, attempt, gateway, replica = found
        assert api["attributes"]["http.response.status_code"] == 200
        assert ingest["attributes"]["batch_id"] == batch_id
        assert attempt["attributes"]["batch_id"] == batch_id
        assert attempt["attributes"]["http.response.status_code"] == 200
        # The gateway's span and the replica's carry the same request id as the attempt: one request, three hops.
        assert gateway["attributes"]["request_id"] == attempt["attributes"]["request_id"]
        assert replica["attributes"]["request_id"] == attempt["attributes"]["request_id"]
        assert gateway["attributes"]["holdback.replica"] == platform.sim_urls[0]

        spans = _spans(trace_file)
        # Both requests of the batch were attempted in this trace, and the batch was finalized in it.
        attempted = {s["attributes"]["request_id"] for s in spans
                     if s["trace_id"] == trace_id and s["name"] == "attempt"}
        assert len(attempted) == 2
        poll(lambda: any(s["trace_id"] == trace_id and s["name"] == "batch.finalize" for s in _spans(trace_file)),
             timeout=30, what="the processor's batch.finalize span in the batch's trace")
        # Log lines written inside a span carry its trace id: the API's line for the create request.
        api_log = "".join(p.read_text() for p in (tmp_path / "logs").glob("api-*.log"))
        created_lines = [json.loads(line) for line in api_log.splitlines()
                         if line.startswith("{") and '"route":"/v1/batches"' in line and '"method":"POST"' in line]
        assert [line.get("trace_id") for line in created_lines] == [trace_id]
    finally:
        platform.close()
