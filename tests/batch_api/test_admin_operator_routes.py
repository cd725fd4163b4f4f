"""The operator JSON routes the dashboard and the study benchmark use: request rows and attempts of any
tenant's batch, operator cancel and download, RQ queue counts, pause/resume and retry-failed, workers.

Rows, attempts and RQ jobs are written the way the processor and the workers write them (job id = row id),
against this test's real database and Redis.
"""

from __future__ import annotations

import io
import json
import time

import httpx
from rq import Queue
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry
from rq.worker import Worker

from holdback.broker import is_paused
from holdback.contract import JOB_FUNCTION, pause_key, requests_queue_name
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Attempt, Batch, RequestRow, Tenant


class Rows:
    """A batch of request rows with chosen statuses, evictions and attempts, straight into the database."""

    def __init__(self, backend):  # noqa: ANN001
        self.engine = make_engine(backend.database_url)
        self.db = make_sessionmaker(self.engine)

    def batch(self, specs: list[dict], status: str = "in_progress") -> tuple[str, list[str]]:
        with transaction(self.db) as s:
            tenant = Tenant(name=f"tenant-{time.time_ns()}")
            s.add(tenant)
            s.flush()
            batch = Batch(tenant_id=tenant.id, endpoint="/v1/chat/completions", input_file_id="file-x",
                          completion_window="24h", window_seconds=86400, status=status, total=len(specs),
                          expires_at=int(time.time()) + 86400)
            s.add(batch)
            s.flush()
            ids = []
            for i, spec in enumerate(specs):
                row = RequestRow(batch_id=batch.id, tenant_id=tenant.id, line=i + 1, custom_id=f"req-{i}",
                                 url="/v1/chat/completions", body="{}", status=spec.get("status", "queued"),
                                 evictions=spec.get("evictions", 0), attempts=len(spec.get("attempts", [])))
                s.add(row)
                s.flush()
                for n, (started, outcome, *extra) in enumerate(spec.get("attempts", []), start=1):
                    s.add(Attempt(request_id=row.id, batch_id=batch.id, number=n, worker="w1", started_at=started,
                                  ended_at=started + 0.5, outcome=outcome, evicted=outcome == "evicted",
                                  status_code=429 if outcome == "evicted" else 200,
                                  drop_reason="evicted" if outcome == "evicted" else None, **(extra or [{}])[0]))
                ids.append(row.id)
            return batch.id, ids

    def close(self) -> None:
        self.engine.dispose()


def admin(api) -> httpx.Client:  # noqa: ANN001
    return api.http(api.settings.admin_key)


# ---- auth ----------------------------------------------------------------------------------------------------


def test_operator_routes_need_the_admin_key(api):
    tenant_key = api.create_key("acme")
    routes = [
        ("GET", "/admin/batches/batch_x"), ("GET", "/admin/batches/batch_x/requests"),
        ("POST", "/admin/batches/batch_x/cancel"), ("GET", "/admin/requests/batch_req_x/attempts"),
        ("GET", "/admin/files/file-x/content"), ("GET", "/admin/queues"), ("GET", "/admin/workers"),
        ("POST", "/admin/queues/q/pause"), ("POST", "/admin/queues/q/resume"),
        ("POST", "/admin/queues/q/retry-failed"),
    ]
    for method, path in routes:
        anonymous = httpx.request(method, api.url + path)
        assert anonymous.status_code == 401, (path, anonymous.text)
        assert anonymous.json()["error"]["code"] == "missing_api_key"
        as_tenant = api.http(tenant_key).request(method, path)
        assert as_tenant.status_code == 403, (path, as_tenant.text)
        assert as_tenant.json()["error"]["code"] == "admin_key_required"
        wrong = api.http("not-a-key").request(method, path)
        assert wrong.status_code == 401, (path, wrong.text)


# ---- request rows and attempts ------------------------------------------------------------------------------


