"""Pausing a queue stops dispatch: a real `holdback worker` in front of the simulator takes no new job from a
paused queue (jobs already in flight finish), and takes them again once the queue is resumed.

The pause flag is set through the operator route (`POST /admin/queues/{name}/pause`), as the dashboard does;
rows and RQ jobs are written as the processor writes them (job id = row id).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from rq import Queue
from sqlalchemy import func, select

from holdback.contract import requests_queue_name
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Attempt, Batch, RequestRow, Tenant
from tests.batch_api.conftest import serve
from tests.support import Processes, free_ports, wait_http

pytestmark = pytest.mark.e2e

WORKER_FAST = ["--backoff-base", "0.05", "--backoff-cap", "0.2", "--heartbeat-ttl", "6", "--scheduler-interval", "0.05",
               "--drain-timeout", "2"]
# 30 tokens at ~20 ms a step: each request runs for about half a second, so some are in flight at the pause.
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 30}


def _rows(db, n: int) -> tuple[str, list[str]]:
    with transaction(db) as s:
        tenant = Tenant(name=f"tenant-{time.time_ns()}")
        s.add(tenant)
        s.flush()
        batch = Batch(tenant_id=tenant.id, endpoint="/v1/chat/completions", input_file_id="file-x",
                      completion_window="24h", window_seconds=86400, status="in_progress", total=n,
                      in_progress_at=int(time.time()), expires_at=int(time.time()) + 3600)
        s.add(batch)
        s.flush()
        rows = [RequestRow(batch_id=batch.id, tenant_id=tenant.id, line=i + 1, custom_id=f"req-{i}",
                           url="/v1/chat/completions", body=json.dumps(CHAT), status="queued") for i in range(n)]
        s.add_all(rows)
        s.flush()
        return batch.id, [r.id for r in rows]


def _counts(db, batch_id: str) -> dict[str, int]:
    with db() as s:
        counts = dict(s.execute(select(RequestRow.status, func.count()).where(RequestRow.batch_id == batch_id)
                                .group_by(RequestRow.status)).all())
        counts["attempts"] = s.scalar(select(func.count()).select_from(Attempt).where(Attempt.batch_id == batch_id))
    return counts


def _wait(predicate, timeout: float, what: str, detail=lambda: ""):  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{detail()}")


def test_a_paused_queue_dispatches_nothing_until_resumed(backend, tmp_path):
    engine = make_engine(backend.database_url)
    db = make_sessionmaker(engine)
    api = serve(backend.settings())
    name = requests_queue_name(backend.namespace)
    operator = httpx.Client(base_url=api.url, headers={"authorization": f"Bearer {backend.admin_key}"}, timeout=10)
    connection = backend.redis()
    queue = Queue(name, connection=connection)
    n = 24  # ~6 s of work at -n 2: the queue still holds jobs when the worker sees the second pause
    batch_id, row_ids = _rows(db, n)
    for row_id in row_ids:
        queue.enqueue("async_processor.job.run_request", args=(row_id, batch_id), job_id=row_id, result_ttl=0)
    try:
        with Processes(env=backend.env, log_dir=tmp_path / "logs") as procs:
            port = free_ports(1)
            sim = procs.start("sim", "--port", str(port), "--decode-base-ms", "20", name="sim")
            wait_http(f"http://127.0.0.1:{port}/health", proc=sim)
            # Paused before the worker starts: it must not take a single job.
            assert operator.post(f"/admin/queues/{name}/pause").json()["paused"] is True
            procs.start("worker", "-n", "2", "--gateway-url", f"http://127.0.0.1:{port}", *WORKER_FAST, name="worker")
            # The worker logs when it sees the flag; from then on it claims nothing, so no quiet period is needed.
            _wait(lambda: '"event":"dispatch_paused"' in procs.log("worker"), 30, "the worker to see the pause",
                  lambda: procs.log("worker"))
            assert queue.count == n and _counts(db, batch_id).get("attempts") == 0, "nothing dispatched while paused"

            operator.post(f"/admin/queues/{name}/resume")
            _wait(lambda: _counts(db, batch_id).get("succeeded", 0) >= 3, 60, "work to start after resume",
                  lambda: procs.log("worker"))

            assert operator.post(f"/admin/queues/{name}/pause").json()["changed"] is True
            # In-flight requests finish once the worker has seen the flag a second time; it claims nothing after.
            _wait(lambda: procs.log("worker").count('"event":"dispatch_paused"') >= 2, 30, "the worker to see the pause",
                  lambda: procs.log("worker"))
            _wait(lambda: _counts(db, batch_id).get("running", 0) == 0, 30, "in-flight requests to finish",
                  lambda: procs.log("worker"))
            held = _counts(db, batch_id)
            waiting = queue.count
            assert waiting + held.get("succeeded", 0) == n, "every row is either done or still queued"
            assert waiting > 0, "the pause came before the queue drained"
            operator.post(f"/admin/queues/{name}/resume")
            _wait(lambda: _counts(db, batch_id).get("succeeded", 0) == n, 60, "every row to succeed after resume",
                  lambda: procs.log("worker"))
            assert queue.count == 0
    finally:
        api.stop()
        engine.dispose()
