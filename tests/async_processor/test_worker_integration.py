"""`holdback worker` as a process against a real database, a real Redis and an HTTP upstream.

Rows and RQ jobs are created here exactly as the processor does (job id = row id, result_ttl=0), so the
worker is tested alone. The upstream is the simulator (`holdback sim`) where it can produce the case,
and a scripted gateway (an HTTP server answering like llm-d's gateway: 429 + drop reason, Retry-After)
where a case needs an exact answer sequence.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import psutil
import pytest
from aiohttp import web
from rq import Queue
from rq.job import Job
from rq.registry import FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry
from rq.worker import Worker

from holdback.contract import requests_queue_name
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.contract import at_risk_key, circuit_key
from holdback.models import Attempt, Batch, RequestRow, Tenant
from holdback.results import close_unfinished, output_line
from holdback.models import RequestStatus
from tests.support import Processes, WakeListener, free_port, free_ports, poll, wait_http

FAST = ["--backoff-base", "0.05", "--backoff-cap", "0.2", "--heartbeat-ttl", "6", "--scheduler-interval", "0.05",
        "--drain-timeout", "2"]
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


# --- helpers ---------------------------------------------------------------------------------------------


class Stack:
    """This test's database, Redis queue and child processes."""

    def __init__(self, backend, tmp_path: Path):
        self.backend = backend
        self.engine = make_engine(backend.database_url)
        self.db = make_sessionmaker(self.engine)
        self.redis = backend.redis()
        self.queue = Queue(requests_queue_name(backend.namespace), connection=self.redis)
        self.procs = Processes(env=backend.env, log_dir=tmp_path / "logs")

    def close(self):
        self.procs.close()
        self.engine.dispose()

    def batch(self, n: int, body: dict | None = None, expires_in: float = 3600.0, enqueue: bool = True,
              url: str = "/v1/chat/completions"):
        body_text = json.dumps(body or CHAT)
        with transaction(self.db) as s:
            t = Tenant(name=f"tenant-{time.time_ns()}")
            s.add(t)
            s.flush()
            b = Batch(tenant_id=t.id, endpoint=url, input_file_id="file-x",
                      completion_window="24h", window_seconds=86400, status="in_progress", total=n,
                      in_progress_at=int(time.time()), expires_at=int(time.time() + expires_in))
            s.add(b)
            s.flush()
            rows = [RequestRow(batch_id=b.id, tenant_id=t.id, line=i + 1, custom_id=f"req-{i}",
                               url=url, body=body_text, status="queued") for i in range(n)]
            s.add_all(rows)
            s.flush()
            batch_id, tenant_id, row_ids = b.id, t.id, [r.id for r in rows]
        if enqueue:
            for row_id in row_ids:
                self.enqueue(row_id, batch_id)
        return batch_id, tenant_id, row_ids

    def enqueue(self, row_id: str, batch_id: str):
        self.queue.enqueue("async_processor.job.run_request", args=(row_id, batch_id), job_id=row_id, result_ttl=0)

    def worker(self, gateway_url: str, *extra: str, name: str = "worker", env: dict | None = None):
        metrics_port = free_port()
        proc = self.procs.start("worker", "-n", "8", "--gateway-url", gateway_url, "--metrics-port", str(metrics_port),
                                *FAST, *extra, name=name, env=env)
        wait_http(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30, proc=proc)
        proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        return proc

    def sim(self, *extra: str) -> str:
        port = free_ports(1)
        proc = self.procs.start("sim", "--port", str(port), "--replicas", "1", *extra, name="sim")
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        return f"http://127.0.0.1:{port}"

    def rows(self, row_ids) -> list[RequestRow]:
        with self.db() as s:
            return [s.get(RequestRow, r) for r in row_ids]

    def attempts(self, row_id) -> list[Attempt]:
        with self.db() as s:
            return s.query(Attempt).filter_by(request_id=row_id).order_by(Attempt.number).all()

    def wait_rows(self, row_ids, predicate, timeout=60.0, what="rows to finish"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = self.rows(row_ids)
            if all(predicate(r) for r in rows):
                return rows
            time.sleep(0.1)
        states = sorted({r.status for r in self.rows(row_ids)})
        raise AssertionError(f"timed out waiting for {what}; states {states}\n{self.procs.log('worker')}")

    def wait_final(self, row_ids, timeout=60.0):
        return self.wait_rows(row_ids, lambda r: r.status in ("succeeded", "failed", "cancelled", "expired"),
                              timeout)


def metric(url: str, name: str, **labels) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for line in httpx.get(url).text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


class ScriptedGateway:
    """An HTTP server that answers like an llm-d gateway, per x-request-id, from a script.

    `script(request_id, call_number) -> (status, headers, body | None, delay_seconds)`; a None body for a
    200 becomes an OpenAI chat completion with usage. Every request is recorded with its headers.
    """

    paths = ("/v1/chat/completions",)

    def __init__(self, script):
        self.script = script
        self.calls: dict[str, list[dict]] = defaultdict(list)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(10)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        for path in self.paths:
            app.router.add_post(path, self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._started.set()
        self._loop.run_forever()

    async def _handle(self, request: web.Request) -> web.Response:
        rid = request.headers.get("x-request-id", "")
        body = await request.read()
        self.calls[rid].append({"at": time.time(), "headers": dict(request.headers), "body": body})
        status, headers, out, delay = self.script(rid, len(self.calls[rid]))
        if delay:
            await asyncio.sleep(delay)
        if status == 200 and out is None:
            out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "model": "sim-model",
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                "finish_reason": "stop"}],
                   "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}}
        return web.json_response(out or {"error": {"message": "scripted", "type": "scripted"}}, status=status,
                                 headers=headers)

    def wait_calls(self, request_ids, n: int, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while any(len(self.calls[r]) < n for r in request_ids):
            assert time.monotonic() < deadline, f"requests never reached the scripted gateway {n} time(s)"
            time.sleep(0.02)

    def close(self):
        async def stop():
            await self._runner.cleanup()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(10)


@pytest.fixture
def stack(backend, tmp_path):
    s = Stack(backend, tmp_path)
    yield s
    s.close()


@pytest.fixture
def scripted():
    gateways = []

    def make(script):
        g = ScriptedGateway(script)
        gateways.append(g)
        return g

    yield make
    for g in gateways:
        g.close()


# --- tests ------------------------------------------------------------------------------------------------


def test_success_is_recorded_with_usage_and_the_job_leaves_redis(stack):
    sim = stack.sim("--decode-base-ms", "1", "--step-overhead-ms", "0.5")
    batch_id, _, row_ids = stack.batch(30)
    wakes = WakeListener(stack.redis, stack.backend.namespace)
    proc = stack.worker(sim)
    rows = stack.wait_final(row_ids)
    # The worker that made the last row final told the processors (jobqueue.Wakes): they finalize it now.
    wakes.wait_for(batch_id, 20, "a wake-up naming the batch", lambda: stack.procs.log("worker"))
    wakes.close()
    assert {r.status for r in rows} == {"succeeded"}
    assert all(r.output_tokens == 4 and r.input_tokens > 0 and r.attempts == 1 for r in rows)
    with stack.db() as s:
        b = s.get(Batch, batch_id)
        assert (b.completed, b.failed, b.output_tokens) == (30, 0, 120)
        assert b.input_tokens == sum(r.input_tokens for r in rows)
    a = stack.attempts(row_ids[0])[0]
    assert (a.outcome, a.status_code, a.evicted, a.output_tokens) == ("success", 200, False, 4)
    assert a.replica and a.worker and a.ended_at >= a.started_at
    line = output_line(rows[0])
    assert line["custom_id"] == "req-0" and line["response"]["body"]["usage"]["completion_tokens"] == 4
    # RQ sees a registered worker; the finished jobs are gone (result_ttl=0), nothing is left started.
    workers = Worker.all(queue=stack.queue)
    assert len(workers) == 1 and workers[0].pid == proc.pid
    # The worker records the row first, then moves the job in Redis and counts it: wait for that, do not sample.
    poll(lambda: stack.redis.exists(*(f"rq:job:{r}" for r in row_ids)) == 0
         and StartedJobRegistry(queue=stack.queue).get_job_ids(cleanup=False) == []
         and metric(proc.metrics_url, "holdback_worker_results_recorded_total", status="succeeded") == 30,
         20, "the jobs to leave Redis and be counted", lambda: stack.procs.log("worker"))
    assert metric(proc.metrics_url, "holdback_worker_attempts_total", outcome="success") == 30
    probes = proc.metrics_url.removesuffix("/metrics")
    ready = httpx.get(probes + "/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["checks"] == {"event_loop": "ok", "redis": "ok"}
    # SIGTERM: the worker unregisters from RQ.
    stack.procs.stop(proc)
    assert proc.returncode == 0
    assert Worker.all(queue=stack.queue) == []


def test_eviction_parks_the_row_honours_retry_after_and_then_succeeds(stack, scripted, backend):
    def script(rid, n):
        if n == 1:
            return 429, {"x-llm-d-request-dropped-reason": "evicted", "retry-after": "4"}, None, 0
        return 200, {"x-sim-replica": "replica-b"}, None, 0

    gw = scripted(script)
    batch_id, tenant_id, row_ids = stack.batch(3)
    proc = stack.worker(gw.url, env={"HOLDBACK_GATEWAY_KEY": "gw-secret"})
    # While it waits, the row is retry_wait and its job sits in the ScheduledJobRegistry, not in a slot. Both are
    # read in one poll: on a loaded machine the rows reach retry_wait at different times, and a wait read once
    # after the last could find the first already back in the queue (Retry-After 4 s leaves a wide window).
    def parked():
        waiting = all(r.status == "retry_wait" for r in stack.rows(row_ids))
        return waiting and set(row_ids) <= set(ScheduledJobRegistry(queue=stack.queue).get_job_ids()) \
            and StartedJobRegistry(queue=stack.queue).get_job_ids(cleanup=False) == []
    poll(parked, 20, "every row parked in retry_wait with its job scheduled, none in a slot",
         lambda: stack.procs.log("worker"))
    rows = stack.wait_final(row_ids)
    assert {r.status for r in rows} == {"succeeded"}
    for row in rows:
        assert (row.attempts, row.evictions, row.transient_failures) == (2, 1, 0)
        first, second = stack.attempts(row.id)
        assert (first.outcome, first.evicted, first.drop_reason, first.status_code) == ("evicted", True, "evicted", 429)
        assert (second.outcome, second.replica, second.input_tokens) == ("success", "replica-b", 11)
        # Retry-After is a floor for the wait between the two attempts.
        assert second.started_at - first.ended_at >= 3.9
        calls = gw.calls[row.id]
        assert len(calls) == 2
        for call in calls:
            h = {k.lower(): v for k, v in call["headers"].items()}
            assert h["x-request-id"] == row.id  # stable across attempts
            assert h["x-llm-d-inference-objective"] == "batch"
            assert h["x-llm-d-inference-fairness-id"] == tenant_id
            assert h["authorization"] == "Bearer gw-secret"
            assert abs(int(h["x-holdback-deadline"]) - rows[0].created_at - 3600) < 60
            # A resumable chat request is asked for streamed with its token ids (to resume from them), 8 tokens
            # an event, and says it can resume.
            assert json.loads(call["body"]) == {**CHAT, "stream": True, "return_token_ids": True, "stream_options": {
                "include_usage": True, "continuous_usage_stats": True}, "stream_interval": 8}
            assert h["x-holdback-resumable"] == "1"
    poll(lambda: metric(proc.metrics_url, "holdback_worker_evictions_total") == 3, 20, "three evictions counted")
    assert metric(proc.metrics_url, "holdback_worker_retries_total", outcome="evicted") == 3


def test_an_evicted_row_goes_back_in_line_at_once_whatever_the_backoff(stack, scripted, backend):
    """An eviction is the gateway's scheduling, not a failure: with `Retry-After: 0` (what holdback's gateway
    answers) the row's next attempt follows at once, though the failure backoff here is 30-60 s."""
    def script(rid, n):
        if n <= 2:
            return 429, {"x-llm-d-request-dropped-reason": "evicted", "retry-after": "0"}, None, 0
        return 200, {"x-sim-replica": "replica-b"}, None, 0

    gw = scripted(script)
    _, _, row_ids = stack.batch(3)
    proc = stack.worker(gw.url, "--backoff-base", "60", "--backoff-cap", "60")
    rows = stack.wait_final(row_ids, timeout=25)  # one backoff step would be 30 s at least
    assert {r.status for r in rows} == {"succeeded"}
    for row in rows:
        assert (row.attempts, row.evictions) == (3, 2)
        attempts = stack.attempts(row.id)
        gaps = [later.started_at - earlier.ended_at for earlier, later in zip(attempts, attempts[1:])]
        assert max(gaps) < 25, gaps
    poll(lambda: metric(proc.metrics_url, "holdback_worker_retries_total", outcome="evicted") == 6, 20,
         "six evicted retries counted")


def test_attempts_of_a_batch_marked_at_risk_say_so_to_the_gateway(stack, scripted, backend):
    """The processor marks a batch at risk of missing its window (holdback.risk) in Redis; the workers' attempts
    of that batch carry `x-holdback-at-risk: 1` (the gateway's at-risk floor), those of other batches do not."""
    gw = scripted(lambda rid, n: (200, {}, None, 0))
    risky_batch, _, risky = stack.batch(2)
    _, _, plain = stack.batch(2)
    stack.redis.zadd(at_risk_key(backend.namespace), {risky_batch: time.time() + 600})
    stack.worker(gw.url)
    rows = stack.wait_final(risky + plain)
    assert {r.status for r in rows} == {"succeeded"}
    for row_id in risky + plain:
        (call,) = gw.calls[row_id]
        marked = {k.lower(): v for k, v in call["headers"].items()}.get("x-holdback-at-risk")
        assert marked == ("1" if row_id in risky else None), row_id


def test_a_batch_turning_at_risk_has_its_attempts_waiting_in_the_gateway_sent_again_marked(stack, scripted, backend):
    """Attempts sent before their batch was marked at risk wait in the gateway's queue unmarked: the worker takes
    back those whose answer has not begun and sends them again at once, marked, so the gateway's floor sees them."""
    gw = scripted(lambda rid, n: (200, {}, None, 120 if n == 1 else 0))  # the first attempt waits "in the queue"
    batch_id, _, row_ids = stack.batch(3)
    stack.worker(gw.url)
    poll(lambda: all(gw.calls.get(r) for r in row_ids), 20, "every row's first attempt waiting at the gateway")
    stack.redis.zadd(at_risk_key(backend.namespace), {batch_id: time.time() + 600})
    rows = stack.wait_final(row_ids, timeout=60)  # the first attempts would answer only after 120 s
    assert {r.status for r in rows} == {"succeeded"}
    for row in rows:
        first, second = stack.attempts(row.id)
        assert (first.outcome, second.outcome) == ("cancelled", "success")
        assert "sent again, marked" in first.error and second.started_at - first.ended_at < 30
        marks = [{k.lower(): v for k, v in c["headers"].items()}.get("x-holdback-at-risk") for c in gw.calls[row.id]]
        assert marks == [None, "1"]


def test_server_errors_spend_the_budget_then_fail_with_an_error_line(stack):
    sim = stack.sim("--fault-500-rate", "1.0", "--decode-base-ms", "1")
    _, _, row_ids = stack.batch(2)
    proc = stack.worker(sim, "--transient-budget", "3")
    rows = stack.wait_final(row_ids)
    for row in rows:
        assert (row.status, row.error_code, row.response_status, row.attempts, row.transient_failures) == (
            "failed", "server_error", 500, 3, 3)
        assert [a.outcome for a in stack.attempts(row.id)] == ["server_error"] * 3
        line = output_line(row)
        assert line["response"]["status_code"] == 500 and "Injected fault" in json.dumps(line)
    # Failed rows' jobs are kept in RQ's FailedJobRegistry for operators (moved there after the row is final).
    poll(lambda: set(FailedJobRegistry(queue=stack.queue).get_job_ids()) == set(row_ids)
         and metric(proc.metrics_url, "holdback_worker_results_recorded_total", status="failed") == 2,
         20, "the failed jobs in the FailedJobRegistry, counted", lambda: stack.procs.log("worker"))
    # RQ's tools show why: the failed job's latest result carries the row's failure.
    reason = Job.fetch(row_ids[0], connection=stack.redis).latest_result().exc_string
    assert reason == f"server_error: {rows[0].error_message}" and "gave up after 3 transient failures" in reason


def test_transport_errors_are_retried_within_the_budget(stack):
    slow = stack.sim("--fault-delay-ms", "5000")  # reachable, but no answer within the request timeout
    _, _, row_ids = stack.batch(1)
    stack.worker(slow, "--transient-budget", "2", "--request-timeout", "0.3")
    (row,) = stack.wait_final(row_ids)
    assert (row.status, row.error_code, row.response_status, row.attempts) == ("failed", "transport_error", None, 2)
    line = output_line(row)
    assert line["response"] is None and line["error"]["code"] == "transport_error"
    assert "no complete answer within 0.3s" in line["error"]["message"]


def test_a_refused_gateway_opens_the_circuit_and_fails_nothing(stack):
    port = free_port()  # nothing listens yet: connection refused
    _, _, row_ids = stack.batch(4)
    proc = stack.worker(f"http://127.0.0.1:{port}", "--transient-budget", "1", "--probe-interval", "0.2")
    key = circuit_key(stack.backend.namespace)
    deadline = time.monotonic() + 30
    while not stack.redis.exists(key):
        assert time.monotonic() < deadline, stack.procs.log("worker")
        time.sleep(0.05)
    assert metric(proc.metrics_url, "holdback_worker_circuit_open") == 1
    rows = stack.rows(row_ids)
    assert all(r.status != "failed" and r.transient_failures == 0 for r in rows), [r.status for r in rows]
    # While the circuit is open nobody claims: the attempts stop growing.
    attempts = sum(r.attempts for r in rows)
    assert attempts <= 4 * 3, attempts

    sim = stack.procs.start("sim", "--port", str(port), "--replicas", "1", name="sim")
    wait_http(f"http://127.0.0.1:{port}/health", proc=sim)
    rows = stack.wait_final(row_ids)
    assert {r.status for r in rows} == {"succeeded"}
    assert not stack.redis.exists(key)
    assert metric(proc.metrics_url, "holdback_worker_circuit_probes_total", result="up") >= 1


def test_client_error_is_final_with_the_response_kept(stack):
    sim = stack.sim()
    _, _, row_ids = stack.batch(1, body={**CHAT, "model": "no-such-model"})
    stack.worker(sim)
    (row,) = stack.wait_final(row_ids)
    assert (row.status, row.response_status, row.attempts) == ("failed", 404, 1)  # vLLM: an unknown model is a 404
    assert stack.attempts(row.id)[0].outcome == "client_error"
    line = output_line(row)
    message = line["response"]["body"]["error"]["message"]
    assert line["response"]["status_code"] == 404 and message
    poll(lambda: FailedJobRegistry(queue=stack.queue).get_job_ids() == [row.id], 20,
         "the failed job in the FailedJobRegistry", lambda: stack.procs.log("worker"))
    assert Job.fetch(row.id, connection=stack.redis).latest_result().exc_string == f"HTTP 404: {message}"


def test_duplicate_deliveries_give_one_final_result_and_are_counted(stack):
    sim = stack.sim("--decode-base-ms", "30")  # ~120 ms per request: deliveries overlap
    batch_id, _, row_ids = stack.batch(5)
    for row_id in row_ids:  # every job delivered twice while the first is in flight
        stack.queue.push_job_id(row_id)
    w1, w2 = stack.worker(sim, name="w1"), stack.worker(sim, name="w2")
    rows = stack.wait_final(row_ids)
    assert {r.status for r in rows} == {"succeeded"}
    for row_id in row_ids:  # and once more after it is final
        stack.enqueue(row_id, batch_id)
    deadline = time.monotonic() + 20
    counted = 0.0
    while time.monotonic() < deadline:
        counted = sum(metric(w.metrics_url, "holdback_worker_duplicates_suppressed_total") for w in (w1, w2))
        if counted >= 10:
            break
        time.sleep(0.1)
    # Each of the 10 extra deliveries is suppressed exactly once: in-process, at begin, or by the CAS.
    assert counted == 10
    with stack.db() as s:
        b = s.get(Batch, batch_id)
        assert (b.completed, b.failed) == (5, 0)
        result_duplicates = sum(s.get(RequestRow, r).duplicates for r in row_ids)
    assert result_duplicates == sum(
        metric(w.metrics_url, "holdback_worker_duplicates_suppressed_total", stage="result") for w in (w1, w2))
    assert sum(metric(w.metrics_url, "holdback_worker_results_recorded_total") for w in (w1, w2)) == 5


def test_a_retry_never_runs_past_the_batch_deadline(stack, scripted):
    gw = scripted(lambda rid, n: (429, {"x-llm-d-request-dropped-reason": "rejected-saturated",
                                        "retry-after": "30"}, None, 0))
    # The worker is up before the batch exists: its first try must come before the deadline, and starting a
    # worker can take seconds on a loaded machine.
    proc = stack.worker(gw.url, "--closing-recheck", "1")
    _, _, row_ids = stack.batch(1, expires_in=8.0)
    (row,) = stack.wait_rows(row_ids, lambda r: r.attempts == 1 and r.status == "retry_wait", timeout=20)
    # Past the deadline the job keeps coming back (each time logged batch_closing) but never sends again.
    poll(lambda: stack.procs.log("worker").count('"event":"batch_closing"') >= 2, 40,
         "the job to come back twice after the deadline", lambda: stack.procs.log("worker"))
    (row,) = stack.rows(row_ids)
    assert len(gw.calls[row.id]) == 1
    assert (row.status, row.attempts) == ("retry_wait", 1)  # left for the processor's expiry, not failed
    with stack.db() as s:
        assert row.next_attempt_at == s.get(Batch, row.batch_id).expires_at
    (a,) = stack.attempts(row.id)
    assert (a.outcome, a.drop_reason, a.evicted) == ("rejected", "rejected-saturated", False)
    assert metric(proc.metrics_url, "holdback_worker_left_for_expiry_total") == 1


def test_a_killed_workers_request_is_requeued_and_completed_by_another(stack, scripted):
    # The first call hangs (the worker is killed meanwhile); later calls answer at once.
    gw = scripted(lambda rid, n: (200, {}, None, 60 if n == 1 else 0))
    _, _, row_ids = stack.batch(2)
    w1 = stack.worker(gw.url, "--heartbeat-ttl", "3", name="w1")
    gw.wait_calls(row_ids, 1)  # every request is at the gateway: the worker dies mid-request
    stack.procs.stop(w1, signal.SIGKILL)
    stack.worker(gw.url, "--heartbeat-ttl", "3", name="w2")
    rows = stack.wait_final(row_ids, timeout=60)
    assert {r.status for r in rows} == {"succeeded"}
    for row in rows:
        first, second = stack.attempts(row.id)
        assert first.outcome == "abandoned" and second.outcome == "success"
        assert len(gw.calls[row.id]) == 2


def test_cancel_aborts_in_flight_requests_at_the_simulator(stack, backend):
    sim = stack.sim("--decode-base-ms", "20", "--step-overhead-ms", "1")
    body = {**CHAT, "max_tokens": 5000, "ignore_eos": True}  # ~100 s per request unless aborted
    batch_id, _, row_ids = stack.batch(4, body=body)
    proc = stack.worker(sim)
    deadline = time.monotonic() + 20
    while httpx.get(f"{sim}/admin/state").json()["running"] < 4:
        assert time.monotonic() < deadline, "requests never reached the simulator"
        time.sleep(0.1)
    # The processor's cancel: close the rows first, then publish the batch id.
    with transaction(stack.db) as s:
        assert close_unfinished(s, batch_id, RequestStatus.cancelled, "batch_cancelled", "cancelled by user") == 4
    stack.redis.publish(f"{backend.namespace}:cancel", batch_id)
    deadline = time.monotonic() + 10
    while httpx.get(f"{sim}/admin/state").json()["running"] > 0:
        assert time.monotonic() < deadline, "the simulator kept running cancelled requests"
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while metric(proc.metrics_url, "holdback_worker_cancelled_total") < 4:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    for row_id in row_ids:
        (a,) = stack.attempts(row_id)
        assert a.outcome == "cancelled" and a.ended_at is not None
    assert {r.status for r in stack.rows(row_ids)} == {"cancelled"}
    # The worker counts a cancel, then deletes its job: wait for the deletion rather than race it.
    deadline = time.monotonic() + 10
    while stack.redis.exists(*(f"rq:job:{r}" for r in row_ids)):
        assert time.monotonic() < deadline, "the cancelled requests' jobs were never deleted"
        time.sleep(0.05)


def test_a_plain_rq_worker_runs_the_same_job(stack, backend):
    sim = stack.sim()
    _, _, row_ids = stack.batch(2)
    import subprocess
    import sys

    env = {**stack.procs.env, "HOLDBACK_GATEWAY_URL": sim}
    subprocess.run([sys.executable, "-m", "rq.cli", "worker", "--burst", "--worker-class", "rq.SimpleWorker",
                    "--url", backend.redis_url, stack.queue.name], env=env, check=True, timeout=60,
                   capture_output=True)
    rows = stack.rows(row_ids)
    assert {r.status for r in rows} == {"succeeded"} and all(r.output_tokens == 4 for r in rows)


def test_processes_share_the_queue_each_registered_with_rq(stack):
    sim = stack.sim("--decode-base-ms", "2")
    _, _, row_ids = stack.batch(40)
    port = free_port()
    proc = stack.procs.start("worker", "-n", "4", "--processes", "2", "--name", "pool", "--gateway-url", sim,
                             "--metrics-port", str(port), *FAST, name="worker")
    for i in range(2):
        wait_http(f"http://127.0.0.1:{port + i}/metrics", timeout=30, proc=proc)
    rows = stack.wait_final(row_ids)
    # A process serves metrics before it registers with RQ, and on a loaded machine the other may have done
    # all 40 meanwhile: wait for both registrations rather than sampling once.
    poll(lambda: sorted(w.name for w in Worker.all(queue=stack.queue)) == ["pool.0", "pool.1"], 30,
         "both worker processes registered with RQ", lambda: stack.procs.log("worker"))
    assert {r.status for r in rows} == {"succeeded"}
    recorded = [metric(f"http://127.0.0.1:{port + i}/metrics", "holdback_worker_results_recorded_total")
                for i in range(2)]
    assert sum(recorded) == 40
    # Gauges sum right over the processes: each names its worker, and the shared queue depth comes from the
    # one process holding the scheduler role only.
    urls = [f"http://127.0.0.1:{port + i}/metrics" for i in range(2)]
    for i, url in enumerate(urls):
        assert metric(url, "holdback_worker_in_flight", worker=f"pool.{i}") == 0
        assert f'holdback_worker_in_flight{{worker="pool.{1 - i}"}}' not in httpx.get(url).text

    def depth_exporters() -> list[str]:
        return [url for url in urls if 'holdback_worker_queue_depth{state="queued"}' in httpx.get(url).text]

    poll(lambda: len(depth_exporters()) == 1, 30, "exactly one worker process exporting the queue depth",
         lambda: "\n".join(httpx.get(url).text for url in urls))
    # Killing only the supervisor takes its children down too (they get SIGTERM and unregister).
    children = psutil.Process(proc.pid).children()
    assert len(children) == 2
    # Each child leads its own session, so the scheduler's per-session CPU share (autogroup) is per process.
    assert {os.getsid(c.pid) for c in children} == {c.pid for c in children}
    os.kill(proc.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(children, timeout=20)
    assert alive == [] and Worker.all(queue=stack.queue) == []


def test_sigterm_requeues_requests_still_running_after_the_drain_timeout(stack, scripted):
    gw = scripted(lambda rid, n: (200, {}, None, 60 if n == 1 else 0))  # first calls hang
    _, _, row_ids = stack.batch(3)
    w1 = stack.worker(gw.url, name="w1")
    gw.wait_calls(row_ids, 1)
    stack.procs.stop(w1)  # SIGTERM; --drain-timeout 2 in FAST
    assert w1.returncode == 0
    assert stack.queue.count == 3 and StartedJobRegistry(queue=stack.queue).get_job_ids(cleanup=False) == []
    stack.worker(gw.url, name="w2")
    rows = stack.wait_final(row_ids)
    assert {r.status for r in rows} == {"succeeded"}
    for row in rows:
        assert [a.outcome for a in stack.attempts(row.id)] == ["abandoned", "success"]


@pytest.mark.parametrize("argv, message", [
    (["-n", "0"], "--concurrency/-n must be at least 1"),
    (["--backoff-base", "5", "--backoff-cap", "1"], "--backoff-cap (1.0) must not be below --backoff-base"),
    (["--transient-budget", "0"], "--transient-budget must be at least 1"),
    (["--stream-interval", "0"], "--stream-interval must be at least 1"),
])
def test_cli_rejects_bad_flags_with_a_message_saying_what_to_change(argv, message, capsys):
    from async_processor.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_a_worker_back_from_a_stall_past_its_ttl_keeps_its_own_requests(stack, scripted):
    # The worker is stopped (as a process starved of CPU stalls) until its executions' heartbeats have lapsed;
    # the gateway answers only after it runs again. Its scheduler wakes with the heartbeat loop and must not take
    # its own live requests for a dead worker's (make test-vllm's worker requeued all it held this way, once).
    gw = scripted(lambda rid, n: (200, {}, None, 12))
    _, _, row_ids = stack.batch(2)
    proc = stack.worker(gw.url, "--heartbeat-ttl", "3")
    gw.wait_calls(row_ids, 1)
    started = StartedJobRegistry(queue=stack.queue)
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        poll(lambda: len(stack.redis.zrangebyscore(started.key, "-inf", time.time())) == 2, 20,
             "both executions to look abandoned")
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    rows = stack.wait_final(row_ids, timeout=60)
    assert {(r.status, r.attempts) for r in rows} == {("succeeded", 1)}
    assert all(len(gw.calls[r]) == 1 for r in row_ids)
    assert metric(proc.metrics_url, "holdback_worker_requeued_abandoned_total") == 0, stack.procs.log("worker")
