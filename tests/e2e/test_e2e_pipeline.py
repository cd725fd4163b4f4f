"""The whole stack for real: the official `openai` client → API → processor → Redis → workers → gateway →
simulator replicas, plus the fault drills (a worker killed mid-request, Redis flushed, the gateway restarted)
and cancellation reaching the simulator. Time is scaled down with short backoffs and simulator latencies.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import func, select

from holdback.db import make_engine, make_sessionmaker
from holdback.models import Attempt, RequestRow
from tests.support import (Processes, chat_lines, free_port, free_ports, poll, submit_batch, wait_batch,
                           wait_http)

pytestmark = pytest.mark.e2e

BATCH_KEY, REALTIME_KEY = "hb-e2e-batch-gateway-key", "hb-e2e-realtime-key"
WORKER_FAST = ["--backoff-base", "0.1", "--backoff-cap", "2", "--heartbeat-ttl", "6", "--scheduler-interval", "0.05",
               "--transient-budget", "10", "--drain-timeout", "2"]
PROCESSOR_FAST = ["--poll-interval", "0.1", "--reconcile-interval", "1", "--reconcile-grace", "2",
                  "--running-grace", "4"]
TERMINAL = {"completed", "failed", "expired", "cancelled"}


class Platform:
    """One test's platform: simulator replicas, gateway, API, processor and workers as child processes."""

    def __init__(self, backend, tmp_path: Path, *, replicas: int = 2, sim_args=(), gateway_config: str | None = None,
                 processor_args=()):
        self.backend = backend
        self.tmp_path = tmp_path
        self.sim_port = free_ports(replicas)
        self.sim_urls = [f"http://127.0.0.1:{self.sim_port + i}" for i in range(replicas)]
        self.gateway_port = free_port()
        self.gateway_url = f"http://127.0.0.1:{self.gateway_port}"
        self.api_url = f"http://127.0.0.1:{free_port()}"
        env = {**backend.env, "HOLDBACK_GATEWAY_URL": self.gateway_url, "HOLDBACK_GATEWAY_KEY": BATCH_KEY,
               "HOLDBACK_GATEWAY_BATCH_KEY": BATCH_KEY, "HOLDBACK_GATEWAY_REALTIME_KEY": REALTIME_KEY}
        self.procs = Processes(env=env, log_dir=tmp_path / "logs")
        self.gateway_config = None
        if gateway_config is not None:
            self.gateway_config = tmp_path / "gateway.yaml"
            self.gateway_config.write_text(gateway_config)
        # Started together, waited for in dependency order: each start-up costs seconds on a loaded machine.
        sim = self.procs.start("sim", "--port", str(self.sim_port), "--replicas", str(replicas), *sim_args, name="sim")
        api = self.procs.start("api", "--port", self.api_url.rsplit(":", 1)[1], name="api")
        self.processor = self.procs.start("processor", *PROCESSOR_FAST, *processor_args, name="processor")
        self.workers = [self.start_worker()]
        for url in self.sim_urls:
            wait_http(f"{url}/health", timeout=30, proc=sim)
        self.gateway = self.start_gateway()
        wait_http(f"{self.api_url}/readyz", timeout=30, proc=api)
        key = httpx.post(f"{self.api_url}/admin/keys", json={"tenant": "e2e"},
                         headers={"Authorization": f"Bearer {backend.admin_key}"}, timeout=10)
        key.raise_for_status()
        self.client = openai.OpenAI(base_url=f"{self.api_url}/v1", api_key=key.json()["key"], max_retries=5)
        self.db = make_sessionmaker(make_engine(backend.database_url))

    def start_gateway(self):
        args = ["--port", str(self.gateway_port), "--replicas", ",".join(self.sim_urls)]
        if self.gateway_config is not None:
            args += ["--config", str(self.gateway_config)]
        proc = self.procs.start("gateway", *args, name="gateway")
        wait_http(f"{self.gateway_url}/health", timeout=30, proc=proc)
        return proc

    def start_worker(self, *extra: str):
        return self.procs.start("worker", "-n", "64", *WORKER_FAST, *extra, name="worker")

    def close(self):
        self.procs.close()
        self.db.kw["bind"].dispose()

    # -- batches ------------------------------------------------------------------------------------------

    def submit(self, n: int, *, max_tokens: int = 8, extra_body: dict | None = None) -> str:
        return submit_batch(self.client, chat_lines(n, max_tokens=max_tokens, extra_body=extra_body))

    def wait(self, batch_id: str, timeout: float = 120.0, until=lambda b: b.status in TERMINAL):
        return wait_batch(self.client, batch_id, until, timeout,
                          lambda: f"{self.procs.log('worker')}\n{self.procs.log('processor')}")

    def wait_completed(self, batch_id: str, n: int, timeout: float = 120.0) -> list[dict]:
        """The batch completes; its output has exactly one line per custom_id, each a 200 with usage."""
        batch = self.wait(batch_id, timeout)
        assert batch.status == "completed", (batch.status, batch.errors)
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (n, n, 0)
        lines = [json.loads(x) for x in self.client.files.content(batch.output_file_id).text.splitlines() if x]
        ids = [line["custom_id"] for line in lines]
        assert len(ids) == n and set(ids) == {f"req-{i}" for i in range(n)}, "one output line per request"
        for line in lines:
            assert line["response"]["status_code"] == 200 and line["error"] is None
            assert line["response"]["body"]["usage"]["completion_tokens"] > 0
        assert batch.error_file_id is None
        assert batch.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in lines)
        assert batch.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in lines)
        return lines

    def attempt_outcomes(self, batch_id: str) -> dict[str, int]:
        with self.db() as s:
            return dict(s.execute(select(Attempt.outcome, func.count()).where(Attempt.batch_id == batch_id)
                                  .group_by(Attempt.outcome)).all())

    def progress(self, batch_id: str) -> int:
        return self.client.batches.retrieve(batch_id).request_counts.completed

    def sim_running(self) -> int:
        return sum(httpx.get(f"{u}/admin/state").json()["running"] for u in self.sim_urls)

    def wait_in_flight(self, n: int, what: str, timeout: float = 30.0) -> None:
        """Wait until at least n requests run at the simulator (sampling once races the worker's claims)."""
        poll(lambda: self.sim_running() >= n, timeout, what, lambda: self.procs.log("worker"))

    def rows_waiting(self, batch_id: str) -> int:
        with self.db() as s:
            return s.scalar(select(func.count()).where(RequestRow.batch_id == batch_id,
                                                       RequestRow.status.in_(("queued", "running"))))


