"""Outages cost time, never results: the gateway down for half a minute (more than twice as long as the workers'
retry budget lasts at this backoff, about 12 s, so a row that spent its budget on refused connections would fail)
fails no request, and a killed worker's requests are retried within 15 s. The real stack (simulator, gateway, API, processor, workers) with the
workers' shipped retry budget and heartbeat; only backoff is scaled down.
"""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import func, select

from holdback.contract import circuit_key
from holdback.models import Attempt, RequestRow
from tests.e2e.test_e2e_pipeline import Platform

pytestmark = pytest.mark.e2e

# The shipped transient budget (5) and heartbeat TTL; quicker backoff (its five retries span about 12 s), so the
# outage outlasts the budget more than twice over and the test's time is mostly outage.
WORKER_ARGS = ("--backoff-base", "0.5", "--backoff-cap", "5", "--scheduler-interval", "0.05", "--drain-timeout", "2")
SIM_ARGS = ("--decode-base-ms", "5", "--step-overhead-ms", "1")


class ShippedWorkerPlatform(Platform):
    """The e2e platform, but its workers keep their shipped budget and heartbeat."""

    def start_worker(self, *extra: str):
        return self.procs.start("worker", "-n", "64", *WORKER_ARGS, *extra, name="worker")


@pytest.fixture
def platform(backend, tmp_path):
    p = ShippedWorkerPlatform(backend, tmp_path, sim_args=SIM_ARGS)
    yield p
    p.close()


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} not within {timeout}s")


def test_gateway_down_half_a_minute_mid_batch_fails_no_request(platform, backend):
    p = platform
    batch_id = p.submit(300, max_tokens=30)  # ~0.2 s each
    p.wait(batch_id, 60, until=lambda b: b.request_counts.completed >= 40)
    p.procs.stop(p.gateway, signal.SIGKILL)
    outage_ends = time.monotonic() + 30  # the outage's length, not a synchronisation
    redis, key = backend.redis(), circuit_key(backend.namespace)
    circuit_opened = False
    while time.monotonic() < outage_ends:
        circuit_opened = circuit_opened or bool(redis.exists(key))
        time.sleep(0.5)
    p.gateway = p.start_gateway()  # the same port
    batch = p.wait(batch_id, 180)
    assert (batch.status, batch.request_counts.failed, batch.request_counts.completed) == ("completed", 0, 300), \
        (batch.errors, p.procs.log("worker"))
    assert circuit_opened, "the workers opened the shared circuit while the gateway was down"
    _wait_for(lambda: not redis.exists(key), 30, "the circuit closing after the gateway came back")
    with p.db() as s:
        spent = s.scalar(select(func.max(RequestRow.transient_failures)).where(RequestRow.batch_id == batch_id))
        refused = s.scalar(select(func.count()).where(Attempt.batch_id == batch_id,
                                                      Attempt.outcome == "transport_error"))
    assert spent <= 1, "only the requests cut off by the kill spent budget; refused ones did not"
    # With the circuit open nobody claims: refused attempts stay a few per row, not one per backoff step.
    assert refused <= 3 * 300, refused


def test_a_killed_workers_requests_are_retried_within_15_seconds(platform):
    p = platform
    batch_id = p.submit(300, max_tokens=100)  # ~0.5 s each: the worker always has many requests open

    def open_attempts() -> dict[str, int]:
        with p.db() as s:
            return dict(s.execute(select(Attempt.request_id, Attempt.number).where(
                Attempt.batch_id == batch_id, Attempt.ended_at.is_(None))).all())

    p.wait(batch_id, 60, until=lambda b: b.request_counts.completed >= 20)
    _wait_for(lambda: len(open_attempts()) >= 10, 30, "ten requests in flight")
    p.procs.stop(p.workers[0], signal.SIGKILL)
    killed_at = time.time()
    orphans = open_attempts()
    assert orphans, "the killed worker had attempts open"
    p.workers.append(p.start_worker())

    def retried() -> dict[str, float] | None:
        """When each orphaned request's next attempt started, once every one has started."""
        with p.db() as s:
            attempts = s.execute(select(Attempt.request_id, Attempt.number, Attempt.started_at).where(
                Attempt.request_id.in_(list(orphans)))).all()
        starts: dict[str, float] = {}
        for row_id, number, started in attempts:
            if number > orphans[row_id]:
                starts[row_id] = min(started, starts.get(row_id, started))
        return starts if len(starts) == len(orphans) else None

    starts = _wait_for(retried, 120, "a retry of every orphaned request")
    slowest = max(starts.values()) - killed_at
    assert slowest < 15.0, f"the last orphaned request was retried {slowest:.1f}s after the kill"
    p.wait_completed(batch_id, 300)
