"""The operator's first hour, over plain HTTP on this test's database and Redis (SQLite or PostgreSQL): a
replica's error message and body, a batch whose every line failed, cancelled requests apart from failed ones
(pages, the API's OpenAI counts and /metrics), the banner, search and the tenant filter, per-tenant usage
against sums over the database, creating a key, a batch's throughput and ETA, and the charts' ranges.

The browser tests (tests/e2e/test_dashboard_operator_browser.py) drive the same pages in Chromium against
the whole stack; these pin each figure against the rows behind it.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from batch_api.dashboard.sampler import DashboardSampler, next_sample, samples_key
from holdback.broker import set_paused
from holdback.contract import requests_queue_name
from holdback.db import make_engine, make_sessionmaker, transaction
from holdback.models import Attempt, Batch, RequestRow, RequestStatus, Tenant
from holdback.results import close_unfinished
from tests.batch_api.test_admin_dashboard import signed_in

REPLICA_400 = {"error": {"message": "n must be at least 1, got 0.", "type": "BadRequestError", "param": None,
                         "code": 400}}


class Seed:
    """Tenants, batches, rows and attempts written straight into the test's database."""

    def __init__(self, backend):  # noqa: ANN001
        self.engine = make_engine(backend.database_url)
        self.db = make_sessionmaker(self.engine)

    def tenant(self, name: str) -> str:
        with transaction(self.db) as s:
            tenant = Tenant(name=name)
            s.add(tenant)
            s.flush()
            return tenant.id

    def batch(self, tenant_id: str, rows: list[dict], *, status: str = "in_progress", created_at: int | None = None,
              metadata: dict | None = None, **fields) -> tuple[str, list[str]]:
        """A batch whose counters agree with its rows, as the workers and the processor would leave them."""
        now = time.time()
        with transaction(self.db) as s:
            final = [r for r in rows if r.get("status", "queued") in ("succeeded", "failed", "cancelled", "expired")]
            batch = Batch(tenant_id=tenant_id, endpoint="/v1/chat/completions", input_file_id="file-in",
                          completion_window="24h", window_seconds=86400, status=status, total=len(rows),
                          created_at=created_at or int(now), in_progress_at=created_at or int(now),
                          expires_at=int(now) + 86400, metadata_=metadata,
                          completed=sum(r.get("status") == "succeeded" for r in final),
                          failed=sum(r.get("status") != "succeeded" for r in final),
                          cancelled=sum(r.get("status") == "cancelled" for r in final),
                          input_tokens=sum(r.get("tokens", (0, 0))[0] for r in final),
                          output_tokens=sum(r.get("tokens", (0, 0))[1] for r in final), **fields)
            s.add(batch)
            s.flush()
            ids = []
            for i, spec in enumerate(rows):
                tokens = spec.get("tokens", (0, 0))
                row = RequestRow(
                    batch_id=batch.id, tenant_id=tenant_id, line=i + 1, custom_id=spec.get("custom_id", f"req-{i}"),
                    url="/v1/chat/completions", body="{}", status=spec.get("status", "queued"),
                    finished_at=spec.get("finished_at"), response_status=spec.get("response_status"),
                    response_body=spec.get("response_body"), error_code=spec.get("error_code"),
                    error_message=spec.get("error_message"), input_tokens=tokens[0], output_tokens=tokens[1],
                    attempts=len(spec.get("attempts", [])), evictions=sum(a.get("evicted", False)
                                                                          for a in spec.get("attempts", [])))
                s.add(row)
                s.flush()
                for n, a in enumerate(spec.get("attempts", []), start=1):
                    s.add(Attempt(request_id=row.id, batch_id=batch.id, number=n, worker="w1",
                                  started_at=a["started_at"], ended_at=a["started_at"] + 0.5, outcome=a["outcome"],
                                  status_code=a.get("status_code"), evicted=a.get("evicted", False),
                                  replica=a.get("replica"), drop_reason=a.get("drop_reason")))
                ids.append(row.id)
            return batch.id, ids

    def close(self) -> None:
        self.engine.dispose()


