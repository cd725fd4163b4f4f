"""Per-tenant limits (holdback.tenant_limits) on both backends: open batches refused at create, enqueued
requests and tokens failing the batch at validation with OpenAI's shape of error, another tenant untouched,
and the room back once earlier work finishes."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from holdback.models import RequestRow
from tests.batch_processor.test_processor_support import Harness, chat, jsonl


@pytest.fixture
def harness_factory(backend):
    made = []

    def make(**settings) -> Harness:
        h = Harness(backend, **settings)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def _rows(h: Harness, batch_id: str) -> int:
    with h.factory() as s:
        return s.scalar(select(func.count()).select_from(RequestRow).where(RequestRow.batch_id == batch_id))


def test_a_batch_over_the_enqueued_request_limit_fails_whole_and_another_tenant_goes_on(harness_factory):
    h = harness_factory(tenant_max_enqueued_requests=30)
    processor = h.processor(window=100)
    first = h.submit(jsonl([chat(i) for i in range(20)]), tenant="flood")
    processor.tick()
    assert h.batch(first).status == "in_progress"
    over = h.submit(jsonl([chat(i) for i in range(20)]), tenant="flood")
    other = h.submit(jsonl([chat(i) for i in range(20)]), tenant="quiet")
    processor.tick()
    failed = h.batch(over)
    assert failed.status == "failed" and _rows(h, over) == 0, "nothing of a refused batch is created"
    (error,) = failed.errors
    assert error["code"] == "request_limit_exceeded"
    assert "'flood'" in error["message"] and "20" in error["message"] and "30" in error["message"]
    assert h.batch(other).status == "in_progress", "the other tenant's limit is its own"
    # Once the first batch's requests are done the room is back.
    for row in h.rows(first):
        h.succeed(row.id)
    processor.tick()
    again = h.submit(jsonl([chat(i) for i in range(20)]), tenant="flood")
    processor.tick()
    assert h.batch(again).status == "in_progress"


def test_the_enqueued_token_limit_and_a_per_tenant_override(harness_factory):
    h = harness_factory(tenant_max_enqueued_tokens=200, tenant_limits={"big": {"enqueued_tokens": 0}})
    processor = h.processor(window=100)
    lines = jsonl([chat(i, pad="x" * 200) for i in range(10)])  # ~2,800 bytes: ~700 tokens estimated
    small, big = h.submit(lines, tenant="small"), h.submit(lines, tenant="big")
    processor.tick()
    (error,) = h.batch(small).errors
    assert h.batch(small).status == "failed" and error["code"] == "token_limit_exceeded"
    assert "input bytes" in error["message"] and "200" in error["message"]
    assert h.batch(big).status == "in_progress", "0 in the tenant's override: no token limit for it"
