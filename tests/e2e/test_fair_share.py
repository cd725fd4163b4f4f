"""Fair share on the real stack: tenants share the workers equally however many batches each submits, and a
tenant arriving late has its first requests sent within seconds, not behind everyone's full windows."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from sqlalchemy import func, select

from holdback.models import Attempt, RequestRow
from tests.e2e.test_e2e_pipeline import PROCESSOR_FAST, platform_factory  # noqa: F401
from tests.support import chat_lines, submit_batch, wait_batch

pytestmark = pytest.mark.e2e

ROWS = 400


def _client(p, tenant: str) -> openai.OpenAI:
    key = httpx.post(f"{p.api_url}/admin/keys", json={"tenant": tenant},
                     headers={"Authorization": f"Bearer {p.backend.admin_key}"}, timeout=10)
    key.raise_for_status()
    return openai.OpenAI(base_url=f"{p.api_url}/v1", api_key=key.json()["key"], max_retries=5)


def _counts(p, batch_ids: list[str]) -> dict[str, dict[str, int]]:
    """Rows per status, per batch."""
    out: dict[str, dict[str, int]] = {b: {} for b in batch_ids}
    with p.db() as s:
        for batch_id, status, n in s.execute(
                select(RequestRow.batch_id, RequestRow.status, func.count())
                .where(RequestRow.batch_id.in_(batch_ids)).group_by(RequestRow.batch_id, RequestRow.status)):
            out[batch_id][status] = n
    return out


def _restart_processor(p, *args: str) -> None:
    p.procs.stop(p.processor)
    p.processor = p.procs.start("processor", *PROCESSOR_FAST, *args, name="processor")


def test_three_tenants_share_throughput_equally_however_many_batches_each_has(platform_factory):
    p = platform_factory(sim_args=("--decode-base-ms", "4", "--step-overhead-ms", "1"))
    # Small windows, so the test sees the steady state of refills rather than the first windows draining.
    _restart_processor(p, "--window", "40")
    clients = {t: _client(p, t) for t in ("a", "b", "c")}
    owner: dict[str, str] = {}
    for tenant, batches in (("a", 3), ("b", 1), ("c", 1)):
        for _ in range(batches):
            owner[submit_batch(clients[tenant], chat_lines(ROWS, max_tokens=20))] = tenant
    batch_ids = list(owner)

    # Sample until some tenant runs out of work; keep the samples taken while every tenant still had rows
    # waiting, after a warm-up in which every batch got going.
    samples: list[dict[str, int]] = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        counts = _counts(p, batch_ids)
        waiting: dict[str, int] = {}
        done: dict[str, int] = {}
        for batch_id, by_status in counts.items():
            tenant = owner[batch_id]
            waiting[tenant] = waiting.get(tenant, 0) + by_status.get("pending", 0)
            done[tenant] = done.get(tenant, 0) + by_status.get("succeeded", 0)
        if min(waiting.values(), default=0) == 0 and samples:
            break
        if all(counts.values()) and sum(done.values()) >= 100:
            samples.append(done)
        time.sleep(0.5)
    assert len(samples) >= 4, f"too few samples while every tenant had work: {samples}"
    first, last = samples[0], samples[-1]
    served = {t: last[t] - first[t] for t in ("a", "b", "c")}
    total = sum(served.values())
    shares = {t: round(n / total, 3) for t, n in served.items()}
    assert total >= 150, served
    assert all(0.25 <= share <= 0.42 for share in shares.values()), (shares, served)


def test_a_late_tenants_first_request_is_sent_within_seconds(platform_factory):
    # ~2 s requests: the shipped window of one busy tenant is several seconds of queue.
    p = platform_factory(sim_args=("--decode-base-ms", "20", "--step-overhead-ms", "1"))
    busy, late = _client(p, "busy"), _client(p, "late")
    big = submit_batch(busy, chat_lines(600, max_tokens=100))
    # The workers are full and a queue waits.
    wait_batch(busy, big, lambda b: b.request_counts.completed >= 64, 60, lambda: p.procs.log("processor"))
    small = submit_batch(late, chat_lines(10, max_tokens=100))
    created = time.time()
    first_sent = None
    deadline = time.monotonic() + 60
    while first_sent is None and time.monotonic() < deadline:
        with p.db() as s:
            first_sent = s.scalar(select(func.min(Attempt.started_at)).where(Attempt.batch_id == small))
        time.sleep(0.1)
    assert first_sent is not None, "the late tenant's batch was never sent"
    assert first_sent - created < 4.0, f"the late tenant's first request was sent {first_sent - created:.1f}s " \
                                       "after its batch was created"