@pytest.fixture
def seed(backend):  # noqa: ANN001
    s = Seed(backend)
    yield s
    s.close()


def admin(api) -> httpx.Client:  # noqa: ANN001
    return api.http(api.settings.admin_key)


def test_a_replicas_error_shows_its_message_and_body_and_all_failed_is_not_green(api, seed):
    tenant = seed.tenant("acme")
    now = time.time()
    failed_400 = {"status": "failed", "finished_at": now, "response_status": 400,
                  "response_body": json.dumps(REPLICA_400),
                  "attempts": [{"started_at": now - 1, "outcome": "client_error", "status_code": 400,
                                "replica": "http://127.0.0.1:8001"}]}
    batch_id, ids = seed.batch(tenant, [failed_400, dict(failed_400, custom_id="other")], status="completed",
                               completed_at=int(now))
    client, _ = signed_in(api)

    rows = admin(api).get(f"/admin/batches/{batch_id}/requests").json()["data"]
    assert [r["error_message"] for r in rows] == ["n must be at least 1, got 0."] * 2
    table = client.get(f"/dashboard/fragments/batches/{batch_id}/requests").text
    assert table.count("n must be at least 1, got 0.") >= 2, "the ERROR column shows the replica's message"

    drawer = client.get(f"/dashboard/fragments/requests/{ids[0]}/attempts").text
    assert "the replica answered HTTP 400: n must be at least 1, got 0." in drawer
    # The gateway's own refusal (it carries a drop reason, and no replica ran it) is not the replica's answer.
    refused = dict(failed_400, custom_id="refused", attempts=[{"started_at": now - 1, "outcome": "client_error",
                                                               "status_code": 400,
                                                               "drop_reason": "rejected-context-length"}])
    _, (refused_id,) = seed.batch(tenant, [refused], status="completed", completed_at=int(now))
    refused_drawer = client.get(f"/dashboard/fragments/requests/{refused_id}/attempts").text
    assert "the gateway refused it (rejected-context-length): HTTP 400" in refused_drawer
    assert "the replica answered" not in refused_drawer
    body = re.search(r'data-testid="result-body">(.*?)</pre>', drawer, re.S).group(1)
    assert json.loads(body.replace("&#34;", '"').replace("&quot;", '"')) == REPLICA_400, "the body, whole"

    # Every line failed: the API says completed (as OpenAI does); the dashboard does not paint it green.
    assert admin(api).get(f"/admin/batches/{batch_id}").json()["status"] == "completed"
    for page in (client.get("/dashboard").text, client.get(f"/dashboard/batches/{batch_id}").text):
        badge = re.search(r'<span class="badge badge-([\w-]+)" data-status="completed"[^>]*>([^<]+)</span>', page)
        assert badge and badge.groups() == ("all-failed", "completed · all failed"), badge


def test_a_succeeded_rows_output_is_in_its_drawer(api, seed):
    tenant = seed.tenant("acme")
    answer = {"id": "chatcmpl-1", "choices": [{"message": {"role": "assistant", "content": "forty-two"}}]}
    _, (row_id,) = seed.batch(tenant, [{"status": "succeeded", "finished_at": time.time(), "response_status": 200,
                                        "response_body": json.dumps(answer)}])
    client, _ = signed_in(api)
    drawer = client.get(f"/dashboard/fragments/requests/{row_id}/attempts").text
    assert "<b>Output</b>" in drawer and "forty-two" in drawer and 'data-testid="result-message"' not in drawer


