"""The Batches API through the official SDK: create, retrieve, list with paging, cancel."""

from __future__ import annotations

import io

import openai
import pytest
from sqlalchemy import update

from batch_api.schemas import batch_to_api
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Batch
from tests.support import WakeListener

BATCH_KEYS = {
    "id", "object", "endpoint", "input_file_id", "completion_window", "status", "created_at", "in_progress_at",
    "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
    "output_file_id", "error_file_id", "errors", "request_counts", "usage", "model", "metadata",
}


def upload_batch_file(client) -> str:  # noqa: ANN001
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
    return client.files.create(file=("in.jsonl", io.BytesIO(line)), purpose="batch").id


def set_status(backend, batch_id: str, **values) -> None:  # noqa: ANN001
    """Move a batch the way the processor would, straight in the database."""
    engine = make_engine(backend.database_url)
    with transaction(make_sessionmaker(engine)) as session:
        session.execute(update(Batch).where(Batch.id == batch_id).values(**values))
    engine.dispose()


def test_create_retrieve_list_cancel(api):
    key = api.create_key("acme")
    client = api.openai(key)
    file_id = upload_batch_file(client)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"project": "eval", "run": "7"},
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert batch.status == "validating" and batch.object == "batch"
    assert batch.input_file_id == file_id and batch.endpoint == "/v1/chat/completions"
    assert batch.expires_at == batch.created_at + 86400
    assert batch.metadata == {"project": "eval", "run": "7"}
    assert batch.model is None and batch.errors is None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (0, 0, 0)
    assert batch.usage.total_tokens == 0 and batch.usage.input_tokens_details.cached_tokens == 0
    for field in ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at",
                  "output_file_id", "error_file_id"):
        assert getattr(batch, field) is None, field

    with api.http(key) as http:
        raw = http.get(f"/v1/batches/{batch.id}").json()
    assert set(raw) == BATCH_KEYS
    assert raw == batch.model_dump(mode="json")

    assert client.batches.retrieve(batch.id) == batch

    ids = [batch.id] + [
        client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h").id for _ in range(4)
    ]
    page = client.batches.list(limit=2)
    assert len(page.data) == 2 and page.has_more is True
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]
    with api.http(key) as http:
        last = http.get("/v1/batches", params={"limit": 2, "after": ids[1]}).json()
    assert [b["id"] for b in last["data"]] == [ids[0]]
    assert (last["first_id"], last["last_id"], last["has_more"]) == (ids[0], ids[0], False)

    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and isinstance(cancelled.cancelling_at, int)
    assert cancelled.cancelling_at >= batch.created_at
    again = client.batches.cancel(batch.id)
    assert again.status == "cancelling" and again.cancelling_at == cancelled.cancelling_at
    assert client.batches.retrieve(batch.id).status == "cancelling"
    assert client.batches.retrieve(ids[1]).status == "validating"


def test_a_batch_created_or_cancelled_wakes_the_processors(api, backend):
    # The processors take a new batch up (and a cancel) at once, not at their next poll (jobqueue.Wakes).
    wakes = WakeListener(backend.redis(), backend.namespace)
    try:
        client = api.openai(api.create_key("acme"))
        batch = client.batches.create(input_file_id=upload_batch_file(client), endpoint="/v1/chat/completions",
                                      completion_window="24h")
        wakes.wait_for(batch.id, 30, "a wake-up naming the new batch")
        wakes.heard.clear()
        assert client.batches.cancel(batch.id).status == "cancelling"
        wakes.wait_for(batch.id, 30, "a wake-up naming the cancelled batch")
    finally:
        wakes.close()


def test_completion_window_durations(api):
    client = api.openai(api.create_key("acme"))
    file_id = upload_batch_file(client)
    for window, seconds in [("24h", 86400), ("1h", 3600), ("30m", 1800), ("90s", 90), ("60s", 60), ("2d", 172800), ("7d", 604800)]:
        batch = client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window=window)
        assert batch.completion_window == window
        assert batch.expires_at == batch.created_at + seconds, window


def test_cancel_by_state(api, backend):
    client = api.openai(api.create_key("acme"))
    file_id = upload_batch_file(client)

    def new_batch(**values) -> str:
        batch_id = client.batches.create(input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h").id
        if values:
            set_status(backend, batch_id, **values)
        return batch_id

    in_progress = new_batch(status="in_progress", in_progress_at=1)
    assert client.batches.cancel(in_progress).status == "cancelling"

    cancelled = new_batch(status="cancelled", cancelling_at=2, cancelled_at=3)
    after = client.batches.cancel(cancelled)
    assert (after.status, after.cancelling_at, after.cancelled_at) == ("cancelled", 2, 3)

    for status in ("completed", "failed", "expired", "finalizing"):
        batch_id = new_batch(status=status)
        with pytest.raises(openai.BadRequestError) as exc:
            client.batches.cancel(batch_id)
        assert exc.value.status_code == 400
        assert batch_id in exc.value.message and status in exc.value.message
        assert exc.value.code == "batch_not_cancellable"
        assert client.batches.retrieve(batch_id).status == status


def test_batch_to_api_reports_progress_errors_and_usage():
    batch = Batch(
        id="batch_x", tenant_id="t", endpoint="/v1/embeddings", input_file_id="file-1", completion_window="1h",
        window_seconds=3600, status="failed", created_at=100, expires_at=3700, failed_at=150.0, model="m",
        errors=[{"code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "param": None, "line": 3}],
        total=10, completed=6, failed=4, input_tokens=50, cached_tokens=5, output_tokens=20, reasoning_tokens=2,
        metadata_=None,
    )
    body = batch_to_api(batch)
    assert set(body) == BATCH_KEYS
    assert body["failed_at"] == 150 and isinstance(body["failed_at"], int)
    assert body["errors"] == {"object": "list", "data": [
        {"code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "param": None, "line": 3}]}
    assert body["request_counts"] == {"total": 10, "completed": 6, "failed": 4}
    assert body["usage"] == {
        "input_tokens": 50, "input_tokens_details": {"cached_tokens": 5},
        "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 70,
    }
    assert body["model"] == "m" and body["metadata"] is None