def test_requests_are_listed_in_line_order_with_filters_and_a_cursor(api, backend):
    rows = Rows(backend)
    t0 = 1_700_000_000.0
    batch_id, ids = rows.batch([
        {"status": "succeeded", "attempts": [(t0 + 5, "evicted"), (t0 + 9, "success")], "evictions": 1},
        {"status": "queued"},
        {"status": "retry_wait", "attempts": [(t0 + 3, "evicted")], "evictions": 1},
        {"status": "failed", "attempts": [(t0 + 1, "client_error")]},
        {"status": "running", "attempts": [(t0 + 2, "success")]},
        {"status": "succeeded", "attempts": [(t0 + 4, "success")]},
        {"status": "pending"},
    ])
    rows.batch([{"status": "queued"}])  # another batch's rows never show
    rows.close()
    client = admin(api)

    page = client.get(f"/admin/batches/{batch_id}/requests").json()
    assert page["object"] == "list" and page["has_more"] is False
    assert [r["id"] for r in page["data"]] == ids
    assert [r["line"] for r in page["data"]] == [1, 2, 3, 4, 5, 6, 7]
    first = page["data"][0]
    assert first["first_attempt_at"] == t0 + 5, "the earliest attempt's start"
    assert (first["attempts"], first["evictions"], first["custom_id"]) == (2, 1, "req-0")
    assert page["data"][1]["first_attempt_at"] is None
    assert set(first) == {"id", "custom_id", "line", "status", "attempts", "evictions", "duplicates",
                          "transient_failures", "created_at", "enqueued_at", "first_attempt_at", "finished_at",
                          "input_tokens", "output_tokens", "response_status", "error_code", "error_message"}

    seen, after = [], None
    while True:
        params = {"limit": 3, **({"after": after} if after else {})}
        page = client.get(f"/admin/batches/{batch_id}/requests", params=params).json()
        seen += [r["id"] for r in page["data"]]
        assert page["first_id"] == page["data"][0]["id"] and page["last_id"] == page["data"][-1]["id"]
        after = page["last_id"]
        if not page["has_more"]:
            break
    assert seen == ids

    def listed(**params) -> list[str]:
        r = client.get(f"/admin/batches/{batch_id}/requests", params=params)
        assert r.status_code == 200, r.text
        return [x["id"] for x in r.json()["data"]]

    assert listed(status="succeeded") == [ids[0], ids[5]]
    assert listed(evicted="true") == [ids[0], ids[2]]
    assert listed(evicted="false") == [ids[1], ids[3], ids[4], ids[5], ids[6]]
    assert listed(unfinished="true") == [ids[1], ids[2], ids[4], ids[6]]
    assert listed(unfinished="false") == [ids[0], ids[3], ids[5]]
    assert listed(unfinished="true", evicted="true", after=ids[0]) == [ids[2]]
    assert listed(status="queued", limit=1) == [ids[1]]

    for bad in ({"limit": 0}, {"limit": 1001}, {"status": "done"}, {"evicted": "maybe"}):
        r = client.get(f"/admin/batches/{batch_id}/requests", params=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == next(iter(bad))


def test_attempts_of_a_request_in_order(api, backend):
    rows = Rows(backend)
    batch_id, ids = rows.batch([{"status": "succeeded", "evictions": 1,
                                 "attempts": [(100.0, "evicted"), (104.0, "success", {"tokens_kept": 9})]}])
    rows.close()
    body = admin(api).get(f"/admin/requests/{ids[0]}/attempts").json()
    assert [(a["tokens_kept"], a["tokens_recomputed"]) for a in body["data"]] == [(0, 0), (9, 0)]
    assert body["request_id"] == ids[0] and body["batch_id"] == batch_id
    assert [(a["number"], a["outcome"], a["evicted"], a["drop_reason"], a["status_code"]) for a in body["data"]] == [
        (1, "evicted", True, "evicted", 429), (2, "success", False, None, 200)]
    assert body["data"][0]["started_at"] == 100.0 and body["data"][0]["ended_at"] == 100.5


def test_unknown_ids_answer_404_with_what_to_do(api, backend):
    rows = Rows(backend)
    batch_id, _ids = rows.batch([{"status": "queued"}])
    _other, other_ids = rows.batch([{"status": "queued"}])
    rows.close()
    client = admin(api)
    for method, path, param in [
        ("GET", "/admin/batches/batch_nope", "batch_id"),
        ("GET", "/admin/batches/batch_nope/requests", "batch_id"),
        ("POST", "/admin/batches/batch_nope/cancel", "batch_id"),
        ("GET", f"/admin/batches/{batch_id}/requests?after={other_ids[0]}", "after"),
        ("GET", "/admin/requests/batch_req_nope/attempts", "row_id"),
        ("GET", "/admin/files/file-nope/content", "file_id"),
        ("POST", "/admin/queues/no-such-queue/pause", "name"),
        ("POST", "/admin/queues/no-such-queue/retry-failed", "name"),
    ]:
        r = client.request(method, path)
        assert r.status_code == 404, (path, r.text)
        error = r.json()["error"]
        assert error["code"] == "not_found" and error["param"] == param, (path, error)
        assert error["message"].startswith("No "), error


# ---- operator cancel and download ------------------------------------------------------------------------------


def test_operator_cancels_any_tenants_batch_like_the_tenant_route(api):
    key = api.create_key("acme")
    client = api.openai(key)
    f = client.files.create(file=("in.jsonl", io.BytesIO(b'{"custom_id":"a"}\n')), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")

    r = admin(api).post(f"/admin/batches/{batch.id}/cancel")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "cancelling" and body["cancelling_at"] and body["tenant_id"]
    assert client.batches.retrieve(batch.id).status == "cancelling", "the tenant sees the operator's cancel"
    again = admin(api).post(f"/admin/batches/{batch.id}/cancel")
    assert again.status_code == 200 and again.json()["status"] == "cancelling"


def test_operator_cancel_of_a_finished_batch_says_why_not(api, backend):
    rows = Rows(backend)
    batch_id, _ = rows.batch([{"status": "succeeded"}], status="completed")
    rows.close()
    r = admin(api).post(f"/admin/batches/{batch_id}/cancel")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "batch_not_cancellable"
    assert "already completed" in r.json()["error"]["message"]


def test_operator_downloads_any_tenants_file(api):
    key = api.create_key("acme")
    content = b'{"custom_id": "a"}\n{"custom_id": "b"}\n'
    f = api.openai(key).files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    r = admin(api).get(f"/admin/files/{f.id}/content")
    assert r.status_code == 200 and r.content == content
    assert 'filename="in.jsonl"' in r.headers["content-disposition"]
    api.openai(key).files.delete(f.id)
    assert admin(api).get(f"/admin/files/{f.id}/content").status_code == 404


# ---- queues --------------------------------------------------------------------------------------------------


def test_queue_counts_and_pause_resume_flags(api, backend):
    rows = Rows(backend)
    batch_id, ids = rows.batch([{"status": "queued"}] * 3)
    rows.close()
    connection = backend.redis()
    name = requests_queue_name(backend.namespace)
    queue = Queue(name, connection=connection)
    for row_id in ids:
        queue.enqueue(JOB_FUNCTION, args=(row_id, batch_id), job_id=row_id, result_ttl=0)
    Queue(f"{backend.namespace}-extra", connection=connection).enqueue(JOB_FUNCTION, args=("x", "y"))
    client = admin(api)

    listed = {q["name"]: q for q in client.get("/admin/queues").json()["data"]}
    assert set(listed) == {name, f"{backend.namespace}-extra"}, "only this namespace's queues"
    q = listed[name]
    assert (q["queued"], q["started"], q["scheduled"], q["failed"], q["deferred"], q["finished"]) == (3, 0, 0, 0, 0, 0)
    assert q["paused"] is False

    paused = client.post(f"/admin/queues/{name}/pause").json()
    assert paused["paused"] is True and paused["changed"] is True and paused["queued"] == 3
    assert is_paused(connection, backend.namespace, name)
    assert connection.exists(pause_key(backend.namespace, name))
    assert client.post(f"/admin/queues/{name}/pause").json()["changed"] is False
    assert {q["name"]: q["paused"] for q in client.get("/admin/queues").json()["data"]}[name] is True

    resumed = client.post(f"/admin/queues/{name}/resume").json()
    assert resumed["paused"] is False and resumed["changed"] is True
    assert not is_paused(connection, backend.namespace, name)
    assert client.post(f"/admin/queues/{name}/resume").json()["changed"] is False


def test_retry_failed_requeues_only_jobs_whose_rows_are_in_flight(api, backend):
    rows = Rows(backend)
    batch_id, ids = rows.batch([{"status": "queued"}, {"status": "retry_wait"}, {"status": "failed"},
                                {"status": "pending"}, {"status": "running"}])
    rows.close()
    connection = backend.redis()
    name = requests_queue_name(backend.namespace)
    queue = Queue(name, connection=connection)
    failed = FailedJobRegistry(name, connection=connection)
    for row_id in ids:
        job = queue.enqueue(JOB_FUNCTION, args=(row_id, batch_id), job_id=row_id, result_ttl=0)
        connection.lrem(queue.key, 0, row_id)  # a worker took it ...
        job.set_status(JobStatus.FAILED)  # ... and it failed
        failed.add(job, ttl=3600, exc_string="boom")
    connection.delete(Job.key_for(ids[4]))  # the running row's job hash expired: nothing left to requeue
    connection.zadd(failed.key, {"batch_req_unknown": time.time() + 3600})

    r = admin(api).post(f"/admin/queues/{name}/retry-failed")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["examined"], body["requeued"], body["kept"], body["cleared"]) == (6, 2, 3, 1), body
    assert sorted(queue.get_job_ids()) == sorted([ids[0], ids[1]])
    assert Job.fetch(ids[0], connection=connection).get_status() == JobStatus.QUEUED
    left = {x.decode() for x in connection.zrange(failed.key, 0, -1)}
    assert left == {ids[2], ids[3], "batch_req_unknown"}, "final, pending and unknown rows stay failed"
    listed = {q["name"]: q for q in admin(api).get("/admin/queues").json()["data"]}[name]
    assert (listed["queued"], listed["failed"]) == (2, 3)
    again = admin(api).post(f"/admin/queues/{name}/retry-failed").json()
    assert (again["requeued"], again["kept"]) == (0, 3)


def test_workers_registered_on_the_namespace_queue_are_listed(api, backend):
    connection = backend.redis()
    name = requests_queue_name(backend.namespace)
    worker = Worker([Queue(name, connection=connection)], connection=connection, name=f"{backend.namespace}-w1")
    worker.register_birth()
    other = Worker([Queue("elsewhere", connection=connection)], connection=connection, name=f"{backend.namespace}-w2")
    other.register_birth()
    try:
        listed = admin(api).get("/admin/workers").json()["data"]
        assert [w["name"] for w in listed] == [f"{backend.namespace}-w1"]
        w = listed[0]
        assert w["queues"] == [name] and w["current_jobs"] == [] and w["pid"] == worker.pid
        assert w["heartbeat_age_s"] is not None and w["heartbeat_age_s"] < 600
        json.dumps(w)
    finally:
        worker.register_death()
        other.register_death()