def test_cancelled_requests_are_their_own_series_and_the_api_keeps_openais_counts(api, seed, backend):
    tenant = seed.tenant("acme")
    batch_id, _ = seed.batch(tenant, [{"status": "succeeded", "finished_at": time.time()}] + [{}] * 4,
                             status="cancelling")
    with transaction(seed.db) as s:
        assert close_unfinished(s, batch_id, RequestStatus.cancelled, "batch_cancelled", "cancelled") == 4
    with seed.db() as s:
        batch = s.get(Batch, batch_id)
        assert (batch.completed, batch.failed, batch.cancelled) == (1, 4, 4), "counted by the closing transaction"
    counts = admin(api).get(f"/admin/batches/{batch_id}").json()["request_counts"]
    assert counts == {"total": 5, "completed": 1, "failed": 4}, "OpenAI's shape: cancelled are failed there"

    client, _ = signed_in(api)
    listing = client.get("/dashboard/fragments/batches").text
    assert 'data-testid="cancelled-count">4 cancelled<' in listing and "failed</span>" not in listing
    summary = client.get(f"/dashboard/fragments/batches/{batch_id}/summary").text
    stat = re.search(r'<div class="stat [^"]*"><div class="stat-value">(\d+)</div><div class="stat-label">failed', summary)
    assert stat and stat.group(1) == "0", "a cancel is not a failure"
    assert re.search(r'<div class="stat-value">4</div><div class="stat-label">cancelled', summary)

    metrics = httpx.get(api.url + "/metrics").text
    finished = {s.labels["outcome"]: s.value for f in text_string_to_metric_families(metrics)
                for s in f.samples if s.name == "holdback_batch_requests_finished"}
    assert finished == {"succeeded": 1, "failed": 0, "cancelled": 4}

    # The sampler measures each apart, so the throughput chart's failure line stays at zero.
    first = next_sample(1000.0, {"completed": 1, "failed": 0, "cancelled": 0}, None, None)
    second = next_sample(1005.0, {"completed": 1, "failed": 0, "cancelled": 4000}, None, first)
    assert second.per_s == {"completed": 0.0, "failed": 0.0, "cancelled": 800.0}


def test_the_banner_names_a_paused_queue_and_an_unreachable_gateway(start_api, backend):
    api = start_api(gateway_url="http://127.0.0.1:9")
    client, _ = signed_in(api)
    name = requests_queue_name(backend.namespace)
    page = client.get("/dashboard/keys").text
    assert 'hx-get="/dashboard/fragments/alerts"' in page, "every page loads the banner"
    banner = client.get("/dashboard/fragments/alerts").text
    assert 'data-alert="gateway"' in banner and "http://127.0.0.1:9 is unreachable" in banner
    assert 'data-alert="paused"' not in banner
    set_paused(backend.redis(), backend.namespace, name, True)
    banner = client.get("/dashboard/fragments/alerts").text
    assert f'data-alert="paused" data-subject="{name}"' in banner and f"Dispatch is paused on queue {name}" in banner
    set_paused(backend.redis(), backend.namespace, name, False)
    assert 'data-alert="paused"' not in client.get("/dashboard/fragments/alerts").text


def test_the_banner_warns_of_a_batch_that_will_not_finish_inside_its_window(api, seed):
    acme = seed.tenant("acme")
    now = int(time.time())
    # 100 s in, 1 of 10 finished, 50 s left: the 9 left need ~900 s.
    late, _ = seed.batch(acme, [{"status": "succeeded"}] + [{}] * 9, created_at=now - 100)
    on_time, _ = seed.batch(acme, [{}] * 3)  # just started: not judged yet
    with transaction(seed.db) as s:
        s.get(Batch, late).expires_at = now + 50
    client, _ = signed_in(api)
    banner = client.get("/dashboard/fragments/alerts").text
    assert f'data-alert="at-risk" data-subject="{late}"' in banner, banner
    assert f"Batch {late} of acme is at risk of expiring: its 9 requests left" in banner
    assert f'href="/dashboard/batches/{late}">Batch →' in banner and on_time not in banner
    with transaction(seed.db) as s:
        s.get(Batch, late).expires_at = now + 86400
    assert 'data-alert="at-risk"' not in client.get("/dashboard/fragments/alerts").text