@pytest.fixture
def platform_factory(backend, tmp_path):
    made = []

    def make(**kwargs) -> Platform:
        p = Platform(backend, tmp_path, **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def test_openai_client_batch_of_500_completes_with_one_line_per_request(platform_factory):
    p = platform_factory(sim_args=("--decode-base-ms", "1", "--step-overhead-ms", "0.5"))
    batch_id = p.submit(500)
    lines = p.wait_completed(batch_id, 500)
    batch = p.client.batches.retrieve(batch_id)
    assert batch.usage.output_tokens == 500 * 8 and batch.usage.input_tokens > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens
    assert len({line["id"] for line in lines}) == 500
    with p.db() as s:
        assert s.scalar(select(func.sum(RequestRow.duplicates)).where(RequestRow.batch_id == batch_id)) == 0
    assert p.attempt_outcomes(batch_id).get("success") == 500


# A pool small enough for a few requests to saturate: 2 replicas x 4; batch is held at half of it.
EVICTION_CONFIG = """
keys:
  - {key_env: HOLDBACK_GATEWAY_REALTIME_KEY, tenant: realtime, objectives: [realtime, standard, batch], defaultObjective: realtime}
  - {key_env: HOLDBACK_GATEWAY_BATCH_KEY, tenant: batch, objectives: [batch], relaysTenants: true}
anonymous: {enabled: false}
saturation: {detector: concurrency, maxConcurrency: 4}
eviction: {enabled: true, maxPerDecision: 2}
"""


def _realtime_bursts(gateway_url: str, stop: threading.Event, answers: list[int], bursts: int = 4):
    """Bursts of 8 concurrent realtime requests: the pool is full, so running batch work gets evicted."""
    headers = {"Authorization": f"Bearer {REALTIME_KEY}", "x-llm-d-inference-objective": "realtime"}
    body = {"model": "sim-model", "max_tokens": 30, "messages": [{"role": "user", "content": "realtime"}]}
    with httpx.Client(timeout=60) as client:
        for _ in range(bursts):
            if stop.is_set():
                return
            threads = [threading.Thread(target=lambda: answers.append(
                client.post(f"{gateway_url}/v1/chat/completions", json=body, headers=headers).status_code))
                for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stop.wait(1.5)


def test_evicted_requests_are_retried_and_complete_once(platform_factory):
    p = platform_factory(sim_args=("--decode-base-ms", "10", "--step-overhead-ms", "1"),
                         gateway_config=EVICTION_CONFIG)
    batch_id = p.submit(60, max_tokens=40)  # ~0.4 s each: batch work is running when realtime arrives
    stop, answers = threading.Event(), []
    traffic = threading.Thread(target=_realtime_bursts, args=(p.gateway_url, stop, answers), daemon=True)
    p.wait(batch_id, 60, until=lambda b: b.request_counts.completed >= 4)
    traffic.start()
    try:
        lines = p.wait_completed(batch_id, 60, timeout=150)
    finally:
        stop.set()
        traffic.join(60)
    assert answers and set(answers) == {200}, "realtime is never shed"
    outcomes = p.attempt_outcomes(batch_id)
    with p.db() as s:
        evicted_rows = s.scalars(select(Attempt.request_id).where(Attempt.batch_id == batch_id,
                                                                  Attempt.evicted.is_(True))).all()
        evictions = s.scalar(select(func.sum(RequestRow.evictions)).where(RequestRow.batch_id == batch_id))
        statuses = {r.status for r in s.scalars(select(RequestRow).where(RequestRow.id.in_(evicted_rows)))}
    assert outcomes.get("evicted", 0) >= 1 and len(evicted_rows) == outcomes["evicted"] == evictions
    assert statuses == {"succeeded"}, "every evicted request was retried to success"
    assert outcomes["success"] == 60 and len(lines) == 60


def test_worker_killed_mid_request_then_another_worker_finishes_the_batch(platform_factory):
    p = platform_factory(sim_args=("--decode-base-ms", "5", "--step-overhead-ms", "1"))
    batch_id = p.submit(300, max_tokens=30)  # ~0.2 s each
    p.wait(batch_id, 60, until=lambda b: b.request_counts.completed >= 40)
    p.wait_in_flight(4, "requests in flight when the worker dies")
    p.procs.stop(p.workers[0], signal.SIGKILL)
    p.workers.append(p.start_worker())
    p.wait_completed(batch_id, 300)
    outcomes = p.attempt_outcomes(batch_id)
    assert outcomes.get("abandoned", 0) >= 1 and outcomes["success"] == 300


def _flush_redis(backend, batch_row_ids: list[str]):
    r = backend.redis()
    if backend.kind == "embedded":
        r.flushdb()  # this test's own Redis server
        return
    # The machine's Redis is shared: delete only this namespace's keys and the jobs of this batch.
    keys = list(r.scan_iter(match=f"*{backend.namespace}*", count=1000))
    keys += [f"rq:job:{row_id}" for row_id in batch_row_ids]
    for i in range(0, len(keys), 500):
        r.delete(*keys[i:i + 500])


def test_redis_flushed_mid_batch_is_reconciled_to_one_result_per_request(platform_factory, backend):
    p = platform_factory(sim_args=("--decode-base-ms", "5", "--step-overhead-ms", "1"))
    batch_id = p.submit(300, max_tokens=30)
    p.wait(batch_id, 60, until=lambda b: b.request_counts.completed >= 40)
    with p.db() as s:
        row_ids = list(s.scalars(select(RequestRow.id).where(RequestRow.batch_id == batch_id)))
    # The flush must hit jobs that are queued or running: wait for some, do not sample once. No check after
    # the flush that the keys are gone: running workers and the reconciler write some back at once.
    poll(lambda: p.rows_waiting(batch_id) > 0, 30, "rows queued or running before the flush")
    job_keys = [f"rq:job:{r}" for r in row_ids]
    poll(lambda: backend.redis().exists(*job_keys) > 0, 30, "this batch's jobs in Redis before the flush")
    _flush_redis(backend, row_ids)
    p.wait_completed(batch_id, 300)
    assert p.attempt_outcomes(batch_id)["success"] == 300


def test_gateway_restarted_mid_batch_requests_retry_and_complete(platform_factory):
    p = platform_factory(sim_args=("--decode-base-ms", "5", "--step-overhead-ms", "1"))
    batch_id = p.submit(300, max_tokens=30)
    p.wait(batch_id, 60, until=lambda b: b.request_counts.completed >= 40)
    p.wait_in_flight(4, "requests in flight through the gateway when it dies")
    p.procs.stop(p.gateway, signal.SIGKILL)  # in-flight requests lose their connection
    p.gateway = p.start_gateway()
    p.wait_completed(batch_id, 300)
    outcomes = p.attempt_outcomes(batch_id)
    assert outcomes.get("transport_error", 0) >= 1 and outcomes["success"] == 300


def test_cancel_aborts_in_flight_requests_at_the_simulator(platform_factory):
    p = platform_factory(sim_args=("--decode-base-ms", "20", "--step-overhead-ms", "1"))
    batch_id = p.submit(6, max_tokens=4000, extra_body={"ignore_eos": True})  # ~80 s each unless aborted
    p.wait_in_flight(6, "the batch reaching the simulator")
    p.client.batches.cancel(batch_id)
    poll(lambda: p.sim_running() == 0, 30, "the simulator to stop running the cancelled batch")
    batch = p.wait(batch_id, 30)
    assert batch.status == "cancelled" and batch.request_counts.failed == 6
    poll(lambda: p.attempt_outcomes(batch_id).get("cancelled", 0) >= 6, 20, "six cancelled attempts",
         lambda: p.attempt_outcomes(batch_id))
