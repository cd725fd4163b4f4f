"""The dashboard over plain HTTP: sign-in with the admin key, the session cookie, CSRF on every action,
pages and fragments rendered from real rows, and the sampler's history in Redis.

The browser tests (tests/e2e/test_dashboard_browser.py) drive the same pages in Chromium against the
whole stack; these pin the contracts one request at a time.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
from rq import Queue
from rq.job import JobStatus
from rq.registry import FailedJobRegistry
from rq.worker import Worker

from batch_api.app import create_app
from batch_api.dashboard.charts import Series, line_chart, value_ticks
from batch_api.dashboard.gateway_view import quantile, ttft_buckets
from batch_api.dashboard.sampler import DashboardSampler, Sample, next_sample, recent_samples, samples_key
from batch_api.dashboard.session import SESSION_SECONDS, issue_session, session_valid
from holdback.broker import is_paused
from holdback.contract import requests_queue_name
from holdback.contract import JOB_FUNCTION
from tests.batch_api.test_admin_operator_routes import Rows


def signed_in(api) -> tuple[httpx.Client, str]:  # noqa: ANN001
    """A client holding the session cookie, and the CSRF token of its pages."""
    client = httpx.Client(base_url=api.url, timeout=30)
    r = client.post("/dashboard/login", data={"admin_key": api.settings.admin_key, "next": "/dashboard"})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard", r.text
    page = client.get("/dashboard")
    assert page.status_code == 200
    token = re.search(r'"X-CSRF-Token": "([0-9a-f]{64})"', page.text)
    assert token, "the page hands htmx its CSRF token"
    return client, token.group(1)


# ---- sign-in, session, CSRF -------------------------------------------------------------------------------


def test_pages_send_a_browser_without_a_session_to_the_login_form(api):
    for path in ("/dashboard", "/dashboard/queues", "/dashboard/gateway", "/dashboard/batches/batch_x?status=failed"):
        r = httpx.get(api.url + path)
        assert r.status_code == 303, path
        assert r.headers["location"].startswith("/dashboard/login?next=/dashboard"), r.headers["location"]
    # htmx asks for fragments: it is told where to go instead of swapping a login page into the table.
    r = httpx.get(api.url + "/dashboard/fragments/batches", headers={"hx-request": "true"})
    assert r.status_code == 401 and r.headers["hx-redirect"] == "/dashboard/login"
    # A bearer key is not a dashboard session, and a forged cookie is not one either.
    admin = {"authorization": f"Bearer {api.settings.admin_key}"}
    assert httpx.get(api.url + "/dashboard", headers=admin).status_code == 303
    forged = issue_session("some-other-key")
    assert httpx.get(api.url + "/dashboard", cookies={"holdback_dashboard": forged}).status_code == 303


def test_login_sets_a_signed_httponly_strict_cookie_not_the_key(api):
    client = httpx.Client(base_url=api.url)
    wrong = client.post("/dashboard/login", data={"admin_key": "guess", "next": "/dashboard"})
    assert wrong.status_code == 401 and "not the admin key" in wrong.text
    assert "set-cookie" not in wrong.headers
    tenant_key = api.create_key("acme")
    assert client.post("/dashboard/login", data={"admin_key": tenant_key}).status_code == 401

    r = client.post("/dashboard/login", data={"admin_key": api.settings.admin_key, "next": "/dashboard/queues"})
    assert r.status_code == 303 and r.headers["location"] == "/dashboard/queues"
    cookie = r.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/dashboard" in cookie
    value = client.cookies["holdback_dashboard"]
    assert api.settings.admin_key not in value and session_valid(api.settings.admin_key, value)
    # A signed-in visit to the form goes straight on; an offsite `next` is never followed.
    assert client.get("/dashboard/login").status_code == 303
    other = httpx.Client(base_url=api.url)
    r = other.post("/dashboard/login", data={"admin_key": api.settings.admin_key, "next": "https://evil.example/"})
    assert r.headers["location"] == "/dashboard"
    r = other.post("/dashboard/login", data={"admin_key": api.settings.admin_key, "next": "//evil.example/x"})
    assert r.headers["location"] == "/dashboard"


def test_sessions_expire_and_die_with_the_admin_key():
    now = time.time()
    token = issue_session("key-1", now=now)
    assert session_valid("key-1", token, now=now + 60)
    assert not session_valid("key-1", token, now=now + SESSION_SECONDS + 1)
    assert not session_valid("key-2", token, now=now)
    issued, nonce, mac = token.split(".")
    assert not session_valid("key-1", f"{int(issued) + 1}.{nonce}.{mac}", now=now), "the timestamp is signed"
    assert not session_valid("key-1", "garbage", now=now)


def test_every_action_needs_the_pages_csrf_token(api, backend):
    client, csrf = signed_in(api)
    name = requests_queue_name(backend.namespace)
    connection = backend.redis()
    for headers in ({}, {"x-csrf-token": "0" * 64}, {"x-csrf-token": csrf[:-1] + ("1" if csrf[-1] == "0" else "0")}):
        r = client.post(f"/dashboard/queues/{name}/pause", headers=headers)
        assert r.status_code == 403 and "security token" in r.text
        assert not is_paused(connection, backend.namespace, name)
    r = client.post(f"/dashboard/queues/{name}/pause", headers={"x-csrf-token": csrf})
    assert r.status_code == 200 and "Paused queue" in r.text and r.headers["hx-trigger"] == "refresh"
    assert is_paused(connection, backend.namespace, name)
    assert "was already paused" in client.post(f"/dashboard/queues/{name}/pause", headers={"x-csrf-token": csrf}).text
    r = client.post(f"/dashboard/queues/{name}/resume", headers={"x-csrf-token": csrf})
    assert "Resumed queue" in r.text and not is_paused(connection, backend.namespace, name)
    # Another session's token does not fit this session.
    _other, other_csrf = signed_in(api)
    assert client.post(f"/dashboard/queues/{name}/pause", headers={"x-csrf-token": other_csrf}).status_code == 403
    # Signing out needs the token too, and ends the session in the browser.
    assert client.post("/dashboard/logout").status_code == 403
    r = client.post("/dashboard/logout", headers={"x-csrf-token": csrf})
    assert r.status_code == 204 and r.headers["hx-redirect"] == "/dashboard/login"
    assert "holdback_dashboard" not in client.cookies
    assert client.get("/dashboard").status_code == 303


def test_pages_carry_a_strict_content_security_policy(api):
    client, _ = signed_in(api)
    r = client.get("/dashboard")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp and "unsafe" not in csp
    assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
    assert "<script>" not in r.text and " style=" not in r.text and "onclick" not in r.text
    js = client.get("/dashboard/static/htmx.min.js")
    assert js.status_code == 200 and js.text.startswith("/*! htmx.org 2.") and "0BSD" in js.text[:300]


# ---- pages from real rows ------------------------------------------------------------------------------------


def test_batch_pages_show_rows_attempts_and_act_on_them(api, backend):
    rows = Rows(backend)
    batch_id, ids = rows.batch([
        {"status": "succeeded", "attempts": [(time.time() - 9, "evicted"), (time.time() - 5, "success", {
            "tokens_kept": 40, "tokens_recomputed": 17})], "evictions": 1},
        {"status": "queued"},
        {"status": "failed", "attempts": [(time.time() - 4, "client_error")]},
    ])
    rows.close()
    client, csrf = signed_in(api)

    listing = client.get("/dashboard").text
    assert f'data-batch-id="{batch_id}"' in listing and "in progress" in listing
    assert client.get("/dashboard?status=completed").text.count("data-batch-id=") == 0
    fragment = client.get("/dashboard/fragments/batches", params={"status": "in_progress"})
    assert f'data-batch-id="{batch_id}"' in fragment.text and "<html" not in fragment.text

    page = client.get(f"/dashboard/batches/{batch_id}").text
    assert all(f'data-request-id="{row_id}"' in page for row_id in ids)
    evicted = client.get(f"/dashboard/fragments/batches/{batch_id}/requests", params={"evicted": "yes"}).text
    assert f'data-request-id="{ids[0]}"' in evicted and f'data-request-id="{ids[1]}"' not in evicted
    failed = client.get(f"/dashboard/fragments/batches/{batch_id}/requests", params={"status": "failed"}).text
    assert f'data-request-id="{ids[2]}"' in failed and f'data-request-id="{ids[0]}"' not in failed
    attempts = client.get(f"/dashboard/fragments/requests/{ids[0]}/attempts").text
    assert "Attempts of line 1" in attempts and "evicted" in attempts and "success" in attempts
    assert "kept 40 · recomputed 17" in attempts, "a resumed attempt shows what it kept and recomputed"
    assert attempts.count('data-testid="resume-tokens"') == 1
    assert client.get("/dashboard/batches/batch_nope").status_code == 404

    r = client.post(f"/dashboard/batches/{batch_id}/cancel", headers={"x-csrf-token": csrf})
    assert r.status_code == 200 and f"Cancelled batch {batch_id}" in r.text
    again = client.post(f"/dashboard/batches/{batch_id}/cancel", headers={"x-csrf-token": csrf})
    assert "already cancelling" in again.text
    gone = client.post("/dashboard/batches/batch_nope/cancel", headers={"x-csrf-token": csrf})
    assert gone.status_code == 404 and "flash-error" in gone.text


def test_queue_page_counts_jobs_lists_workers_and_retries_failed(api, backend):
    rows = Rows(backend)
    batch_id, ids = rows.batch([{"status": "queued"}, {"status": "queued"}, {"status": "succeeded"}])
    rows.close()
    connection = backend.redis()
    name = requests_queue_name(backend.namespace)
    queue = Queue(name, connection=connection)
    failed = FailedJobRegistry(name, connection=connection)
    for row_id in ids[1:]:
        job = queue.enqueue(JOB_FUNCTION, args=(row_id, batch_id), job_id=row_id, result_ttl=0)
        connection.lrem(queue.key, 0, row_id)
        job.set_status(JobStatus.FAILED)
        failed.add(job, ttl=3600, exc_string="boom")
    queue.enqueue(JOB_FUNCTION, args=(ids[0], batch_id), job_id=ids[0], result_ttl=0)
    worker = Worker([queue], connection=connection, name=f"{backend.namespace}-w1")
    worker.register_birth()
    try:
        client, csrf = signed_in(api)
        page = client.get("/dashboard/queues").text
        assert f'data-queue="{name}"' in page and f'data-worker="{backend.namespace}-w1"' in page
        r = client.post(f"/dashboard/queues/{name}/retry-failed", headers={"x-csrf-token": csrf})
        assert "Requeued 1 of 2 failed jobs" in r.text and "1 stay failed" in r.text
        assert sorted(queue.get_job_ids()) == sorted([ids[0], ids[1]])
        assert client.post("/dashboard/queues/nope/pause", headers={"x-csrf-token": csrf}).status_code == 404
    finally:
        worker.register_death()


def test_gateway_page_says_the_gateway_is_unreachable(start_api):
    api = start_api(gateway_url="http://127.0.0.1:9")
    client, _ = signed_in(api)
    for path in ("/dashboard/gateway", "/dashboard/fragments/gateway"):
        r = client.get(path)
        assert r.status_code == 200 and 'data-testid="gateway-unreachable"' in r.text
        assert "http://127.0.0.1:9" in r.text


# ---- the sampler and its charts --------------------------------------------------------------------------------


METRICS = """# TYPE holdback_gateway_ttft_seconds histogram
holdback_gateway_ttft_seconds_bucket{le="0.1",objective="realtime"} %d
holdback_gateway_ttft_seconds_bucket{le="0.5",objective="realtime"} %d
holdback_gateway_ttft_seconds_bucket{le="1.0",objective="realtime"} %d
holdback_gateway_ttft_seconds_bucket{le="+Inf",objective="realtime"} %d
holdback_gateway_ttft_seconds_count{objective="realtime"} %d
holdback_gateway_ttft_seconds_sum{objective="realtime"} 1.0
"""


def test_ttft_p95_comes_from_the_bucket_deltas_of_one_interval():
    before = ttft_buckets(METRICS % (100, 100, 100, 100, 100))["realtime"]
    # 100 new observations: 10 under 0.1 s, 80 in (0.1, 0.5], 10 in (0.5, 1.0].
    after = ttft_buckets(METRICS % (110, 190, 200, 200, 200))["realtime"]
    p95 = quantile(0.95, after, before)
    assert 0.5 < p95 <= 1.0
    assert abs(p95 - 0.75) < 1e-9, "linear within (0.5, 1.0]: rank 95 of 100 is halfway through the last 10"
    assert quantile(0.95, after, after) is None, "nothing observed in between"
    restarted = ttft_buckets(METRICS % (0, 10, 10, 10, 10))["realtime"]
    assert 0.1 < quantile(0.95, restarted, after) <= 0.5, "a gateway restart counts from zero"
    beyond = ttft_buckets(METRICS % (0, 0, 0, 5, 5))["realtime"]
    assert quantile(0.95, beyond) == 1.0, "the +Inf bucket answers the highest finite bound"


def test_samples_measure_rates_against_the_previous_one():
    first = next_sample(1000.0, {"completed": 10, "failed": 0}, ttft_buckets(METRICS % (3, 3, 3, 3, 3)), None)
    assert first.per_s == {} and first.ttft_p95 == {}, "the first sample has nothing to measure against"
    buckets = ttft_buckets(METRICS % (10, 10, 10, 10, 10))
    second = next_sample(1005.0, {"completed": 35, "failed": 5}, buckets, first)
    assert second.per_s == {"completed": 5.0, "failed": 1.0}
    assert 0 < second.ttft_p95["realtime"] <= 0.1
    assert Sample.from_json(second.to_json()) == second
    after_outage = next_sample(1010.0, {"completed": 40, "failed": 5}, buckets, next_sample(1007.0, None, None, second))
    assert after_outage.ttft_p95 == {} and after_outage.per_s == {}, "no interval is measured across an outage"
    stale = next_sample(2000.0, {"completed": 99, "failed": 5}, buckets, second)
    assert stale.per_s == {}, "no rate across a long gap"


def test_two_api_servers_share_one_history_one_sample_per_interval(backend):
    apps = [create_app(backend.settings(gateway_url="http://127.0.0.1:9")) for _ in range(2)]
    samplers = []
    for app in apps:
        app.state.context.redis = backend.redis()
        samplers.append(DashboardSampler(app.state.context, interval=3600.0))

    async def both() -> list:
        async with httpx.AsyncClient() as client:
            return [await s.sample_once(client) for s in samplers]

    taken = asyncio.run(both())
    assert sum(s is not None for s in taken) == 1, "the second server found the slot taken"
    sample = next(s for s in taken if s is not None)
    assert sample.ttft is None and sample.totals == {"completed": 0, "failed": 0, "cancelled": 0}
    assert sample.depth == {"queued": 0, "retrying": 0} and sample.kv == {}, "the gateway is down: no KV usage"
    assert backend.redis().llen(samples_key(backend.namespace)) == 1
    assert [s.t for s in recent_samples(backend.redis(), backend.namespace)] == [sample.t]
    for app in apps:
        app.state.context.engine.dispose()


def test_charts_scale_to_nice_ticks_and_break_lines_at_gaps():
    assert value_ticks(20.3) == [0, 5, 10, 15, 20, 25]
    assert value_ticks(0.6)[-1] >= 0.6 and len(value_ticks(0.6)) <= 6
    now = 10_000.0
    svg = line_chart([Series("realtime", "#d9480f", [(now - 100, 0.2), (now - 95, 0.3), (now - 20, 0.25)])],
                     now=now, window=600, label=str, title="t", empty="nothing")
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1, "a 75 s gap splits the line"
    assert "nothing" in line_chart([], now=now, window=600, label=str, title="t", empty="nothing")


def test_gateway_page_reads_the_gateway_with_the_admin_key_and_shows_kv_admission(start_api, tmp_path):
    from tests.support import Processes, free_port, free_ports, wait_http

    api = start_api()
    with Processes(log_dir=tmp_path / "logs") as procs:
        sim_port, gw_port = free_ports(1), free_port()
        sim = procs.start("sim", "--port", str(sim_port), "--log-level", "WARNING", name="sim")
        wait_http(f"http://127.0.0.1:{sim_port}/health", proc=sim)
        config = tmp_path / "gateway.yaml"
        config.write_text(f"adminKeys: [{{key: {api.settings.admin_key}}}]\nkeys: [{{key: rt, tenant: rt}}]\n")
        gw = procs.start("gateway", "--config", str(config), "--port", str(gw_port), "--replicas",
                         f"http://127.0.0.1:{sim_port}", name="gateway")
        gw_url = f"http://127.0.0.1:{gw_port}"
        wait_http(gw_url + "/health", proc=gw)
        assert httpx.get(gw_url + "/admin/state").status_code == 401  # the page needs the key
        page_api = start_api(gateway_url=gw_url)
        client, _ = signed_in(page_api)
        page = client.get("/dashboard/gateway").text
        assert 'data-testid="gateway-unreachable"' not in page
        assert 'data-testid="kv-admission"' in page and f'data-kv-replica="http://127.0.0.1:{sim_port}"' in page
        assert "No reservation held." in page and "Nothing rejected by admission." in page


def test_gateway_page_shows_every_model_pools_replicas_bands_and_alerts(start_api, backend, tmp_path):
    """Replicas of two models, grouped into a pool each: the page has a section per pool with its replicas and
    bands, the sampler charts every pool's KV usage, and a replica of the second pool going down is an alert
    (all of which read only the first pool before)."""
    from tests.support import Processes, free_port, free_ports, poll, wait_http

    api = start_api()
    with Processes(log_dir=tmp_path / "logs") as procs:
        first = free_ports(2)  # two consecutive free ports
        urls = [f"http://127.0.0.1:{first}", f"http://127.0.0.1:{first + 1}"]
        sims = []
        for url, model in zip(urls, ("model-a", "model-b")):
            sims.append(procs.start("sim", "--port", url.rsplit(":", 1)[1], "--model", model, "--log-level",
                                    "WARNING", name=model))
            wait_http(f"{url}/health", proc=sims[-1])
        config = tmp_path / "gateway.yaml"
        config.write_text(f"adminKeys: [{{key: {api.settings.admin_key}}}]\n")
        gw_port = free_port()
        gw = procs.start("gateway", "--config", str(config), "--port", str(gw_port), "--replicas", ",".join(urls),
                         name="gateway")
        gw_url = f"http://127.0.0.1:{gw_port}"
        wait_http(gw_url + "/health", proc=gw)
        page_api = start_api(gateway_url=gw_url)
        client, _ = signed_in(page_api)
        # No pools configured: the replicas are grouped by the model each reports once identified.
        page = poll(lambda: (text := client.get("/dashboard/gateway").text).count('data-testid="pool"') == 2 and text,
                    30, "two pool sections on the gateway page", lambda: client.get("/dashboard/gateway").text[-2000:])
        sections = page.split('data-testid="pool"')[1:]
        for url, model in zip(urls, ("model-a", "model-b")):
            # Pools are named by the order the replicas were identified in (the first is "default"): find by model.
            [section] = [s for s in sections if f'title="{model}"' in s]
            assert "1 / 1" in section, section  # its one replica, healthy
            assert section.count("data-replica=") == 1 and f'data-replica="{url}"' in section, section
            assert 'data-band="100"' in section and 'data-band="-10"' in section, section
            assert 'data-testid="pool-saturation">0%' in section, section

        app = create_app(backend.settings(gateway_url=gw_url))
        sampler = DashboardSampler(app.state.context)

        async def state() -> tuple[dict, int | None]:
            async with httpx.AsyncClient() as http:
                return await sampler._state(http)

        kv = poll(lambda: (found := asyncio.run(state())[0]).keys() == set(urls) and found, 30,
                  "the KV usage of both pools' replicas", lambda: str(asyncio.run(state())))
        assert set(kv.values()) == {0.0}
        app.state.context.engine.dispose()

        procs.stop(sims[1])
        poll(lambda: urls[1] in client.get("/dashboard/fragments/alerts").text, 30,
             "an alert for the second pool's replica", lambda: client.get("/dashboard/fragments/alerts").text)


MIXED = """# TYPE holdback_gateway_ttft_seconds histogram
holdback_gateway_ttft_seconds_bucket{le="0.5",objective="realtime",stream="true"} %d
holdback_gateway_ttft_seconds_bucket{le="2.0",objective="realtime",stream="true"} %d
holdback_gateway_ttft_seconds_bucket{le="+Inf",objective="realtime",stream="true"} %d
holdback_gateway_ttft_seconds_bucket{le="0.5",objective="realtime",stream="false"} %d
holdback_gateway_ttft_seconds_bucket{le="2.0",objective="realtime",stream="false"} %d
holdback_gateway_ttft_seconds_bucket{le="+Inf",objective="realtime",stream="false"} %d
"""


def test_streamed_first_tokens_and_whole_answers_are_separate_series_and_an_old_value_is_not_shown():
    """Streaming clients at 0.3 s and non-streamed whole answers at 1.5 s: the realtime series is 0.3 s, not a
    mix; and once traffic stops the legend shows "—", not the last value from minutes ago."""
    from batch_api.dashboard import charts
    from batch_api.dashboard.history import _legend, _ttft_series

    before = ttft_buckets(MIXED % (0, 0, 0, 0, 0, 0))
    after = ttft_buckets(MIXED % (100, 100, 100, 0, 100, 100))  # 100 streamed under 0.5 s, 100 whole in 0.5-2 s
    sample = next_sample(1005.0, None, after, next_sample(1000.0, None, before, None))
    assert set(sample.ttft_p95) == {"realtime", "realtime (whole answer)"}
    assert sample.ttft_p95["realtime"] <= 0.5 < 1.0 < sample.ttft_p95["realtime (whole answer)"] <= 2.0
    series = _ttft_series([sample])
    assert [s.name for s in series] == ["realtime", "realtime (whole answer)"]
    assert _legend(series, stale_before=1000.0)[0][2] == sample.ttft_p95["realtime"]
    assert [value for _, _, value in _legend(series, stale_before=1010.0)] == [None, None]
    assert _legend([charts.Series("x", "#000", [])], stale_before=0.0) == [("x", "#000", None)]


def test_gateway_page_shows_the_flow_control_leader_its_relays_and_its_last_takeover(start_api, tmp_path):
    """A gateway run as one relay and two flow controls contending for the Redis lease: the page says which process
    leads, since when, with which fencing token, the relays connected and what they hold; once the leader is killed
    and the standby takes over, the new leader, its token and how long its takeover took."""
    import signal

    from tests.gateway.conftest import Stack
    from tests.gateway.test_fleet_leadership import LeasedFleet
    from tests.support import Processes, poll

    api = start_api()
    with Processes(log_dir=tmp_path / "logs") as procs:
        stack = Stack(procs, tmp_path)
        [sim] = stack.sim(1)
        fleet = LeasedFleet(stack, [sim], f"adminKeys: [{{key: {api.settings.admin_key}}}]\n"
                                          "flowControl:\n  heartbeatSeconds: 0.2\n")
        try:
            first = fleet.flow_control("flow-a")
            poll(fleet.leader, 60, "flow-a to take the lease", lambda: procs.log("flow-a"))
            fleet.flow_control("flow-b")  # the standby
            relay = fleet.relay("relay", ["flow-a", "flow-b"])
            page_api = start_api(gateway_url=relay)
            client, _ = signed_in(page_api)

            def card(token: int) -> str | None:
                page = client.get("/dashboard/fragments/gateway").text
                found = re.findall(r'<section class="card" data-testid="leadership">.*?</section>', page, re.S)
                return found[0] if found and f'data-testid="fencing-token">{token}<' in found[0] else None

            before = poll(lambda: card(1), 60, "the leadership panel of the first leader", lambda: procs.log("relay"))
            assert "leading</span>" in before and f":{first.pid}<" in before, before
            assert re.search(r'<div class="stat-value">1</div><div class="stat-label">relays connected', before)
            assert 'data-testid="last-takeover"' in before and ">none<" in before, "the first term took nothing over"
            assert before.count("data-relay=") == 1 and '<td class="num">0</td></tr>' in before, before

            first.send_signal(signal.SIGKILL)  # the standby takes the lease once it lapses; the relay re-registers
            after = poll(lambda: (found := card(2)) and "under way" not in found and found, 120,
                         "the panel to show the standby's finished takeover", lambda: procs.log("flow-b")[-3000:])
            assert f':{fleet.procs["flow-b"].pid}<' in after, after
            took = re.search(r'data-testid="last-takeover"[^>]*>([\d.]+) (ms|s)<', after)
            assert took, after
            # Until the relay on the old leader's roster re-registered (a fraction of a second), at most the
            # hold-back window (3 heartbeats + 6 s; its timer may fire late on a loaded machine).
            assert float(took.group(1)) / (1000 if took.group(2) == "ms" else 1) < 30, after
            assert "token 2" in after and "0 running requests re-registered by 1 relay," in after, after
        finally:
            fleet.close()