def test_search_by_batch_id_custom_id_metadata_and_the_tenant_filter(api, seed):
    acme, beta = seed.tenant("acme"), seed.tenant("beta")
    zebra, _ = seed.batch(acme, [{"custom_id": "invoice-77"}], metadata={"project": "Zebra", "owner": "ana"})
    lion, _ = seed.batch(beta, [{"custom_id": "invoice-78"}], metadata={"project": "lion_100%"})
    other, _ = seed.batch(beta, [{"custom_id": "x"}], metadata={"café": "crème"})
    client, _ = signed_in(api)

    def listed(**params) -> list[str]:
        ids = [b["id"] for b in admin(api).get("/admin/batches", params=params).json()["data"]]
        if "tenant_id" in params:
            params["tenant"] = params.pop("tenant_id")
        page = client.get("/dashboard/fragments/batches", params=params).text
        assert re.findall(r'data-batch-id="([^"]+)"', page) == ids, "the dashboard lists what the API does"
        return ids

    assert listed() == [other, lion, zebra]
    assert listed(q=zebra) == [zebra] and listed(q=zebra[:14]) == [zebra], "a batch id or its start"
    assert listed(q="invoice-78") == [lion], "a custom_id, exactly"
    assert listed(q="invoice") == [], "custom_id is matched whole (it is indexed)"
    assert listed(q="zebra") == [zebra], "metadata text, ignoring case"
    assert listed(q="project=lion") == [lion] and listed(q="owner=zebra") == []
    assert listed(q="100%") == [lion] and listed(q="on_1") == [lion], "LIKE's wildcards are literal"
    assert listed(q="_") == [lion]
    assert listed(q="crème") == [other], "non-ASCII metadata, as stored escaped"
    assert listed(tenant_id=beta) == [other, lion] and listed(tenant_id=beta, q="zebra") == []
    assert listed(q="file-in") == [other, lion, zebra], "a file id of the batch"
    page = client.get("/dashboard", params={"tenant": beta, "q": "lion"}).text
    assert re.findall(r'data-batch-id="([^"]+)"', page) == [lion]
    assert f'<option value="{beta}" selected>beta</option>' in page


def test_usage_per_tenant_equals_the_sums_over_the_database(api, seed):
    now = time.time()
    old = now - 3 * 86400
    acme, beta, idle = seed.tenant("acme"), seed.tenant("beta"), seed.tenant("idle")

    def attempts(t: float, *outcomes: str) -> list[dict]:
        return [{"started_at": t + i, "outcome": o, "evicted": o == "evicted", "status_code": 429 if o != "success"
                 else 200} for i, o in enumerate(outcomes)]

    seed.batch(acme, [
        {"status": "succeeded", "finished_at": now - 60, "tokens": (100, 40), "attempts": attempts(now - 90, "evicted", "rejected", "success")},
        {"status": "failed", "finished_at": now - 30, "tokens": (7, 0), "attempts": attempts(now - 40, "client_error")},
        {"status": "running", "attempts": attempts(now - 5, "evicted")},
        {"status": "running"},
    ])
    seed.batch(acme, [{"status": "succeeded", "finished_at": old + 10, "tokens": (999, 999),
                       "attempts": attempts(old, "evicted", "success")}],
               status="completed", created_at=int(old), completed_at=int(old) + 20)
    seed.batch(beta, [{"status": "cancelled", "finished_at": now - 10}, {"status": "expired", "finished_at": now - 9},
                      {"status": "succeeded", "finished_at": now - 8, "tokens": (5, 6), "attempts": attempts(now - 20, "rejected", "rejected", "success")},
                      {"status": "running"}], status="cancelling")
    seed.batch(idle, [], status="completed", created_at=int(old), completed_at=int(old))

    def by_database(since: float, until: float) -> dict[str, dict]:
        """The same figures, summed over every row and attempt in Python."""
        with seed.db() as s:
            rows, batches, tries = s.query(RequestRow).all(), s.query(Batch).all(), s.query(Attempt).all()
            names = {t.id: t.name for t in s.query(Tenant).all()}
        tenant_of = {b.id: b.tenant_id for b in batches}
        running = [r for r in rows if r.status == "running"]
        found: dict[str, dict] = {}
        for tenant_id, name in names.items():
            done = [r for r in rows if r.tenant_id == tenant_id and r.finished_at is not None
                    and since <= r.finished_at < until]
            mine = [a for a in tries if tenant_of[a.batch_id] == tenant_id and since <= a.started_at < until]
            figures = {
                "tenant": name,
                "batches": sum(b.tenant_id == tenant_id and since <= b.created_at < until for b in batches),
                "succeeded": sum(r.status == "succeeded" for r in done),
                "failed": sum(r.status in ("failed", "expired") for r in done),
                "cancelled": sum(r.status == "cancelled" for r in done),
                "input_tokens": sum(r.input_tokens for r in done), "output_tokens": sum(r.output_tokens for r in done),
                "rejections": sum(a.outcome == "rejected" for a in mine), "evictions": sum(bool(a.evicted) for a in mine),
                "in_flight": sum(r.tenant_id == tenant_id for r in running),
            }
            figures["in_flight_share"] = figures["in_flight"] / len(running) if running else 0.0
            if any(v for k, v in figures.items() if k != "tenant"):
                found[tenant_id] = figures
        return found

    for since, until in ((now - 3600, now + 1), (now - 7 * 86400, now + 1), (old - 1, old + 60)):
        answer = admin(api).get("/admin/usage", params={"since": since, "until": until})
        assert answer.status_code == 200, answer.text
        got = {u.pop("tenant_id"): u for u in answer.json()["data"]}
        for u in got.values():
            assert u.pop("object") == "tenant.usage"
        assert got == by_database(since, until), (since, until)
    recent = by_database(now - 3600, now + 1)
    assert recent[acme]["evictions"] == 2 and recent[beta]["rejections"] == 2 and idle not in recent
    assert recent[acme]["in_flight_share"] == pytest.approx(2 / 3)

    client, _ = signed_in(api)
    page = client.get("/dashboard/usage", params={"period": "24h"}).text
    day = by_database(now - 86400, time.time() + 1)
    for tenant_id, figures in day.items():
        row = re.search(rf'<tr data-tenant="{tenant_id}">(.*?)</tr>', page, re.S).group(1)
        for field in ("batches", "succeeded", "failed", "cancelled", "input_tokens", "output_tokens", "rejections",
                      "evictions", "in_flight"):
            cell = re.search(rf'data-field="{field}">([\d,]+)<', row).group(1)
            assert int(cell.replace(",", "")) == figures[field], (tenant_id, field)
    assert f'data-tenant="{idle}"' not in page
    assert admin(api).get("/admin/usage", params={"since": now, "until": now - 1}).status_code == 400
    # Beyond what a database timestamp holds (PostgreSQL refused -3.4e38 with a 500): refused, naming the field.
    for params in ({"since": -3.4e38}, {"until": 1e300}):
        refused = admin(api).get("/admin/usage", params=params)
        assert refused.status_code == 400 and list(params)[0] in refused.text, refused.text


def test_a_key_created_on_the_keys_page_is_shown_once_and_works(api):
    client, csrf = signed_in(api)
    assert client.post("/dashboard/keys", data={"tenant": "newco"}).status_code == 403, "CSRF first"
    empty = client.post("/dashboard/keys", data={"tenant": "   "}, headers={"x-csrf-token": csrf})
    assert empty.status_code == 400 and "Name the tenant" in empty.text
    r = client.post("/dashboard/keys", data={"tenant": "newco"}, headers={"x-csrf-token": csrf})
    assert r.status_code == 200 and r.headers["hx-trigger"] == "refresh" and r.headers["cache-control"] == "no-store"
    secret = re.search(r'data-testid="new-key-secret">([^<]+)</pre>', r.text).group(1)
    key_id = re.search(r'data-testid="new-key-id">([^<]+)</span>', r.text).group(1)
    assert api.http(secret).get("/v1/batches").status_code == 200, "the printed secret is a working key"
    keys = client.get("/dashboard/fragments/keys").text
    assert f'data-key="{key_id}"' in keys and "newco" in keys and secret not in keys, "listed, never the secret"


def test_the_batch_page_shows_throughput_and_an_eta(api, seed):
    tenant = seed.tenant("acme")
    now = time.time()
    rows = [{"status": "succeeded", "finished_at": now - 50 + i} for i in range(30)] + [{}] * 60
    batch_id, _ = seed.batch(tenant, rows, created_at=int(now) - 600)
    client, _ = signed_in(api)
    summary = client.get(f"/dashboard/fragments/batches/{batch_id}/summary").text
    rate = re.search(r'data-testid="throughput">([\d.]+)/s<', summary)
    assert rate and float(rate.group(1)) == pytest.approx(0.5), "30 finished in the last minute"
    assert re.search(r'data-testid="eta">2m 00s<', summary), "60 left at 0.5/s"
    stalled, _ = seed.batch(tenant, [{"status": "succeeded", "finished_at": now - 500}, {}], created_at=int(now) - 600)
    assert "nothing finished in the last minute" in client.get(f"/dashboard/fragments/batches/{stalled}/summary").text


def test_chart_ranges_and_the_history_of_kv_usage_and_queue_depth(api, backend):
    connection = backend.redis()
    buckets = {"realtime": [(0.1, 3.0), (float("inf"), 4.0)]}
    quiet = backend.namespace + "-direct"  # the API server's own sampler writes to its namespace meanwhile
    for _ in range(3):
        DashboardSampler._record(connection, quiet, {"completed": 1, "failed": 0, "cancelled": 0}, buckets, {}, {})
    stored = [json.loads(raw) for raw in connection.lrange(samples_key(quiet), 0, -1)]
    assert len(stored) == 3 and stored[0]["ttft"] is not None, "the newest keeps the buckets to measure against"
    assert [s["ttft"] for s in stored[1:]] == [None, None], "history is kept without them"
    for _ in range(2):
        DashboardSampler._record(connection, backend.namespace, {"completed": 1, "failed": 0, "cancelled": 0}, None,
                        {"http://replica-a": 0.25}, {"queued": 7, "retrying": 1})
    client, _ = signed_in(api)
    hour = client.get("/dashboard/fragments/charts", params={"range": "1h", "show": "gateway"}).text
    assert 'data-range="1h"' in hour and "KV cache usage, last 1 hour" in hour
    assert 'data-series="replica-a"' in hour and "25%" in hour
    assert 'data-series="RQ queued"' in hour
    short = client.get("/dashboard/fragments/charts", params={"range": "nonsense"}).text
    assert 'data-range="15m"' in short and "Batch throughput, last 15 min" in short


def test_a_failed_batchs_row_shows_its_first_error(api, seed):
    tenant = seed.tenant("acme")
    errors = [{"code": "invalid_json_line", "message": "line is not valid JSON: expected '}'", "param": None,
               "line": 3}, {"code": "invalid_json_line", "message": "line is not valid JSON", "param": None, "line": 9}]
    failed_id, _ = seed.batch(tenant, [], status="failed", errors=errors, failed_at=int(time.time()))
    done_id, _ = seed.batch(tenant, [], status="completed", completed_at=int(time.time()))
    client, _ = signed_in(api)
    page = client.get("/dashboard").text
    row = re.search(rf'<tr data-batch-id="{failed_id}">(.*?)</tr>', page, re.S).group(1)
    assert "line 3: line is not valid JSON: expected &#39;}&#39; (and 1 more)" in row
    assert 'data-testid="first-error"' not in re.search(rf'<tr data-batch-id="{done_id}">(.*?)</tr>', page, re.S).group(1)


def test_the_batches_list_comes_before_the_charts(api, seed):
    seed.batch(seed.tenant("acme"), [], status="completed", completed_at=int(time.time()))
    client, _ = signed_in(api)
    page = client.get("/dashboard").text
    assert 0 < page.index('id="batches-live"') < page.index('class="chart'), "the list is above the fold"


def test_an_ended_batchs_pace_is_over_the_time_it_ran(api, seed):
    """It ran 100 s and finished 10 requests: 0.1/s however long ago it ended, not a rate that falls for ever."""
    now = int(time.time())
    rows = [{"status": "succeeded", "finished_at": now - 950}] * 10
    batch_id, _ = seed.batch(seed.tenant("acme"), rows, status="completed", created_at=now - 1000,
                             completed_at=now - 900)
    client, _ = signed_in(api)
    page = client.get(f"/dashboard/batches/{batch_id}").text
    assert "0.1/s since it started" in page, re.search(r"throughput.{0,300}", page, re.S).group(0)
